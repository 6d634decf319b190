"""FP8 block-128 GEMM with fused bias (`kernels/fp8_gemm/`) on one H200, against cuBLAS.

Shapes are gpt-oss's dense layers (random weights): qkv 2880 -> 5120, o 4096 -> 2880 and the
lm_head 2880 -> 201088 (up to --lm-head-max-m rows: prefill only needs the last rows' logits).
For each M:
  - ours, `fp8_linear` (bf16 x -> quantise -> GEMM + bias, heuristic launch config), and
    `fp8_gemm` on pre-quantised operands, and the quantisation kernel alone;
  - peers in the same process on the same operands (`peers()`): cuBLAS block-scaled FP8
    (`torch.nn.functional.scaled_mm`, 1x128 x 128x128 scales, else `torch._scaled_mm`) plus a
    separate bias add; cuBLAS needs K % 128 == 0, so its operands are padded once, outside
    the timing, from 2880 to 2944 zero columns (2.2% more bytes and FLOPs than ours reads);
    bf16 `F.linear` with bias (weights dequantised to bf16); SGLang 0.5.23's own Triton
    `w8a8_block_fp8_matmul_triton` + bias add on the same pre-quantised operands (its kernel masks
    K: no padding), and SGLang's Triton per-token-group quant + that GEMM from bf16 x (its quant
    needs K % 128 == 0: w padded 2880 -> 2944 once outside the timing, x zero-padded inside the
    timed call; exact), both through benchmarks/sglang_peers.py (carried source: run
    `bash benchmarks/fetch_sglang_peers.sh`, carry .peers/sglang_src). A peer that fails records
    why; every peer's output is compared with ours (max abs diff and max diff / max |y| per row).
Times: median of CUDA-graph replays; each replay runs the op over enough distinct weight copies
(> 2x the L2 cache) that weights come from HBM as in a real decode step, not from L2.
Achieved TB/s counts the weight bytes (e4m3 + scales) only; ceilings measured in the same run:
device copy bandwidth and cuBLAS block-scaled FP8 at 8192^3. `--sweep` (default on) also times
alternative launch configs at a few M, to calibrate `gemm_config`.

    python -m benchmarks.bench_fp8_gemm --out benchmarks/results
    # decode only (M <= 16): the decode kernel's candidates beside the tl.dot tile path, < 150 s
    python -m benchmarks.bench_fp8_gemm --m 1,4,16 --sweep-m 1,4,16 --sweep-shapes qkv,o,lm_head \
        --budget-s 120 --out $OUT
    # the GEMV's fixed cost: `fixed_cost_variants` at M = 1, 4 (lm_head at 1), no main table,
    # kernels compiled in 12 processes first
    python -m benchmarks.bench_fp8_gemm --m "" --sweep-m 1,4 --sweep-lm-head-m 1 \
        --sweep-shapes qkv,o,lm_head --decode-sweep fixed-cost --compile-workers 12 --budget-s 100 --out $OUT
    # the one-shot decode kernel at M = 1, 2, 4, x quantised in-kernel and pre-quantised, beside the
    # heuristic's picks and the split-K x_once kernel, no main table (< 120 s)
    python -m benchmarks.bench_fp8_gemm --m "" --sweep-m 1,2,4 --sweep-shapes qkv,o \
        --decode-sweep oneshot --compile-workers 14 --budget-s 90 --out $OUT
    # the sweep's plan, no GPU needed
    python -m benchmarks.bench_fp8_gemm --list-sweep --sweep-m 1,4,16 --sweep-shapes qkv,o,lm_head
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks import bench_common

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
STEM = "bench_fp8_gemm"
SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "lm_head": (201088, 2880)}  # name: (N, K)
DEFAULT_M = "1,4,16,64,256,1024,4096,8192"


def import_project():
    """`sglang_ext.kernels.fp8_gemm` and `sglang_ext.layers.fp8`, installed or from the checkout."""
    bench_common.import_project()
    from sglang_ext.kernels import fp8_gemm
    from sglang_ext.layers import fp8

    return fp8_gemm, fp8


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--m", default=DEFAULT_M, help="comma-separated token counts")
    ap.add_argument("--shapes", default="qkv,o,lm_head", help=f"subset of {','.join(SHAPES)}")
    ap.add_argument("--lm-head-max-m", type=int, default=1024)
    ap.add_argument("--sweep", default="on", choices=("on", "off"), help="time alternative launch configs")
    ap.add_argument("--sweep-m", default="1,16,64,256,4096", help="token counts the sweep times")
    ap.add_argument("--sweep-shapes", default="qkv,o", help="shapes the sweep times (of --shapes)")
    ap.add_argument("--sweep-lm-head-m", default="",
                    help="token counts the sweep times on lm_head (default: --sweep-m)")
    ap.add_argument("--decode-sweep", default="all", choices=("all", "configs", "fixed-cost", "oneshot"),
                    help="decode (M <= 16) candidates: launch-config variants, the fixed-cost variants "
                         "(x once per program, vector split sum, no split-K, one-shot, pre-quantised x), "
                         "both, or only the one-shot kernel's rows beside the heuristic and x_once")
    ap.add_argument("--compile-workers", type=int, default=0,
                    help="compile the sweep's kernels first in this many processes (0: as they come)")
    ap.add_argument("--budget-s", type=float, default=110.0,
                    help="skip remaining sweep entries once the whole run is this old")
    ap.add_argument("--list-sweep", action="store_true",
                    help="print the sweep's candidate configs per shape and M and exit (no GPU needed)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    args.m_values = [int(v) for v in args.m.split(",") if v]
    args.shape_names = [s for s in args.shapes.split(",") if s]
    args.sweep_m_values = [int(v) for v in args.sweep_m.split(",") if v]
    args.sweep_lm_head_m_values = [int(v) for v in args.sweep_lm_head_m.split(",") if v]
    args.sweep_shape_names = [s for s in args.sweep_shapes.split(",") if s in args.shape_names]
    unknown = [s for s in args.shape_names + args.sweep_shapes.split(",") if s and s not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}")
    return args


# ---------------------------------------------------------------------------------------------
# timing and ceilings
# ---------------------------------------------------------------------------------------------


def event_time(fn, iters=10, warmup=2) -> float:
    return bench_common.event_time(fn, iters, warmup)


def graph_time(calls, iters=20, min_replay_s=300e-6) -> tuple[float, str]:
    """Seconds per call: `calls` (one per weight copy) run back to back, `repeat` times, in one
    CUDA graph; median replay / (repeat * len(calls)). Falls back to CUDA events without a
    graph if capture fails (recorded in the second value)."""
    def one_pass():
        for c in calls:
            c()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            one_pass()
    torch.cuda.current_stream().wait_stream(stream)
    t_pass = event_time(one_pass, iters=3, warmup=0)
    repeat = int(max(1, min(50, math.ceil(min_replay_s / max(t_pass, 1e-7)))))
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeat):
                one_pass()
        t = event_time(graph.replay, iters=iters, warmup=3)
        del graph
        return t / (repeat * len(calls)), "graph"
    except Exception as exc:  # noqa: BLE001  (a peer that cannot be captured is still timed)
        torch.cuda.synchronize()
        t = event_time(lambda: [one_pass() for _ in range(repeat)], iters=iters, warmup=1)
        return t / (repeat * len(calls)), f"events ({type(exc).__name__})"


def copy_bandwidth() -> float:
    return bench_common.copy_bandwidth()


def l2_bytes() -> int:
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20) or (50 << 20))


# ---------------------------------------------------------------------------------------------
# peers
# ---------------------------------------------------------------------------------------------


def _cublas_operands(a_fp8, a_scale, w_fp8, w_scale_inv):
    """cuBLAS block scaling wants K % 128 == 0, 1x128 scales MN-major [M, K/128] (strides (1, M)),
    128x128 scales as [L4, N/128] K-major with L4 = K/128 rounded up to 4: pad once here."""
    m, k = a_fp8.shape
    n = w_fp8.shape[0]
    k_pad = -(-k // 128) * 128
    kb = k_pad // 128
    l4 = -(-kb // 4) * 4
    a_pad = torch.zeros(m, k_pad, dtype=torch.float8_e4m3fn, device=a_fp8.device)
    a_pad[:, :k] = a_fp8
    w_pad = torch.zeros(n, k_pad, dtype=torch.float8_e4m3fn, device=w_fp8.device)
    w_pad[:, :k] = w_fp8
    sa = a_scale.float().t().contiguous().t()  # [M, KB], strides (1, M)
    sb = torch.ones(w_scale_inv.shape[0], l4, dtype=torch.float32, device=w_fp8.device)
    sb[:, :kb] = w_scale_inv
    return a_pad, w_pad, sa, sb.t()  # sb.t(): [L4, NB], strides (1, L4)


def cublas_blockwise_fn(a_fp8, a_scale, w_fp8, w_scale_inv, bias, out_dtype=torch.bfloat16):
    """A zero-arg callable for cuBLAS block-scaled FP8 + bias add, or raises with the reason."""
    a_pad, w_pad, sa, sb = _cublas_operands(a_fp8, a_scale, w_fp8, w_scale_inv)
    errors = []
    scaled_mm = getattr(F, "scaled_mm", None)
    if scaled_mm is not None:
        from torch.nn.functional import ScalingType

        def run_v2():
            y = scaled_mm(a_pad, w_pad.t(), sa, ScalingType.BlockWise1x128, sb, ScalingType.BlockWise128x128,
                          output_dtype=out_dtype)
            return y.add_(bias) if bias is not None else y

        try:
            run_v2()
            torch.cuda.synchronize()
            return run_v2, "torch.nn.functional.scaled_mm"
        except Exception as exc:  # noqa: BLE001
            errors.append(f"F.scaled_mm: {type(exc).__name__}: {str(exc)[:300]}")
    else:
        errors.append("torch.nn.functional.scaled_mm: missing")

    def run_v1():
        y = torch._scaled_mm(a_pad, w_pad.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        return y.add_(bias) if bias is not None else y

    try:
        run_v1()
        torch.cuda.synchronize()
        return run_v1, "torch._scaled_mm"
    except Exception as exc:  # noqa: BLE001
        errors.append(f"torch._scaled_mm: {type(exc).__name__}: {str(exc)[:300]}")
    raise RuntimeError(" | ".join(errors))


def _peer_module(name: str):
    """A peer adapter of this package (benchmarks/sglang_peers.py, benchmarks/deepgemm_peer.py), imported
    when a case asks for it: a machine without the peer still runs the rest."""
    import importlib

    return importlib.import_module(f"benchmarks.{name}")


def _sglang_kernels() -> dict:
    """SGLang 0.5.23's own Triton kernels through benchmarks/sglang_peers.py (carried source,
    stubbed imports): name -> callable, or name -> the reason it is missing."""
    try:
        return _peer_module("sglang_peers").load_sglang_kernels()
    except Exception as exc:  # noqa: BLE001  (no adapter module here: a result, not a crash)
        reason = f"{type(exc).__name__}: {exc}"
        return {"make_fp8_gemm": reason, "make_fp8_linear": reason}


def _sglang_fn(adapter: str, *args):
    make = _sglang_kernels().get(adapter)
    if not callable(make):
        raise RuntimeError(str(make))
    run = make(*args)
    run()
    return run, getattr(run, "api", adapter)


def deepgemm_fn(a_fp8, a_scale, w_fp8, w_scale_inv, bias):
    """DeepGEMM's SM90 FP8 block-scaled GEMM (benchmarks/deepgemm_peer.py: its pure-Python JIT release,
    carried in .peers/deepgemm) on the same pre-quantised operands, + a bias add (it has no bias epilogue).
    The scales are copied once, outside the timing, into its TMA-aligned layout (the same values)."""
    dgp = _peer_module("deepgemm_peer")
    dgp.load_deepgemm()  # DeepGemmUnavailable says why: recorded as the peer's error
    m, k = a_fp8.shape
    scale = dgp.deepgemm_scale_buffer(m, k, a_fp8.device)
    scale.copy_(a_scale)
    out = torch.empty((m, w_fp8.shape[0]), dtype=torch.bfloat16, device=a_fp8.device)

    def run():
        dgp.deepgemm_gemm(a_fp8, scale, w_fp8, w_scale_inv, out)
        return out.add_(bias)

    run()  # its JIT compiles each shape on the first call
    return run, "deep_gemm.gemm_fp8_fp8_bf16_nt + bias add"


# Which of our timings each peer is compared with: fp8 GEMM peers take the same pre-quantised
# operands as `fp8_gemm`; the others start from bf16 x, as `fp8_linear` does.
PEER_BASELINE = {"cublas_fp8_blockwise": "ours_gemm_us", "sglang_triton_fp8": "ours_gemm_us",
                 "deepgemm_fp8": "ours_gemm_us",
                 "sglang_triton_fp8_linear": "ours_linear_us", "bf16_linear": "ours_linear_us"}


def peers(a_fp8, a_scale, w_fp8, w_scale_inv, bias, w_bf16, x_bf16) -> dict:
    """name -> (zero-arg callable, api) or (None, reason). Add a peer here: one entry (and its
    baseline in PEER_BASELINE)."""
    found = {}
    makers = {
        "cublas_fp8_blockwise": lambda: cublas_blockwise_fn(a_fp8, a_scale, w_fp8, w_scale_inv, bias),
        "sglang_triton_fp8": lambda: _sglang_fn("make_fp8_gemm", a_fp8, a_scale, w_fp8, w_scale_inv, bias),
        "deepgemm_fp8": lambda: deepgemm_fn(a_fp8, a_scale, w_fp8, w_scale_inv, bias),
        "sglang_triton_fp8_linear": lambda: _sglang_fn("make_fp8_linear", x_bf16, w_fp8, w_scale_inv, bias),
        "bf16_linear": lambda: ((lambda: F.linear(x_bf16, w_bf16, bias)), "F.linear bf16"),
    }
    for name, make in makers.items():
        try:
            found[name] = make()
        except Exception as exc:  # noqa: BLE001  (recorded, never fatal)
            found[name] = (None, f"{type(exc).__name__}: {str(exc)[:400]}")
    return found


def fp8_blockwise_ceiling(n=8192) -> dict:
    """cuBLAS block-scaled FP8 rate at n^3 (and bf16 for context)."""
    out = {}
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out["bf16_cublas_TFLOPs"] = 2 * n ** 3 / event_time(lambda: x @ y.t(), iters=10) / 1e12
    kb = n // 128
    a = x.to(torch.float8_e4m3fn)
    b = y.to(torch.float8_e4m3fn)
    sa = torch.rand(n, kb, device="cuda") + 0.5
    sb = torch.rand(kb, kb, device="cuda") + 0.5
    try:
        fn, api = cublas_blockwise_fn(a, sa, b, sb, None)
        out["fp8_blockwise_cublas_TFLOPs"] = 2 * n ** 3 / event_time(fn, iters=10) / 1e12
        out["fp8_blockwise_cublas_api"] = api
    except Exception as exc:  # noqa: BLE001
        out["fp8_blockwise_cublas_error"] = str(exc)[:400]
    del x, y, a, b
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


def fixed_cost_candidates(mod, m: int, n: int, k: int, device=None) -> list:
    """`fixed_cost_variants` (the heuristic's pick first, then the split-K tail alone (`vr`), x
    quantised once per program (`xo`, `xob`, FMA) at 1-8 K blocks per program, no split-K, the
    one-shot kernel (`gvos`)), plus (config, "prequant") rows: `fp8_gemm` on x quantised
    beforehand (that kernel not timed), what taking the quantisation out of the GEMV buys, for
    the heuristic, the x_once default and every one-shot config."""
    variants = mod.fixed_cost_variants(m, n, k, device)
    if n > 100_000:
        return variants
    x_once = next(c for c in variants if c.x_once and c.use_dot and not c.batched_dot and c.vector_reduce)
    return (variants[:1] + [(variants[0], "prequant")] + variants[1:] + [(x_once, "prequant")]
            + [(c, "prequant") for c in variants if c.oneshot and c != variants[0]])


def oneshot_candidates(mod, m: int, n: int, k: int, device=None) -> list:
    """The one-shot kernel's rows (`oneshot_variants`), each with x quantised in-kernel and
    pre-quantised, beside the split-K kernel the heuristic picks otherwise (`split_k_gemv_config`,
    x_once at M <= 4) both ways; the heuristic's own picks are added by `sweep_shape`."""
    base = mod.split_k_gemv_config(m, n, k, device)
    out = [base, (base, "prequant")]
    for c in mod.oneshot_variants(m, n, k):
        out += [c, (c, "prequant")]
    return out


def sweep_candidates(mod, m: int, n: int = 5120, k: int = 2880, device=None, decode_set: str = "all"):
    """Launch configs to time against the heuristic's pick (short names: m/n tile, s split-K
    (k: summed by a second kernel), w warps, st stages, fq x quantised inside the GEMM; `gv...`
    the decode kernel: fma/dot block maths, n BLOCK_N, xo x once per program, vr vector split
    sum, gvos the one-shot kernel). Decode (M <= 16): `decode_set` "configs" = the tl.dot tile path
    it replaced, then launch-config variants around the heuristic (split 0 = auto); "fixed-cost" =
    `fixed_cost_candidates`; "all" = both, fixed-cost first; "oneshot" = `oneshot_candidates`.
    Lists hold configs or (config, "prequant")."""
    Cfg = mod.Fp8GemmConfig
    if m <= 16:
        G = mod.Fp8GemvConfig
        k_blocks = -(-k // 128)
        auto64 = mod._auto_split_gemv(m, n, k, 64, mod.num_sms(device))
        more = min(k_blocks, 2 * auto64)  # twice the auto split (partials permitting: M = 1)
        fma = [G(64, 0, use_dot=False), G(128, 0, num_warps=8, use_dot=False), G(32, 0, use_dot=False),
               G(16, 0, use_dot=False), G(64, 0, num_warps=8, use_dot=False),
               G(64, 0, inline_reduce=False, use_dot=False), G(64, more, use_dot=False)]
        dot = [G(64, 0, num_stages=4), G(128, 0, num_stages=4), G(128, 0, num_warps=8, num_stages=3),
               G(256, 0, num_warps=8, num_stages=3), G(64, 0, num_stages=2), G(64, 0, num_stages=6),
               G(32, 0, num_stages=4), G(64, 0, num_stages=4, inline_reduce=False),
               G(64, more, num_stages=4), G(64, 0, num_stages=4, hw_round=False)]
        if m > 4:  # 5+ FMAs per weight byte: CUDA cores fall behind HBM; keep two for the record
            fma = fma[:2]
            # the 8-warp 128-wide blocks the heuristic takes from 5 rows (tuned at 16) with fewer / more K
            # splits and deeper stages, timed at 8 rows
            dot += [G(128, s, num_warps=8, num_stages=st) for s, st in ((4, 4), (6, 4), (12, 3), (0, 4), (0, 5))]
        entries = []
        if decode_set == "oneshot":
            entries += oneshot_candidates(mod, m, n, k, device)
        if decode_set in ("fixed-cost", "all"):
            entries += fixed_cost_candidates(mod, m, n, k, device)
        if decode_set in ("configs", "all"):
            entries += [mod.dot_tile_decode_config(m, n, k, device)] + fma + dot
        resolved = []
        for e in entries:
            e = resolve_split(mod, e, m, n, k, device)
            if e not in resolved:
                resolved.append(e)
        return resolved
    if m <= 256:
        # x pre-quantised (as the decode step's qkv gets it from the norm): the GEMM alone. Without split-K the
        # tiles load by TMA (as the table's rows do); split-K keeps pointer loads. Small N tiles and splits give
        # more programs than 17..256 rows' few output tiles (qkv at M = 64 on 32 x 64 tiles: 160 programs)
        return [(Cfg(bm, bn, split_k=s, num_warps=w, num_stages=st, tma=s == 1), "prequant")
                for bm, bn, s, w, st in ((32, 64, 1, 4, 4), (32, 64, 1, 4, 6), (32, 32, 1, 4, 4), (32, 32, 1, 4, 6),
                                         (64, 32, 1, 4, 4), (64, 64, 1, 4, 4), (64, 64, 1, 4, 6), (64, 128, 1, 4, 4),
                                         (64, 128, 1, 4, 3), (32, 64, 2, 4, 4), (32, 32, 2, 4, 4), (64, 32, 2, 4, 4),
                                         (64, 64, 2, 4, 4), (64, 64, 3, 4, 4), (64, 32, 3, 4, 4))]
    return [Cfg(bm, bn, num_warps=w, num_stages=st, group_m=g)
            for bm, bn, w, st, g in ((128, 128, 8, 3, 8), (128, 128, 4, 4, 8), (128, 256, 8, 3, 8), (128, 256, 8, 4, 8),
                                     (256, 128, 8, 3, 8), (64, 256, 4, 4, 8), (128, 128, 8, 5, 16),
                                     # 64-row tiles: two CTAs per SM can overlap one's scale epilogue with
                                     # the other's MMAs (Triton waits for each wgmma before scaling it)
                                     (64, 128, 4, 3, 8), (64, 128, 4, 4, 8))]


def prepare_shape(fp8, shape: str, dev, l2: int, with_bf16: bool = True) -> dict:
    """Random weights of one layer, quantised, in enough distinct copies to defeat L2 reuse
    (`with_bf16`: their bf16 dequantisations too, for the bf16 peer; the sweep needs none)."""
    n, k = SHAPES[shape]
    w_master = torch.randn(n, k, device=dev) * 0.02
    w_fp8, w_scale_inv = fp8.quantize_weight_block128(w_master)
    del w_master
    w_bytes = w_fp8.numel() + 4 * w_scale_inv.numel()
    copies = int(max(1, min(16, math.ceil(2 * l2 / w_bytes))))
    layer = {"n": n, "k": k, "w_bytes": w_bytes, "copies": copies,
             "bias": (torch.randn(n, device=dev) * 0.1).to(torch.bfloat16),
             "w": [(w_fp8, w_scale_inv)] + [(w_fp8.clone(), w_scale_inv.clone()) for _ in range(copies - 1)]}
    if with_bf16:
        w_bf16 = fp8.dequantize_weight_block128(w_fp8, w_scale_inv, torch.bfloat16)
        layer["w_bf16"] = [w_bf16] + [w_bf16.clone() for _ in range(copies - 1)]
    return layer


def measure_row(mod, fp8, shape, layer, m, bw, iters) -> dict:
    n, k, bias, w_list = layer["n"], layer["k"], layer["bias"], layer["w"]
    w_fp8, w_scale_inv = w_list[0]
    dev = w_fp8.device
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    x_q, x_s = mod.quantize_activation_group128(x)
    y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    cfg = mod.gemm_config(m, n, k, dev)
    # correctness at full size: ours vs the fp32 torch maths on the same quantised operands
    want = fp8.dequantize_activation_group128(x_q, x_s) @ fp8.dequantize_weight_block128(w_fp8, w_scale_inv).t()
    want += bias.float()
    got = mod.fp8_linear(x, w_fp8, w_scale_inv, bias)
    scale = want.abs().max().item()
    row = {"shape": shape, "M": m, "N": n, "K": k, "config": cfg.short(), "weight_copies": layer["copies"],
           "weight_bytes": layer["w_bytes"], "flops": 2 * m * n * k,
           "max_rel_err_vs_torch": (got.float() - want).abs().max().item() / scale}
    del want
    t, how = graph_time([lambda w=w, s=s: mod.fp8_linear(x, w, s, bias, out=y) for w, s in w_list], iters)
    row.update(ours_linear_us=t * 1e6, timing=how)
    t, _ = graph_time([lambda w=w, s=s: mod.fp8_gemm(x_q, x_s, w, s, bias, out=y) for w, s in w_list], iters)
    row["ours_gemm_us"] = t * 1e6
    t, _ = graph_time([lambda: mod.quantize_activation_group128(x, out=x_q, out_scale=x_s)], iters)
    row["quant_us"] = t * 1e6
    row["ours_TFLOPs"] = row["flops"] / row["ours_linear_us"] / 1e6
    row["ours_gemm_TFLOPs"] = row["flops"] / row["ours_gemm_us"] / 1e6
    row["ours_weight_TBps"] = layer["w_bytes"] / row["ours_linear_us"] / 1e6
    row["ours_pct_copy_bw"] = 100 * row["ours_weight_TBps"] * 1e12 / bw
    peer_list = [peers(x_q, x_s, w, s, bias, wb, x) for (w, s), wb in zip(w_list, layer["w_bf16"])]
    for name in peer_list[0]:
        fns = [p[name][0] for p in peer_list]
        api = peer_list[0][name][1]
        if any(f is None for f in fns):
            row[f"{name}_error"] = api
            continue
        peer_y = fns[0]()
        diff = (peer_y.float() - got.float()).abs().max().item()
        row[f"{name}_max_abs_diff_vs_ours"] = diff
        row[f"{name}_max_rel_err_vs_ours"] = diff / scale
        del peer_y
        t, how = graph_time(fns, iters)
        row[f"{name}_us"] = t * 1e6
        row[f"{name}_api"] = api + ("" if how == "graph" else f", timed with {how}")
        row[f"speedup_vs_{name}"] = row[f"{name}_us"] / row[PEER_BASELINE[name]]  # > 1: ours is faster
    return row


def _entry(cand):
    """(config, how): how = "linear" (fp8_linear from bf16 x) or "prequant" (fp8_gemm on x
    quantised beforehand)."""
    return cand if isinstance(cand, tuple) else (cand, "linear")


def _label(cand) -> str:
    cfg, how = _entry(cand)
    return cfg.short() + (" (x pre-quantised)" if how == "prequant" else "")


def resolve_split(mod, entry, m: int, n: int, k: int, device=None):
    """A decode entry with the split it actually runs (`gemv_splits`), so equal kernels compare
    equal and each short name says what runs."""
    cfg, how = _entry(entry)
    if isinstance(cfg, mod.Fp8GemvConfig):
        split = mod.gemv_splits(cfg, min(m, 16), n, k, mod.num_sms(device))[0]
        cfg = dataclasses.replace(cfg, split_k=split)
        if split == 1:  # nothing to reduce: the reduction style is moot
            cfg = dataclasses.replace(cfg, inline_reduce=True, vector_reduce=False)
    return (cfg, how) if how != "linear" else cfg


def heuristic_entries(mod, m: int, n: int, k: int, device=None) -> list:
    """The heuristic's picks as sweep entries: from bf16 x, and (up to 256 rows) from pre-quantised x, as
    `fp8_gemm` / `fp8_linear(x_quant=...)` launch it."""
    out = [mod.gemm_config(m, n, k, device)]
    if m <= 256:  # decode batches: the qkv GEMM gets x quantised by the norm before it
        out.append((mod.gemm_config(m, n, k, device, x_prequantized=True), "prequant"))
    return [resolve_split(mod, e, m, n, k, device) for e in out]


def sweep_entries(mod, m: int, n: int, k: int, dev, decode_set: str = "all") -> tuple[list, list]:
    """(the heuristic's entries, every entry sweep_shape times in its order: those first, then the candidates);
    sweep_shape's rows are in the same order."""
    heuristics = heuristic_entries(mod, m, n, k, dev)
    cands = sweep_candidates(mod, m, n, k, dev, decode_set)
    return heuristics, [h for h in heuristics if h not in cands] + cands


def sweep_shape(mod, fp8, shape, layer, m, iters, deadline, bw, decode_set="all") -> list:
    n, k, bias, w_list = layer["n"], layer["k"], layer["bias"], layer["w"]
    dev = w_list[0][0].device
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    x_q, x_s = mod.quantize_activation_group128(x)
    y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    heuristics, cands = sweep_entries(mod, m, n, k, dev, decode_set)
    # every candidate's output against fp32 torch maths on the same quantised operands (first copy)
    w0, s0 = w_list[0]
    want = fp8.dequantize_activation_group128(x_q, x_s) @ fp8.dequantize_weight_block128(w0, s0).t()
    want += bias.float()
    scale = want.abs().max().item()
    out = []
    for cand in cands:
        cfg, how = _entry(cand)
        r = {"shape": shape, "M": m, "config": _label(cand), "heuristic": cand in heuristics,
             "kernel": "decode" if isinstance(cfg, mod.Fp8GemvConfig) else "tile", "x": how}
        if how == "prequant":
            call = lambda w, s: mod.fp8_gemm(x_q, x_s, w, s, bias, out=y, config=cfg)  # noqa: E731
        else:
            call = lambda w, s: mod.fp8_linear(x, w, s, bias, out=y, config=cfg)  # noqa: E731
        if time.time() > deadline:
            r["skipped"] = "time budget"
        else:
            try:
                call(w0, s0)
                r["max_rel_err_vs_torch"] = (y.float() - want).abs().max().item() / scale
                t, _ = graph_time([lambda w=w, s=s: call(w, s) for w, s in w_list], iters)
                r["linear_us"] = t * 1e6
                r["weight_TBps"] = layer["w_bytes"] / t / 1e12
                r["pct_copy_bw"] = 100 * r["weight_TBps"] * 1e12 / bw
            except Exception as exc:  # noqa: BLE001
                r["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        out.append(r)
    del want
    # against the heuristic's pick for the same x (bf16, or pre-quantised)
    base = {r["x"]: r.get("linear_us") for r in out if r["heuristic"]}
    for r in out:
        if base.get(r["x"]) and r.get("linear_us"):
            r["heuristic_over_this"] = base[r["x"]] / r["linear_us"]
    return out


class _Warmup:
    """Stands in for a jit kernel in a precompile worker: `kernel[grid](...)` compiles (into
    Triton's on-disk cache) without launching."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.fn.warmup(*args, grid=grid, **kwargs)


def _precompile_worker(tasks, device="cuda") -> int:
    """Spawned worker: every (shape, M, config, how) through the launchers with empty full-size
    tensors (the same specialisations the timed calls get), kernels compiled, none launched."""
    mod, _ = import_project()
    # each launcher looks its kernels up in its own module of the package
    for sub in (mod.gemv, mod.gemm, mod.quantize):
        for name in ("_fp8_gemv_kernel", "_fp8_gemv_kernel_xonce", "_fp8_gemv_oneshot_kernel", "_splitk_sum_kernel",
                     "_fp8_gemm_kernel", "_quantize_group128_kernel"):
            if name in vars(sub):
                setattr(sub, name, _Warmup(getattr(sub, name)))
    dev = torch.device(device)
    for shape, m, cfg, how in tasks:
        n, k = SHAPES[shape]
        kb = -(-k // 128)
        w = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=dev)
        ws = torch.empty(-(-n // 128), kb, dtype=torch.float32, device=dev)
        b = torch.empty(n, dtype=torch.bfloat16, device=dev)
        y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
        if how == "prequant":
            xq = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=dev)
            xs = torch.empty(kb, m, dtype=torch.float32, device=dev).t()  # MN-major, as the quantiser's
            mod.fp8_gemm(xq, xs, w, ws, b, out=y, config=cfg)
        else:
            mod.fp8_linear(torch.empty(m, k, dtype=torch.bfloat16, device=dev), w, ws, b, out=y, config=cfg)
        del w
    return len(tasks)


def precompile(mod, args, workers: int) -> float:
    """Compile every sweep candidate's kernels in `workers` spawned processes (Triton compiles
    one kernel at a time per process; the sweep's ~35 specialisations took most of a serial
    run). The timed calls then load them from Triton's cache. Returns the seconds taken."""
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    groups: dict = {}
    for shape in args.sweep_shape_names:
        n, k = SHAPES[shape]
        for m in _sweep_m_values(args, shape):
            for cand in heuristic_entries(mod, m, n, k) + sweep_candidates(mod, m, n, k, decode_set=args.decode_sweep):
                cfg, how = _entry(cand)
                key = (m, how, type(cfg).__name__, cfg.short())  # one worker per kernel, roughly
                if isinstance(cfg, mod.Fp8GemvConfig):
                    split, per = mod.gemv_splits(cfg, min(m, 16), n, k)
                    key = (m, how, dataclasses.replace(cfg, split_k=0), per, split > 1)
                groups.setdefault(key, []).append((shape, m, cfg, how))
    buckets = [[] for _ in range(max(1, workers))]
    for i, tasks in enumerate(groups.values()):
        buckets[i % len(buckets)] += tasks
    with cf.ProcessPoolExecutor(len(buckets), mp_context=mp.get_context("spawn")) as pool:
        for f in [pool.submit(_precompile_worker, b) for b in buckets if b]:
            f.result()
    return time.time() - t0


def _sweep_m_values(args, shape) -> list:
    if shape == "lm_head":
        ms = args.sweep_lm_head_m_values or args.sweep_m_values
        return [m for m in ms if m <= args.lm_head_max_m]
    return args.sweep_m_values


def list_sweep(mod, args) -> list:
    """The sweep's plan without a GPU: shape, M, the heuristic's config and each candidate."""
    plan = []
    for shape in args.sweep_shape_names:
        n, k = SHAPES[shape]
        for m in _sweep_m_values(args, shape):
            heuristics = heuristic_entries(mod, m, n, k)
            cands = sweep_candidates(mod, m, n, k, decode_set=args.decode_sweep)
            plan.append({"shape": shape, "M": m, "heuristic": [_label(h) for h in heuristics],
                         "candidates": [_label(c) for c in [h for h in heuristics if h not in cands] + cands]})
            print(json.dumps(plan[-1]), flush=True)
    return plan


def main(argv=None):
    args = parse_args(argv)
    mod, fp8 = import_project()
    if args.list_sweep:
        return list_sweep(mod, args)
    t_start = time.time()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    ceilings = {"copy_bandwidth_TBps": bw / 1e12, **fp8_blockwise_ceiling()}
    print(json.dumps(ceilings), flush=True)
    rows, sweep_rows = [], []
    l2 = l2_bytes()
    for shape in args.shape_names:
        ms = [m for m in args.m_values if shape != "lm_head" or m <= args.lm_head_max_m]
        if not ms:
            continue
        layer = prepare_shape(fp8, shape, dev, l2)
        for m in ms:
            rows.append(measure_row(mod, fp8, shape, layer, m, bw, args.iters))
            print(json.dumps(rows[-1]), flush=True)
        del layer
        torch.cuda.empty_cache()
    # Sweep last, under the time budget, so the main table is always complete.
    if args.sweep == "on":
        if args.compile_workers > 0:
            try:
                ceilings["precompile_s"] = precompile(mod, args, args.compile_workers)
            except Exception as exc:  # noqa: BLE001  (the sweep then compiles as it goes)
                ceilings["precompile_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps({k: v for k, v in ceilings.items() if k.startswith("precompile")}), flush=True)
        deadline = t_start + args.budget_s
        for shape in args.sweep_shape_names:
            ms = _sweep_m_values(args, shape)
            if not ms:
                continue
            layer = prepare_shape(fp8, shape, dev, l2, with_bf16=False)
            for m in ms:
                sweep_rows += sweep_shape(mod, fp8, shape, layer, m, args.iters, deadline, bw, args.decode_sweep)
                print(json.dumps(sweep_rows[-1]), flush=True)
            del layer
            torch.cuda.empty_cache()
    write(args, ceilings, rows, sweep_rows, time.time() - t_start)


def _deepgemm_version() -> str:
    try:
        return _peer_module("deepgemm_peer").deepgemm_version()
    except Exception as exc:  # noqa: BLE001  (not carried: the table says so per row)
        return f"unavailable: {type(exc).__name__}: {str(exc)[:200]}"


def write(args, ceilings, rows, sweep_rows, elapsed):
    import platform

    import triton

    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
            "command": " ".join(["python -m benchmarks.bench_fp8_gemm"] + sys.argv[1:]), "elapsed_s": elapsed,
            "cublas_padding": "cuBLAS operands padded K 2880 -> 2944 with zero columns, once, outside timing",
            "sglang_padding": "SGLang gemm: none (its kernel masks K); SGLang linear: w padded K 2880 -> 2944 "
                              "once outside timing, x zero-padded inside the timed call (its quant needs "
                              "K % 128 == 0)",
            "deepgemm": _deepgemm_version(), **ceilings}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{STEM}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "sweep": sweep_rows}, f, indent=2)
    fmt = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
    lines = [
        "# FP8 block-128 GEMM with fused bias on one H200 (gpt-oss dense shapes, random weights)", "",
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. Ceilings measured in this "
        f"run: copy bandwidth {ceilings['copy_bandwidth_TBps']:.2f} TB/s, cuBLAS block-scaled FP8 at 8192^3 "
        f"{fmt(ceilings.get('fp8_blockwise_cublas_TFLOPs'), '.0f')} TFLOP/s, bf16 "
        f"{ceilings['bf16_cublas_TFLOPs']:.0f} TFLOP/s.", "",
        "Times in us: medians of CUDA-graph replays over enough distinct weight copies to defeat L2. "
        "`ours` = `fp8_linear` (quantise bf16 x + GEMM + bias); `gemm` = `fp8_gemm` on pre-quantised x; "
        "`cuBLAS` = block-scaled `scaled_mm` + bias add on the same pre-quantised operands, K padded to 2944 "
        "(outside timing); `SGLang gemm` / `SGLang linear` = SGLang 0.5.23's Triton "
        "`w8a8_block_fp8_matmul_triton` + bias add, on pre-quantised operands / after its own Triton quant "
        "(benchmarks/sglang_peers.py; `SGLang linear` pads x 2880 -> 2944 inside the timed call, w once outside; "
        "`SGLang gemm` needs no padding); `DeepGEMM` = deepseek-ai/DeepGEMM's SM90 `gemm_fp8_fp8_bf16_nt` (the "
        "pure-Python JIT release 03d0be3, benchmarks/deepgemm_peer.py) + bias add on the same pre-quantised "
        "operands. Speedups > 1: ours faster (`gemm` vs the GEMM peers, `ours` vs the "
        "linear peers). TB/s and % copy bandwidth: weight bytes over `ours`.", "",
        "| shape | M | config | ours | gemm | quant | cuBLAS fp8 | SGLang gemm | DeepGEMM | SGLang linear | "
        "bf16 linear | gemm vs cuBLAS | gemm vs SGLang | gemm vs DeepGEMM | ours vs SGLang linear | ours vs bf16 | "
        "TFLOP/s | weight TB/s | % copy BW | rel err |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        us = lambda key: fmt(r.get(f"{key}_us"), ".1f")  # noqa: E731
        x = lambda key: fmt(r.get(f"speedup_vs_{key}"), ".2f")  # noqa: E731
        lines.append(
            f"| {r['shape']} | {r['M']} | {r['config']} | {r['ours_linear_us']:.1f} | {r['ours_gemm_us']:.1f} | "
            f"{r['quant_us']:.1f} | {us('cublas_fp8_blockwise')} | {us('sglang_triton_fp8')} | "
            f"{us('deepgemm_fp8')} | {us('sglang_triton_fp8_linear')} | {us('bf16_linear')} | "
            f"{x('cublas_fp8_blockwise')} | {x('sglang_triton_fp8')} | {x('deepgemm_fp8')} | "
            f"{x('sglang_triton_fp8_linear')} | {x('bf16_linear')} | "
            f"{r['ours_TFLOPs']:.0f} | {r['ours_weight_TBps']:.2f} | {r['ours_pct_copy_bw']:.0f} | "
            f"{r['max_rel_err_vs_torch']:.1e} |")
    agree = {}
    for r in rows:
        for key, v in r.items():
            if key.endswith("_max_abs_diff_vs_ours"):
                name = key[: -len("_max_abs_diff_vs_ours")]
                rel = r.get(f"{name}_max_rel_err_vs_ours")
                worst = agree.get(name)
                if worst is None or rel > worst[1]:
                    agree[name] = (v, rel, f"{r['shape']} M={r['M']}")
    if agree:
        lines += ["", "Peer outputs vs ours (same inputs; worst row by max diff / max |y|; bf16 linear also "
                      "differs by skipping the activation quantisation):"]
        lines += [f"- {name}: max abs diff {d:.2e}, rel {rel:.1e} ({where})" for name, (d, rel, where) in agree.items()]
    errors = sorted({(k, r[k]) for r in rows for k in r if k.endswith("_error")})
    if errors:
        lines += ["", "Peers that did not run:"] + [f"- {k[:-6]}: {' '.join(str(v).split())}" for k, v in errors]
    if sweep_rows:
        lines += ["", "## Launch-config sweep (fp8_linear, us; * = the heuristic's pick)", "",
                  "`gv…` = the decode kernel (`fma`/`dot` block maths, `n` BLOCK_N, `s` K splits, `k` = "
                  "summed by a second kernel, `w` warps, `st` pipeline stages; `xo` = `_fp8_gemv_kernel_xonce`, "
                  "x quantised once per program for its K blocks (K/128 / splits, rounded up to a power of "
                  "two), then a tensor-core K loop over the weight, or `xob` one batched dot, or FMAs; `vr` = "
                  "the last arriver sums the split partials in one load); `gvos n… w…` = the one-shot kernel "
                  "(`_fp8_gemv_oneshot_kernel`: BLOCK_N rows and all of K per program, no split, FMA); "
                  "`m16…fq` = the 16-row tl.dot tile path decode used before; `(x pre-quantised)` = `fp8_gemm` "
                  "on x quantised beforehand (quantisation not timed; as `fp8_linear(x_quant=...)` after the "
                  "residual norm's `quantize`). * marks the heuristic's pick for that x (bf16 / pre-quantised); "
                  "heuristic / this compares with it. % copy BW: weight bytes over the time. rel err: max "
                  "|y - torch fp32 maths| / max |y| on the same quantised operands.", "",
                  "| shape | M | config | us | % copy BW | heuristic / this | rel err |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        for r in sweep_rows:
            us = r.get("linear_us")
            lines.append(f"| {r['shape']} | {r['M']} | {r['config']}{' *' if r.get('heuristic') else ''} | "
                         f"{fmt(us, '.2f') if us else r.get('error', r.get('skipped', ''))} | "
                         f"{fmt(r.get('pct_copy_bw'), '.0f')} | {fmt(r.get('heuristic_over_this'), '.2f')} | "
                         f"{fmt(r.get('max_rel_err_vs_torch'), '.1e')} |")
    lines += ["", f"Command: `{meta['command']}` ({elapsed:.0f} s)"]
    with open(os.path.join(args.out, f"{STEM}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
