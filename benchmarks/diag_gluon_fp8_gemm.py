"""Prototype (session 20, compiled for sm_90 only, never run): a block-scaled FP8 GEMM in Gluon whose tensor
cores keep working while the scales are applied.

Why: the prefill's FP8 GEMMs (the dense layers and the MoE's mlp1 / mlp2) apply each 128-wide K block's scales
to the block's product before adding it (`acc += dot(a, w) * a_s * w_s`). In Triton's language the dot's
result is waited for at once (`wgmma.wait_group 0`, diag_wgmma_wait.md), so the warpgroup's MMAs stop while
it scales: the kernels run at ~600-750 TFLOP/s, DeepGEMM's grouped GEMM at 1.24-1.63x that on the MoE's
shapes (diag_moe_deepgemm_padded.md). Gluon exposes the asynchronous wgmma: here K block kb's MMA is issued,
then block kb - 1's product (finished: `warpgroup_mma_wait(num_outstanding=1)`) is scaled and added while kb's
runs, and block kb + STAGES - 1's tiles are requested by TMA into the buffers kb - 1 freed. The two products in
flight live in two loop-carried register sets (the loop runs over pairs of K blocks): one variable swapped
each iteration made ptxas serialise every wgmma (its C7514 warning; in the machine code a wait after each one). Same maths as
`_fp8_gemm_kernel` without bias: out[m, n] = sum_kb (A_kb W_kb^T)[m, n] * a_s[m, kb] * w_s[n // 128, kb],
fp32 accumulation, the block sums in K order.

    python benchmarks/diag_gluon_fp8_gemm.py --compile-only     # any machine: the wgmma waits, PTX and SASS
    python benchmarks/diag_gluon_fp8_gemm.py --out DIR          # an H200: check against float64, time

Written against Triton 3.8's Gluon (this machine); the device image's Triton 3.6 was not tried.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BLOCK_K = gl.constexpr(128)  # = the quantisation block: one scale per row (A) and per 128 rows (W) a K step
K_TILE = 128  # the same, as the host's int


@gluon.jit
def _issue_block(a_bufs, w_bufs, ready, kb, zero, STAGES: gl.constexpr):
    """K block kb's MMA, asynchronous, once its tiles have landed (its slot's mbarrier, phase by reuse)."""
    slot = kb % STAGES
    mbarrier.wait(ready.index(slot), phase=(kb // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _request_block(a_desc, w_desc, a_bufs, w_bufs, ready, kb, num_kb, off_m, off_n, STAGES: gl.constexpr):
    """TMA of K block kb's A and W tiles into slot kb % STAGES (nothing past the last block)."""
    if kb < num_kb:
        slot = kb % STAGES
        mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, kb * BLOCK_K], ready.index(slot), a_bufs.index(slot))
        tma.async_copy_global_to_shared(w_desc, [off_n, kb * BLOCK_K], ready.index(slot), w_bufs.index(slot))


@gluon.jit
def _fp8_gemm_overlap_kernel(a_desc, w_desc, AS, WS, OUT, M, N, K, stride_out,
                             STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(128 % BLOCK_N == 0, "a tile inside one 128-row W scale block")
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    num_kb = gl.cdiv(K, BLOCK_K)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    # the first STAGES blocks' tiles in flight; block kb + STAGES - 1 then goes where block kb - 1 was, once its
    # MMA is done
    for i in gl.static_range(STAGES):
        _request_block(a_desc, w_desc, a_bufs, w_bufs, ready, i, num_kb, off_m, off_n, STAGES)

    rows = off_m + gl.arange(0, BLOCK_M, layout=row_layout)
    row_ok = rows < M
    a_s_ptrs = AS + rows.to(gl.int64) * num_kb  # a_s [M, cdiv(K, 128)], contiguous
    w_s_ptr = WS + (off_n // 128) * num_kb  # w_s [cdiv(N, 128), cdiv(K, 128)], contiguous

    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)
    acc = zero
    # Two products in flight at most, each in its own loop-carried register set: p0 holds the even K blocks, p1
    # the odd ones (the loop runs over pairs). Swapping one "pending" variable instead made the back edge copy
    # the running MMA's registers, and ptxas then serialised every wgmma (warning C7514).
    p0 = _issue_block(a_bufs, w_bufs, ready, 0, zero, STAGES)
    s0 = gl.load(a_s_ptrs, mask=row_ok, other=0.0) * gl.load(w_s_ptr)
    for pair in range((num_kb - 1) // 2):
        kb = 1 + 2 * pair
        p1 = _issue_block(a_bufs, w_bufs, ready, kb, zero, STAGES)
        p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0, ))  # block kb - 1 done, kb running
        acc += p0 * s0[:, None]
        _request_block(a_desc, w_desc, a_bufs, w_bufs, ready, kb + STAGES - 1, num_kb, off_m, off_n, STAGES)
        s1 = gl.load(a_s_ptrs + kb, mask=row_ok, other=0.0) * gl.load(w_s_ptr + kb)
        p0 = _issue_block(a_bufs, w_bufs, ready, kb + 1, zero, STAGES)
        p1 = warpgroup_mma_wait(num_outstanding=1, deps=(p1, ))  # block kb done, kb + 1 running
        acc += p1 * s1[:, None]
        _request_block(a_desc, w_desc, a_bufs, w_bufs, ready, kb + STAGES, num_kb, off_m, off_n, STAGES)
        s0 = gl.load(a_s_ptrs + kb + 1, mask=row_ok, other=0.0) * gl.load(w_s_ptr + kb + 1)
    last = 1 + 2 * ((num_kb - 1) // 2)  # num_kb when num_kb is odd: one block left over otherwise
    if last < num_kb:
        q1 = _issue_block(a_bufs, w_bufs, ready, last, zero, STAGES)
        d0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0, ))
        acc += d0 * s0[:, None]
        s1 = gl.load(a_s_ptrs + last, mask=row_ok, other=0.0) * gl.load(w_s_ptr + last)
        d1 = warpgroup_mma_wait(num_outstanding=0, deps=(q1, ))
        acc += d1 * s1[:, None]
    else:
        d0 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, ))
        acc += d0 * s0[:, None]
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    cols = off_n + gl.arange(0, BLOCK_N, layout=col_layout)
    out_ptrs = OUT + rows.to(gl.int64)[:, None] * stride_out + cols[None, :]
    gl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


def fp8_gemm_overlap(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     out: torch.Tensor | None = None, block_m: int = 128, block_n: int = 128, stages: int = 4,
                     num_warps: int = 8) -> torch.Tensor:
    """a [M, K] e4m3 with a_scale [M, cdiv(K, 128)] fp32, w [N, K] e4m3 with w_scale [cdiv(N, 128), cdiv(K, 128)]:
    out [M, N] (bf16 unless given) = the block-scaled product (see the module docstring)."""
    m, k = a.shape
    n = w.shape[0]
    kb = triton.cdiv(k, K_TILE)
    if block_m != 16 * num_warps or 128 % block_n:
        raise ValueError(f"block_m {block_m} needs {block_m // 16} warps (got {num_warps}); block_n must divide 128")
    if (tuple(a_scale.shape) != (m, kb) or tuple(w_scale.shape) != (triton.cdiv(n, 128), kb)
            or not (a_scale.is_contiguous() and w_scale.is_contiguous())):
        raise ValueError(f"scales: contiguous a_scale [{m}, {kb}] and w_scale [{triton.cdiv(n, 128)}, {kb}], got "
                         f"{tuple(a_scale.shape)} / {tuple(w_scale.shape)}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if out.shape != (m, n) or out.stride(1) != 1:
        raise ValueError(f"out: [{m}, {n}] with unit column stride")
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, K_TILE], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, K_TILE], gl.float8e4nv)
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [block_m, K_TILE], a_layout)
    w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [block_n, K_TILE], w_layout)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_gemm_overlap_kernel[grid](a_desc, w_desc, a_scale, w_scale, out, m, n, k, out.stride(0),
                                   STAGES=stages, num_warps=num_warps)
    return out


def fp8_gemm_overlap_ref(a, a_scale, w, w_scale) -> torch.Tensor:
    """The same product in float64 from the dequantised operands."""
    m, k = a.shape
    n = w.shape[0]
    kb = torch.arange(k, device=a.device) // K_TILE
    a64 = a.double() * a_scale.double()[:, kb]
    w64 = w.double() * w_scale.double()[torch.arange(n, device=a.device) // 128][:, kb]
    return a64 @ w64.t()


def compile_only() -> list:
    """Compile the kernel for sm_90 on this machine (no launch) and read its wgmma waits from the PTX."""
    from compile_only import install_compile_only_h200, pretend_torch_has_h200

    pretend_torch_has_h200()
    compiled = []
    install_compile_only_h200(lambda fn, kernel, kwargs: compiled.append(kernel))
    rows = []
    for block_m, warps in ((64, 4), (128, 8)):
        a = torch.zeros(256, 2880, dtype=torch.float8_e4m3fn)
        w = torch.zeros(256, 2880, dtype=torch.float8_e4m3fn)
        fp8_gemm_overlap(a, torch.ones(256, 23), w, torch.ones(2, 23), block_m=block_m, num_warps=warps)
        kernel = compiled[-1]
        ptx = kernel.asm["ptx"]
        sass = _sass(kernel.asm["cubin"])
        rows.append({"tile": f"m{block_m} n128 w{warps} s4", "wgmma": ptx.count("wgmma.mma_async"),
                     "ptx_waits": ", ".join(re.findall(r"wgmma\.wait_group\.sync\.aligned \d+", ptx)),
                     # what the GPU runs: ptxas may still serialise (a DEPBAR ... 0x0 after every QGMMA)
                     "sass_depbar": ", ".join(f"{w} x{sass.count(w)}" for w in sorted(set(
                         re.findall(r"DEPBAR\.LE gsb0, 0x\d", sass)))),
                     "sass_qgmma": sass.count("QGMMA")})
    return rows


def _sass(cubin: bytes) -> str:
    """The cubin's machine code through Triton's bundled cuobjdump."""
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    import bench_common as bc

    if args.compile_only:
        rows = compile_only()
        meta = {"command": "python benchmarks/diag_gluon_fp8_gemm.py " + " ".join(sys.argv[1:]),
                "triton": triton.__version__, "target": "cuda sm_90, compiled only (no GPU)"}
        md = "\n".join([
            "# Gluon FP8 GEMM prototype: its wgmma waits, compiled for sm_90 (no GPU)", "",
            f"`{meta['command']}` — Triton {meta['triton']} (the device image runs 3.6: not compiled there)", "",
            "Per tile: the wgmma instructions and waits in the PTX, and in the machine code (cuobjdump) the QGMMA "
            "count and the scoreboard waits by how many wgmma groups they leave in flight (0x1: one, the MMA "
            "that runs while the previous K block is scaled; 0x0 only at the end). Never run: no timing, no "
            "check of its outputs yet (stage gluon21).", "",
            bc.md_table(rows, [("tile", "tile", None), ("PTX wgmma", "wgmma", None), ("PTX waits", "ptx_waits", None),
                               ("SASS QGMMA", "sass_qgmma", None), ("SASS waits", "sass_depbar", None)])]) + "\n"
        bc.write_results(args.out, "diag_gluon_fp8_gemm_compile", meta, rows, md)
        print(md)
        return

    bc.import_project()
    from sglang_ext.kernels import fp8_gemm

    torch.manual_seed(0)
    rows = []
    for m, n, k in ((8192, 5120, 2880), (8192, 2880, 4096), (1000, 640, 2880)):
        a = (torch.randn(m, k, device="cuda") * 64).to(torch.float8_e4m3fn)
        w = (torch.randn(n, k, device="cuda") * 64).to(torch.float8_e4m3fn)
        a_s = torch.rand(m, triton.cdiv(k, 128), device="cuda") * 1e-3 + 1e-4
        w_s = torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device="cuda") * 1e-3 + 1e-4
        want = fp8_gemm_overlap_ref(a, a_s, w, w_s)
        for block_m, warps in ((64, 4), (128, 8)):
            row = {"M": m, "N": n, "K": k, "tile": f"m{block_m} w{warps}"}
            try:
                got = fp8_gemm_overlap(a, a_s, w, w_s, block_m=block_m, num_warps=warps)
                torch.cuda.synchronize()
                row["max_rel_err"] = ((got.double() - want).abs().max() / want.abs().max()).item()
                row["gluon_us"] = bc.graph_time_calls([lambda: fp8_gemm_overlap(a, a_s, w, w_s, out=got,
                                                                                 block_m=block_m, num_warps=warps)]) * 1e6
                row["TFLOPs"] = 2 * m * n * k / row["gluon_us"] / 1e6
            except Exception as e:  # noqa: BLE001 - a prototype: report, keep going
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(row, flush=True)
        try:  # ours as served (bias-free form of the dense layer's GEMM) on the same operands
            ours = lambda: fp8_gemm.fp8_gemm(a, a_s, w, w_s)  # noqa: E731  (bf16 out, no bias)
            rows.append({"M": m, "N": n, "K": k, "tile": "ours (_fp8_gemm_kernel)",
                         "gluon_us": bc.graph_time_calls([ours]) * 1e6})
        except Exception as e:  # noqa: BLE001
            rows.append({"M": m, "N": n, "K": k, "tile": "ours", "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(rows[-1], flush=True)
    meta = bc.run_meta("python benchmarks/diag_gluon_fp8_gemm.py " + " ".join(sys.argv[1:]))
    md = "# Gluon FP8 GEMM prototype with the promotion behind the MMA\n\n" + bc.md_table(rows, [
        ("M", "M", None), ("N", "N", None), ("K", "K", None), ("tile", "tile", None),
        ("us", "gluon_us", "{:.1f}"), ("TFLOP/s", "TFLOPs", "{:.0f}"), ("max rel err", "max_rel_err", "{:.1e}"),
        ("error", "error", None)]) + "\n"
    bc.write_results(args.out, "diag_gluon_fp8_gemm", meta, rows, md)
    print(md)


if __name__ == "__main__":
    main()
