"""Paged sink attention on one H200 at gpt-oss attention shapes (64 q / 8 kv heads, D 64, bf16 KV).

Decode: context 8192 and 32768, batch 1/8/32/128, a full-causal layer and a sliding layer (window 128
keys), slots scattered over the pool (a random permutation: the gather worst case). Time per call is the
median over replays of a CUDA graph that runs the launcher several times back to back on different
requests, so that the KV one replay reads exceeds the 50 MB L2 where it can (a real decode step flushes
L2 between two visits of a layer); "distinct MB per replay" says how far that held. Achieved bandwidth
counts KV bytes that must be read (K and V of every visible key) against the device copy bandwidth
measured in the same run (target: >= 75% for the full layer).

Extend: one 8192-token request, no prefix, full causal (and the sliding layer), against
torch.nn.functional.scaled_dot_product_attention on the flash backend (no sinks, same shapes, K/V
contiguous: the peer gets the easier layout); TFLOP/s counts the causal half only. Also a small sweep
of launch configurations, for the next tuning step.

Peers: ``peers(kind, case)`` returns name -> callable; errors are caught and recorded, and every peer's
output on the first case is compared with ours (max abs diff in the row). SGLang 0.5.23's own Triton
``decode_attention_fwd`` / ``extend_attention_fwd`` with sinks run through benchmarks/sglang_peers.py
(carried source: ``bash benchmarks/fetch_sglang_peers.sh``, carry ``.peers/sglang_src``); their index
building is untimed setup, as SGLang's per-step metadata. A sliding layer gives SGLang the same 128 keys
as ours (not 0.5.23's one-key-short decode window, ``upstream_window``), so both read the same bytes.

    python -m benchmarks.bench_sink_attention --out benchmarks/results

Decode launch configurations (``--decode-sweep``, only that): candidate ``DecodeConfig``s beside the
launcher's default at batch 1/2/4/8/16/32, context 8192 and 32768 (full layers) and the sliding layer,
into bench_sink_attention_decode_sweep.{json,md}:

    python -m benchmarks.bench_sink_attention --decode-sweep --out benchmarks/results

It measures the one-shot decode (``DecodeConfig.oneshot``: a program per chunk of 64/128/256 keys, no key
loop) at batch <= 4 too. ``--oneshot`` narrows it to the default and the one-shot variants at batch 1/2/4,
context 8192 and 32768, with req_to_token as wide as the context and as wide as the model's context
(131072, as under SGLang: the split count is a host constant from that width), full and sliding layers,
into bench_sink_attention_decode_oneshot.{json,md} (about a minute on an H200; ONESHOT_PICKS in
kernels/sink_attention/config.py takes its winners):

    python -m benchmarks.bench_sink_attention --decode-sweep --oneshot --out benchmarks/results

The split merge (``--decode-merge``, only that): at batch 1/8/32/128, context 8192 and 32768, the whole
decode, the decode kernel alone and the merge kernel alone, for the default, the default with the other
merge, and (batch 1) more splits with either merge, into bench_sink_attention_merge.{json,md}:

    python -m benchmarks.bench_sink_attention --decode-merge --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
import traceback

import torch



from benchmarks import bench_common as bc  # noqa: E402

bc.import_project()
from sglang_ext.kernels import sink_attention as sa  # noqa: E402

HQ, HKV, D = 64, 8, 64
SCALE = 1 / 8
WINDOW_LEFT = 127  # gpt-oss sliding layers: 128 keys inclusive
KV_BYTES_PER_KEY = HKV * D * 2 * 2  # K and V, bf16
L2_DEFEAT_BYTES = 200e6  # distinct KV per graph replay we aim for (H200 L2: 50 MB)
# "cpu" only for a smoke run of this script under TRITON_INTERPRET=1 (--device cpu: wall-clock
# timing, no graphs; with --dtype float32 there: the interpreter's bf16 arithmetic is wrong, which shows
# as a huge peer diff); every number in results/ comes from "cuda" in bf16.
DEVICE = "cuda"
DTYPE = torch.bfloat16


# ---------------------------------------------------------------------------------------------------------
# timing and ceilings
# ---------------------------------------------------------------------------------------------------------


def event_time(fn, iters=20, warmup=3) -> float:
    return bc.event_time(fn, iters, warmup, device=DEVICE)


def copy_bandwidth() -> float:
    return bc.copy_bandwidth(DEVICE)


# ---------------------------------------------------------------------------------------------------------
# peers
# ---------------------------------------------------------------------------------------------------------


def _sdpa_flash_causal(case):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    t = case["q"].shape[0]
    q = case["q"].view(1, t, HQ, D).transpose(1, 2)
    slots = case["req_to_token"][0, :t].long()
    k = case["k_buffer"][slots].transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hkv, T, D]
    v = case["v_buffer"][slots].transpose(0, 1).unsqueeze(0).contiguous()
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
        gqa = True
    except RuntimeError:
        # Flash without native GQA in this torch: give it the expanded heads (not timed).
        k = k.repeat_interleave(HQ // HKV, dim=1)
        v = v.repeat_interleave(HQ // HKV, dim=1)
        gqa = False

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=gqa)
        return o.transpose(1, 2).reshape(t, HQ, D)

    return run


def _sglang_kernels() -> dict:
    """SGLang 0.5.23's own Triton kernels through benchmarks/sglang_peers.py (carried source, stubbed
    imports); name -> callable, or name -> the reason it is missing."""
    try:
        from benchmarks import sglang_peers

        return sglang_peers.load_sglang_kernels()
    except Exception as exc:  # no adapter module on this machine: a result, not a crash
        return {"make_paged_decode": f"{type(exc).__name__}: {exc}", "make_paged_extend": f"{type(exc).__name__}: {exc}"}


def _raiser(reason: str):
    def unavailable():
        raise RuntimeError(reason)
    return unavailable


def peers(kind: str, case: dict) -> dict:
    """Peer implementations on the same inputs: name -> zero-argument callable returning [T, Hq, D].
    ``kind`` is "decode" or "extend"; ``case`` holds the paged inputs (q, k_buffer, v_buffer,
    req_to_token, req_pool_indices, seq_lens, q_start, q_len, sinks, window_left). Setup (index
    building) happens here, untimed; a peer that cannot be built returns a callable that raises."""
    result = {}
    if kind == "extend" and case["window_left"] < 0 and case["sinks"] is None:
        result["sdpa_flash_no_sinks"] = _sdpa_flash_causal(case)
    make = _sglang_kernels().get(f"make_paged_{kind}")
    try:
        if not callable(make):
            raise RuntimeError(str(make))
        if kind == "decode":
            result["sglang_triton"] = make(case["q"], case["k_buffer"], case["v_buffer"], case["req_to_token"],
                                           case["req_pool_indices"], case["seq_lens"], case["sinks"],
                                           case["window_left"], SCALE)
        else:
            result["sglang_triton"] = make(case["q"], case["k_buffer"], case["v_buffer"], case["req_to_token"],
                                           case["req_pool_indices"], case["seq_lens"], case["q_start"],
                                           case["q_len"], case["sinks"], case["window_left"], SCALE)
    except Exception as exc:
        result["sglang_triton"] = _raiser(f"{type(exc).__name__}: {exc}"[:400])
    return result


def run_peers(kind, cases, ours_s, ours_out, extend_graphs: bool = False):
    """Time each peer on the same cases as ours (decode: one call per request set in one graph, as
    ours; extend: one case, eager-timed, or with ``extend_graphs`` as a CUDA graph of 3 calls like ours,
    falling back to eager where the peer cannot be captured; the peer's "timing" says which) and compare
    its output on the first case with ours."""
    by_name = {}
    for case in cases:
        try:
            built = peers(kind, case)
        except Exception as exc:
            built = {"peers()": _raiser(f"{type(exc).__name__}: {exc}"[:400])}
        for name, fn in built.items():
            by_name.setdefault(name, []).append(fn)
    results = {}
    for name, fns in by_name.items():
        try:
            out = fns[0]()
            timing = "graph"
            if kind != "extend":
                t = bc.graph_time_calls(fns, device=DEVICE)
            elif extend_graphs:
                try:
                    t = bc.graph_time_calls([fns[0]] * 3, device=DEVICE)
                    timing = "graph of 3 calls"
                except Exception:  # noqa: BLE001 - a peer that cannot be captured is timed eagerly
                    t, timing = event_time(fns[0]), "events"
            else:
                t, timing = event_time(fns[0]), "events"
            results[name] = {"time_us": t * 1e6, "ours_speedup": t / ours_s, "timing": timing,
                             "max_abs_diff_vs_ours": (out.float() - ours_out.float()).abs().max().item()}
            api = getattr(fns[0], "api", None)
            if api:
                results[name]["api"] = api
        except Exception as exc:  # a peer's failure is a result, not a crash
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return results


# ---------------------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------------------


def bench_decode(contexts, batches, bw):
    max_ctx = max(contexts)
    max_batch = max(batches)
    num_slots = max_batch * max_ctx + 1
    g = torch.Generator(device=DEVICE).manual_seed(0)
    k_buffer = torch.randn(num_slots, HKV, D, device=DEVICE, dtype=DTYPE, generator=g)
    v_buffer = torch.randn(num_slots, HKV, D, device=DEVICE, dtype=DTYPE, generator=g)
    sinks = torch.randn(HQ, device=DEVICE, generator=g)
    rows = []
    for ctx in contexts:
        # Every request row of the pool: random, disjoint slots (slot 0 is SGLang's dummy); and, for one
        # comparison row, each request in consecutive slots (a fresh pool's allocation).
        n_rows = (num_slots - 1) // ctx
        perm = torch.randperm(num_slots - 1, device=DEVICE, generator=g)[: n_rows * ctx] + 1
        layouts = {"random": perm.view(n_rows, ctx).to(torch.int32),
                   "contiguous": (torch.arange(n_rows * ctx, device=DEVICE) + 1).view(n_rows, ctx).to(torch.int32)}
        del perm
        shapes = [(b, w, "random") for b in batches for w in (-1, WINDOW_LEFT)]
        shapes += [(b, -1, "contiguous") for b in batches if b == 32]
        for batch, window_left, layout in shapes:
            req_to_token = layouts[layout]
            keys = ctx if window_left < 0 else min(ctx, window_left + 1)
            kv_bytes = batch * keys * KV_BYTES_PER_KEY
            n_sets = max(1, min(n_rows // batch, math.ceil(L2_DEFEAT_BYTES / kv_bytes), 256))
            q = torch.randn(n_sets, batch, HQ, D, device=DEVICE, dtype=DTYPE, generator=g)
            out = torch.empty_like(q)
            seq_lens = torch.full((batch,), ctx, device=DEVICE, dtype=torch.int64)
            sets = [torch.arange(s * batch, (s + 1) * batch, device=DEVICE) for s in range(n_sets)]

            def call(s):
                return lambda: sa.sink_attention_decode(q[s], k_buffer, v_buffer, req_to_token, sets[s],
                                                        seq_lens, sinks, window_left, SCALE, out=out[s])

            t = bc.graph_time_calls([call(s) for s in range(n_sets)], device=DEVICE)
            ref = sa.sink_attention_ref(q[0], k_buffer, v_buffer, req_to_token, sets[0], seq_lens, None,
                                        torch.ones_like(seq_lens), sinks, window_left, SCALE)
            err = (out[0].float() - ref.float()).abs().max().item()
            row = {
                "context": ctx, "batch": batch, "layer": "full" if window_left < 0 else "sliding128",
                "slots": layout,
                "num_splits": sa.decode_config(batch, HKV, window_left, req_to_token.shape[1], q.device).num_splits,
                "time_us": t * 1e6, "kv_bytes": kv_bytes, "achieved_TBps": kv_bytes / t / 1e12,
                "fraction_of_copy_bw": kv_bytes / t / bw, "distinct_MB_per_replay": n_sets * kv_bytes / 1e6,
                "max_abs_err_vs_ref": err,
            }
            cases = [dict(q=q[s], k_buffer=k_buffer, v_buffer=v_buffer, req_to_token=req_to_token,
                          req_pool_indices=sets[s], seq_lens=seq_lens, q_start=None, q_len=None, sinks=sinks,
                          window_left=window_left) for s in range(n_sets)]
            row["peers"] = run_peers("decode", cases, t, out[0])
            rows.append(row)
            print(json.dumps(row), flush=True)
        del layouts
    return rows


# ---------------------------------------------------------------------------------------------------------
# decode launch-configuration sweep (--decode-sweep)
# ---------------------------------------------------------------------------------------------------------


def _splits(programs_per_sm, batch, ctx, block_n, min_split_blocks, sms):
    return max(1, min(sa.MAX_SPLITS, math.ceil(programs_per_sm * sms / (batch * HKV)),
                      math.ceil(ctx / (block_n * min_split_blocks))))


def decode_candidates(batch: int, window_left: int, ctx: int, sms: int) -> dict:
    """name -> DecodeConfig measured beside the launcher's default. Full layers: splits aimed at
    p programs per SM (p/SM), at least m key blocks per split (m), block size, warps, stages, the
    merge in the last split (fused) or in a second kernel, and the key loop with or without its
    hand-made prefetch. "old" approximates the previous launcher: splits for 2 programs per SM (at
    most 32), one block minimum, a merge kernel, the plain key loop."""
    C = sa.DecodeConfig
    if window_left >= 0:
        return {
            "1 split bn128 w4": C(num_splits=1, block_n=128, num_warps=4, prefetch=False),
            "1 split bn128 w8 st1": C(num_splits=1, block_n=128, num_warps=8, num_stages=1, prefetch=False),
            "1 split bn64 w4 prefetch": C(num_splits=1, block_n=64, num_warps=4, prefetch=True),
            "1 split bn64 w4": C(num_splits=1, block_n=64, num_warps=4, prefetch=False),
            "2 splits bn64 fused": C(num_splits=2, block_n=64, min_split_blocks=1, prefetch=False),
            "old: 2 splits bn64 merge kernel": C(num_splits=2, block_n=64, min_split_blocks=1, fused_merge=False,
                                                 prefetch=False),
        }
    out = {"old: 2/SM m1 merge kernel": C(num_splits=min(32, _splits(2, batch, ctx, 64, 1, sms)), block_n=64,
                                          min_split_blocks=1, fused_merge=False, prefetch=False)}
    for p, m, bn, warps, stages, fused, pf in (
            (2, 2, 64, 4, 3, True, True), (4, 1, 64, 4, 3, True, True), (4, 4, 64, 4, 3, True, True),
            (8, 2, 64, 4, 3, True, True), (16, 1, 64, 4, 3, True, True), (4, 2, 64, 4, 3, False, True),
            (4, 2, 64, 4, 3, True, False), (8, 2, 64, 4, 3, True, False), (16, 1, 64, 4, 3, True, False),
            (4, 4, 32, 4, 3, True, True), (8, 2, 32, 2, 3, True, True), (4, 1, 128, 8, 2, True, True),
            (4, 2, 64, 8, 3, True, True), (4, 2, 64, 2, 3, True, True), (8, 1, 64, 4, 3, True, True)):
        name = (f"{p}/SM m{m} bn{bn} w{warps} st{stages}" + ("" if fused else " merge kernel")
                + ("" if pf else " no prefetch"))
        out[name] = C(num_splits=_splits(p, batch, ctx, bn, m, sms), block_n=bn, min_split_blocks=m,
                      num_warps=warps, num_stages=stages, fused_merge=fused, prefetch=pf)
    return out


def oneshot_candidates(batch: int, window_left: int, max_context: int) -> dict:
    """name -> one-shot DecodeConfig (oneshot_config, as decode_config would build it from ONESHOT_PICKS):
    keys per split (c), warps (w), V loaded after the scores (v_late), a split cap above MAX_SPLITS (cap).
    Sliding layers: the 128-key window in 1, 2 or 4 splits."""
    P = sa.OneshotPick
    if window_left >= 0:
        picks = [P(128), P(128, v_late=True), P(128, num_warps=8), P(64), P(64, v_late=True), P(32)]
    else:
        picks = [P(64), P(64, v_late=True), P(64, num_warps=2), P(128), P(128, v_late=True), P(128, num_warps=8),
                 P(128, v_late=True, num_warps=8), P(256), P(256, num_warps=8), P(256, v_late=True, num_warps=8)]
        if math.ceil(max_context / 64) > sa.MAX_SPLITS:
            picks.append(P(64, max_splits=2 * sa.MAX_SPLITS))
    out = {}
    for pick in picks:
        name = (f"oneshot c{pick.chunk} w{pick.num_warps}" + (" v_late" if pick.v_late else "")
                + ("" if pick.max_splits == sa.MAX_SPLITS else f" cap{pick.max_splits}"))
        out[name] = sa.oneshot_config(batch, HKV, window_left, max_context, *pick)
    return out


def _resolve_max_contexts(spec: str, ctx: int) -> list:
    """req_to_token widths for context ctx: "same" is ctx itself; widths below ctx are skipped."""
    widths = []
    for item in spec.split(","):
        w = ctx if item.strip() == "same" else int(item)
        if w >= ctx and w not in widths:
            widths.append(w)
    return widths


def bench_decode_sweep(contexts, batches, bw, max_contexts: str = "same", oneshot_only: bool = False):
    """Candidate decode configs beside the default, full layers at every (context, batch) and the sliding
    layer at every batch (its cost does not depend on the context): same inputs and timing as
    bench_decode (random slots, a graph of back-to-back calls on distinct requests). Each point runs at
    every req_to_token width of ``max_contexts`` (the split counts are host constants from that width;
    columns past the context hold slot 0, never read). ``oneshot_only``: the default and the one-shot
    variants only."""
    max_ctx = max(contexts)
    num_slots = max(batches) * max_ctx + 1
    g = torch.Generator(device=DEVICE).manual_seed(0)
    k_buffer = torch.randn(num_slots, HKV, D, device=DEVICE, dtype=DTYPE, generator=g)
    v_buffer = torch.randn(num_slots, HKV, D, device=DEVICE, dtype=DTYPE, generator=g)
    sinks = torch.randn(HQ, device=DEVICE, generator=g)
    sms = sa.num_sms(k_buffer.device, off_gpu=1)
    rows = []
    for ctx in contexts:
        n_rows = (num_slots - 1) // ctx
        req_to_token_ctx = (torch.randperm(num_slots - 1, device=DEVICE, generator=g)[: n_rows * ctx] + 1).view(
            n_rows, ctx).to(torch.int32)
        layers = [-1] + ([WINDOW_LEFT] if ctx == min(contexts) else [])
        points = [(w, m, b) for m in _resolve_max_contexts(max_contexts, ctx) for w in layers for b in batches]
        for window_left, max_context, batch in points:
            if max_context == ctx:
                req_to_token = req_to_token_ctx
            else:
                req_to_token = torch.zeros(n_rows, max_context, device=DEVICE, dtype=torch.int32)
                req_to_token[:, :ctx] = req_to_token_ctx
            keys = ctx if window_left < 0 else min(ctx, window_left + 1)
            kv_bytes = batch * keys * KV_BYTES_PER_KEY
            n_sets = max(1, min(n_rows // batch, math.ceil(L2_DEFEAT_BYTES / kv_bytes), 256))
            q = torch.randn(n_sets, batch, HQ, D, device=DEVICE, dtype=DTYPE, generator=g)
            out = torch.empty_like(q)
            seq_lens = torch.full((batch,), ctx, device=DEVICE, dtype=torch.int64)
            sets = [torch.arange(s * batch, (s + 1) * batch, device=DEVICE) for s in range(n_sets)]
            ref = sa.sink_attention_ref(q[0], k_buffer, v_buffer, req_to_token, sets[0], seq_lens, None,
                                        torch.ones_like(seq_lens), sinks, window_left, SCALE)
            default = sa.decode_config(batch, HKV, window_left, req_to_token.shape[1], k_buffer.device)
            configs = {"default": default}
            if not oneshot_only:
                configs.update(decode_candidates(batch, window_left, ctx, sms))
            if batch <= sa.ONESHOT_MAX_BATCH:
                configs.update(oneshot_candidates(batch, window_left, max_context))
            row = {"context": ctx, "max_context": max_context, "batch": batch,
                   "layer": "full" if window_left < 0 else "sliding128",
                   "kv_bytes": kv_bytes, "distinct_MB_per_replay": n_sets * kv_bytes / 1e6, "configs": {}}
            for name, cfg in configs.items():
                entry = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
                try:
                    calls = [(lambda s=s: sa.sink_attention_decode(
                        q[s], k_buffer, v_buffer, req_to_token, sets[s], seq_lens, sinks, window_left, SCALE,
                        out=out[s], config=cfg)) for s in range(n_sets)]
                    t = bc.graph_time_calls(calls, device=DEVICE)
                    entry.update(time_us=t * 1e6, fraction_of_copy_bw=kv_bytes / t / bw,
                                 max_abs_err_vs_ref=(out[0].float() - ref.float()).abs().max().item())
                except Exception as exc:
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
                row["configs"][name] = entry
            ok = {k: v for k, v in row["configs"].items() if "time_us" in v}
            if ok:
                row["best"] = min(ok, key=lambda k: ok[k]["time_us"])
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("context", "max_context", "batch", "layer")} | {
                "default_us": row["configs"]["default"].get("time_us"), "best": row.get("best"),
                "best_us": ok[row["best"]]["time_us"] if ok else None}), flush=True)
            del q, out, ref, req_to_token
        del req_to_token_ctx
    return rows


def sweep_markdown(meta, rows) -> str:
    lines = [
        "# Sink attention decode: launch-configuration sweep (H200, gpt-oss shapes, bf16 KV)", "",
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, {meta['seconds']} s. "
        f"Copy bandwidth in this run: {meta['copy_bandwidth_TBps']:.2f} TB/s. Per-call time: median over replays "
        "of a CUDA graph of back-to-back calls on distinct requests (random slots). `default` is what "
        "`decode_config` picks; splits count the most per (request, kv head).", "",
    ]
    for r in rows:
        d = r["configs"]["default"]
        width = r.get("max_context", r["context"])
        lines += [f"## ctx {r['context']}" + ("" if width == r["context"] else f" (max context {width})")
                  + f", batch {r['batch']}, {r['layer']} ({r['kv_bytes'] / 1e6:.1f} MB KV, "
                  f"{r['distinct_MB_per_replay']:.0f} MB/replay)", "",
                  "| config | splits | time (us) | of copy BW | vs default | max err |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, e in sorted(r["configs"].items(), key=lambda kv: kv[1].get("time_us", float("inf"))):
            if "error" in e:
                lines.append(f"| {name} | {e['num_splits']} | error: {e['error'][:80].replace('|', '/')} | | | |")
                continue
            rel = f"{d['time_us'] / e['time_us']:.2f}x" if "time_us" in d else "-"
            lines.append(f"| {'**' + name + '**' if name == 'default' else name} | {e['num_splits']} | "
                         f"{e['time_us']:.1f} | {100 * e['fraction_of_copy_bw']:.0f}% | {rel} | "
                         f"{e['max_abs_err_vs_ref']:.1e} |")
        lines.append("")
    lines += [f"Command: `{meta['command']}`"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# the split merge alone (--decode-merge)
# ---------------------------------------------------------------------------------------------------------


def merge_candidates(batch: int, ctx: int, sms: int) -> dict:
    """name -> DecodeConfig for the merge comparison: the default, the default with its merge moved
    (fused <-> merge kernel), and at batch 1 more splits with the merge kernel: with a merge that no longer
    loops over the splits, they may now beat decode_config's batch-1 choice (2/SM m1 at <= 8k)."""
    C = sa.DecodeConfig
    default = sa.decode_config(batch, HKV, -1, ctx, torch.device(DEVICE))
    out = {"default": default}
    if default.num_splits > 1:
        out["default, " + ("merge kernel" if default.fused_merge else "fused")] = dataclasses.replace(
            default, fused_merge=not default.fused_merge)
    if batch == 1:
        for p, m, warps in ((2, 1, 4), (4, 1, 4), (4, 2, 2), (8, 1, 4)):
            for fused in (False, True):
                name = f"{p}/SM m{m} w{warps} prefetch" + (" fused" if fused else " merge kernel")
                out[name] = C(num_splits=_splits(p, batch, ctx, 64, m, sms), block_n=64, min_split_blocks=m,
                              num_warps=warps, num_stages=3, fused_merge=fused, prefetch=True)
    return out


def bench_decode_merge(contexts, batches, bw):
    """Full layers, random slots, as bench_decode. Per config: the whole decode (graph of back-to-back calls
    on distinct requests); the decode kernel alone (the merge launch stubbed out, output not checked);
    and, for the merge kernel, the merge alone: back-to-back launches on one set of partials (L2-resident,
    as right after the decode kernel), at 4 and 2 warps. For a fused config, whole - kernel alone is the
    merge tail the last split adds."""
    max_ctx = max(contexts)
    num_slots = max(batches) * max_ctx + 1
    g = torch.Generator(device=DEVICE).manual_seed(0)
    k_buffer = torch.randn(num_slots, HKV, D, device=DEVICE, dtype=DTYPE, generator=g)
    v_buffer = torch.randn(num_slots, HKV, D, device=DEVICE, dtype=DTYPE, generator=g)
    sinks = torch.randn(HQ, device=DEVICE, generator=g)
    sms = sa.num_sms(k_buffer.device, off_gpu=1)
    real_launch_merge = sa.launch_merge
    rows = []
    for ctx in contexts:
        n_rows = (num_slots - 1) // ctx
        req_to_token = (torch.randperm(num_slots - 1, device=DEVICE, generator=g)[: n_rows * ctx] + 1).view(
            n_rows, ctx).to(torch.int32)
        for batch in batches:
            kv_bytes = batch * ctx * KV_BYTES_PER_KEY
            n_sets = max(1, min(n_rows // batch, math.ceil(L2_DEFEAT_BYTES / kv_bytes), 256))
            q = torch.randn(n_sets, batch, HQ, D, device=DEVICE, dtype=DTYPE, generator=g)
            out = torch.empty_like(q)
            seq_lens = torch.full((batch,), ctx, device=DEVICE, dtype=torch.int64)
            sets = [torch.arange(s * batch, (s + 1) * batch, device=DEVICE) for s in range(n_sets)]
            ref = sa.sink_attention_ref(q[0], k_buffer, v_buffer, req_to_token, sets[0], seq_lens, None,
                                        torch.ones_like(seq_lens), sinks, -1, SCALE)
            for name, cfg in merge_candidates(batch, ctx, sms).items():
                row = {"context": ctx, "batch": batch, "config": name, "num_splits": cfg.num_splits,
                       "fused_merge": cfg.fused_merge, "kv_bytes": kv_bytes,
                       "distinct_MB_per_replay": n_sets * kv_bytes / 1e6}

                def calls():
                    return [(lambda s=s: sa.sink_attention_decode(
                        q[s], k_buffer, v_buffer, req_to_token, sets[s], seq_lens, sinks, -1, SCALE, out=out[s],
                        config=cfg)) for s in range(n_sets)]

                try:
                    t = bc.graph_time_calls(calls(), device=DEVICE)
                    row.update(time_us=t * 1e6, fraction_of_copy_bw=kv_bytes / t / bw,
                               max_abs_err_vs_ref=(out[0].float() - ref.float()).abs().max().item())
                    if cfg.num_splits > 1:
                        kernel_cfg = dataclasses.replace(cfg, fused_merge=False)
                        sa.decode.launch_merge = lambda *a, **k: None  # where sink_attention_decode calls it
                        try:
                            tk = bc.graph_time_calls([(lambda s=s: sa.sink_attention_decode(
                                q[s], k_buffer, v_buffer, req_to_token, sets[s], seq_lens, sinks, -1, SCALE,
                                out=out[s], config=kernel_cfg)) for s in range(n_sets)], device=DEVICE)
                        finally:
                            sa.decode.launch_merge = real_launch_merge
                        row["decode_kernel_alone_us"] = tk * 1e6
                    if cfg.num_splits > 1 and not cfg.fused_merge:
                        group = HQ // HKV
                        part_o = torch.randn(batch, HKV, cfg.num_splits, group, D, device=DEVICE, generator=g)
                        part_lse = torch.randn(batch, HKV, cfg.num_splits, group, device=DEVICE, generator=g) * 4
                        merged = torch.empty(batch, HQ, D, device=DEVICE, dtype=DTYPE)
                        for warps in (4, 2):
                            tm = bc.graph_time_calls([lambda: sa.launch_merge(
                                part_o, part_lse, sinks, merged, seq_lens, -1, cfg, num_warps=warps)] * 20,
                                device=DEVICE)
                            row[f"merge_alone_w{warps}_us"] = tm * 1e6
                        row["merge_bytes"] = part_o.numel() * 4 + part_lse.numel() * 4
                        row["merge_tile_heads_splits"] = sa._merge_tile(cfg, group, D, 4, fused=False)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
            del q, out, ref
        del req_to_token
    return rows


def merge_markdown(meta, rows) -> str:
    lines = [
        "# Sink attention decode: the split merge (H200, gpt-oss full layer: 64 q / 8 kv heads, D 64, bf16 KV)", "",
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, {meta['seconds']} s. "
        f"Copy bandwidth in this run: {meta['copy_bandwidth_TBps']:.2f} TB/s. `decode` is the whole decode "
        "attention per call (graph of back-to-back calls on distinct requests, random slots); `kernel alone` "
        "the decode kernel with the merge launch stubbed out (for a fused config, decode - kernel alone is the "
        "merge tail of the last split); `merge alone` back-to-back merge-kernel launches on L2-resident "
        "partials. `default` is what decode_config picks.", "",
        "| context | batch | config | splits | decode (us) | kernel alone (us) | merge alone w4 (us) | "
        "merge alone w2 (us) | merge tile (heads, splits) | of copy BW | max err |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]

    def f(v):
        return "-" if v is None else f"{v:.1f}"

    for r in rows:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['batch']} | {r['config']} | {r['num_splits']} | error: "
                         f"{r['error'][:80].replace('|', '/')} | | | | | | |")
            continue
        tile = r.get("merge_tile_heads_splits")
        name = "**default**" if r["config"] == "default" else r["config"]
        lines.append(f"| {r['context']} | {r['batch']} | {name} | "
                     f"{r['num_splits']} | {f(r['time_us'])} | {f(r.get('decode_kernel_alone_us'))} | "
                     f"{f(r.get('merge_alone_w4_us'))} | {f(r.get('merge_alone_w2_us'))} | "
                     f"{'-' if tile is None else tuple(tile)} | {100 * r['fraction_of_copy_bw']:.0f}% | "
                     f"{r['max_abs_err_vs_ref']:.1e} |")
    lines += ["", f"Command: `{meta['command']}`"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# extend
# ---------------------------------------------------------------------------------------------------------


def causal_flops(t: int, window_left: int) -> float:
    keys = sum(min(i + 1, window_left + 1) if window_left >= 0 else i + 1 for i in range(t))
    return 4.0 * HQ * D * keys  # QK^T and PV, 2 FLOPs per multiply-add each


EXTEND_SWEEP = ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3))
# --extend-sweep: both layer kinds, wider: tiles of 8..32 positions x 8 heads, key blocks 32..128
EXTEND_SWEEP_WIDE = ((128, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 4, 2),
                     (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 4, 2), (256, 64, 8, 3),
                     (256, 128, 8, 2), (256, 64, 8, 2), (128, 64, 4, 4), (64, 128, 4, 2))


# The one-shot window path's tiles (query rows per program, warps), swept on sliding layers.
WINDOW_SWEEP = ((64, 4), (128, 4), (128, 8), (256, 8))


def bench_extend(tokens, sweep: bool, configs=EXTEND_SWEEP, sweep_sliding: bool = False, windows=None,
                 slots: str = "random", ncu: bool = False, graphs: bool = False):
    """``ncu``: one call per layer kind with sinks, nothing timed. ``graphs``: ours timed as CUDA graphs of
    three back-to-back calls (device time; an eager call's host share is comparable to a sliding layer's
    device time), the peers as always. ``slots``: "random" (a permutation of the pool: every key a scattered row) or "contiguous" (a fresh
    server's prefill, as the model-step harness lays it out)."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    k_buffer = torch.randn(tokens + 1, HKV, D, device=DEVICE, dtype=DTYPE, generator=g)
    v_buffer = torch.randn(tokens + 1, HKV, D, device=DEVICE, dtype=DTYPE, generator=g)
    order = torch.randperm(tokens, device=DEVICE, generator=g) if slots == "random" else torch.arange(tokens, device=DEVICE)
    req_to_token = (order + 1).view(1, tokens).to(torch.int32)
    q = torch.randn(tokens, HQ, D, device=DEVICE, dtype=DTYPE, generator=g)
    sinks = torch.randn(HQ, device=DEVICE, generator=g)
    common = dict(req_pool_indices=torch.zeros(1, dtype=torch.int64, device=DEVICE),
                  seq_lens=torch.tensor([tokens], device=DEVICE), q_start=torch.zeros(1, dtype=torch.int64, device=DEVICE),
                  q_len=torch.tensor([tokens], device=DEVICE))
    rows = []
    for window_left in windows or (-1, WINDOW_LEFT):
        for with_sinks in (True, False):
            s = sinks if with_sinks else None
            out = torch.empty_like(q)
            if ncu:
                if with_sinks:
                    sa.sink_attention_extend(q, k_buffer, v_buffer, req_to_token, **common, sinks=s,
                                             window_left=window_left, scale=SCALE, out=out)
                    torch.cuda.synchronize()
                continue

            def ours(**kw):
                return lambda: sa.sink_attention_extend(q, k_buffer, v_buffer, req_to_token, **common, sinks=s,
                                                        window_left=window_left, scale=SCALE, out=out, **kw)

            timer = (lambda fn: bc.graph_time_calls([fn] * 3, device=DEVICE)) if graphs else event_time
            t = timer(ours())
            flops = causal_flops(tokens, window_left)
            row = {"tokens": tokens, "layer": "full" if window_left < 0 else "sliding128", "sinks": with_sinks,
                   "slots": slots, "timing": "graph of 3 calls" if graphs else "events",
                   "time_us": t * 1e6, "TFLOPs": flops / t / 1e12}
            if with_sinks:
                ref = sa.sink_attention_ref(q, k_buffer, v_buffer, req_to_token, **common, sinks=s,
                                            window_left=window_left, scale=SCALE)
                row["max_abs_err_vs_ref"] = (out.float() - ref.float()).abs().max().item()
                del ref
            case = dict(q=q, k_buffer=k_buffer, v_buffer=v_buffer, req_to_token=req_to_token, **common, sinks=s,
                        window_left=window_left)
            row["peers"] = run_peers("extend", [case], t, out, extend_graphs=graphs)
            if window_left >= 0:
                # The key loop on the same inputs: the path the one-shot window kernel replaced.
                loop_out = torch.empty_like(q)
                tl_ = timer(lambda: sa.sink_attention_extend(
                    q, k_buffer, v_buffer, req_to_token, **common, sinks=s, window_left=window_left, scale=SCALE,
                    out=loop_out, window_oneshot=False))
                row["peers"]["ours_key_loop"] = {"time_us": tl_ * 1e6, "ours_speedup": tl_ / t,
                                                 "max_abs_diff_vs_ours": (loop_out.float() - out.float()).abs().max().item()}
            if sweep and (window_left < 0 or sweep_sliding) and with_sinks:
                row["config_sweep"] = {}
                loop_kw = dict(window_oneshot=False) if window_left >= 0 else {}
                for block_m, block_n, warps, stages in configs:
                    key = f"block_m={block_m} block_n={block_n} warps={warps} stages={stages}"
                    try:
                        tc = timer(ours(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                                        **loop_kw))
                        row["config_sweep"][key] = {"time_us": tc * 1e6, "TFLOPs": flops / tc / 1e12}
                    except Exception as exc:
                        row["config_sweep"][key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            if sweep and window_left >= 0 and with_sinks:
                row.setdefault("config_sweep", {})
                for block_m, warps in WINDOW_SWEEP:
                    key = f"one-shot window block_m={block_m} warps={warps}"
                    try:
                        tc = timer(ours(block_m=block_m, num_warps=warps, window_oneshot=True))
                        row["config_sweep"][key] = {"time_us": tc * 1e6, "TFLOPs": flops / tc / 1e12}
                    except Exception as exc:
                        row["config_sweep"][key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------


def _peer_cells(row, name) -> str:
    p = row.get("peers", {}).get(name)
    if not p:
        return "- | -"
    if "error" in p:
        return "error | " + p["error"][:60].replace("|", "/")
    return f"{p['time_us']:.1f} | {p['ours_speedup']:.2f}x"


def _peer_diff(row, name) -> str:
    d = (row.get("peers", {}).get(name) or {}).get("max_abs_diff_vs_ours")
    return "-" if d is None else f"{d:.1e}"


def markdown(meta, decode_rows, extend_rows) -> str:
    bw = meta["copy_bandwidth_TBps"]
    lines = [
        "# Paged sink attention on one H200 (gpt-oss shapes: 64 q / 8 kv heads, D 64, bf16)", "",
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. "
        f"Copy bandwidth measured in this run: {bw:.2f} TB/s. Decode: median per-call time over replays of a "
        "CUDA graph of back-to-back calls on different requests (random slot permutation); bandwidth counts "
        "the K/V bytes of every visible key. Extend: median of CUDA-event timed calls (see below where CUDA graphs). "
        "`max err`: ours vs the torch "
        "reference; `SGLang diff` / `peer diff`: max abs difference of the peer's output from ours on the same "
        "inputs (SGLang 0.5.23's Triton kernels via benchmarks/sglang_peers.py, index building untimed; sliding "
        "layer: 128 keys for both).", "",
        "## Decode", "",
        "| context | batch | layer | slots | splits | time (us) | KV MB | TB/s | of copy BW | distinct MB/replay | "
        "max err | SGLang triton (us) | ours vs SGLang | SGLang diff |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in decode_rows:
        lines.append(f"| {r['context']} | {r['batch']} | {r['layer']} | {r['slots']} | {r['num_splits']} | "
                     f"{r['time_us']:.1f} | "
                     f"{r['kv_bytes'] / 1e6:.1f} | {r['achieved_TBps']:.2f} | {100 * r['fraction_of_copy_bw']:.0f}% | "
                     f"{r['distinct_MB_per_replay']:.0f} | {r['max_abs_err_vs_ref']:.1e} | {_peer_cells(r, 'sglang_triton')} | "
                     f"{_peer_diff(r, 'sglang_triton')} |")
    graphs = any(r.get("timing", "").startswith("graph") for r in extend_rows)
    lines += ["", "## Extend (one request, no prefix; K/V slots a random permutation unless the row says "
              "contiguous)", ""]
    if graphs:
        lines += ["Ours, the key loop, the sweeps and the peers that can be captured timed as CUDA graphs of 3 "
                  "back-to-back calls: device time, per call (a peer that cannot be captured: eager, marked *).", ""]
    lines += [
              "| tokens | layer | sinks | time (us) | TFLOP/s | peer | peer time (us) | ours vs peer | max err | "
              "peer diff |",
              "|---:|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in extend_rows:
        peer_items = list(r["peers"].items()) or [("-", {})]
        for name, p in peer_items:
            if "error" in p:
                peer_t, speed = "error", p["error"][:60].replace("|", "/")
            elif p:
                star = "*" if graphs and p.get("timing") == "events" else ""
                peer_t, speed = f"{p['time_us']:.0f}{star}", f"{p['ours_speedup']:.2f}x"
            else:
                peer_t, speed = "-", "-"
            err = r.get("max_abs_err_vs_ref")
            layer = r["layer"] + (" contiguous" if r.get("slots") == "contiguous" else "")
            lines.append(f"| {r['tokens']} | {layer} | {r['sinks']} | {r['time_us']:.0f} | {r['TFLOPs']:.0f} | "
                         f"{name} | {peer_t} | {speed} | {'-' if err is None else f'{err:.1e}'} | {_peer_diff(r, name)} |")
    sweeps = [(f"decode ctx {r['context']} batch {r['batch']} {r['layer']}", r["config_sweep"])
              for r in decode_rows if "config_sweep" in r]
    sweeps += [(f"extend {r['tokens']} {r['layer']} sinks={r['sinks']} slots={r.get('slots', 'random')}",
                r["config_sweep"])
               for r in extend_rows if "config_sweep" in r]
    for title, sw in sweeps:
        lines += ["", f"Config sweep, {title} (the table's row is the launcher's default; on a sliding layer the "
                  "`block_m=.. block_n=..` entries are the key loop, the `one-shot window` entries the default path):",
                  ""]
        for key, v in sw.items():
            lines.append(f"- {key}: " + (v["error"] if "error" in v else f"{v['time_us']:.1f} us"))
    lines += ["", f"Command: `{meta['command']}`"]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--batches", default=None, help="default 1,8,32,128 (--decode-sweep: 1,2,4,8,16,32)")
    ap.add_argument("--extend-tokens", type=int, default=8192)
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweeps")
    ap.add_argument("--decode-sweep", action="store_true",
                    help="only the decode config sweep (batches 1,2,4,8,32 unless --batches is given), written to "
                         "bench_sink_attention_decode_sweep.{json,md}")
    ap.add_argument("--oneshot", action="store_true",
                    help="with --decode-sweep: only the default and the one-shot variants (batches 1,2,4 and max "
                         "contexts same,131072 unless given), written to bench_sink_attention_decode_oneshot.{json,md}")
    ap.add_argument("--max-contexts", default=None,
                    help="--decode-sweep: req_to_token widths, 'same' = the context (default 'same'; with --oneshot "
                         "'same,131072')")
    ap.add_argument("--ncu-extend", action="store_true",
                    help="run the full and the sliding layer's extend once each (8192 tokens, sinks) for Nsight Compute, "
                         "and nothing else")
    ap.add_argument("--extend-window", action="store_true",
                    help="only the sliding layer's extend (with and without sinks): the one-shot window path, its "
                         "tiles (WINDOW_SWEEP) and the key loop, written to bench_sink_attention_extend_window.{json,md}")
    ap.add_argument("--extend-window-loop", action="store_true",
                    help="with --extend-window: the full layer too, and the key loop's EXTEND_SWEEP tiles on both")
    ap.add_argument("--extend-sweep", action="store_true",
                    help="only extend (full and sliding layers, with and without sinks), each with sinks swept over "
                         "EXTEND_SWEEP_WIDE, written to bench_sink_attention_extend_sweep.{json,md}")
    ap.add_argument("--decode-merge", action="store_true",
                    help="only the split-merge comparison (batches 1,8,32,128 unless --batches is given), written to "
                         "bench_sink_attention_merge.{json,md}")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    global DEVICE, DTYPE
    DEVICE = args.device
    DTYPE = getattr(torch, args.dtype)
    t0 = time.time()
    bw = copy_bandwidth()
    meta = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__,
            "triton": __import__("triton").__version__, "dtype": str(DTYPE).replace("torch.", ""),
            "copy_bandwidth_TBps": bw / 1e12,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
            "command": "python -m benchmarks.bench_sink_attention " + " ".join(sys.argv[1:])}
    contexts = [int(c) for c in args.contexts.split(",")]
    errors = []

    def collect(fn):
        """fn()'s rows, or [] with its traceback kept: one failing part keeps the others' rows."""
        try:
            return fn()
        except Exception:
            errors.append(traceback.format_exc())
            print(errors[-1], flush=True)
            return []

    def write(stem, payload, markdown_of):
        meta["seconds"] = round(time.time() - t0, 1)
        md = markdown_of()
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, stem + ".json"), "w") as f:
            json.dump({"meta": meta, **payload, "errors": errors}, f, indent=2)
        if errors:
            md += "\n## Errors\n\n" + "\n".join(f"```\n{e}\n```" for e in errors)
        with open(os.path.join(args.out, stem + ".md"), "w") as f:
            f.write(md)
        print(md)

    if args.decode_merge:
        batches = [int(b) for b in (args.batches or "1,8,32,128").split(",")]
        rows = collect(lambda: bench_decode_merge(contexts, batches, bw))
        write("bench_sink_attention_merge", {"rows": rows}, lambda: merge_markdown(meta, rows))
        return
    if args.decode_sweep:
        batches = [int(b) for b in (args.batches or ("1,2,4" if args.oneshot else "1,2,4,8,16,32")).split(",")]
        max_contexts = args.max_contexts or ("same,131072" if args.oneshot else "same")
        rows = collect(lambda: bench_decode_sweep(contexts, batches, bw, max_contexts, oneshot_only=args.oneshot))
        stem = "bench_sink_attention_decode_oneshot" if args.oneshot else "bench_sink_attention_decode_sweep"
        write(stem, {"rows": rows}, lambda: sweep_markdown(meta, rows))
        return
    if args.extend_window_loop and not args.extend_window:
        ap.error("--extend-window-loop goes with --extend-window")
    if args.ncu_extend:
        bench_extend(args.extend_tokens, sweep=False, windows=(-1, WINDOW_LEFT), slots="contiguous", ncu=True)
        return
    if args.extend_window:
        extend_rows = collect(lambda: [r for slots in ("random", "contiguous")
                                       for r in bench_extend(args.extend_tokens, sweep=True,
                                                             configs=EXTEND_SWEEP if args.extend_window_loop else (),
                                                             sweep_sliding=args.extend_window_loop,
                                                             windows=(-1, WINDOW_LEFT) if args.extend_window_loop
                                                             else (WINDOW_LEFT,), slots=slots, graphs=True)])
        write("bench_sink_attention_extend_window", {"extend": extend_rows},
              lambda: markdown(meta, [], extend_rows))
        return
    if args.extend_sweep:
        extend_rows = collect(lambda: bench_extend(args.extend_tokens, sweep=True, configs=EXTEND_SWEEP_WIDE,
                                                   sweep_sliding=True))
        write("bench_sink_attention_extend_sweep", {"extend": extend_rows},
              lambda: markdown(meta, [], extend_rows))
        return
    batches = [int(b) for b in (args.batches or "1,8,32,128").split(",")]
    extend_rows = collect(lambda: bench_extend(args.extend_tokens, sweep=not args.no_sweep))
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    decode_rows = collect(lambda: bench_decode(contexts, batches, bw))
    write("bench_sink_attention", {"decode": decode_rows, "extend": extend_rows},
          lambda: markdown(meta, decode_rows, extend_rows))

if __name__ == "__main__":
    main()
