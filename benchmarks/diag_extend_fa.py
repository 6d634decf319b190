"""Prototype: how fast can a Triton flash-attention forward run gpt-oss's 8k prefill on an H200?

    python benchmarks/diag_extend_fa.py --out benchmarks/results

The shipped extend kernel (`kernels/sink_attention.py` `_sink_extend_kernel`: tiles of 16 positions x the 8 q
heads of a kv head, K/V gathered through req_to_token's slot ids) runs a full layer's 8192-token prefill at
~300 TFLOP/s (1.8-1.9 ms; ncu: latency-bound at 252 registers, two programs an SM). This times, in CUDA graphs
and on the same inputs, a textbook form beside it: one q head and BLOCK_M consecutive positions per program,
K/V read as contiguous rows of this forward's own K/V (no slot ids: a prefill without a cached prefix) by TMA
descriptors, the causal range split into unmasked blocks and the masked diagonal, the sink joined as the
running max's start. Output checked against the shipped kernel's. SDPA's flash kernel (no sinks, GQA
expanded) runs beside as the peer. The textbook kernel here is the prototype of the shipped
`sink_attention_prefill` (kernels/sink_attention.py, session 13), which took its tile from this run's table
(benchmarks/results/diag_extend_fa.md); it stays as the record of that choice.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def _exp2_poly(x):
    """2^x for x <= 0 on the FMA pipe instead of the MUFU unit: 2^floor(x) from the exponent bits times a
    degree-3 minimax polynomial of the fraction (relative error ~1e-4, below the bf16 rounding P takes for
    P.V); 0 below 2^-126 (the masked -inf scores included)."""
    xc = tl.maximum(x, -127.0)
    n = tl.floor(xc)
    f = xc - n
    p = tl.fma(tl.fma(tl.fma(f, 0.07711908, 0.22756439), f, 0.69514614), f, 1.0)
    bits = p.to(tl.int32, bitcast=True) + (n.to(tl.int32) << 23)
    return tl.where(x < -126.0, 0.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def _fa_probs(s, m_new, qk_scale_log2, BN: tl.constexpr, EXP_POLY: tl.constexpr):
    x = s * qk_scale_log2 - m_new[:, None]
    if EXP_POLY:  # half the columns on the FMA pipe: at D 64 the MUFU's exp2 keeps pace with the MMAs
        BM: tl.constexpr = x.shape[0]
        hw, poly = tl.split(tl.reshape(x, [BM, BN // 2, 2]))
        return tl.reshape(tl.join(tl.exp2(hw), _exp2_poly(poly)), [BM, BN])
    return tl.exp2(x)


@triton.jit
def _fa_update(acc, m_i, l_i, s, v, qk_scale_log2, BN: tl.constexpr, EXP_POLY: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale_log2)
    p = _fa_probs(s, m_new, qk_scale_log2, BN, EXP_POLY)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _fa_block(acc, m_i, l_i, q, k_desc, v_desc, start, col, offs_m, qk_scale_log2,
              BN: tl.constexpr, MASK: tl.constexpr, EXP_POLY: tl.constexpr):
    k = k_desc.load([start, col])
    v = v_desc.load([start, col])
    s = tl.dot(q, tl.trans(k))
    if MASK:
        offs_n = start + tl.arange(0, BN)
        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
    return _fa_update(acc, m_i, l_i, s, v, qk_scale_log2, BN, EXP_POLY)


@triton.jit
def _fa_rows(acc, m_i, l_i, q, k_desc, v_desc, col, lo, hi, offs_m, qk_scale_log2, BN: tl.constexpr,
             STAGES: tl.constexpr, MASK: tl.constexpr, EXP_POLY: tl.constexpr):
    """Keys lo..hi-1 of this forward's rows, BN at a time: the blocks before the tile (MASK False) or its
    diagonal (MASK True)."""
    for start in tl.range(lo, hi, BN, num_stages=STAGES):
        acc, m_i, l_i = _fa_block(acc, m_i, l_i, q, k_desc, v_desc, start, col, offs_m, qk_scale_log2, BN, MASK,
                                  EXP_POLY)
    return acc, m_i, l_i


@triton.jit
def _fa_tile_start(q_desc, SINKS, GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr):
    """Program (tile, q head), tiles longest first: its head, kv column, first row, rows, q tile, and the
    softmax state before any key (the sink as the running max with weight 1)."""
    h = tl.program_id(1)
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BM
    offs_m = m0 + tl.arange(0, BM)
    m_i = tl.zeros([BM], dtype=tl.float32) + tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
    return (h, (h // GROUP) * D, m0, offs_m, q_desc.load([m0, h * D]), m_i, tl.full([BM], 1.0, dtype=tl.float32),
            tl.zeros([BM, D], dtype=tl.float32))


@triton.jit
def _fa_tile_store(OUT, acc, l_i, offs_m, h, T, stride_ot, D: tl.constexpr):
    offs_d = tl.arange(0, D)
    out = acc / l_i[:, None]
    tl.store(OUT + offs_m[:, None] * stride_ot + h * D + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=offs_m[:, None] < T)


@triton.jit
def _fa_causal_kernel(q_desc, k_desc, v_desc, OUT, SINKS, T, qk_scale_log2, stride_ot,
                      GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      STAGES: tl.constexpr, EXP_POLY: tl.constexpr = False, ROTATE: tl.constexpr = False):
    """ROTATE: the unmasked loop computes block j+1's scores before block j's softmax (a hand-rotated loop,
    so the next QK^T can run on the tensor cores while the softmax runs on the other pipes)."""
    h, col, m0, offs_m, q, m_i, l_i, acc = _fa_tile_start(q_desc, SINKS, GROUP, D, BM)
    if ROTATE:
        if m0 > 0:
            s = tl.dot(q, tl.trans(k_desc.load([0, col])))
            for start in tl.range(0, m0 - BN, BN, num_stages=STAGES):
                s_next = tl.dot(q, tl.trans(k_desc.load([start + BN, col])))
                acc, m_i, l_i = _fa_update(acc, m_i, l_i, s, v_desc.load([start, col]), qk_scale_log2, BN, EXP_POLY)
                s = s_next
            acc, m_i, l_i = _fa_update(acc, m_i, l_i, s, v_desc.load([m0 - BN, col]), qk_scale_log2, BN, EXP_POLY)
    else:
        acc, m_i, l_i = _fa_rows(acc, m_i, l_i, q, k_desc, v_desc, col, 0, m0, offs_m, qk_scale_log2, BN, STAGES,
                                 False, EXP_POLY)
    acc, m_i, l_i = _fa_rows(acc, m_i, l_i, q, k_desc, v_desc, col, m0, tl.minimum(m0 + BM, T), offs_m, qk_scale_log2,
                             BN, STAGES, True, EXP_POLY)
    _fa_tile_store(OUT, acc, l_i, offs_m, h, T, stride_ot, D)


@triton.jit
def _fa_prefix_kernel(q_desc, k_desc, v_desc, K_CACHE, V_CACHE, TOK, OUT, SINKS, T, P, qk_scale_log2, stride_ot,
                      stride_kc, stride_vc, GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, STAGES: tl.constexpr):
    """--prefix: one request of P cached keys (slot ids TOK[0..P-1] into K_CACHE / V_CACHE [slots, Hkv * D]) and
    T new rows (q, k, v by TMA, positions P..P+T-1): the cached keys by gathered rows, unmasked but for the
    last partial block, then the new rows as _fa_causal_kernel."""
    h, col, m0, offs_m, q, m_i, l_i, acc = _fa_tile_start(q_desc, SINKS, GROUP, D, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    for key0 in tl.range(0, P, BN, num_stages=STAGES):
        key_ok = key0 + offs_n < P
        slot = tl.load(TOK + key0 + offs_n, mask=key_ok, other=0).to(tl.int64)
        k = tl.load(K_CACHE + slot[:, None] * stride_kc + col + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(V_CACHE + slot[:, None] * stride_vc + col + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        s = tl.where(key_ok[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
        acc, m_i, l_i = _fa_update(acc, m_i, l_i, s, v, qk_scale_log2, BN, False)
    acc, m_i, l_i = _fa_rows(acc, m_i, l_i, q, k_desc, v_desc, col, 0, m0, offs_m, qk_scale_log2, BN, STAGES,
                             False, False)
    acc, m_i, l_i = _fa_rows(acc, m_i, l_i, q, k_desc, v_desc, col, m0, tl.minimum(m0 + BM, T), offs_m, qk_scale_log2,
                             BN, STAGES, True, False)
    _fa_tile_store(OUT, acc, l_i, offs_m, h, T, stride_ot, D)


def fa_prefix(q, k, v, k_cache, v_cache, tok, prefix, sinks, scale, bm, bn, warps, stages):
    """q / k / v [T, H, D] this forward's rows (positions prefix..prefix+T-1), the cached keys' slot ids
    tok[0..prefix-1] into k_cache / v_cache [slots, Hkv, D]; causal, sinks."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    t, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty_like(q)
    q2, k2, v2 = q.view(t, hq * d), k.view(t, hkv * d), v.view(t, hkv * d)
    _fa_prefix_kernel[(triton.cdiv(t, bm), hq)](
        TensorDescriptor.from_tensor(q2, [bm, d]), TensorDescriptor.from_tensor(k2, [bn, d]),
        TensorDescriptor.from_tensor(v2, [bn, d]), k_cache, v_cache, tok, out, sinks, t, prefix, scale * LOG2E,
        out.stride(0), k_cache.stride(0), v_cache.stride(0),
        GROUP=hq // hkv, D=d, BM=bm, BN=bn, STAGES=stages, num_warps=warps)
    return out


def fa_causal(q, k, v, sinks, scale, bm, bn, warps, stages, exp_poly=False, rotate=False):
    """q [T, Hq, D], k/v [T, Hkv, D] contiguous (this forward's rows), causal, sinks."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    t, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty_like(q)
    q2, k2, v2 = q.view(t, hq * d), k.view(t, hkv * d), v.view(t, hkv * d)
    qd = TensorDescriptor.from_tensor(q2, [bm, d])
    kd = TensorDescriptor.from_tensor(k2, [bn, d])
    vd = TensorDescriptor.from_tensor(v2, [bn, d])
    _fa_causal_kernel[(triton.cdiv(t, bm), hq)](qd, kd, vd, out, sinks, t, scale * LOG2E, out.stride(0),
                                                 GROUP=hq // hkv, D=d, BM=bm, BN=bn, STAGES=stages,
                                                 EXP_POLY=exp_poly, ROTATE=rotate, num_warps=warps)
    return out


CONFIGS = ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3),
           (64, 64, 4, 3), (64, 32, 4, 4), (256, 64, 8, 3), (128, 64, 4, 4))
# --variants (not yet run on a GPU): the two best tiles with half the exp2s on the FMA pipe (EXP_POLY) and/or
# the hand-rotated unmasked loop (ROTATE): (bm, bn, warps, stages, exp_poly, rotate)
VARIANTS = ((64, 64, 4, 3, True, False), (64, 64, 4, 3, False, True), (64, 64, 4, 3, True, True),
            (128, 64, 8, 3, True, False), (128, 64, 8, 3, False, True), (128, 64, 8, 3, True, True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--variants", action="store_true", help="also the VARIANTS rows (exp2 polynomial, rotated loop)")
    ap.add_argument("--stem", default="diag_extend_fa")
    ap.add_argument("--prefix", type=int, default=0, help="instead: one request with this many cached keys (random "
                    "slots) before --tokens new ones (a later chunk or a radix hit): the shipped key loop vs "
                    "PREFIX_CONFIGS of the prototype that gathers the cached keys and reads the new rows by TMA")
    ap.add_argument("--device", default="cuda", help="--prefix: cpu checks this script under TRITON_INTERPRET=1 "
                    "(fp32, small sizes)")
    ap.add_argument("--window", type=int, default=-1, help="instead: a sliding layer's prefill (window_left, 127 "
                    "for gpt-oss): the shipped one-shot window kernel vs sink_attention_prefill's WINDOW_TILES")
    args = ap.parse_args()
    if args.prefix:
        return prefix_main(args)
    if args.window >= 0:
        return window_main(args)
    bc.import_project()
    from sglang_ext.kernels.sink_attention import sink_attention_extend

    meta = bc.run_meta("python benchmarks/diag_extend_fa.py " + " ".join(sys.argv[1:]))
    dev = torch.device("cuda")
    t, hq, hkv, d = args.tokens, 64, 8, 64
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(t, hq, d, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(t, hkv, d, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(t, hkv, d, device=dev, generator=g).to(torch.bfloat16)
    sinks = torch.randn(hq, device=dev, generator=g)
    scale = 1.0 / math.sqrt(d)
    flops = 4 * hq * d * t * (t + 1) / 2
    # the shipped kernel on a paged cache whose slots are this forward's rows (a fresh server's prefill)
    req_to_token = torch.arange(t, device=dev, dtype=torch.int32).view(1, t)
    common = dict(req_pool_indices=torch.zeros(1, device=dev, dtype=torch.int64),
                  seq_lens=torch.tensor([t], device=dev, dtype=torch.int64), q_start=None,
                  q_len=torch.tensor([t], device=dev, dtype=torch.int64), sinks=sinks, window_left=-1, scale=scale)
    shipped = lambda: sink_attention_extend(q, k, v, req_to_token, **common)  # noqa: E731
    ref = shipped().float()
    rows = []

    def row(name, fn, check=True):
        try:
            out = fn()
            torch.cuda.synchronize()
            us = bc.graph_time_calls([fn] * 3, iters=10) * 1e6
        except Exception as e:  # noqa: BLE001  (a config that fails to compile is a row too)
            rows.append({"kernel": name, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            print(rows[-1], flush=True)
            return
        r = {"kernel": name, "us": us, "TFLOPs": flops / us / 1e6}
        if check:
            r["max_abs_diff_vs_shipped"] = (out.float() - ref).abs().max().item()
        rows.append(r)
        print(r, flush=True)

    row("shipped _sink_extend_kernel (slot ids, 16 pos x 8 heads, 128 x 64, w4 s3)", shipped)
    for bm, bn, w, s in CONFIGS:
        row(f"textbook TMA bm{bm} bn{bn} w{w} s{s}", lambda bm=bm, bn=bn, w=w, s=s: fa_causal(q, k, v, sinks, scale, bm, bn, w, s))
    for bm, bn, w, s, poly, rot in VARIANTS if args.variants else ():
        row(f"textbook TMA bm{bm} bn{bn} w{w} s{s}" + (" exp2-poly" if poly else "") + (" rotated" if rot else ""),
            lambda bm=bm, bn=bn, w=w, s=s, poly=poly, rot=rot: fa_causal(q, k, v, sinks, scale, bm, bn, w, s, poly, rot))
    qe, ke, ve = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    ke, ve = (x.repeat_interleave(hq // hkv, dim=1) for x in (ke, ve))

    def sdpa():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qe, ke, ve, is_causal=True, scale=scale)

    row("SDPA flash (no sinks, GQA expanded)", sdpa, check=False)
    md = [f"# Extend prototype: a textbook flash-attention forward vs the shipped extend ({meta.get('gpu', 'GPU')})", "",
          f"`{meta['command']}` — {meta.get('date', '')}", "",
          f"{t} tokens, 64 q / 8 kv heads, D 64, bf16, causal with sinks (SDPA: no sinks). us: per call, CUDA graph "
          "of 3 calls, median. TFLOP/s: 4 H D T(T+1)/2 / time. diff: max |out - shipped| (bf16 outputs).", "",
          bc.md_table(rows, [("kernel", "kernel", None), ("us", "us", "{:.0f}"), ("TFLOP/s", "TFLOPs", "{:.0f}"),
                             ("max diff vs shipped", "max_abs_diff_vs_shipped", "{:.2e}"), ("error", "error", None)]), ""]
    bc.write_results(args.out, args.stem, meta, rows, "\n".join(md))
    print("\n".join(md))


PREFIX_CONFIGS = ((64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4))


def _timed_rows(candidates, want, flops, dev) -> list:
    """(name, fn) candidates -> a row each: us per call (CUDA graph of 3 calls), TFLOP/s, max |out - want|,
    or the error that stopped it (a config that fails to compile is a row too)."""
    rows = []
    for name, fn in candidates:
        try:
            out = fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            us = bc.graph_time_calls([fn] * 3, iters=10, device=dev) * 1e6
            rows.append({"kernel": name, "us": us, "TFLOPs": flops / us / 1e6,
                         "max_abs_diff_vs_shipped": (out.float() - want).abs().max().item()})
        except Exception as e:  # noqa: BLE001
            rows.append({"kernel": name, "error": f"{type(e).__name__}: {str(e)[:160]}"})
        print(rows[-1], flush=True)
    return rows


def _kernel_table(rows, us_format: str) -> str:
    return bc.md_table(rows, [("kernel", "kernel", None), ("us", "us", us_format), ("TFLOP/s", "TFLOPs", "{:.0f}"),
                              ("max diff vs shipped", "max_abs_diff_vs_shipped", "{:.2e}"), ("error", "error", None)])


def prefix_main(args):
    """--prefix: the extend of a request with a cached prefix, shipped key loop vs fa_prefix, CUDA graphs."""
    bc.import_project()
    from sglang_ext.kernels.sink_attention import sink_attention_extend

    meta = bc.run_meta("python benchmarks/diag_extend_fa.py " + " ".join(sys.argv[1:]))
    dev = torch.device(args.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the interpreter computes bf16 wrongly
    p, t, hq, hkv, d = args.prefix, args.tokens, 64, 8, 64
    g = torch.Generator(device=dev).manual_seed(0)
    slots = (torch.randperm(p + t + 64, device=dev, generator=g)[: p + t] + 1).to(torch.int32)
    k_cache = torch.randn(p + t + 66, hkv, d, device=dev, generator=g).to(dt)
    v_cache = torch.randn(p + t + 66, hkv, d, device=dev, generator=g).to(dt)
    q = torch.randn(t, hq, d, device=dev, generator=g).to(dt)
    k, v = k_cache[slots[p:].long()].contiguous(), v_cache[slots[p:].long()].contiguous()  # this forward's rows
    sinks = torch.randn(hq, device=dev, generator=g)
    scale = 1.0 / math.sqrt(d)
    flops = 4 * hq * d * (t * p + t * (t + 1) / 2)
    common = dict(req_pool_indices=torch.zeros(1, device=dev, dtype=torch.int64),
                  seq_lens=torch.tensor([p + t], device=dev, dtype=torch.int64), q_start=None,
                  q_len=torch.tensor([t], device=dev, dtype=torch.int64), sinks=sinks, window_left=-1, scale=scale)
    shipped = lambda: sink_attention_extend(q, k_cache, v_cache, slots.view(1, -1), **common)  # noqa: E731
    ref = shipped().float()
    kc2, vc2 = k_cache.view(k_cache.shape[0], -1), v_cache.view(v_cache.shape[0], -1)
    rows = _timed_rows([("shipped _sink_extend_kernel (slot ids for every key)", shipped)] + [
        (f"prototype: prefix gathered, new rows by TMA, bm{bm} bn{bn} w{w} s{st}",
         lambda bm=bm, bn=bn, w=w, st=st: fa_prefix(q, k, v, kc2, vc2, slots[:p].contiguous(), p, sinks, scale,
                                                    bm, bn, w, st))
        for bm, bn, w, st in PREFIX_CONFIGS], ref, flops, dev)
    md = [f"# Extend with a cached prefix: the key loop vs a gather + TMA prototype ({meta.get('gpu', 'GPU')})", "",
          f"`{meta['command']}` — {meta.get('date', '')}", "",
          f"One request: {p} cached keys in random slots, then {t} new tokens (their K/V also in their slots, and as "
          "rows for the prototype); 64 q / 8 kv heads, D 64, bf16, causal with sinks. us: per call, CUDA graph of 3 "
          "calls, median. TFLOP/s: 4 H D (T P + T(T+1)/2) / time.", "",
          _kernel_table(rows, "{:.0f}"), ""]
    bc.write_results(args.out, args.stem if args.stem != "diag_extend_fa" else "diag_extend_prefix", meta, rows,
                     "\n".join(md))
    print("\n".join(md))


WINDOW_TILES = ((64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 2), (32, 32, 4, 3), (128, 128, 8, 2))


def window_main(args):
    """--window W: a sliding layer's prefill with no cached prefix, the shipped window kernel (slot ids) vs
    sink_attention_prefill(window_left=W) (rows by TMA) at WINDOW_TILES, CUDA graphs."""
    bc.import_project()
    from sglang_ext.kernels.sink_attention import sink_attention_extend, sink_attention_prefill

    meta = bc.run_meta("python benchmarks/diag_extend_fa.py " + " ".join(sys.argv[1:]))
    dev = torch.device(args.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the interpreter computes bf16 wrongly
    t, w, hq, hkv, d = args.tokens, args.window, 64, 8, 64
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(t, hq, d, device=dev, generator=g).to(dt)
    k = torch.randn(t, hkv, d, device=dev, generator=g).to(dt)
    v = torch.randn(t, hkv, d, device=dev, generator=g).to(dt)
    sinks = torch.randn(hq, device=dev, generator=g)
    scale = 1.0 / math.sqrt(d)
    keys = sum(min(i, w) + 1 for i in range(t))  # visible (query, key) pairs
    flops = 4 * hq * d * keys
    q_len = torch.tensor([t], device=dev, dtype=torch.int64)
    req_to_token = torch.arange(t, device=dev, dtype=torch.int32).view(1, t)  # the cache's slots: these rows
    req_pool_indices = torch.zeros(1, device=dev, dtype=torch.int64)
    shipped = lambda: sink_attention_extend(q, k, v, req_to_token, req_pool_indices, q_len, None,  # noqa: E731
                                            q_len, sinks, w, scale)
    rows = _timed_rows([("shipped _sink_extend_window_kernel (slot ids, one shot)", shipped)] + [
        (f"sink_attention_prefill bm{bm} bn{bn} w{wa} s{st}",
         lambda tile=(bm, bn, wa, st): sink_attention_prefill(q, k, v, None, q_len, sinks, scale, window_left=w,
                                                              tile=tile))
        for bm, bn, wa, st in WINDOW_TILES], shipped().float(), flops, dev)
    md = [f"# Sliding-layer prefill: the window kernel vs the prefill kernel with a window ({meta.get('gpu', 'GPU')})",
          "", f"`{meta['command']}` — {meta.get('date', '')}", "",
          f"One request of {t} tokens, no cached prefix, window_left {w}; 64 q / 8 kv heads, D 64, {str(dt)[6:]}, "
          "sinks. us: per call, CUDA graph of 3 calls, median. TFLOP/s: 4 H D (visible query-key pairs) / time.", "",
          _kernel_table(rows, "{:.1f}"), ""]
    bc.write_results(args.out, args.stem if args.stem != "diag_extend_fa" else "diag_extend_window", meta, rows,
                     "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
