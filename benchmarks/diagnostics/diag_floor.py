"""How fast can one H200 kernel read N bytes, and how close does a one-shot FP8 GEMV get?

Every batch-1 decode kernel reads 1-70 MB. diag_decode_b1 fits the FP8 GEMV as 6.2 us fixed per call
+ bytes at 4.18 TB/s (diag_decode_b1.md), and the MoE and sink kernels show the same few-us
surplus. This asks whether that surplus is the hardware's or ours:

1. read floor: a streaming read kernel (no arithmetic) over one contiguous buffer, at the byte
   counts of the decode kernels, several grid shapes, inside a CUDA graph of back-to-back calls on
   distinct buffers (more than L2 holds), as in the real step; torch's own sum as a peer;
2. one-shot GEMV prototype: y = quant(x) . W^T (FP8 block-128, bias) at M = 1 where each program
   owns BLOCK_N rows and ALL of K, loading its whole weight slab in at most two loads before any
   arithmetic (no K loop, no split-K, so no partial sums and no last-arriver tail), beside the
   shipped `fp8_linear` in the same process, and a read-only twin of the same grid.

    python -m benchmarks.diagnostics.diag_floor               # into benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl

from benchmarks.bench_common import copy_bandwidth, graph_time_calls, import_project, md_table, run_meta

import_project()
from sglang_ext.kernels.fp8_gemm import _quantize_tile, fp8_linear, gemv_config, quantize_activation_group128  # noqa: E402

L2_DEFEAT_BYTES = 256 << 20


@triton.jit
def _stream_read_kernel(SRC, OUT, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Program p xors words [p * BLOCK * ITERS, ...): ITERS independent loads, then the sums."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * (BLOCK * ITERS)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(ITERS):
        idx = base + i * BLOCK + offs
        acc ^= tl.load(SRC + idx, mask=idx < n_words, other=0)
    tl.store(OUT + pid, tl.xor_sum(acc, axis=0))


@triton.jit
def _gemv_x_side(X, XS, WS, BIAS, rows_c, stride_wsn, K, nkb, k1, b1, k2, b2, C2: tl.constexpr, PREQ: tl.constexpr):
    """Everything but the weight: x (or its codes) over both K chunks, their scales (PREQ) or zeros
    (quantised later), the weight scales, the bias. C2 == 0: the second chunk repeats the first."""
    x1 = tl.load(X + k1, mask=k1 < K, other=0.0)
    ws1 = tl.load(WS + (rows_c // 128)[:, None] * stride_wsn + b1[None, :], mask=(b1 < nkb)[None, :], other=0.0)
    s1 = tl.load(XS + b1, mask=b1 < nkb, other=0.0) if PREQ else tl.zeros(b1.shape, dtype=tl.float32)
    x2, ws2, s2 = x1, ws1, s1
    if C2 > 0:
        x2 = tl.load(X + k2, mask=k2 < K, other=0.0)
        ws2 = tl.load(WS + (rows_c // 128)[:, None] * stride_wsn + b2[None, :], mask=(b2 < nkb)[None, :], other=0.0)
        s2 = tl.load(XS + b2, mask=b2 < nkb, other=0.0) if PREQ else tl.zeros(b2.shape, dtype=tl.float32)
    bias = tl.load(BIAS + rows_c).to(tl.float32)
    return x1, ws1, s1, x2, ws2, s2, bias


@triton.jit
def _gemv_oneshot_kernel(X, XS, W, WS, BIAS, Y, N, K, stride_wn, stride_wsn,
                         BLOCK_N: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, READ_ONLY: tl.constexpr,
                         X_FIRST: tl.constexpr, PREQ: tl.constexpr):
    """M = 1. Program owns rows [pid * BLOCK_N, +BLOCK_N) and K blocks [0, C1) then [C1, C1 + C2)
    (C1, C2 powers of two, C2 may be 0; masked past K); no K loop, no split.
    X_FIRST: x (and both scale vectors) are loaded before the weight, so x's quantisation runs
    while the weight is in flight; else after it (behind it in the SM's memory queue).
    PREQ: X holds e4m3 codes and XS their group scales (quantised by the producer of x)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = (rows % N).to(tl.int64)
    offs_k = tl.arange(0, 128)
    nkb = tl.cdiv(K, 128)
    b1 = tl.arange(0, C1)
    k1 = b1[:, None] * 128 + offs_k[None, :]  # [C1, 128]
    b2 = C1 + tl.arange(0, C2 if C2 > 0 else 1)
    k2 = b2[:, None] * 128 + offs_k[None, :]
    if X_FIRST:
        x1, ws1, s1, x2, ws2, s2, bias = _gemv_x_side(X, XS, WS, BIAS, rows_c, stride_wsn, K, nkb, k1, b1, k2, b2,
                                                      C2, PREQ)
    w1 = tl.load(W + rows_c[:, None, None] * stride_wn + k1[None, :, :], mask=(k1 < K)[None, :, :], other=0.0)
    if C2 > 0:
        w2 = tl.load(W + rows_c[:, None, None] * stride_wn + k2[None, :, :], mask=(k2 < K)[None, :, :], other=0.0)
    if not X_FIRST:
        x1, ws1, s1, x2, ws2, s2, bias = _gemv_x_side(X, XS, WS, BIAS, rows_c, stride_wsn, K, nkb, k1, b1, k2, b2,
                                                      C2, PREQ)
    if READ_ONLY:
        acc = tl.sum(tl.sum(w1.to(tl.float32), axis=2), axis=1)
        if C2 > 0:
            acc += tl.sum(tl.sum(w2.to(tl.float32), axis=2), axis=1)
    else:
        if PREQ:
            q1 = x1
        else:
            q1, s1 = _quantize_tile(x1.to(tl.float32), True)
        d1 = tl.sum(w1.to(tl.float32) * q1.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_N, C1]
        acc = tl.sum(d1 * (ws1 * s1[None, :]), axis=1)
        if C2 > 0:
            if PREQ:
                q2 = x2
            else:
                q2, s2 = _quantize_tile(x2.to(tl.float32), True)
            d2 = tl.sum(w2.to(tl.float32) * q2.to(tl.float32)[None, :, :], axis=2)
            acc += tl.sum(d2 * (ws2 * s2[None, :]), axis=1)
        acc += bias
    tl.store(Y + rows, acc.to(Y.dtype.element_ty), mask=rows < N)


def pow2_chunks(kb: int) -> tuple[int, int]:
    """K blocks -> (C1, C2): C1 the largest power of two <= kb, C2 a power of two covering the rest."""
    c1 = 1 << (kb.bit_length() - 1)
    rest = kb - c1
    return c1, (0 if rest == 0 else 1 << (rest - 1).bit_length())


def read_floor(bw: float, sizes_mb, rows: list):
    big = torch.empty(max(L2_DEFEAT_BYTES, 2 * int(max(sizes_mb) * 1e6)) // 4 + 1024, dtype=torch.int32,
                      device="cuda").random_()
    out = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for mb in sizes_mb:
        n_words = int(mb * 1e6) // 4
        copies = max(2, min(64, (big.numel() - 1024) // n_words))
        slices = [big[i * n_words:(i + 1) * n_words] for i in range(copies)]
        variants = []
        for warps, block, iters in ((4, 1024, 1), (4, 1024, 4), (4, 1024, 16), (8, 2048, 8), (4, 512, 8)):
            progs = triton.cdiv(n_words, block * iters)
            variants.append((f"stream b{block} i{iters} w{warps}", progs, (block, iters, warps)))
        for name, progs, (block, iters, warps) in variants:
            if progs > out.numel():
                continue
            calls = [lambda s=s, p=progs, b=block, it=iters, w=warps: _stream_read_kernel[(p,)](
                s, out, n_words, BLOCK=b, ITERS=it, num_warps=w) for s in slices]
            t = graph_time_calls(calls * max(1, 32 // copies), iters=20)
            rows.append({"part": "read floor", "MB": mb, "variant": name, "programs": progs,
                         "programs_per_sm": round(progs / sms, 2), "us": t * 1e6,
                         "pct_copy_bw": 100 * n_words * 4 / t / bw})
        calls = [lambda s=s: s.view(torch.float16).sum() for s in slices]
        t = graph_time_calls(calls * max(1, 32 // copies), iters=20)
        rows.append({"part": "read floor", "MB": mb, "variant": "torch fp16 sum", "programs": None,
                     "programs_per_sm": None, "us": t * 1e6, "pct_copy_bw": 100 * n_words * 4 / t / bw})
        print(json.dumps(rows[-1]), flush=True)
    del big


def gemv_oneshot(bw: float, rows: list):
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape, n, k in (("n256", 256, 2880), ("n2048", 2048, 2880), ("o", 2880, 4096), ("qkv", 5120, 2880),
                        ("n11520", 11520, 2880), ("n23040", 23040, 2880)):
        copies = max(2, min(32, L2_DEFEAT_BYTES // (n * k)))
        ws = [(torch.randn(n, k, device="cuda", generator=gen) * 0.05).to(torch.float8_e4m3fn) for _ in range(copies)]
        ss = [torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device="cuda", generator=gen) * 1e-2 + 1e-3
              for _ in range(copies)]
        bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
        x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        ref = fp8_linear(x, ws[0], ss[0], bias).float()
        wbytes = n * k
        shipped = graph_time_calls([lambda w=w, s=s: fp8_linear(x, w, s, bias) for w, s in zip(ws, ss)]
                                   * max(1, 32 // copies), iters=20)
        rows.append({"part": "gemv M=1", "shape": shape, "N": n, "K": k, "MB": wbytes / 1e6,
                     "variant": f"shipped fp8_linear ({gemv_config(1, n, k).short()})", "us": shipped * 1e6,
                     "pct_copy_bw": 100 * wbytes / shipped / bw, "vs_shipped": 1.0, "rel_err": 0.0})
        c1, c2 = pow2_chunks(triton.cdiv(k, 128))
        xq, xs = quantize_activation_group128(x)
        variants = [(bn, wp, ro, xf, pq) for bn in (2, 4, 8, 16) for wp in (2, 4, 8) for ro, xf, pq in
                    ((True, False, False), (False, False, False), (False, True, False), (False, True, True))]
        for block_n, warps, read_only, x_first, preq in variants:
            if block_n * 128 * (c1 + c2) // (32 * warps) > 512:  # > 128 registers of weight bytes per thread
                continue
            grid = (triton.cdiv(n, block_n),)

            def call(w, s, bn=block_n, wp=warps, ro=read_only, xf=x_first, pq=preq, g=grid):
                _gemv_oneshot_kernel[g](xq if pq else x, xs, w, s, bias, y, n, k, w.stride(0), s.stride(0), BLOCK_N=bn,
                                        C1=c1, C2=c2, READ_ONLY=ro, X_FIRST=xf, PREQ=pq, num_warps=wp)
            name = (f"oneshot n{block_n} w{warps}" + (" read-only" if read_only else "")
                    + (" x-first" if x_first else "") + (" x pre-quantised" if preq else ""))
            try:
                call(ws[0], ss[0])
                torch.cuda.synchronize()
                err = None if read_only else ((y.float() - ref).abs().max() / ref.abs().max()).item()
                t = graph_time_calls([lambda w=w, s=s: call(w, s) for w, s in zip(ws, ss)]
                                     * max(1, 32 // copies), iters=20)
            except Exception as exc:  # a variant that does not compile is a row, not a stop
                rows.append({"part": "gemv M=1", "shape": shape, "variant": name, "error": repr(exc)[:160]})
                continue
            rows.append({"part": "gemv M=1", "shape": shape, "N": n, "K": k, "MB": wbytes / 1e6,
                         "variant": name, "programs": grid[0], "programs_per_sm": round(grid[0] / sms, 2),
                         "us": t * 1e6, "pct_copy_bw": 100 * wbytes / t / bw, "vs_shipped": shipped / t,
                         "rel_err": err})
            print(json.dumps(rows[-1]), flush=True)
        del ws, ss
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results"))
    ap.add_argument("--sizes-mb", default="0.7,2.9,5.9,11.8,14.7,16.8,33.2,66.4,132.7,1160")
    ap.add_argument("--parts", default="read,gemv")
    args = ap.parse_args()
    t0 = time.time()
    bw = copy_bandwidth()
    rows: list = []
    if "read" in args.parts:
        read_floor(bw, [float(s) for s in args.sizes_mb.split(",")], rows)
    if "gemv" in args.parts:
        gemv_oneshot(bw, rows)
    meta = run_meta(f"python -m benchmarks.diagnostics.diag_floor --parts {args.parts} --out {args.out}",
                    {"copy_bandwidth_Bps": bw, "seconds": time.time() - t0, "gpu": torch.cuda.get_device_name()})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "diag_floor.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    best = {}
    for r in rows:
        if r["part"] == "read floor" and "us" in r:
            key = r["MB"]
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    lines = [f"# Read floor and a one-shot FP8 GEMV ({meta['gpu']})", "",
             f"`{meta['command']}` — {meta['date']}, torch {meta['torch']}, triton {meta.get('triton')}; "
             f"copy bandwidth {bw / 1e12:.2f} TB/s. Per-call times: CUDA graphs of back-to-back calls on "
             "distinct buffers (> L2).", "", "## Fastest streaming read by size", "",
             md_table([best[k] for k in sorted(best)], [("MB", "MB", "{:.1f}"), ("variant", "variant", "{}"),
                                                        ("programs/SM", "programs_per_sm", "{}"),
                                                        ("us", "us", "{:.2f}"), ("% copy BW", "pct_copy_bw", "{:.0f}")]),
             "", "## All read rows", "",
             md_table([r for r in rows if r["part"] == "read floor"],
                      [("MB", "MB", "{:.1f}"), ("variant", "variant", "{}"), ("programs/SM", "programs_per_sm", "{}"),
                       ("us", "us", "{:.2f}"), ("% copy BW", "pct_copy_bw", "{:.0f}")]),
             "", "## GEMV at M = 1", "",
             md_table([r for r in rows if r["part"] == "gemv M=1" and "us" in r],
                      [("shape", "shape", "{}"), ("MB", "MB", "{:.1f}"), ("variant", "variant", "{}"),
                       ("programs/SM", "programs_per_sm", "{}"), ("us", "us", "{:.2f}"),
                       ("% copy BW", "pct_copy_bw", "{:.0f}"), ("x vs shipped", "vs_shipped", "{:.2f}"),
                       ("rel err vs shipped", "rel_err", "{:.1e}")])]
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["", "Variants that did not run:", ""] + [f"- {r['shape']} {r['variant']}: {r['error']}" for r in errors]
    with open(os.path.join(args.out, "diag_floor.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
