"""Paged sink attention (extend + split-KV decode): Triton kernels == torch reference == float64 loop.

The kernels run under ``TRITON_INTERPRET=1`` in a subprocess (this file run as a script): triton decides
interpretation when ``@triton.jit`` runs, so the variable must be set before the kernel module is first
imported, and setting it in the pytest process would change other tests' kernels too. The same sweep runs
compiled on a GPU, and there the decode launcher is also captured in a CUDA graph and replayed on changed
inputs, which is what makes "no host reads in the launcher" a tested property rather than a claim.

Every case poisons the K/V slots that no query may see (other positions of the request outside its
window, and slots of no request) with NaN: a kernel that reads a key it should skip, even masked, turns
its output into NaN. So "sliding layers only read their window" is tested too.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.util
import json
import os
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
HQ, HKV, D = 8, 2, 16  # the tiny model's attention: GQA group 4
WINDOWS = (-1, 0, 1, 7, 15)  # window_left: full causal, self only, ..., a small stand-in for gpt-oss's 127
# (cached prefix, query rows) per request: no prefix, a prefix the window crosses, a one-row extend
# far into the context, lengths off the block sizes, and a block-sized one.
EXTEND_REQUESTS = [(0, 23), (20, 30), (100, 1), (110, 19), (0, 1), (3, 16)]
# Decode context lengths: 1 (a CUDA-graph padding row), block (16) edges, window (41 keys for
# window_left 40) edges, several blocks.
DECODE_SEQ_LENS = [1, 16, 17, 41, 42, 129]
DECODE_WINDOWS = WINDOWS + (40,)
TOL = {"float32": 3e-5, "float16": 3e-3, "bfloat16": 2e-2}


def _kernel_module():
    """The kernel module, installed (``sglang_ext.kernels``) or from the checkout (device machines)."""
    try:
        from sglang_ext.kernels import sink_attention as mod

        return mod
    except ImportError:
        path = os.path.join(HERE, "..", "..", "kernels", "sink_attention")
        spec = importlib.util.spec_from_file_location("_sink_attention_checkout", os.path.join(path, "__init__.py"),
                                                      submodule_search_locations=[path])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
        return mod


# ---------------------------------------------------------------------------------------------------------
# cases and the independent oracle
# ---------------------------------------------------------------------------------------------------------


def make_case(requests, dtype, seed, hq=HQ, hkv=HKV, d=D, device="cpu", swa_map=False):
    """A paged batch: each request's positions sit in random, non-contiguous slots of a shared pool
    (a radix cache after evictions), in scrambled rows of req_to_token; q rows packed in request order.
    With ``swa_map``, req_to_token holds full-pool ids and ``slot_map`` translates them into a smaller
    scrambled sub-pool, as SGLang's hybrid SWA pool does (unused ids map to -1)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in requests]
    max_ctx = max(seq_lens) + 3
    num_slots = sum(seq_lens) + 64
    slots = torch.randperm(num_slots - 1, generator=g)[: sum(seq_lens)] + 1  # slot 0: SGLang's dummy
    rows = torch.randperm(len(requests) + 2, generator=g)[: len(requests)]
    req_to_token = torch.zeros((len(requests) + 2, max_ctx), dtype=torch.int32)
    off = 0
    for r, n in zip(rows.tolist(), seq_lens):
        req_to_token[r, :n] = slots[off:off + n].int()
        off += n
    pool_slots = num_slots
    slot_map = None
    if swa_map:
        # Sub-pool of its own size; the mapping covers the full pool plus SGLang's trailing -1 sentinel.
        pool_slots = sum(seq_lens) + 8
        slot_map = torch.full((num_slots + 1,), -1, dtype=torch.int64)
        slot_map[slots] = torch.randperm(pool_slots - 1, generator=g)[: len(slots)] + 1
        slot_map[0] = 0
    k_buffer = torch.randn(pool_slots, hkv, d, generator=g).to(dtype)
    v_buffer = torch.randn(pool_slots, hkv, d, generator=g).to(dtype)
    q_len = torch.tensor([n for _, n in requests])
    q = (torch.randn(int(q_len.sum()), hq, d, generator=g) * 2.0).to(dtype)  # peaked softmax: masking errors show
    sinks = torch.randn(hq, generator=g) * 2.0
    case = dict(q=q, k_buffer=k_buffer, v_buffer=v_buffer, req_to_token=req_to_token, req_pool_indices=rows,
                seq_lens=torch.tensor(seq_lens), q_start=torch.cumsum(q_len, 0) - q_len, q_len=q_len)
    extra = dict(sinks=sinks, slot_map=slot_map)
    return ({k: v.to(device) for k, v in case.items()},
            {k: (v.to(device) if v is not None else None) for k, v in extra.items()})


@contextlib.contextmanager
def poisoned_workspaces():
    """The decode launcher's partial buffers (floating-point torch.empty) filled with poison instead of
    whatever the allocator hands back: partial outputs [B, Hkv, S, G, D] with NaN, partial lse
    [B, Hkv, S, G] with 1e4, which would outweigh every real split. A kernel that weighs in a row no
    split of this launch wrote (or marked empty) turns its output NaN or wrong."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan") if t.dim() == 5 else 1e4)
        return t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def poisoned(case, slot_map, window_left):
    """Copy of ``case`` whose K/V slots that no query row may see hold NaN."""
    visible = torch.zeros(case["k_buffer"].shape[0], dtype=torch.bool)
    for r, n, ql in zip(case["req_pool_indices"].tolist(), case["seq_lens"].tolist(), case["q_len"].tolist()):
        lo = max(0, n - ql - window_left) if window_left >= 0 else 0
        ids = case["req_to_token"][r, lo:n].long().cpu()
        visible[slot_map.cpu()[ids] if slot_map is not None else ids] = True
    out = dict(case)
    for name in ("k_buffer", "v_buffer"):
        buf = case[name].clone()
        buf[~visible.to(buf.device)] = float("nan")
        out[name] = buf
    return out


def loop_reference_f64(case, sinks, window_left, scale, slot_map=None):
    """Independent oracle: per query row, its visible keys listed explicitly, softmax over them plus the
    sink column in float64."""
    q = case["q"].double()
    hq = q.shape[1]
    group = hq // case["k_buffer"].shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = case["q_start"].tolist()
    for b, (r, n, ql) in enumerate(zip(case["req_pool_indices"].tolist(), case["seq_lens"].tolist(),
                                       case["q_len"].tolist())):
        for i in range(ql):
            pos = n - ql + i
            keys = [j for j in range(pos + 1) if window_left < 0 or j >= pos - window_left]
            ids = case["req_to_token"][r, keys].long().cpu()
            if slot_map is not None:
                ids = slot_map.cpu()[ids]
            heads = torch.arange(hq) // group
            k = case["k_buffer"].cpu()[ids][:, heads].double()  # [L, Hq, D]
            v = case["v_buffer"].cpu()[ids][:, heads].double()
            logits = torch.einsum("hd,lhd->hl", q[starts[b] + i].cpu(), k) * scale
            if sinks is not None:
                logits = torch.cat([logits, sinks.cpu().double()[:, None]], dim=1)
            w = torch.softmax(logits, dim=1)[:, : len(keys)]
            out[starts[b] + i] = torch.einsum("hl,lhd->hd", w, v)
    return out


def _decode_case(dtype, seed, device="cpu", swa_map=False, seq_lens=DECODE_SEQ_LENS, hq=HQ, hkv=HKV, d=D):
    return make_case([(n - 1, 1) for n in seq_lens], dtype, seed, hq=hq, hkv=hkv, d=d, device=device,
                     swa_map=swa_map)


# ---------------------------------------------------------------------------------------------------------
# in-process: the torch reference against the float64 loop and the layers' semantics oracle
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window_left", WINDOWS)
@pytest.mark.parametrize("with_sinks", [True, False])
def test_reference_matches_float64_loop(window_left, with_sinks):
    mod = _kernel_module()
    case, extra = make_case(EXTEND_REQUESTS, torch.float32, seed=window_left + 10, swa_map=window_left == 7)
    sinks = extra["sinks"] if with_sinks else None
    case = poisoned(case, extra["slot_map"], window_left)
    got = mod.sink_attention_ref(**case, sinks=sinks, window_left=window_left, scale=0.25, slot_map=extra["slot_map"])
    want = loop_reference_f64(case, sinks, window_left, 0.25, extra["slot_map"])
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


def test_reference_chunks_and_matches_layers_oracle():
    """Row chunking changes nothing, and each request equals ``sink_attention_torch`` (the torch path
    the backend runs) on its gathered keys."""
    from sglang_ext.layers.sink_attention import sink_attention_torch

    mod = _kernel_module()
    case, extra = make_case(EXTEND_REQUESTS, torch.float32, seed=3)
    whole = mod.sink_attention_ref(**case, sinks=extra["sinks"], window_left=15, scale=0.25)
    chunked = mod.sink_attention_ref(**case, sinks=extra["sinks"], window_left=15, scale=0.25, max_elems=1)
    torch.testing.assert_close(chunked, whole, atol=2e-6, rtol=1e-6)
    for b, (r, n, ql) in enumerate(zip(case["req_pool_indices"].tolist(), case["seq_lens"].tolist(),
                                       case["q_len"].tolist())):
        ids = case["req_to_token"][r, :n].long()
        start = int(case["q_start"][b])
        want = sink_attention_torch(case["q"][start:start + ql], case["k_buffer"][ids], case["v_buffer"][ids],
                                    extra["sinks"], torch.arange(n - ql, n), 0, 15, 0.25)
        torch.testing.assert_close(whole[start:start + ql], want, atol=2e-6, rtol=1e-6)


def test_launchers_reject_bad_shapes():
    mod = _kernel_module()
    case, extra = make_case([(0, 3)], torch.float32, seed=0)
    bad_kv = dict(case, k_buffer=case["k_buffer"][:, :, :8])
    with pytest.raises(ValueError, match="k/v buffers"):
        mod.sink_attention_ref(**bad_kv, sinks=None, window_left=-1, scale=0.25)
    with pytest.raises(ValueError, match="sinks must be"):
        mod.sink_attention_extend(**case, sinks=extra["sinks"][:3], window_left=-1, scale=0.25)
    with pytest.raises(ValueError, match="q heads"):
        mod.sink_attention_extend(**dict(case, q=case["q"][:, :3]), sinks=None, window_left=-1, scale=0.25)
    with pytest.raises(ValueError, match="q rows"):
        mod.sink_attention_decode(case["q"], case["k_buffer"], case["v_buffer"], case["req_to_token"],
                                  case["req_pool_indices"], case["seq_lens"], None, -1, 0.25)
    # The kernels take the max of unscaled scores: only right for a positive scale.
    for scale in (0.0, -0.25, float("nan")):
        with pytest.raises(ValueError, match="scale must be > 0"):
            mod.sink_attention_extend(**case, sinks=None, window_left=-1, scale=scale)
        with pytest.raises(ValueError, match="scale must be > 0"):
            mod.sink_attention_decode(case["q"][:1], case["k_buffer"], case["v_buffer"], case["req_to_token"],
                                      case["req_pool_indices"], case["seq_lens"], None, -1, scale)
    with pytest.raises(ValueError, match="window_oneshot needs a sliding window"):
        mod.sink_attention_extend(**case, sinks=None, window_left=-1, scale=0.25, window_oneshot=True)


class _LaunchRecorder:
    """Stands in for a @triton.jit kernel: records each launch's grid and constexprs, runs nothing."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, grid, kwargs))

        return launch


def test_extend_picks_the_path_for_the_window(monkeypatch):
    """The one-shot window kernel runs for a window of at most WINDOW_ONESHOT_MAX_KEYS keys (gpt-oss's 127)
    unless the caller asks for the key loop; full attention and wider windows take the key loop; forcing the
    one-shot path on a wider window is refused, not silently clipped. Tiles: the path's default pair, or the
    caller's."""
    mod = _kernel_module()
    launches = []
    monkeypatch.setattr(mod.extend, "_sink_extend_window_kernel", _LaunchRecorder("window", launches))
    monkeypatch.setattr(mod.extend, "_sink_extend_kernel", _LaunchRecorder("loop", launches))
    case, _ = make_case([(0, 40), (5, 9)], torch.float32, seed=0)

    def path(**kw):
        launches.clear()
        mod.sink_attention_extend(**case, sinks=None, scale=0.25, **kw)
        (name, grid, kwargs), = launches
        return name, kwargs

    max_window = mod.WINDOW_ONESHOT_MAX_KEYS - 1
    name, kw = path(window_left=max_window)
    group_pad = 1 << (HQ // HKV - 1).bit_length()
    assert name == "window" and kw["WIN_KEYS"] == mod.WINDOW_ONESHOT_MAX_KEYS
    assert (kw["BLOCK_POS"] * group_pad, kw["num_warps"]) == mod.WINDOW_TILE
    assert kw["WIN_KEYS"] + kw["LEAD_KEYS"] >= max_window + kw["BLOCK_POS"]
    assert path(window_left=5)[0] == "window"
    name, kw = path(window_left=-1)
    assert name == "loop" and (kw["BLOCK_POS"] * group_pad, kw["num_warps"]) == mod.EXTEND_TILE
    assert path(window_left=max_window + 1)[0] == "loop"
    assert path(window_left=max_window, window_oneshot=False)[0] == "loop"
    name, kw = path(window_left=-1, block_m=256)
    assert kw["BLOCK_POS"] * group_pad == 256 and kw["num_warps"] == 8
    name, kw = path(window_left=-1, num_warps=2)
    assert (kw["BLOCK_POS"] * group_pad, kw["num_warps"]) == (mod.EXTEND_TILE[0], 2)
    launches.clear()
    with pytest.raises(ValueError, match="window_oneshot holds at most"):
        mod.sink_attention_extend(**case, sinks=None, scale=0.25, window_left=max_window + 1, window_oneshot=True)
    assert launches == []


SWEEP_JSON = os.path.join(HERE, "..", "..", "benchmarks", "results", "sweeps", "bench_sink_attention_decode_sweep.json")
H200_SMS = 132


def test_decode_config_picks_the_sweep_winners(monkeypatch):
    """decode_config (as on an H200) returns, at every point of the H200 decode sweep, the configuration
    that measured fastest there."""
    mod = _kernel_module()
    if not os.path.exists(SWEEP_JSON):
        pytest.skip("no decode sweep results in this checkout")
    with open(SWEEP_JSON) as f:
        rows = json.load(f)["rows"]
    monkeypatch.setattr(mod.config, "num_sms", lambda device, off_gpu: H200_SMS)  # where decode_config reads it
    defaults = mod.DecodeConfig()
    fields = list(mod.DecodeConfig.__dataclass_fields__)
    assert rows
    for row in rows:
        window_left = -1 if row["layer"] == "full" else 127
        got = mod.decode_config(row["batch"], 8, window_left, row.get("max_context", row["context"]),
                                torch.device("cpu"))
        if got.oneshot:  # an ONESHOT_PICKS point: the one-shot sweep's test below judges it
            continue
        best = row["configs"][row["best"]]
        # Fields added after the sweep (the merge tile) were at their defaults when it ran. Which merge runs
        # is the merge sweep's call (next test), made after the merge kernel lost its serial loop.
        keep = [k for k in fields if k != "fused_merge"]
        assert {k: getattr(got, k) for k in keep} == {k: best.get(k, getattr(defaults, k)) for k in keep}, (
            f"ctx {row['context']} batch {row['batch']} {row['layer']}: picks {got}, fastest was {row['best']}")


ONESHOT_SWEEP_JSON = os.path.join(os.path.dirname(SWEEP_JSON), "bench_sink_attention_decode_oneshot.json")
ONESHOT_SLACK = 1.05  # a pick within 5 % of the fastest: one table entry serves neighbouring points


def test_decode_config_picks_near_the_oneshot_sweep_winners(monkeypatch):
    """ONESHOT_PICKS follows the H200 one-shot sweep (batch 1/2/4, max context = the context or the
    model's): at every point decode_config returns a configuration measured there. One table entry
    (batch, keys kind) serves several points, e.g. ">8k" both a short request and a 32k one under the
    model's max context, so the entry is held to its worst point: within 5 % of the fastest there, or
    no candidate measured at all of that entry's points has a better worst ratio (minimax)."""
    mod = _kernel_module()
    if not os.path.exists(ONESHOT_SWEEP_JSON):
        pytest.skip("no one-shot decode sweep results in this checkout")
    with open(ONESHOT_SWEEP_JSON) as f:
        rows = json.load(f)["rows"]
    monkeypatch.setattr(mod.config, "num_sms", lambda device, off_gpu: H200_SMS)  # where decode_config reads it
    # The register cap came later than this sweep (test_batch1_pick_is_the_in_step_winner holds it).
    fields = [k for k in mod.DecodeConfig.__dataclass_fields__ if k not in ("fused_merge", "max_regs")]
    defaults = mod.DecodeConfig()
    assert rows
    entries: dict = {}  # (batch entry, keys kind, layer) -> {label: [time / fastest at each point]}, picked label
    for row in rows:
        window_left = -1 if row["layer"] == "full" else 127
        got = mod.decode_config(row["batch"], 8, window_left, row["max_context"], torch.device("cpu"))
        mine = {k: getattr(got, k) for k in fields}
        timed = {name: e["time_us"] for name, e in row["configs"].items()
                 if "time_us" in e and {k: e.get(k, getattr(defaults, k)) for k in fields} == mine}
        where = f"ctx {row['context']} max {row['max_context']} batch {row['batch']} {row['layer']}"
        assert timed, f"{where}: decode_config picks {got}, not measured there"
        best = row["configs"][row["best"]]["time_us"]
        keys = row["max_context"] if window_left < 0 else min(row["max_context"], window_left + 1)
        key = (4 if row["batch"] == 3 else row["batch"], mod._keys_kind(keys), row["layer"])
        ratios, picked = entries.setdefault(key, ({}, set()))
        picked.add("oneshot" if got.oneshot else "split loop")
        for name, e in row["configs"].items():
            if "time_us" in e:
                label = "split loop" if name == "default" or not e.get("oneshot") else name
                if name == "default" or e.get("oneshot"):
                    ratios.setdefault(label, []).append(e["time_us"] / best)
        ratios.setdefault("picked", []).append(min(timed.values()) / best)
    for key, (ratios, picked) in entries.items():
        n = len(ratios["picked"])
        worst_pick = max(ratios["picked"])
        rivals = [max(r) for label, r in ratios.items() if label != "picked" and len(r) == n]
        assert worst_pick <= ONESHOT_SLACK or worst_pick <= min(rivals) + 1e-9, (key, picked, worst_pick, rivals)


ROPE_FUSION_JSON = os.path.join(HERE, "..", "..", "benchmarks", "results", "diag_rope_fusion.json")


def test_batch1_pick_is_the_in_step_winner():
    """The batch-1 full-layer pick (<= 8k) is the one-shot variant that made the whole decode step fastest
    in the committed in-step A/B (benchmarks/diag_pdl.py --rope-fusion-ab, paired graphs, both models),
    among those whose logits equal the unfused step's, and it was faster than the unfused step there."""
    mod = _kernel_module()
    if not os.path.exists(ROPE_FUSION_JSON):
        pytest.skip("no in-step A/B results in this checkout")
    with open(ROPE_FUSION_JSON) as f:
        rows = json.load(f)["rows"]
    labels = {"c128 v_late": mod.OneshotPick(chunk=128, v_late=True),
              "c128 v_late r128": mod.OneshotPick(chunk=128, v_late=True, max_regs=128),
              "c128 r128": mod.OneshotPick(chunk=128, max_regs=128), "c64": mod.OneshotPick(chunk=64),
              "c64 v_late": mod.OneshotPick(chunk=64, v_late=True)}
    for row in rows:
        assert row["batch"] == 1 and row["picks"], row["model"]
        exact = [p for p in row["picks"] if p["logits_equal"]]
        best = min(exact, key=lambda p: p["diff_us"])
        assert labels[best["pick"]] == mod.ONESHOT_PICKS[(1, "<=8k")], (row["model"], best)
        assert best["iqr_us"][1] < 0, (row["model"], best)


def test_oneshot_config_from_host_values():
    """One split per chunk of the keys a request may have (max context, or the window's), capped at
    MAX_SPLITS; always the merge kernel; chunks must be powers of two."""
    mod = _kernel_module()
    cfg = mod.oneshot_config(1, 8, -1, 8192, chunk=128)
    assert (cfg.num_splits, cfg.block_n, cfg.min_split_blocks, cfg.oneshot, cfg.fused_merge) == (64, 128, 1, True,
                                                                                                  False)
    assert mod.oneshot_config(4, 8, -1, 131072, chunk=128).num_splits == mod.MAX_SPLITS
    assert mod.oneshot_config(1, 8, -1, 131072, chunk=64, max_splits=512).num_splits == 512
    assert mod.oneshot_config(2, 8, 127, 131072, chunk=64, v_late=True).num_splits == 2
    assert mod.oneshot_config(2, 8, 127, 131072, chunk=128).num_splits == 1
    assert mod.oneshot_config(1, 8, -1, 100, chunk=256).num_splits == 1
    with pytest.raises(ValueError, match="power of two"):
        mod.oneshot_config(1, 8, -1, 8192, chunk=96)


def test_decode_config_takes_oneshot_picks(monkeypatch):
    """An ONESHOT_PICKS entry switches its (batch, keys) to the one-shot decode: batch 3 takes batch 4's
    entry, batch 5 and up never; points without an entry keep the split loop's choice."""
    mod = _kernel_module()
    monkeypatch.setattr(mod.config, "num_sms", lambda device, off_gpu: H200_SMS)  # where decode_config reads them
    cpu = torch.device("cpu")
    monkeypatch.setattr(mod.config, "ONESHOT_PICKS", {})
    before = {(b, w, m): mod.decode_config(b, 8, w, m, cpu) for b in (1, 2, 3, 4, 5) for w in (-1, 127)
              for m in (8192, 32768, 131072)}
    assert not any(c.oneshot for c in before.values())
    picks = {(b, k): mod.OneshotPick(chunk=64 * b, v_late=b == 2) for b in (1, 2, 4) for k in ("<=8k", ">8k")}
    picks[(1, "short")] = mod.OneshotPick(chunk=128, num_warps=8)
    monkeypatch.setattr(mod.config, "ONESHOT_PICKS", picks)
    for (b, w, m), old in before.items():
        got = mod.decode_config(b, 8, w, m, cpu)
        kind = "short" if w >= 0 else ">8k" if m > 8192 else "<=8k"
        pick = picks.get((4 if b == 3 else b, kind)) if b <= 4 else None
        assert got == (mod.oneshot_config(b, 8, w, m, *pick) if pick else old), (b, w, m, got)
    assert mod.decode_config(3, 8, -1, 32768, cpu).block_n == 256
    assert mod.decode_config(1, 8, 127, 131072, cpu) == mod.oneshot_config(1, 8, 127, 131072, 128, num_warps=8)


def test_decode_config_merges_with_the_merge_kernel_where_it_measured_faster(monkeypatch):
    """In the H200 merge sweep every configuration timed both ways ran faster with the merge kernel than
    with the fused last-arriver merge, so decode_config never picks the fused one."""
    mod = _kernel_module()
    merge_json = os.path.join(os.path.dirname(SWEEP_JSON), "bench_sink_attention_merge.json")
    if not os.path.exists(merge_json):
        pytest.skip("no merge sweep results in this checkout")
    with open(merge_json) as f:
        rows = json.load(f)["rows"]
    times = {}
    for row in rows:
        name = row["config"].replace(", fused", "").replace(", merge kernel", "").replace(" fused", "").replace(
            " merge kernel", "")
        times.setdefault((row["context"], row["batch"], name), {})[row["fused_merge"]] = row["time_us"]
    pairs = [t for t in times.values() if len(t) == 2]
    assert len(pairs) >= 8
    assert all(t[False] < t[True] for t in pairs), times
    monkeypatch.setattr(mod.config, "num_sms", lambda device, off_gpu: H200_SMS)  # where decode_config reads it
    for batch in (1, 2, 3, 4, 8, 15, 16, 32, 128):
        for width in (8192, 32768, 131072):
            assert not mod.decode_config(batch, 8, -1, width, torch.device("cpu")).fused_merge


# ---------------------------------------------------------------------------------------------------------
# the kernels: interpreted here (subprocess), compiled + CUDA graph on a GPU
# ---------------------------------------------------------------------------------------------------------


def _check(got, case, sinks, window_left, scale, dtype_name, label, slot_map=None, with_loop=True):
    """Kernel output vs the torch reference and (optionally) the float64 loop; returns the max error."""
    mod = _kernel_module()
    ref = mod.sink_attention_ref(**case, sinks=sinks, window_left=window_left, scale=scale, slot_map=slot_map)
    tol = TOL[dtype_name]
    wants = [ref.double().cpu()]
    if with_loop:
        wants.append(loop_reference_f64(case, sinks, window_left, scale, slot_map))
    got = got.double().cpu()
    worst = 0.0
    for want in wants:
        if not torch.isfinite(got).all():
            raise AssertionError(f"{label}: non-finite output (a skipped key was read)")
        err = (got - want).abs().max().item()
        if not err <= tol * max(1.0, want.abs().max().item()):
            raise AssertionError(f"{label}: max err {err} (tol {tol})")
        worst = max(worst, err)
    return worst


def sweep(dtype_name: str, device: str = "cpu") -> dict:
    """Extend and decode over windows x sinks x splits; returns counts and worst errors (raises on a miss).
    The interpreter is slow, so fp32 carries the full matrix and the 16-bit types a slice of it: the
    masking and split logic does not depend on the dtype, the 16-bit dot path does (fp16 runs it on CPU;
    bf16 runs it on a GPU and is upcast under the interpreter)."""
    mod = _kernel_module()
    dtype = getattr(torch, dtype_name)
    full = dtype_name == "float32" or device != "cpu"
    gpu = device != "cpu"
    # The float64 loop for fp32 on CPU; elsewhere the torch reference (itself checked against the loop).
    with_loop = dtype_name == "float32" and not gpu
    n_ext = n_dec = 0
    worst = 0.0
    # Small blocks: several key blocks per tile, all three loops of the extend kernel, split edges
    # inside and outside windows. On a GPU the production block sizes run too.
    ext_blocks = [(64, 16)] + ([(128, 64)] if gpu else [])
    for i, window_left in enumerate(WINDOWS):
        if full:
            sink_choices = (True, False)
        elif dtype_name == "float16":
            sink_choices = (i % 2 == 0,)
        else:
            sink_choices = {-1: (True,), 15: (False,)}.get(window_left, ())
        for with_sinks in sink_choices:
            case, extra = make_case(EXTEND_REQUESTS, dtype, seed=100 + i, device=device)
            case = poisoned(case, None, window_left)
            sinks = extra["sinks"] if with_sinks else None
            # Windowed layers run the one-shot window kernel by default; the key loop stays covered too.
            paths = (None, False) if window_left >= 0 else (None,)
            for (block_m, block_n), path in [(b, p) for b in ext_blocks for p in paths]:
                got = mod.sink_attention_extend(**case, sinks=sinks, window_left=window_left, scale=0.25,
                                                block_m=block_m, block_n=block_n, window_oneshot=path)
                worst = max(worst, _check(got, case, sinks, window_left, 0.25, dtype_name,
                                          f"extend {dtype_name} W={window_left} sinks={with_sinks} "
                                          f"blocks={block_m}x{block_n} window_oneshot={path}", with_loop=with_loop))
                n_ext += 1
    if full:
        # GQA group 3 (padded to 4 rows per position); the SWA sub-pool's slot map with q_start left to
        # the launcher, each on both windowed paths.
        for path in (None, False):
            case, extra = make_case(EXTEND_REQUESTS, dtype, seed=7, hq=6, hkv=2, device=device)
            case = poisoned(case, None, 7)
            got = mod.sink_attention_extend(**case, sinks=extra["sinks"], window_left=7, scale=0.3, block_m=64,
                                            block_n=16, window_oneshot=path)
            worst = max(worst, _check(got, case, extra["sinks"], 7, 0.3, dtype_name,
                                      f"extend group 3 window_oneshot={path}", with_loop=with_loop))
            case, extra = make_case(EXTEND_REQUESTS, dtype, seed=8, device=device, swa_map=True)
            case = poisoned(case, extra["slot_map"], 15)
            got = mod.sink_attention_extend(**dict(case, q_start=None), sinks=extra["sinks"], window_left=15,
                                            scale=0.25, slot_map=extra["slot_map"], block_m=64, block_n=16,
                                            window_oneshot=path)
            worst = max(worst, _check(got, case, extra["sinks"], 15, 0.25, dtype_name,
                                      f"extend swa slot map window_oneshot={path}", slot_map=extra["slot_map"],
                                      with_loop=with_loop))
            n_ext += 2
        # paged_attention (the model-step harness's entry) picks extend or decode from shapes alone.
        for requests in (EXTEND_REQUESTS, [(n - 1, 1) for n in DECODE_SEQ_LENS]):
            case, extra = make_case(requests, dtype, seed=9, device=device)
            got = mod.paged_attention(**case, sinks=extra["sinks"], window_left=15, scale=0.25)
            worst = max(worst, _check(got, case, extra["sinks"], 15, 0.25, dtype_name, "paged_attention",
                                      with_loop=False))

    for i, window_left in enumerate(DECODE_WINDOWS):
        # (splits, sinks, launch overrides). 16 splits: requests use as many as their length allows
        # (at least min_split_blocks blocks each) and the rest exit; the merge runs in the last split to
        # arrive, or as the second kernel. The 16-bit types on CPU: 3 splits with sinks, windows that
        # split across blocks and do not.
        if full:
            combos = [(1, True, dict(prefetch=True)), (2, False, dict(fused_merge=False, prefetch=True)),
                      (3, True, dict(prefetch=False))]
            if window_left in (-1, 1, 40):
                combos.append((16, True, dict(min_split_blocks=1 + i % 2, prefetch=True)))
            # The last split's merge folding the splits in several loads (2 splits each, the last one half
            # empty). The merge kernel's tiles are covered on their own (merge_kernel_cases).
            if window_left == -1:
                combos.append((5, True, dict(min_split_blocks=1, merge_splits=2)))
        else:
            combos = ([(3, True, dict(prefetch=window_left != 40))]
                      if window_left in ((-1, 15, 40) if dtype_name == "float16" else (-1, 40)) else [])
        for splits, with_sinks, kw in combos:
            case, extra = _decode_case(dtype, seed=200 + i, device=device, swa_map=window_left == 40)
            case = poisoned(case, extra["slot_map"], window_left)
            sinks = extra["sinks"] if with_sinks else None
            with poisoned_workspaces():
                got = mod.sink_attention_decode(
                    case["q"], case["k_buffer"], case["v_buffer"], case["req_to_token"], case["req_pool_indices"],
                    case["seq_lens"], sinks, window_left, 0.25, slot_map=extra["slot_map"], num_splits=splits,
                    block_n=16, **kw)
            worst = max(worst, _check(got, case, sinks, window_left, 0.25, dtype_name,
                                      f"decode {dtype_name} W={window_left} splits={splits} sinks={with_sinks} {kw}",
                                      slot_map=extra["slot_map"], with_loop=with_loop))
            n_dec += 1
    if full:
        n_dec += decode_paged_batch1(dtype, dtype_name, device, with_loop)
    res = {"dtype": dtype_name, "extend_cases": n_ext, "decode_cases": n_dec, "max_abs_err": worst}
    if dtype_name == "float32":
        res["merge_cases"] = merge_kernel_cases(device)
    return res


def _n_used(seq_len, window_left, splits, min_split_blocks, block_n):
    """_split_range's count of splits that carry keys, in Python."""
    lo = max(seq_len - 1 - window_left, 0) if window_left >= 0 else 0
    n_keys = max(seq_len - lo, 0)
    per_split = max(-(-(-(-n_keys // block_n)) // splits), min_split_blocks) * block_n
    return max(-(-n_keys // per_split), 1)


def merge_kernel_cases(device) -> int:
    """The merge kernel alone on made-up partials, against the merge in float64: every tile kind (one
    load of all splits issued before the split count is known, or a loop of loads; 1, 2 or all 4 q heads
    of a group per program), with and without sinks, over ragged batches whose requests use one split,
    some, or all. Output rows of splits a request does not use hold NaN, so one that leaks in shows;
    requests with one split must keep their output (the split wrote it). Few requests: the
    interpreter's cost is per program."""
    mod = _kernel_module()
    g = torch.Generator().manual_seed(400)
    group = HQ // HKV
    kinds = set()
    n = 0
    # (splits, window_left, block_n, seq_lens, merge_heads, merge_splits, sinks); 0 = the launcher's choice.
    for splits, window_left, block_n, seq_lens, heads, chunk, with_sinks in (
            (2, -1, 16, [1, 17, 129], 0, 0, True),
            (5, 40, 16, [1, 42], 1, 2, False),  # the window: 3 blocks, so 3 splits at most
            (13, -1, 16, [1, 41, 200], 2, 4, True),
            (13, -1, 16, [1, 41, 200], 0, 0, False),
            (40, -1, 8, [1, 17, 320], 0, 0, True),
            (40, -1, 8, [1, 17, 320], 4, 8, False)):
        batch = len(seq_lens)
        used = [_n_used(s, window_left, splits, 1, block_n) for s in seq_lens]
        assert used[0] == 1 and used[1] > 1 and used[-1] == (3 if window_left >= 0 else splits), used
        part_o = torch.randn(batch, HKV, splits, group, D, generator=g)
        part_lse = torch.randn(batch, HKV, splits, group, generator=g) * 3
        # What a decode launch leaves: a split past n_used writes only lse = -inf; the one split of a
        # request with n_used 1 writes nothing here (it writes the output). Unwritten means any bits: NaN.
        for b, u in enumerate(used):
            part_o[b, :, u:] = float("nan")
            part_lse[b, :, u:] = float("-inf")
            if u == 1:
                part_lse[b, :, 0] = float("nan")
        sinks = torch.randn(HQ, generator=g) * 2
        cfg = mod.DecodeConfig(num_splits=splits, block_n=block_n, min_split_blocks=1, fused_merge=False,
                               merge_heads=heads, merge_splits=chunk)
        tile = mod._merge_tile(cfg, group, D, 4, fused=False)
        kinds.add((tile[0], tile[1] >= splits))
        out = torch.full((batch, HQ, D), 7.0, device=device)
        mod.launch_merge(part_o.to(device), part_lse.to(device), sinks.to(device) if with_sinks else None, out,
                         torch.tensor(seq_lens, device=device), window_left, cfg)
        got = out.double().cpu()
        for b, u in enumerate(used):
            label = f"merge {splits} splits W={window_left} tile {tile} sinks={with_sinks} request {b}"
            if u == 1:
                assert (got[b] == 7.0).all(), f"{label}: wrote a one-split request"
                continue
            w = torch.exp2(part_lse[b, :, :u].double())  # [Hkv, u, G]
            num = torch.einsum("hsg,hsgd->hgd", w, part_o[b, :, :u].double()).reshape(HQ, D)
            den = w.sum(1).reshape(HQ) + (torch.exp(sinks.double()) if with_sinks else 0.0)
            want = num / den[:, None]
            err = (got[b] - want).abs().max().item()
            assert err <= 1e-5 * max(1.0, want.abs().max().item()), f"{label}: err {err}"
        n += 1
    assert kinds == {(4, True), (1, False), (2, False), (2, True), (4, False)}, kinds
    return n


def paged_case(seq_len, page, dtype, seed, hq=HQ, hkv=HKV, d=D, device="cpu"):
    """One request whose positions fill whole pages of ``page`` consecutive slots, the pages scattered
    over the pool (SGLang with --page-size > 1)."""
    g = torch.Generator().manual_seed(seed)
    n_pages = -(-seq_len // page)
    pages = torch.randperm(2 * n_pages + 2, generator=g)[:n_pages] + 1  # page 0 holds the dummy slot
    req_to_token = (pages[:, None] * page + torch.arange(page)[None, :]).reshape(1, -1)[:, :seq_len + 5]
    num_slots = (2 * n_pages + 3) * page
    q = (torch.randn(1, hq, d, generator=g) * 2.0).to(dtype)
    case = dict(q=q, k_buffer=torch.randn(num_slots, hkv, d, generator=g).to(dtype),
                v_buffer=torch.randn(num_slots, hkv, d, generator=g).to(dtype),
                req_to_token=req_to_token.int().contiguous(), req_pool_indices=torch.zeros(1, dtype=torch.int64),
                seq_lens=torch.tensor([seq_len]), q_start=torch.zeros(1, dtype=torch.int64),
                q_len=torch.ones(1, dtype=torch.int64))
    return {k: v.to(device) for k, v in case.items()}, (torch.randn(hq, generator=g) * 2.0).to(device)


def _counters_after(mod, device, label):
    """The fused merge's arrival counters of ``device`` (a torch.device with its index: "cuda" alone has
    index None, the launcher keys them by q.device) must all be zero after a launch."""
    from sglang_ext.kernels.arrival_counters import current

    counters = current(mod.COUNTERS_OWNER, device)
    assert counters is not None, f"{label}: no arrival counters on {device} (the fused merge never ran)"
    left = int(counters.count_nonzero())
    assert left == 0, f"{label}: fused merge left {left} arrival counters set"


def decode_paged_batch1(dtype, dtype_name, device, with_loop) -> int:
    """Batch 1 over 64-slot pages: many splits whose boundaries fall inside pages (split runs of
    5 x 16 and 3 x 32 keys, from a window start that is not page-aligned), 64 splits of which 56 have
    no keys and exit, both merges, and the launcher's own choice. After every fused launch the arrival
    counters are zero, and a second launch on the same inputs gives the same output (a counter left set
    would make it merge before all partials are in)."""
    mod = _kernel_module()
    n = 0
    # fused_merge spelled out: at batch 1 and this width decode_config's choice is the merge kernel.
    for window_left, kw in ((-1, dict(num_splits=13, block_n=16, min_split_blocks=5, fused_merge=True)),
                            (-1, dict(num_splits=40, block_n=32, min_split_blocks=3, fused_merge=False)),
                            (300, dict(num_splits=9, block_n=16, min_split_blocks=2, prefetch=False)),
                            (-1, dict(num_splits=64, block_n=16, min_split_blocks=8, fused_merge=True)),
                            (-1, {}), (127, {})):
        case, sinks = paged_case(1000, 64, dtype, seed=300 + n, device=device)
        case = poisoned(case, None, window_left)
        label = f"decode paged batch 1 W={window_left} {kw}"
        args = (case["q"], case["k_buffer"], case["v_buffer"], case["req_to_token"], case["req_pool_indices"],
                case["seq_lens"], sinks, window_left, 0.25)
        with poisoned_workspaces():
            got = mod.sink_attention_decode(*args, **kw)
        _check(got, case, sinks, window_left, 0.25, dtype_name, label, with_loop=with_loop)
        if kw.get("fused_merge", True) and kw.get("num_splits", 1) > 1:
            _counters_after(mod, case["q"].device, label)
            again = mod.sink_attention_decode(*args, **kw)
            assert torch.equal(again, got), f"{label}: a second launch differs"
        n += 1
    _counters_after(mod, case["q"].device, "decode paged batch 1")
    return n


# --- the one-shot decode ----------------------------------------------------------------------------------


def oneshot_cases(dtype_name: str):
    """(label, requests' lengths or a paged length, window_left, sinks, slot map, config kwargs) of the
    one-shot decode: batch 1-4, ragged lengths with 1 (a CUDA-graph padding row) and lengths off the chunk,
    full and sliding windows (one split for the whole window, or several), sinks and none, V with K or
    after the scores, splits from oneshot_config at the request table's width, capped splits that fold
    several chunks, the merge kernel loading every split at once (empty splits marked) or in a loop (not
    marked), and 64-slot pages whose chunks start inside pages. fp32 runs them all; the 16-bit types a
    slice (the masking and split logic does not depend on the dtype)."""
    cases = [
        # (label, lengths or ("paged", n), window_left, sinks, swa map, oneshot_config(chunk, v_late) or
        # None for the table's width, extra overrides)
        ("b4 full c16", [1, 17, 50, 129], -1, True, False, (16, False), {}),
        ("b4 full c32 v_late capped", [1, 17, 50, 129], -1, False, False, (32, True), dict(num_splits=2)),
        ("b4 full c16 merge loop", [1, 17, 50, 129], -1, True, False, (16, True), dict(merge_splits=4)),
        ("b3 window 8 one split", [16, 33, 100], 7, True, False, (16, False), {}),
        ("b3 window 41 swa map", [16, 33, 100], 40, True, True, (16, True), {}),
        ("b2 window 16 c16", [1, 64], 15, False, False, (16, False), {}),
        ("b4 full c16 capped merge loop", [129, 1, 100, 17], -1, True, False, (16, False),
         dict(num_splits=3, merge_splits=2)),
        ("b1 paged full c64", ("paged", 1000), -1, True, False, (64, False), {}),
        ("b1 paged window 128 c32 merge loop", ("paged", 1000), 127, True, False, (32, True), dict(merge_splits=2)),
        ("b1 full one split", [37], -1, True, False, (64, False), {}),
    ]
    if dtype_name == "float32":
        return cases
    keep = {"float16": ("b4 full c16", "b3 window 41 swa map", "b1 paged window 128 c32 merge loop"),
            "bfloat16": ("b4 full c32 v_late capped", "b3 window 41 swa map")}[dtype_name]
    return [c for c in cases if c[0] in keep]


def _oneshot_case(lengths, window_left, with_sinks, swa_map, dtype, seed, device):
    """(case with unseen K/V slots poisoned, sinks or None, slot map or None) of one oneshot_cases entry:
    lengths are the requests' or ("paged", n) for one request on 64-slot pages."""
    if lengths[0] == "paged":
        case, sinks = paged_case(lengths[1], 64, dtype, seed=seed, device=device)
        slot_map = None
    else:
        case, extra = _decode_case(dtype, seed=seed, device=device, swa_map=swa_map, seq_lens=lengths)
        sinks, slot_map = extra["sinks"], extra["slot_map"]
    return poisoned(case, slot_map, window_left), sinks if with_sinks else None, slot_map


def oneshot_sweep(dtype_name: str, device: str = "cpu") -> dict:
    """The one-shot decode against the torch reference (and the float64 loop for fp32 on CPU), KV slots
    no query may see and the launcher's partial buffers poisoned."""
    mod = _kernel_module()
    dtype = getattr(torch, dtype_name)
    with_loop = dtype_name == "float32" and device == "cpu"
    worst = 0.0
    kinds = set()
    for i, (label, lengths, window_left, with_sinks, swa_map, (chunk, v_late), kw) in enumerate(
            oneshot_cases(dtype_name)):
        case, sinks, slot_map = _oneshot_case(lengths, window_left, with_sinks, swa_map, dtype, 500 + i, device)
        batch = case["q"].shape[0]
        cfg = mod.oneshot_config(batch, HKV, window_left, case["req_to_token"].shape[1], chunk=chunk, v_late=v_late)
        cfg = dataclasses.replace(cfg, **kw)
        used = [_n_used(n, window_left, cfg.num_splits, 1, cfg.block_n) for n in case["seq_lens"].tolist()]
        tile = mod._merge_tile(cfg, HQ // HKV, D, 4, fused=False)
        n_keys = [n - (max(n - 1 - window_left, 0) if window_left >= 0 else 0) for n in case["seq_lens"].tolist()]
        kinds.add(("one split" if cfg.num_splits == 1 else "merge all" if tile[1] >= cfg.num_splits
                   else "merge loop", max(-(-n // cfg.block_n) for n in n_keys) > cfg.num_splits))
        with poisoned_workspaces():
            got = mod.sink_attention_decode(case["q"], case["k_buffer"], case["v_buffer"], case["req_to_token"],
                                            case["req_pool_indices"], case["seq_lens"], sinks, window_left, 0.25,
                                            slot_map=slot_map, config=cfg)
        worst = max(worst, _check(got, case, sinks, window_left, 0.25, dtype_name,
                                  f"oneshot {dtype_name} {label} {cfg} used {used}", slot_map=slot_map,
                                  with_loop=with_loop))
    if dtype_name == "float32":
        # One split per (request, kv head); all splits merged in one load, or in a loop; splits that own one
        # chunk, and capped splits that fold several.
        assert kinds >= {("one split", False), ("merge all", False), ("merge loop", False), ("merge all", True),
                         ("merge loop", True)}, kinds
    return {"dtype": dtype_name, "oneshot_cases": len(oneshot_cases(dtype_name)), "max_abs_err": worst}


# --- the one-shot decode with RoPE and the KV write in its launch (RopeKV) --------------------------------


def rope_case_inputs(case, slot_map, seed):
    """This step's unrotated q / k / v as strided views of one qkv row per request (the GEMM's output),
    their RoPE rows (gpt-oss's layout: cos half, sin half; real angles at position seq_len - 1) and the
    slots the new k / v go to (the newest position's slot, translated into the sub-pool with a slot map)."""
    g = torch.Generator().manual_seed(seed)
    batch, hq, d = case["q"].shape
    hkv = case["k_buffer"].shape[1]
    dev, dtype = case["q"].device, case["q"].dtype
    qkv = (torch.randn(batch, (hq + 2 * hkv) * d, generator=g) * 2.0).to(dtype).to(dev)
    q = qkv[:, : hq * d].view(batch, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(batch, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(batch, hkv, d)
    pos = (case["seq_lens"] - 1).double().cpu()
    inv_freq = 1.0 / (150000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).float().to(dev)
    newest = torch.stack([case["req_to_token"][r, n - 1].long() for r, n in
                          zip(case["req_pool_indices"].tolist(), case["seq_lens"].tolist())])
    loc = (slot_map[newest] if slot_map is not None else newest).to(torch.int64)
    return q, k, v, cos_sin, loc


PREFILL_REQUESTS = ((1, 37, 64, 130), (150,), (16, 1, 95))
PREFILL_TILES = (None, (32, 16, 4, 2), (16, 16, 1, 1), (64, 32, 4, 3))
# A sliding window per PREFILL_REQUESTS entry: far edges inside a block, on a block boundary (64: every tile's
# first block starts exactly at the edge), and narrower than a block.
PREFILL_WINDOWS = (37, 64, 5)


def prefill_sweep(dtype_name: str, device: str = "cpu") -> dict:
    """sink_attention_prefill (a prefill with no cached prefix: keys are this forward's rows) on ragged
    batches, tiles, with and without sinks, against the reference on a cache holding those rows in
    scrambled slots; then paged_attention's no_prefix path (RoPE + the KV write with k_out, then the prefill
    kernel on strided k / v views of one GEMM-like output) against its extend path: the same cache bits, and
    outputs within tolerance (their bits on a GPU: the gpu test); k_out equals the cache rows it wrote."""
    from sglang_ext.kernels.rope_kv import rope_store_kv

    mod = _kernel_module()
    dtype = getattr(torch, dtype_name)
    tol = TOL[dtype_name]
    worst, cases = 0.0, 0
    for i, lens in enumerate(PREFILL_REQUESTS):
        case, extra = make_case([(0, n) for n in lens], dtype, seed=900 + i, device=device)
        t = int(case["q_len"].sum())
        # this forward's K/V as rows, and the same rows in the request's cache slots
        g = torch.Generator().manual_seed(950 + i)
        k_rows = torch.randn(t, HKV, D, generator=g).to(dtype).to(device)
        v_rows = torch.randn(t, HKV, D, generator=g).to(dtype).to(device)
        slots = torch.cat([case["req_to_token"][r, :n].long() for r, n in
                           zip(case["req_pool_indices"].tolist(), case["q_len"].tolist())])
        case["k_buffer"][slots] = k_rows
        case["v_buffer"][slots] = v_rows
        for sinks, window_left in ((extra["sinks"], -1), (None, -1), (extra["sinks"], PREFILL_WINDOWS[i])):
            want = mod.sink_attention_ref(case["q"], case["k_buffer"], case["v_buffer"], case["req_to_token"],
                                          case["req_pool_indices"], case["seq_lens"], case["q_start"],
                                          case["q_len"], sinks, window_left, 0.3).float()
            scale_ref = max(1.0, want.abs().max().item())
            for tile in PREFILL_TILES if dtype_name == "float32" else PREFILL_TILES[:1]:  # tiles: dtype-free logic
                got = mod.sink_attention_prefill(case["q"], k_rows, v_rows, case["q_start"], case["q_len"], sinks,
                                                 0.3, window_left=window_left, tile=tile).float()
                err = (got - want).abs().max().item() / scale_ref
                if not err <= tol:
                    raise AssertionError(f"prefill {dtype_name} {lens} sinks={sinks is not None} "
                                         f"window_left={window_left} {tile}: err {err}")
                worst, cases = max(worst, err), cases + 1
    # paged_attention(no_prefix=True, rope=...) vs its extend path, k / v strided views of one qkv output
    lens = (3, 50, 77)
    case, extra = make_case([(0, n) for n in lens], dtype, seed=990, device=device)
    t = sum(lens)
    g = torch.Generator().manual_seed(991)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=g).to(dtype).to(device)
    q = qkv[:, :HQ * D].view(t, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(t, HKV, D)
    ang = torch.rand(t, D // 2, generator=g) * 6.0
    cos_sin = torch.cat([ang.cos(), ang.sin()], 1).to(device)
    loc = torch.cat([case["req_to_token"][r, :n].long() for r, n in
                     zip(case["req_pool_indices"].tolist(), case["q_len"].tolist())])
    outs, caches, ran = {}, {}, []
    prefill = mod.sink_attention_prefill
    mod.sink_attention_prefill = lambda *a, **kw: ran.append(1) or prefill(*a, **kw)  # counted: the path taken
    try:
        for window_left in (-1, 20):  # a full layer, a sliding one
            for no_prefix in (False, True):
                kc, vc = case["k_buffer"].clone(), case["v_buffer"].clone()
                outs[window_left, no_prefix] = mod.paged_attention(
                    q, kc, vc, case["req_to_token"], case["req_pool_indices"], case["seq_lens"], case["q_start"],
                    case["q_len"], extra["sinks"], window_left, 0.3, rope=mod.RopeKV(k, v, cos_sin, loc),
                    no_prefix=no_prefix).float()
                caches[window_left, no_prefix] = (kc, vc)
                assert len(ran) == int(no_prefix), f"no_prefix={no_prefix}: the prefill kernel ran {len(ran)} times"
                ran.clear()
        # a cache in another dtype than this forward's k / v keeps the key loop (it reads the keys as stored)
        other = torch.float16 if dtype == torch.float32 else torch.float32
        mod.paged_attention(q, case["k_buffer"].to(other), case["v_buffer"].to(other), case["req_to_token"],
                            case["req_pool_indices"], case["seq_lens"], case["q_start"], case["q_len"],
                            extra["sinks"], -1, 0.3, rope=mod.RopeKV(k, v, cos_sin, loc), no_prefix=True)
        assert not ran, "the prefill kernel ran beside a cache of another dtype"
    finally:
        mod.sink_attention_prefill = prefill
    err = 0.0
    for window_left in (-1, 20):
        for a, b in zip(caches[window_left, False], caches[window_left, True]):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg="no_prefix changed the cache writes")
        keyloop, rows = outs[window_left, False], outs[window_left, True]
        err = max(err, (rows - keyloop).abs().max().item() / max(1.0, keyloop.abs().max().item()))
        if not err <= tol:
            raise AssertionError(f"paged_attention no_prefix {dtype_name} window_left={window_left}: err {err} "
                                 "against the extend path")
    k_out = torch.empty(t, HKV, D, dtype=dtype, device=device)
    kc, vc = case["k_buffer"].clone(), case["v_buffer"].clone()
    rope_store_kv(q, k, v, cos_sin, kc, vc, loc, k_out=k_out)
    torch.testing.assert_close(k_out, kc[loc], rtol=0, atol=0, msg="k_out differs from the cache rows written")
    with pytest.raises(ValueError, match="multiple of its"):
        mod.sink_attention_prefill(q.contiguous(), k_out, v, case["q_start"], case["q_len"], None, 0.3,
                                   tile=(16, 32, 4, 2))
    empty = torch.empty(0, HQ, D, dtype=dtype, device=device)
    got = mod.sink_attention_prefill(empty, empty[:, :HKV], empty[:, :HKV], None,
                                     torch.zeros(0, dtype=torch.int64, device=device), None, 0.3)
    assert got.shape == (0, HQ, D)
    return {"dtype": dtype_name, "prefill_cases": cases, "paged_err": err, "max_err": worst}


def rope_sweep(dtype_name: str, device: str = "cpu") -> dict:
    """sink_attention_decode(rope=RopeKV(...)) on the one-shot cases and split-loop configs: the cache and
    the output afterwards equal the unfused launches' (rope_store_kv, then the same decode config) bit for
    bit, the cache equals rope_store_kv_ref's (bit for bit in the interpreter, within an ulp compiled) and
    the output the references within tolerance. The newest key's slot holds NaN before the fused launch:
    the one-shot kernel must take that key from its registers, the split loop must read it only after its
    own store (a read before it would carry the NaN into the output)."""
    from sglang_ext.kernels.rope_kv import rope_store_kv, rope_store_kv_ref

    mod = _kernel_module()
    dtype = getattr(torch, dtype_name)
    with_loop = dtype_name == "float32" and device == "cpu"
    cases = list(oneshot_cases(dtype_name))
    # the split loop (`_sink_decode_kernel`'s ROPE): merge kernel, last-arriver merge, prefetch, a window
    cases.append(("b3 split loop", [16, 70, 129], -1, True, False, None, {}))
    cases.append(("b3 split loop fused merge prefetch", [16, 70, 129], -1, True, False, None,
                  dict(fused_merge=True, prefetch=True)))
    cases.append(("b2 split loop one split", [1, 40], -1, False, False, None, dict(num_splits=1)))
    cases.append(("b3 split loop window 47 swa map", [30, 48, 120], 47, True, True, None, {}))
    # the batch-1 pick's register cap (compiled only: the interpreter has no registers to cap)
    cases.append(("b2 full c32 v_late capped registers", [1, 200], -1, True, False, (32, True), dict(max_regs=128)))
    worst = 0.0
    for i, (label, lengths, window_left, with_sinks, swa_map, oneshot, kw) in enumerate(cases):
        case, sinks, slot_map = _oneshot_case(lengths, window_left, with_sinks, swa_map, dtype, 700 + i, device)
        batch = case["q"].shape[0]
        width = case["req_to_token"].shape[1]
        if oneshot is None:
            cfg = dataclasses.replace(mod.DecodeConfig(num_splits=4, block_n=16, min_split_blocks=1, fused_merge=False),
                                      **kw)
        else:
            cfg = dataclasses.replace(mod.oneshot_config(batch, HKV, window_left, width, chunk=oneshot[0],
                                                         v_late=oneshot[1]), **kw)
        q, k, v, cos_sin, loc = rope_case_inputs(case, slot_map, seed=800 + i)
        kc_ref, vc_ref = case["k_buffer"].clone(), case["v_buffer"].clone()
        q_roped = rope_store_kv_ref(q, k, v, cos_sin, kc_ref, vc_ref, loc)
        kc, vc = case["k_buffer"].clone(), case["v_buffer"].clone()
        kc[loc] = float("nan")
        vc[loc] = float("nan")
        common = (case["req_to_token"], case["req_pool_indices"], case["seq_lens"], sinks, window_left, 0.25)

        def unfused_call(*args, **kwargs):  # the fused launch must not fall back to rope_store_kv
            raise AssertionError("the decode fell back to rope_store_kv")

        mod.set_rope_fusion(True)
        # where sink_attention_decode looks it up
        mod.decode.rope_store_kv, real_rope_store_kv = unfused_call, mod.decode.rope_store_kv
        try:
            with poisoned_workspaces():
                got = mod.sink_attention_decode(q, kc, vc, *common, slot_map=slot_map, config=cfg,
                                                rope=mod.RopeKV(k, v, cos_sin, loc))
        finally:
            mod.decode.rope_store_kv = real_rope_store_kv
            mod.set_rope_fusion(None)
        kc2, vc2 = case["k_buffer"].clone(), case["v_buffer"].clone()
        with poisoned_workspaces():
            q2 = rope_store_kv(q, k, v, cos_sin, kc2, vc2, loc)
            unfused = mod.sink_attention_decode(q2, kc2, vc2, *common, slot_map=slot_map, config=cfg)
        tag = f"rope {dtype_name} {label} {cfg}"
        exact = dict(rtol=0, atol=0, equal_nan=True)
        for name, have, want in (("k cache", kc, kc2), ("v cache", vc, vc2), ("v cache vs ref", vc, vc_ref)):
            torch.testing.assert_close(have, want, **exact, msg=f"{tag}: {name}")
        # The interpreter has no FMA contraction: torch's RoPE bit for bit. Compiled, the rotation's
        # products may be contracted (as in rope_store_kv's kernel): an ulp of k's dtype.
        torch.testing.assert_close(kc, kc_ref, **(exact if device == "cpu" else dict(
            rtol={"float32": 1e-6, "float16": 2 ** -10, "bfloat16": 2 ** -7}[dtype_name], atol=1e-6,
            equal_nan=True)), msg=f"{tag}: k cache vs ref")
        assert torch.equal(got, unfused), f"{tag}: fused output differs from rope_store_kv + decode"
        ref_case = dict(case, q=q_roped, k_buffer=kc_ref, v_buffer=vc_ref)
        worst = max(worst, _check(got, ref_case, sinks, window_left, 0.25, dtype_name, tag, slot_map=slot_map,
                                  with_loop=with_loop))
    return {"dtype": dtype_name, "rope_cases": len(cases), "max_abs_err": worst}


# --- the backend's Triton path against its torch path -----------------------------------------------------


def backend_parity() -> dict:
    """Run tests/layers/test_attention_backend.py's mixed-batch case through two ext_sinks backends on the same
    SGLang KV pools, one on the Triton path (SGLANG_EXT_KERNELS=triton), one on the torch path, and
    compare every output: prefix extends, a ragged extend batch, one decode step; both layer kinds.
    The decode step also runs through the CUDA-graph hooks (static buffers, capture-time then
    replay-time metadata, eagerly: CPUs have no graphs), which route the hybrid pool's KV write
    through the backend's static slot buffer."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "layers"))  # test_attention_backend's folder
    from sglang_ext.launch.cpu_shims import build_libcuda_stub, has_cuda_driver

    if not has_cuda_driver():
        ctypes.CDLL(str(build_libcuda_stub() / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
    import test_attention_backend as tab

    from sglang_ext import kernel_select
    from sglang_ext.kernels import sink_attention as sa

    prefill_calls = []
    prefill = sa.sink_attention_prefill

    def counted_prefill(*args, **kwargs):
        prefill_calls.append(1)
        return prefill(*args, **kwargs)

    sa.sink_attention_prefill = counted_prefill  # the backend imports it at each call
    results = []
    seq_lens, prefix_lens = tab.CASES[1]
    num_heads, num_kv_heads, head_dim, num_layers, size = 8, 2, 16, 2, 2048
    for swa_pool, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        torch.manual_seed(1)
        pools = tab._Pools(swa=swa_pool, dtype=dtype, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           num_layers=num_layers, size=size)
        slots = torch.randperm(size - 1)[: sum(seq_lens) + len(seq_lens)] + 1
        req_to_token = torch.zeros((8, 512), dtype=torch.int32)
        rpis = [3, 1, 6, 0][: len(seq_lens)]
        off = 0
        for rpi, n in zip(rpis, seq_lens):
            req_to_token[rpi, : n + 1] = slots[off: off + n + 1].int()
            off += n + 1
        backends = {}
        # The graph-hook backend goes first: the decode token's slots are still empty then, so a KV write
        # through a wrong static buffer would show in its own output.
        for path in ("triton_graph_hooks", "triton", "torch"):
            os.environ["SGLANG_EXT_KERNELS"] = path.split("_")[0]
            kernel_select.reload_settings()  # the mode is read once per process
            backends[path] = tab._make_backend(pools, req_to_token)
            assert backends[path].kernel_path == path.split("_")[0]
        backends["triton_graph_hooks"].init_cuda_graph_state(max_bs=8, max_num_tokens=8)
        sinks = torch.randn(num_heads) * 2
        worst = 0.0

        def both(kind, q, k, v, layer, fb, rope_cos_sin=None):
            nonlocal worst
            rope_kw = {} if rope_cos_sin is None else {"rope_cos_sin": rope_cos_sin}
            # With RoPE each backend writes this step's k / v itself (the Triton decode inside its launch):
            # the slots are poisoned before each backend runs and compared after, so a write to the wrong
            # slot (or none) shows even though the kernel attends to the new key from its registers.
            kbuf, vbuf = pools.kv.get_key_buffer(layer.layer_id), pools.kv.get_value_buffer(layer.layer_id)
            in_swa = swa_pool and pools.kv.layers_mapping[layer.layer_id][1]
            slots = (pools.kv.translate_loc_from_full_to_swa(fb.out_cache_loc) if in_swa else fb.out_cache_loc).long()
            outs, written = {}, {}
            for path, backend in backends.items():
                if path == "triton_graph_hooks":
                    if kind != "decode":
                        continue
                    backend.init_forward_metadata_out_graph(fb, in_capture=True)
                    backend.init_forward_metadata_out_graph(fb)
                else:
                    backend.init_forward_metadata(fb)
                if rope_cos_sin is not None:
                    kbuf[slots] = float("nan")
                    vbuf[slots] = float("nan")
                fwd = backend.forward_decode if kind == "decode" else backend.forward_extend
                outs[path] = fwd(q, k, v, layer, fb, sinks=sinks, **rope_kw).float()
                written[path] = (kbuf[slots].float().clone(), vbuf[slots].float().clone())
            tol = TOL["float32" if dtype == torch.float32 else "bfloat16"]
            if rope_cos_sin is not None:
                for path, (kw, vw) in written.items():
                    for name, got, want in (("k", kw, written["torch"][0]), ("v", vw, written["torch"][1])):
                        if not (torch.isfinite(got).all() and (got - want).abs().max().item() <= tol * 4):
                            raise AssertionError(f"backend {path} swa={swa_pool} layer {layer.layer_id}: this "
                                                 f"step's {name} not written to its slots as the torch path writes it")
            err = max((outs[p] - outs["torch"]).abs().max().item() for p in outs if p != "torch")
            if not err <= tol * max(1.0, outs["torch"].abs().max().item()):
                raise AssertionError(f"backend {kind} swa={swa_pool} {dtype} layer {layer.layer_id}: err {err}")
            worst = max(worst, err)

        for layer_id, window_left in ((0, tab.WINDOW_LEFT), (1, -1)):
            layer = tab._layer(layer_id, num_heads, num_kv_heads, head_dim, window_left)
            keys = {r: torch.randn(n + 1, num_kv_heads, head_dim).to(dtype) for r, n in zip(rpis, seq_lens)}
            values = {r: torch.randn(n + 1, num_kv_heads, head_dim).to(dtype) for r, n in zip(rpis, seq_lens)}
            for rpi, n, p in zip(rpis, seq_lens, prefix_lens):
                if p:
                    fb = tab._forward_batch("extend", [rpi], [p], [p], req_to_token[rpi, :p].long())
                    both("extend", torch.randn(p, num_heads * head_dim).to(dtype), keys[rpi][:p], values[rpi][:p],
                         layer, fb)
            ext = [n - p for n, p in zip(seq_lens, prefix_lens)]
            loc = torch.cat([req_to_token[r, p:n].long() for r, n, p in zip(rpis, seq_lens, prefix_lens)])
            # with SGLang's prefix lengths (some requests hit the cache), and RoPE as gpt-oss calls it: a batch
            # with any prefix keeps the key loop
            fb = tab._forward_batch("extend", rpis, seq_lens, ext, loc, prefix_lens=prefix_lens)
            before = len(prefill_calls)
            ang = torch.rand(sum(ext), head_dim // 2) * 6.0
            both("extend", torch.randn(sum(ext), num_heads * head_dim).to(dtype),
                 torch.randn(sum(ext), num_kv_heads, head_dim).to(dtype),
                 torch.randn(sum(ext), num_kv_heads, head_dim).to(dtype), layer, fb,
                 rope_cos_sin=torch.cat([ang.cos(), ang.sin()], 1))
            if len(prefill_calls) != before:
                raise AssertionError(f"swa={swa_pool} layer {layer_id}: a batch with cached prefixes took the "
                                     "prefill kernel")
            fb = tab._forward_batch("extend", rpis, seq_lens, ext, loc)
            both("extend", torch.randn(sum(ext), num_heads * head_dim).to(dtype),
                 torch.cat([keys[r][p:n] for r, n, p in zip(rpis, seq_lens, prefix_lens)]),
                 torch.cat([values[r][p:n] for r, n, p in zip(rpis, seq_lens, prefix_lens)]), layer, fb)
            loc = torch.stack([req_to_token[r, n].long() for r, n in zip(rpis, seq_lens)])
            fb = tab._forward_batch("decode", rpis, [n + 1 for n in seq_lens], [1] * len(rpis), loc)
            both("decode", torch.randn(len(rpis), num_heads * head_dim).to(dtype),
                 torch.stack([keys[r][n] for r, n in zip(rpis, seq_lens)]),
                 torch.stack([values[r][n] for r, n in zip(rpis, seq_lens)]), layer, fb)
            # The same step with q and k unrotated and their RoPE rows (gpt-oss's call): the Triton path
            # rotates and writes in the decode launcher (in the one-shot kernel where it runs: here the
            # sliding layer), the torch path with apply_rope + set_kv_buffer.
            ang = torch.rand(len(rpis), head_dim // 2) * 6.0
            both("decode", torch.randn(len(rpis), num_heads * head_dim).to(dtype),
                 torch.randn(len(rpis), num_kv_heads, head_dim).to(dtype),
                 torch.randn(len(rpis), num_kv_heads, head_dim).to(dtype), layer, fb,
                 rope_cos_sin=torch.cat([ang.cos(), ang.sin()], dim=1))
            # A ragged prefill with no cached prefix, unrotated q / k and their RoPE rows, k / v strided views
            # of one GEMM-like output (the model's call): the Triton path's layers, full and sliding (in the
            # sliding sub-pool too), read this forward's keys as rows (sink_attention_prefill, counted).
            t = sum(seq_lens)
            qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
            kv_cols = num_heads * head_dim
            k_rows = qkv[:, kv_cols:kv_cols + num_kv_heads * head_dim].view(t, num_kv_heads, head_dim)
            v_rows = qkv[:, kv_cols + num_kv_heads * head_dim:].view(t, num_kv_heads, head_dim)
            loc = torch.cat([req_to_token[r, :n].long() for r, n in zip(rpis, seq_lens)])
            fb = tab._forward_batch("extend", rpis, seq_lens, seq_lens, loc, prefix_lens=[0] * len(rpis))
            ang = torch.rand(t, head_dim // 2) * 6.0
            before = len(prefill_calls)
            both("extend", qkv[:, :kv_cols], k_rows, v_rows, layer, fb, rope_cos_sin=torch.cat([ang.cos(), ang.sin()], 1))
            took = len(prefill_calls) - before
            if took != 1:
                raise AssertionError(f"swa={swa_pool} layer {layer_id}: sink_attention_prefill ran {took} times")
        results.append({"swa_pool": swa_pool, "dtype": str(dtype), "max_abs_err": worst})
    return {"backend_parity": results}


def _run_interpreted(args, timeout):
    from interpreted import run_interpreted

    t0 = time.time()
    return run_interpreted(__file__, args, timeout), time.time() - t0


def test_kernels_match_reference_interpreted():
    """fp32 (full matrix), fp16 (16-bit dots) and bf16 (upcast at load) in one interpreter process."""
    results, _ = _run_interpreted(["--sweep", "float32,float16,bfloat16"], timeout=900)
    assert [r["dtype"] for r in results] == ["float32", "float16", "bfloat16"]
    fp32 = results[0]
    assert fp32["extend_cases"] == 2 * sum(2 if w >= 0 else 1 for w in WINDOWS) + 4
    assert fp32["decode_cases"] == 3 * len(DECODE_WINDOWS) + 3 + 6 + 1
    assert fp32["merge_cases"] == 6
    assert all(r["extend_cases"] > 0 and r["decode_cases"] > 0 for r in results)


def test_oneshot_decode_matches_reference_interpreted():
    """The one-shot decode: fp32 (every case), fp16 (16-bit dots) and bf16 (upcast at load), one process;
    in the same process, RoPE + the KV write inside its launch (RopeKV) against rope_store_kv + the decode,
    fp32 and fp16 (bf16 with RoPE: the backend parity test here, and the GPU sweep)."""
    results, _ = _run_interpreted(["--oneshot", "float32,float16,bfloat16", "--rope", "float32,float16"],
                                  timeout=600)
    oneshot = [r for r in results if "oneshot_cases" in r]
    rope = [r for r in results if "rope_cases" in r]
    assert [r["dtype"] for r in oneshot] == ["float32", "float16", "bfloat16"]
    assert oneshot[0]["oneshot_cases"] == 10
    assert [r["dtype"] for r in rope] == ["float32", "float16"]
    assert rope[0]["rope_cases"] == 15


def test_prefill_matches_reference_interpreted():
    """The no-prefix prefill kernel: fp32 (every tile), fp16 (16-bit dots), bf16 (upcast at load)."""
    results, _ = _run_interpreted(["--prefill", "float32,float16,bfloat16"], timeout=600)
    assert [r["dtype"] for r in results] == ["float32", "float16", "bfloat16"]
    assert results[0]["prefill_cases"] == len(PREFILL_REQUESTS) * 3 * len(PREFILL_TILES)  # sinks, none, window
    assert results[1]["prefill_cases"] == results[2]["prefill_cases"] == len(PREFILL_REQUESTS) * 3


def test_backend_triton_path_matches_torch_path_interpreted():
    results, _ = _run_interpreted(["--backend"], timeout=900)
    parity = results[0]["backend_parity"]
    assert len(parity) == 2


# --- full shapes on a GPU ------------------------------------------------------------------------------------


def gpu_full_shapes() -> dict:
    """gpt-oss-120b attention shapes (64 q / 8 kv heads, D 64, bf16) at 8k context, compiled: ragged extend
    and decode vs the reference for both layer kinds, then decode captured in a CUDA graph and replayed
    after every input (q, lengths, request rows, K/V) changed in place."""
    mod = _kernel_module()
    hq, hkv, d = 64, 8, 64
    scale = 1 / 8
    res = {}
    extend_requests = [(0, 1000), (7000, 1192), (130, 70), (8191, 1)]
    # The sliding layer on the launcher's choice (the one-shot window kernel), its other tiles and the key loop.
    extend_variants = [(127, {}), (127, dict(block_m=64, num_warps=4)), (127, dict(block_m=256, num_warps=8)),
                       (127, dict(window_oneshot=False)), (-1, {})]
    for window_left, kw in extend_variants:
        case, extra = make_case(extend_requests, torch.bfloat16, seed=1, hq=hq, hkv=hkv, d=d, device="cuda",
                                swa_map=window_left >= 0)
        case = poisoned(case, extra["slot_map"], window_left)
        got = mod.sink_attention_extend(**case, sinks=extra["sinks"], window_left=window_left, scale=scale,
                                        slot_map=extra["slot_map"], **kw)
        res[f"extend_W{window_left}{kw or ''}"] = _check(got, case, extra["sinks"], window_left, scale, "bfloat16",
                                                         f"gpu extend W={window_left} {kw}",
                                                         slot_map=extra["slot_map"], with_loop=False)
    seq_lens = [8192, 1, 128, 129, 4097, 8000, 65, 300] * 2
    # The launcher's own choice, one split, a few, and the choices it makes at batch 1 (many splits,
    # two key blocks at least per split, merged in the last split or by the merge kernel), and the
    # sliding layer's one-pass 128-key block; the prefetching key loop and the plain one. The merge
    # kernel's tile: by default all 66 splits in one load, one q head per program; forced to a loop of
    # 16-split loads, two heads per program.
    variants = [{}, dict(num_splits=1), dict(num_splits=7),
                dict(num_splits=66, min_split_blocks=2), dict(num_splits=66, min_split_blocks=1, fused_merge=False),
                dict(num_splits=40, min_split_blocks=1, fused_merge=False, merge_splits=16, merge_heads=2),
                dict(num_splits=1, block_n=128, num_warps=8, prefetch=False),
                dict(num_splits=20, block_n=32, min_split_blocks=3, prefetch=False),
                # The one-shot decode: a chunk per split (all splits merged in one load), 256 splits of which
                # half exit (the merge loops over loads), capped splits that fold several 256-key chunks
                # (their loop pipelined: num_stages 3), the sliding window in two splits.
                dict(oneshot=True, num_splits=64, block_n=128, min_split_blocks=1, num_stages=1),
                dict(oneshot=True, num_splits=256, block_n=64, min_split_blocks=1, v_late=True, num_stages=1),
                dict(oneshot=True, num_splits=20, block_n=256, min_split_blocks=1, num_warps=8, num_stages=3),
                dict(oneshot=True, num_splits=2, block_n=64, min_split_blocks=1, num_stages=1)]
    for window_left in (127, -1):
        for kw in variants:
            case, extra = _decode_case(torch.bfloat16, seed=2, device="cuda", seq_lens=seq_lens, hq=hq, hkv=hkv, d=d)
            case = poisoned(case, None, window_left)
            with poisoned_workspaces():
                got = mod.sink_attention_decode(case["q"], case["k_buffer"], case["v_buffer"], case["req_to_token"],
                                                case["req_pool_indices"], case["seq_lens"], extra["sinks"],
                                                window_left, scale, **kw)
            res[f"decode_W{window_left}_{kw}"] = _check(
                got, case, extra["sinks"], window_left, scale, "bfloat16", f"gpu decode W={window_left} {kw}",
                with_loop=False)
        res[f"graph_W{window_left}"] = _graph_check(mod, window_left, seq_lens, hq, hkv, d, scale)
        # Batch 1 at 32k: the default's many splits, captured and replayed at other lengths.
        res[f"graph_batch1_W{window_left}"] = _graph_check(mod, window_left, [32768], hq, hkv, d, scale)
    # Every branch of decode_config's rule (batch x max context 8k / 32k), eager then captured (the fused
    # merge is covered by the explicit configs above; the rule now always picks the merge kernel).
    res.update(gpu_decode_defaults(mod, hq, hkv, d, scale))
    res.update(gpu_oneshot(mod, hq, hkv, d, scale))
    res.update(gpu_prefill(mod, hq, hkv, d, scale))
    return res


def gpu_prefill(mod, hq, hkv, d, scale) -> dict:
    """The no-prefix prefill kernel at gpt-oss shapes, ragged (8192 + 1000 + 70 + 1 tokens), with sinks, every
    tile of PREFILL_TILES and the default, against the reference and the key loop on the same rows (in scrambled
    cache slots); prints whether its bits equal the key loop's (the prototype's were, diag_extend_fa.md)."""
    res = {}
    lens = (8192, 1000, 70, 1)
    case, extra = make_case([(0, n) for n in lens], torch.bfloat16, seed=5, hq=hq, hkv=hkv, d=d, device="cuda")
    t = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(6)
    k_rows = torch.randn(t, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    v_rows = torch.randn(t, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.cat([case["req_to_token"][r, :n].long() for r, n in
                       zip(case["req_pool_indices"].tolist(), case["q_len"].tolist())])
    case["k_buffer"][slots] = k_rows
    case["v_buffer"][slots] = v_rows
    loop = mod.sink_attention_extend(**case, sinks=extra["sinks"], window_left=-1, scale=scale)
    for tile in PREFILL_TILES:
        got = mod.sink_attention_prefill(case["q"], k_rows, v_rows, case["q_start"], case["q_len"], extra["sinks"],
                                         scale, tile=tile)
        label = f"gpu prefill {tile}"
        res[label] = _check(got, case, extra["sinks"], -1, scale, "bfloat16", label, with_loop=False)
        print(json.dumps({"prefill_tile": str(tile), "bits_equal_key_loop": bool(torch.equal(got, loop)),
                          "max_abs_diff_key_loop": (got.float() - loop.float()).abs().max().item()}), flush=True)
    return res


def gpu_oneshot(mod, hq, hkv, d, scale) -> dict:
    """The one-shot variants the sweep measures (oneshot_config at max context 8k, 32k and the model's
    131072) at batch 1-4 with ragged lengths, eager; then each captured in a CUDA graph at batch 4 (and the
    sliding layer at batch 1) and replayed on changed inputs."""
    res = {}
    picks = [mod.OneshotPick(128), mod.OneshotPick(64, v_late=True), mod.OneshotPick(256, num_warps=8),
             mod.OneshotPick(128, v_late=True, num_warps=8)]
    for width in (8192, 32768, 131072):
        for batch in (1, 2, 3, 4):
            seq_lens = [min(width, 32768) - 3, 1, 5000, 129][:batch]
            for window_left in (-1, 127):
                case, extra = _decode_case(torch.bfloat16, seed=20 + batch, device="cuda", seq_lens=seq_lens, hq=hq,
                                           hkv=hkv, d=d)
                case = poisoned(case, None, window_left)
                for pick in picks:
                    cfg = mod.oneshot_config(batch, hkv, window_left, width, *pick)
                    with poisoned_workspaces():
                        got = mod.sink_attention_decode(case["q"], case["k_buffer"], case["v_buffer"],
                                                        case["req_to_token"], case["req_pool_indices"],
                                                        case["seq_lens"], extra["sinks"], window_left, scale,
                                                        config=cfg)
                    label = f"gpu oneshot width={width} batch={batch} W={window_left} {cfg}"
                    res[label] = _check(got, case, extra["sinks"], window_left, scale, "bfloat16", label,
                                        with_loop=False)
    for width in (8192, 131072):
        for pick in picks:
            cfg = mod.oneshot_config(4, hkv, -1, width, *pick)
            res[f"graph_oneshot_w{width}_{pick}"] = _graph_check(mod, -1, [8000, 2, 4097, 700], hq, hkv, d, scale,
                                                                 config=cfg)
    res["graph_oneshot_sliding_b1"] = _graph_check(mod, 127, [5000], hq, hkv, d, scale,
                                                   config=mod.oneshot_config(1, hkv, 127, 131072, 64))
    return res


def gpu_decode_defaults(mod, hq, hkv, d, scale) -> dict:
    res = {}
    picked = {}
    for width in (8192, 32768):
        for batch in (1, 2, 3, 4, 8, 16):
            # Ragged lengths up to width - 3 (req_to_token is 3 wider than the longest request).
            seq_lens = ([width - 3, 1, width // 2 + 7, 129, 5000, width - 64, 300, 4097] * 2)[:batch]
            if batch > 1:
                seq_lens[1] = 2  # a short request (one split) beside long ones
            cfg = mod.decode_config(batch, hkv, -1, width, torch.device("cuda"))
            picked.setdefault(cfg, []).append((width, batch))
            case, extra = _decode_case(torch.bfloat16, seed=10 + batch, device="cuda", seq_lens=seq_lens, hq=hq,
                                       hkv=hkv, d=d)
            case = poisoned(case, None, -1)
            args = (case["q"], case["k_buffer"], case["v_buffer"], case["req_to_token"], case["req_pool_indices"],
                    case["seq_lens"], extra["sinks"], -1, scale)
            label = f"gpu decode default width={width} batch={batch} {cfg}"
            got = mod.sink_attention_decode(*args)
            res[f"default_w{width}_b{batch}"] = _check(got, case, extra["sinks"], -1, scale, "bfloat16", label,
                                                       with_loop=False)
            if cfg.fused_merge and cfg.num_splits > 1:
                _counters_after(mod, case["q"].device, label)
                for _ in range(3):
                    assert torch.equal(mod.sink_attention_decode(*args), got), f"{label}: a later launch differs"
                _counters_after(mod, case["q"].device, label)
        res[f"graph_defaults_w{width}_b4"] = _graph_check(mod, -1, [width - 3, 2, width // 2, 700], hq, hkv, d,
                                                          scale)
    # The rule's three kinds: old (batch 1 <= 8k, batch >= 16), 2 warps + prefetch (batch 1 > 8k, 2, 3-4
    # <= 8k), 4 warps without prefetch (batch 3-4 > 8k at 4/SM, 5-15 at 8/SM); all with the merge kernel.
    # (Batch 1-4 points that ONESHOT_PICKS moves to the one-shot decode leave their kind.)
    kinds = {(c.fused_merge, c.prefetch, c.num_warps, c.min_split_blocks) for c in picked if not c.oneshot}
    expected = {(False, False, 4, 1), (False, True, 2, 2), (False, False, 4, 2)}
    assert kinds == expected if not mod.ONESHOT_PICKS else kinds <= expected, picked
    return res


def _graph_check(mod, window_left, seq_lens, hq, hkv, d, scale, config=None) -> float:
    case, extra = _decode_case(torch.bfloat16, seed=3, device="cuda", seq_lens=seq_lens, hq=hq, hkv=hkv, d=d)
    out = torch.empty_like(case["q"])
    args = lambda: (case["q"], case["k_buffer"], case["v_buffer"], case["req_to_token"],  # noqa: E731
                    case["req_pool_indices"], case["seq_lens"], extra["sinks"], window_left, scale)
    mod.sink_attention_decode(*args(), out=out, config=config)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod.sink_attention_decode(*args(), out=out, config=config)
    worst = 0.0
    for seed, lens in ((4, seq_lens[::-1]), (5, [n // 2 + 1 for n in seq_lens])):
        new, new_extra = _decode_case(torch.bfloat16, seed=seed, device="cuda", seq_lens=lens, hq=hq, hkv=hkv, d=d)
        for name in ("q", "req_pool_indices", "seq_lens"):
            case[name].copy_(new[name])
        n_slots = min(case["k_buffer"].shape[0], new["k_buffer"].shape[0])
        case["k_buffer"][:n_slots].copy_(new["k_buffer"][:n_slots])
        case["v_buffer"][:n_slots].copy_(new["v_buffer"][:n_slots])
        case["req_to_token"].zero_()
        rows, cols = new["req_to_token"].shape
        case["req_to_token"][:rows, :cols].copy_(new["req_to_token"].clamp(max=n_slots - 1))
        extra["sinks"].copy_(new_extra["sinks"])
        graph.replay()
        torch.cuda.synchronize()
        worst = max(worst, _check(out, case, extra["sinks"], window_left, scale, "bfloat16",
                                  f"graph replay W={window_left}", with_loop=False))
    return worst


# One compile-heavy sweep per test, so that they spread over workers (each raises on a miss)
COMPILED_SWEEPS = {"prefill": prefill_sweep, "split": sweep, "oneshot": oneshot_sweep, "rope": rope_sweep}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", list(COMPILED_SWEEPS))
def test_kernels_compiled(kind, dtype_name):
    print(json.dumps(COMPILED_SWEEPS[kind](dtype_name, device="cuda")), flush=True)


@pytest.mark.gpu
def test_kernels_compiled_full_shapes_and_graph():
    res = gpu_full_shapes()
    assert all(err <= TOL["bfloat16"] * 8 for err in res.values()), res


if __name__ == "__main__":
    # python tests/kernels/test_kernel_sink_attention.py --sweep DTYPE[,DTYPE...] [--device cuda]
    # python tests/kernels/test_kernel_sink_attention.py --oneshot DTYPE[,DTYPE...] [--rope DTYPE[,...]] [--device cuda]
    # python tests/kernels/test_kernel_sink_attention.py --prefill DTYPE[,DTYPE...] [--device cuda]
    # python tests/kernels/test_kernel_sink_attention.py --backend          (interpreter: TRITON_INTERPRET=1)
    # python tests/kernels/test_kernel_sink_attention.py --gpu              (sweep fp32/bf16 + full shapes + graph)
    # python tests/kernels/test_kernel_sink_attention.py --gpu-full         (full shapes + graph only)
    argv = sys.argv[1:]
    if "--prefill" in argv or "--oneshot" in argv or "--rope" in argv:
        dev = argv[argv.index("--device") + 1] if "--device" in argv else "cpu"
        for flag, run in (("--prefill", prefill_sweep), ("--oneshot", oneshot_sweep), ("--rope", rope_sweep)):
            for name in (argv[argv.index(flag) + 1].split(",") if flag in argv else ()):
                t0 = time.time()
                res = run(name, device=dev)
                res["seconds"] = round(time.time() - t0, 1)
                print(json.dumps(res), flush=True)
    elif "--backend" in argv:
        print(json.dumps(backend_parity()), flush=True)
    elif "--gpu-full" in argv:
        print(json.dumps({"full_shapes": gpu_full_shapes()}), flush=True)
    elif "--gpu" in argv:
        for name in ("float32", "bfloat16"):
            print(json.dumps(prefill_sweep(name, device="cuda")), flush=True)
            print(json.dumps(sweep(name, device="cuda")), flush=True)
            print(json.dumps(oneshot_sweep(name, device="cuda")), flush=True)
            print(json.dumps(rope_sweep(name, device="cuda")), flush=True)
        print(json.dumps({"full_shapes": gpu_full_shapes()}), flush=True)
    else:
        dev = argv[argv.index("--device") + 1] if "--device" in argv else "cpu"
        for name in argv[argv.index("--sweep") + 1].split(","):
            t0 = time.time()
            res = sweep(name, device=dev)
            res["seconds"] = round(time.time() - t0, 1)
            print(json.dumps(res), flush=True)
