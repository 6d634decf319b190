"""Dense FP8 GEMM on an H200: the shipped row against other TMA tiles, and Triton's warp specialisation.

Why: the prefill's FP8 GEMMs run at 43-54 % of the FP8 matmul rate (MoE mlp1 615 TFLOP/s, the dense
GEMMs ~780, of 1441 measured). Every K step rescales the step's partial product by its activation and
weight scales, so each program waits for its tensor-core result before the next step; a producer warp
feeding the tiles by TMA while the consumer warpgroups compute (what DeepGEMM does by hand) is the
known cure. Triton exposes it as `tl.range(..., warp_specialize=True)`; whether triton 3.6 does it for
Hopper and this loop is what this script finds out.

    python benchmarks/diag_ws.py --variants cfg --stem diag_dense_cfg --out benchmarks/results
    python benchmarks/diag_ws.py --variants ws --m 8192,2048 --out benchmarks/results

It times the shipped `fp8_gemm` (TMA tiles, `gemm_config`'s row) in CUDA graphs against (`cfg_*`) the
same launcher on other TMA tiles, (`copy_*`) a copy of `_fp8_gemm_tma_kernel` with its K loop a
`tl.range`, and (`ws_*`) that copy warp-specialised; same operands, bits compared; a variant that cannot
compile records its error. The prototype is this file's only kernel copy.

H200 findings (session 9): the `cfg_*` rows set gemm_config's M 257..1024 row (results/diag_dense_cfg.md).
The warp-specialised loop at qkv M = 8192 logged "395.1 us, 0.95x" (shipped / variant, eager timing:
slower than the shipped kernel) and then did not finish compiling the next variant in the step's 90 s
(results/logs/h200_session9_diag_ws_timed_out.log): not pursued.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

bc.import_project()
from bench_common import graph_time_calls, md_table, run_meta, write_results  # noqa: E402
from sglang_ext.kernels import fp8_gemm as fg  # noqa: E402
from sglang_ext.kernels.tma import descriptor  # noqa: E402

FP8 = torch.float8_e4m3fn


@triton.jit
def _ws_gemm_kernel(a_desc, b_desc, A_SCALE, B_SCALE, BIAS, C, M, N, K,
                    stride_asm, stride_ask, stride_bsn, stride_bsk, stride_cm, stride_cn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                    NUM_STAGES: tl.constexpr, WS: tl.constexpr):
    BLOCK_K: tl.constexpr = 128
    pid_m, pid_n = fg._grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    a_scale_ptrs = A_SCALE + rows * stride_asm
    b_scale_ptrs = B_SCALE + (pid_n * BLOCK_N // 128) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + tl.load(BIAS + cols).to(tl.float32)[None, :]
    for kb in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES, warp_specialize=WS):
        a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
        b = b_desc.load([pid_n * BLOCK_N, kb * BLOCK_K])
        a_scale = tl.load(a_scale_ptrs + kb * stride_ask)
        acc += tl.dot(a, tl.trans(b)) * (a_scale[:, None] * tl.load(b_scale_ptrs + kb * stride_bsk))
    c_ptrs = C + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def ws_gemm(a, a_s, w, ws, bias, out, block_m, block_n, warps, stages, ws_on):
    m, k = a.shape
    n = w.shape[0]
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _ws_gemm_kernel[grid](descriptor(a, [block_m, 128]), descriptor(w, [block_n, 128]), a_s, ws, bias, out,
                          m, n, k, a_s.stride(0), a_s.stride(1), ws.stride(0), ws.stride(1),
                          out.stride(0), out.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=8,
                          NUM_STAGES=stages, WS=ws_on, num_warps=warps, num_stages=stages)


CALLS = 4
VARIANTS = (  # (name, block_m, block_n, warps, stages, warp_specialize or None: the shipped launcher); the copies:
    # the shipped maths in this file's kernel (its tl.range loop is not the shipped loop: 0.82-0.87x the shipped
    # kernel's speed at the shipped tile, results/sweeps/diag_dense_tiles.md), other tiles
    ("copy_m128w8s4", 128, 128, 8, 4, False),
    ("copy_m64w4s4", 64, 128, 4, 4, False),
    ("copy_m64w4s3", 64, 128, 4, 3, False),
    ("copy_m128n64w4s4", 128, 64, 4, 4, False),
    # The shipped launcher (fp8_gemm) with another TMA tile: what a gemm_config row would run.
    ("cfg_m64w4s4", 64, 128, 4, 4, None),
    ("cfg_m64w4s3", 64, 128, 4, 3, None),
    ("cfg_m128w8s3", 128, 128, 8, 3, None),
    ("ws_m128w8s4", 128, 128, 8, 4, True),
    ("ws_m128w4s4", 128, 128, 4, 4, True),
    ("ws_m64w4s4", 64, 128, 4, 4, True),
)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--m", default="512,1024,2048,4096,8192")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", default="copy", help="name prefixes of VARIANTS to run (comma-separated)")
    ap.add_argument("--stem", default="diag_ws")
    args = ap.parse_args()
    variants = [v for v in VARIANTS if any(v[0].startswith(p) for p in args.variants.split(","))]
    dev = torch.device("cuda")
    rows = []
    for name, n, k in (("qkv", 5120, 2880), ("o", 2880, 4096)):
        for m in (int(v) for v in args.m.split(",")):
            g = torch.Generator(device=dev).manual_seed(m + n)
            x = torch.randn(m, k, device=dev, generator=g)
            a, a_s = fg.quantize_activation_group128_ref(x)
            w = (torch.randn(n, k, device=dev, generator=g) * 0.5).to(FP8)
            ws = torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=dev, generator=g) * 0.01 + 0.001
            bias = torch.randn(n, device=dev, generator=g).to(torch.bfloat16)
            out1 = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            out2 = torch.empty_like(out1)
            table = fg.gemm_config(m, n, k, dev, x_prequantized=True)
            shipped = lambda: fg.fp8_gemm(a, a_s, w, ws, bias, out=out1, config=table)  # noqa: E731
            row = {"shape": name, "M": m, "N": n, "K": k, "table": table.short()}
            # Device time: CUDA graphs of CALLS back-to-back calls (an eager call's host share would otherwise
            # count, and the shipped launcher's is not the copy's).
            row["shipped_us"] = graph_time_calls([shipped] * CALLS, iters=args.iters, device=dev) * 1e6
            flop = 2.0 * m * n * k
            row["shipped_tflops"] = flop / row["shipped_us"] / 1e6
            for vname, bm, bn, wp, st, ws_on in variants:
                try:
                    if ws_on is None:
                        cfg = fg.Fp8GemmConfig(block_m=bm, block_n=bn, num_warps=wp, num_stages=st, tma=True)
                        fn = lambda: fg.fp8_gemm(a, a_s, w, ws, bias, out=out2, config=cfg)  # noqa: E731
                    else:
                        fn = lambda: ws_gemm(a, a_s, w, ws, bias, out2, bm, bn, wp, st, ws_on)  # noqa: E731
                    fn()
                    t = graph_time_calls([fn] * CALLS, iters=args.iters, device=dev) * 1e6
                    row[vname] = f"{t:.1f} us, {row['shipped_us'] / t:.2f}x, diff {float((out1.float() - out2.float()).abs().max()):.1e}"
                except Exception as exc:  # noqa: BLE001
                    row[vname] = f"error {type(exc).__name__}: {str(exc)[:160]}".replace("\n", " ").replace("|", "/")
                print(name, m, vname, row[vname], flush=True)
            rows.append(row)
            report(args, rows, variants)


def report(args, rows, variants):
    """Written after every shape, so a variant that hangs in compilation leaves the rows before it."""
    meta = run_meta("python benchmarks/diag_ws.py " + " ".join(sys.argv[1:]))
    cols = ([("shape", "shape", None), ("M", "M", None), ("table", "table", None),
             ("shipped us", "shipped_us", "{:.1f}"), ("shipped TFLOP/s", "shipped_tflops", "{:.0f}")]
            + [(v[0], v[0], None) for v in variants])
    md = (f"# Dense FP8 GEMM: the shipped row against other TMA tiles and a warp-specialised loop (H200)\n\n{meta.get('gpu')}, triton "
          f"{triton.__version__}, {meta['date']}. Times: per call in CUDA graphs of {CALLS} back-to-back calls. Cells: time, shipped / variant, max abs diff vs shipped.\n\n"
          + md_table(rows, cols) + f"\n\nCommand: `{meta['command']}`\n")
    if args.out:
        write_results(args.out, args.stem, meta, rows, md)


if __name__ == "__main__":
    main()
