"""Does Triton overlap a block-scaled FP8 GEMM's tensor-core work with its per-K-step scale promotion? Compiles
two K loops for sm_90 on any machine (no GPU: Triton's bundled ptxas) and counts the `wgmma.wait_group` waits in
the PTX: `acc += tl.dot(a, w) * scale` (the form of the project's FP8 GEMMs and MoE mlp1 / mlp2) and the same
with the promotion written one K step behind the dot (the dot's result carried to the next iteration).
`wait_group 0` right after each dot means the warpgroup stalls until its MMA is done before applying the scales:
the tensor cores idle through the promotion unless another program on the SM issues its own.

    python benchmarks/diag_wgmma_wait.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@triton.jit
def promote_each_step(A, W, S, O, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr):
    offs_m, offs_n, offs_k = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, 128)
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in tl.range(0, K // 128, num_stages=STAGES):
        a = tl.load(A + offs_m[:, None] * K + kb * 128 + offs_k[None, :])
        w = tl.load(W + offs_n[None, :] * K + kb * 128 + offs_k[:, None])
        s = tl.load(S + kb * BM + offs_m)
        acc += tl.dot(a, w) * s[:, None]
    tl.store(O + offs_m[:, None] * BN + offs_n[None, :], acc)


@triton.jit
def promote_one_step_behind(A, W, S, O, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr):
    offs_m, offs_n, offs_k = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, 128)
    acc = tl.zeros([BM, BN], tl.float32)
    prev = tl.zeros([BM, BN], tl.float32)
    s_prev = tl.zeros([BM], tl.float32)
    for kb in tl.range(0, K // 128, num_stages=STAGES):
        a = tl.load(A + offs_m[:, None] * K + kb * 128 + offs_k[None, :])
        w = tl.load(W + offs_n[None, :] * K + kb * 128 + offs_k[:, None])
        s = tl.load(S + kb * BM + offs_m)
        cur = tl.dot(a, w)
        acc += prev * s_prev[:, None]
        prev = cur
        s_prev = s
    acc += prev * s_prev[:, None]
    tl.store(O + offs_m[:, None] * BN + offs_n[None, :], acc)


def compile_sm90(fn, block_m: int, block_n: int, warps: int, stages: int) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"A": "*fp8e4nv", "W": "*fp8e4nv", "S": "*fp32", "O": "*fp32", "K": "constexpr", "BM": "constexpr",
           "BN": "constexpr", "STAGES": "constexpr"}
    src = ASTSource(fn=fn, signature=sig, constexprs={"K": 2944, "BM": block_m, "BN": block_n, "STAGES": stages})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
    return {"loop": fn.__name__, "tile": f"m{block_m} n{block_n} w{warps} s{stages}",
            "wgmma": ptx.count("wgmma.mma_async"),
            "waits": ", ".join(re.findall(r"wgmma\.wait_group\.sync\.aligned \d+", ptx))}


def main():
    import bench_common as bc

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    rows = [compile_sm90(fn, bm, bn, w, st) for fn in (promote_each_step, promote_one_step_behind)
            for bm, bn, w, st in ((64, 128, 4, 4), (128, 128, 8, 4))]
    meta = {"command": "python benchmarks/diag_wgmma_wait.py " + " ".join(sys.argv[1:]),
            "triton": triton.__version__, "target": "cuda sm_90 (compiled only)"}
    md = "\n".join([
        "# wgmma waits in a block-scaled FP8 K loop (Triton, compiled for sm_90, no GPU)", "",
        f"`{meta['command']}` — Triton {meta['triton']} (the device image runs 3.6; not compiled there)", "",
        "The PTX of one K loop (K = 2944, fp8 operands, fp32 scales per row and K step) per tile: how many "
        "`wgmma.mma_async` it issues and which `wgmma.wait_group` it waits with. `wait_group 0` after each dot: "
        "the warpgroup waits for its MMAs before applying the step's scales, in both forms.", "",
        bc.md_table(rows, [("loop", "loop", None), ("tile", "tile", None), ("wgmma", "wgmma", None),
                           ("waits", "waits", None)])]) + "\n"
    bc.write_results(args.out, "diag_wgmma_wait", meta, rows, md)
    print(md)


if __name__ == "__main__":
    main()
