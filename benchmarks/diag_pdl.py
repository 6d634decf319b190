"""Programmatic dependent launch (kernels/pdl.py) on the gpt-oss decode step: time and bits.

    python benchmarks/diag_pdl.py --out benchmarks/results [--models 120b,20b] [--batches 1,4,8]

For each model and batch (context 8192, one GPU, the model-step harness) the step is captured
twice from the same model and inputs, once with every PDL-capable kernel launched plainly and
once as programmatic dependents, and the two graphs are replayed alternately (paired rounds, as
bench_decode times the probe). Reported: both medians, the median of the per-round differences
with its quartiles, and whether the PDL graph's logits equal the plain graph's bit for bit on
every one of `--check` replays (a kernel that read its predecessor's output before its wait
would show up here as a mismatch). At batch 1 the probe's overhead is measured again with PDL on
(paired graphs, 100 rounds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402


def round_robin_times(graphs: list, rounds: int, reps: int = 3) -> list:
    """Seconds per replay of each graph in `graphs`, a list per graph: every round replays each graph `reps`
    times in turn, so drift hits all alike (two warm-up passes first)."""
    for g in graphs * 2:
        g.replay()
    torch.cuda.synchronize()
    times = [[] for _ in graphs]
    for _ in range(rounds):
        for g, t in zip(graphs, times):
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            for _ in range(reps):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            t.append(start.elapsed_time(end) / 1e3 / reps)
    return times


def paired(graph_a, graph_b, rounds: int, reps: int = 3):
    """(median a, median b, median b - a, (q1, q3) of b - a), seconds per replay."""
    a_times, b_times = round_robin_times([graph_a, graph_b], rounds, reps)
    diffs = [b - a for a, b in zip(a_times, b_times)]
    q1, _, q3 = statistics.quantiles(diffs, n=4)
    return statistics.median(a_times), statistics.median(b_times), statistics.median(diffs), (q1, q3)


def critical_path(graph, num_layers: int, replays: int = 5) -> list[dict]:
    """Where a PDL replay's time goes: kernels overlap under PDL, so a kernel's own duration
    says little; its increment end(i) - end(i-1) over the previous kernel in time order is what
    it adds to the step (the critical path), summed per kernel name over the replays. A kernel
    launched once per layer is split into even (sliding-attention) and odd (full) layers, one
    launched twice per layer into its first and second launch of the layer (qkv / o, input /
    post-attention norm)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start = evt.time_range.start
        end = evt.time_range.end
        if end > start:
            kernels.append((end, start, evt.name[:90]))
    kernels.sort()
    per_replay: dict[str, int] = {}
    for _, _, name in kernels:
        per_replay[name] = per_replay.get(name, 0) + 1
    seen: dict[str, int] = {}
    labelled = []
    for end, start, name in kernels:
        n = per_replay[name] // replays
        i = seen.get(name, 0) % max(n, 1)
        seen[name] = seen.get(name, 0) + 1
        if n == num_layers:
            name = f"{name} ({'even' if i % 2 == 0 else 'odd'} layers)"
        elif n == 2 * num_layers:
            name = f"{name} ({'1st' if i % 2 == 0 else '2nd'} of a layer)"
        labelled.append((end, start, name))
    by_name: dict[str, dict] = {}
    prev_end = None
    for end, start, name in labelled:
        inc = end - (prev_end if prev_end is not None and prev_end > start else start)
        prev_end = max(prev_end or end, end)
        r = by_name.setdefault(name, {"name": name, "calls": 0, "increment_us": 0.0, "duration_us": 0.0})
        r["calls"] += 1
        r["increment_us"] += max(inc, 0.0)
        r["duration_us"] += end - start
    rows = sorted(by_name.values(), key=lambda r: -r["increment_us"])
    for r in rows:
        r["calls"] /= replays
        r["increment_us"] /= replays
        r["duration_us"] /= replays
        r["per_call"] = r["increment_us"] / max(r["calls"], 1e-9)
    return rows


def table_with_mlp2_per_pair(block_n: int, warps: int):
    """The MoE table with its one-shot rows' mlp2 as the per-pair kernel of this tile."""
    from dataclasses import replace

    from sglang_ext.kernels import moe

    return tuple((t, replace(c, mlp2_block_n=block_n, mlp2_warps=warps, mlp2_per_pair=True) if c.oneshot else c)
                 for t, c in moe.H200_HIDDEN_2880_CONFIGS)


def count_mismatches(graph, outs: dict, key, reference, check: int) -> int:
    """Replays of `graph` (`check` of them) whose output outs[key] differs from `reference` in any bit."""
    mismatches = 0
    for _ in range(check):
        graph.replay()
        torch.cuda.synchronize()
        mismatches += int(not torch.equal(outs[key], reference))
    return mismatches


def closeness(out: torch.Tensor, reference: torch.Tensor) -> dict:
    """How far one graph's logits land from another's: max abs difference, argmax agreement."""
    return {"logits_max_abs_diff": (out.float() - reference.float()).abs().max().item(),
            "argmax_equal": (out.argmax(-1) == reference.argmax(-1)).float().mean().item()}


def capture_ab(model, inputs, switch, rounds: int, check: int):
    """model.forward captured twice, with switch(False) then switch(True) applied at capture (switch(None)
    after); the True graph's logits against the False graph's on `check` replays, then paired rounds.
    Returns (graphs, outs, reference logits, mismatches, (median a, median b, diff, (q1, q3)))."""
    outs, graphs = {}, {}
    try:
        for on in (False, True):
            switch(on)
            graphs[on] = bc.capture_graph(lambda on=on: outs.__setitem__(on, model.forward(**inputs)))
    finally:
        switch(None)
    graphs[False].replay()
    torch.cuda.synchronize()
    reference = outs[False].clone()
    mismatches = count_mismatches(graphs[True], outs, True, reference, check)
    return graphs, outs, reference, mismatches, paired(graphs[False], graphs[True], rounds)


def ab_row(model_name: str, batch: int, context: int, stems: tuple, check: int, mismatches: int, timing: tuple,
           **extra) -> dict:
    """One A/B row from capture_ab's (median a, median b, diff, (q1, q3)) in seconds: the keys ab_table reads,
    `stems` = (a, b) naming them (e.g. ("plain", "pdl") -> plain_us, pdl_us, tok_s_plain, tok_s_pdl)."""
    a_s, b_s, diff, (q1, q3) = timing
    a, b = stems
    return {"model": model_name, "batch": batch, "context": context, **extra, f"{a}_us": a_s * 1e6,
            f"{b}_us": b_s * 1e6, "diff_us": diff * 1e6, "diff_pct": 100 * diff / a_s, "iqr_us": [q1 * 1e6, q3 * 1e6],
            f"tok_s_{a}": batch / a_s, f"tok_s_{b}": batch / b_s, "bit_checks": check, "bit_mismatches": mismatches}


def step_row(model_name: str, batch: int, context: int, rounds: int, check: int, probe: bool,
             mlp2_variants: tuple = ()) -> dict:
    from model_step import MODELS, ModelStep, Sharding

    from sglang_ext.kernels.pdl import set_pdl

    model = ModelStep(MODELS[model_name], Sharding(1, 1, 1, 0), batch=batch, context=context)
    inputs = model.decode_inputs(context)
    graphs, outs, _, mismatches, timing = capture_ab(model, inputs, set_pdl, rounds, check)
    row = ab_row(model_name, batch, context, ("plain", "pdl"), check, mismatches, timing)
    if batch <= 16:  # the PDL range (kernels/pdl.py PDL_MAX_ROWS)
        row["critical_path"] = critical_path(graphs[True], MODELS[model_name].num_layers)
    # MoE one-shot mlp2 as the per-pair kernel (kernels/moe_decode.py), PDL on, against the table's
    from sglang_ext.kernels import moe

    table = moe.H200_HIDDEN_2880_CONFIGS
    row["mlp2_per_pair"] = []
    for block_n, warps in mlp2_variants:
        moe.H200_HIDDEN_2880_CONFIGS = table_with_mlp2_per_pair(block_n, warps)
        holder = {}
        try:
            set_pdl(True)
            g = bc.capture_graph(lambda: holder.__setitem__("out", model.forward(**inputs)))
        finally:
            set_pdl(None)
            moe.H200_HIDDEN_2880_CONFIGS = table
        base, var, d, (v1, v3) = paired(graphs[True], g, rounds)
        row["mlp2_per_pair"].append({"tile": f"n{block_n}/w{warps}", "table_us": base * 1e6, "variant_us": var * 1e6,
                                     "diff_us": d * 1e6, "iqr_us": [v1 * 1e6, v3 * 1e6],
                                     "logits_equal": (holder["out"] == outs[True]).float().mean().item()})
        del g
    graphs.clear()
    outs.clear()
    if probe:
        from bench_decode import time_decode_probe_pair

        set_pdl(True)
        spread: dict = {}
        p_off, p_on, p_diff = time_decode_probe_pair(model, context, rounds=100, spread=spread)
        set_pdl(None)
        row["probe_with_pdl"] = {"off_us": p_off * 1e6, "on_us": p_on * 1e6, "overhead_us": p_diff * 1e6,
                                 "overhead_pct": 100 * p_diff / p_off,
                                 "iqr_us": [spread["q1_s"] * 1e6, spread["q3_s"] * 1e6]}
    model = None
    torch.cuda.empty_cache()
    return row


def families_rows(model_name: str, batch: int, context: int, variants: list, rounds: int, check: int,
                  profile: bool = True) -> list:
    """PDL with some kernel families launched plainly (kernels/pdl.py set_pdl_plain), each variant against
    the plain step (PDL off) of the same model and inputs: paired rounds, the variant's logits against the
    plain graph's on `check` replays. `variants` = family sets; the empty set is every kernel as a
    dependent. With `profile`, the critical paths of the plain step and of each variant's."""
    from model_step import MODELS, ModelStep, Sharding

    from sglang_ext.kernels.pdl import set_pdl, set_pdl_plain

    model = ModelStep(MODELS[model_name], Sharding(1, 1, 1, 0), batch=batch, context=context)
    inputs = model.decode_inputs(context)
    layers = MODELS[model_name].num_layers
    outs: dict = {}
    set_pdl(False)
    try:
        plain = bc.capture_graph(lambda: outs.__setitem__("plain", model.forward(**inputs)))
    finally:
        set_pdl(None)
    plain.replay()
    torch.cuda.synchronize()
    reference = outs["plain"].clone()
    rows = []
    for families in variants:
        label = "+".join(sorted(families)) or "none"
        set_pdl(True)
        set_pdl_plain(families)
        try:
            graph = bc.capture_graph(lambda: outs.__setitem__(label, model.forward(**inputs)))
        finally:
            set_pdl(None)
            set_pdl_plain(None)
        mismatches = count_mismatches(graph, outs, label, reference, check)
        row = ab_row(model_name, batch, context, ("plain", "pdl"), check, mismatches, paired(plain, graph, rounds),
                     candidate=f"plain launch: {label}")
        if profile:
            row["critical_path"] = critical_path(graph, layers)
        rows.append(row)
        del graph
    if profile and rows:
        rows[0]["critical_path_plain"] = critical_path(plain, layers)
    del plain
    model = None
    torch.cuda.empty_cache()
    return rows


def probe_path_row(model_name: str, batch: int, context: int, rounds: int) -> dict:
    """Where the probe's overhead goes (20b batch 1 sat at 0.32-0.41 % against the 0.25 % target in
    sessions 18-19): the step captured without and with the probe (PDL as served), paired rounds, and both
    graphs' critical paths (kernels of both streams in end order), with the per-kernel increments on - off."""
    from bench_decode import capture_probe_pair
    from model_step import MODELS, ModelStep, Sharding

    model = ModelStep(MODELS[model_name], Sharding(1, 1, 1, 0), batch=batch, context=context)
    layers = MODELS[model_name].num_layers
    graph_off, graph_on, probe = capture_probe_pair(model, model.decode_inputs(context))
    off_s, on_s, diff, (q1, q3) = paired(graph_off, graph_on, rounds)
    replays = 5
    off_path, on_path = critical_path(graph_off, layers, replays), critical_path(graph_on, layers, replays)
    delta = critical_path_delta(off_path, on_path)
    del graph_off, graph_on, probe
    model = None
    torch.cuda.empty_cache()
    return {"model": model_name, "batch": batch, "context": context, "off_us": off_s * 1e6, "on_us": on_s * 1e6,
            "overhead_us": diff * 1e6, "overhead_pct": 100 * diff / off_s, "iqr_us": [q1 * 1e6, q3 * 1e6],
            "critical_path_off": off_path, "critical_path_on": on_path, "delta": delta}


# --probe-variants: how the probe's step is launched beside the LM head (session 20). Each: (positions taken
# inside the step's kernels, the step's three launches a PDL chain).
# Knobs: positions (inside the step's kernels, else two torch launches first), chain (the three launches a PDL
# chain), qkv_splits (the q|k|v GEMV's K splits, None: its rule, 23 at 1..16 rows: ~460 programs), priority (the
# side stream's).
PROBE_VARIANTS = {
    "before": dict(positions=False, chain=False),  # before session 20
    "positions": dict(positions=True, chain=False),
    "chain": dict(positions=True, chain=True),
    "chain_q6": dict(positions=True, chain=True, qkv_splits=6),  # ~120 programs: slots left for the main chain
    "positions_q6": dict(positions=True, chain=False, qkv_splits=6),
    "chain_normal": dict(positions=True, chain=True, priority="normal"),
    # session 25: the LM head's GEMM leaves N SMs to the probe's step (model_step.head_carveout)
    "carve8": dict(positions=True, chain=False, carveout=8),
    "carve16": dict(positions=True, chain=False, carveout=16),
    "carve16lt": dict(positions=True, chain=False, carveout=16, lt=True),  # the head through cuBLASLt
    "carve32lt": dict(positions=True, chain=False, carveout=32, lt=True),
    # session 26: the side stream starts at the deepest tap (SGLANG_EXT_PROBE_LAUNCH=tap), beside the base model's
    # last layers instead of the LM head: at batch 1 "head" won (diag_decode_b1.md), never timed at 32..128 rows
    "tap": dict(positions=True, chain=False, launch="tap"),
    "tap_normal": dict(positions=True, chain=False, launch="tap", priority="normal"),
    # session 26: the probe's attention split differently (its rule: 5 splits of 64-key blocks at 128 rows, 9 at 64),
    # fewer / more and longer / shorter programs taking the SM slots the LM head's waves need
    "attn_s1": dict(positions=True, chain=False, attn_splits=1),
    "attn_s2": dict(positions=True, chain=False, attn_splits=2),
    "attn_s3": dict(positions=True, chain=False, attn_splits=3),
    "attn_s10": dict(positions=True, chain=False, attn_splits=10),
    "attn_bn32": dict(positions=True, chain=False, attn_block_n=32),
    "attn_bn128": dict(positions=True, chain=False, attn_block_n=128),
    "qkv_s2": dict(positions=True, chain=False, qkv_splits=2),
}


def tail_timeline(graph, keep_us: float = 420.0) -> list[dict]:
    """The kernels of one replay that end in its last `keep_us` microseconds: start and end relative to the
    replay's last end, the stream, so what runs beside the LM head can be read off."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end, e.name[:60], getattr(e, "device_resource_id", -1))
               for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.time_range.end > e.time_range.start]
    if not kernels:
        return []
    last = max(k[1] for k in kernels)
    return [{"name": n, "stream": st, "start_us": a - last, "end_us": b - last, "duration_us": b - a}
            for a, b, n, st in sorted(kernels) if b >= last - keep_us]


def probe_variants_row(model_name: str, batch: int, context: int, rounds: int, variants: list) -> dict:
    """The step without the probe and with it launched each way of PROBE_VARIANTS, replayed round-robin in
    the same rounds (each variant's overhead is paired against the same probe-off replays), with each
    variant's critical path and the last ~400 us of one replay (the LM head and what runs beside it)."""
    from model_step import MODELS, HarnessProbe, ModelStep, Sharding

    from sglang_ext.kernels import pdl

    model = ModelStep(MODELS[model_name], Sharding(1, 1, 1, 0), batch=batch, context=context)
    layers = MODELS[model_name].num_layers
    inputs = model.decode_inputs(context)
    model.probe = None
    graph_off = bc.capture_graph(lambda: model.forward(**inputs))
    graphs, probes = {}, []
    try:
        for name in variants:
            knobs = PROBE_VARIANTS[name]
            table = set(pdl.PDL_PLAIN_FROM_ROWS)
            plain = table - {"probe"} if knobs["chain"] else table | {"probe"}
            pdl.set_pdl_plain(plain)
            dev = torch.device(model.device)
            assert pdl.pdl_launch_kwargs(dev, batch, "probe")["launch_pdl"] == (
                knobs["chain"] and pdl.pdl_enabled(dev) and batch <= pdl.PDL_MAX_ROWS), name
            os.environ["SGLANG_EXT_PROBE_PRIORITY"] = knobs.get("priority", "high")  # read when the runtime binds
            model.probe = HarnessProbe(model)
            model.probe.runtime.positions_in_kernel = knobs["positions"]
            model.probe.runtime.qkv_splits = knobs.get("qkv_splits")
            model.probe.runtime.launch_point = knobs.get("launch", "head")
            model.probe.runtime.attn_splits = knobs.get("attn_splits")
            model.probe.runtime.attn_block_n = knobs.get("attn_block_n", 64)
            model.probe.head_carveout, model.probe.head_carveout_lt = knobs.get("carveout", 0), knobs.get("lt", False)
            graphs[name] = bc.capture_graph(lambda: model.forward(**inputs))
            probes.append(model.probe)  # its buffers back the graph
    finally:
        model.probe = None
        pdl.set_pdl_plain(None)
        os.environ.pop("SGLANG_EXT_PROBE_PRIORITY", None)
    order = [("off", graph_off)] + list(graphs.items())
    times = dict(zip([name for name, _ in order], round_robin_times([g for _, g in order], rounds)))
    off = times["off"]
    row = {"model": model_name, "batch": batch, "context": context, "rounds": rounds,
           "off_us": statistics.median(off) * 1e6, "variants": []}
    for name in graphs:
        diffs = [b - a for a, b in zip(off, times[name])]
        q1, _, q3 = statistics.quantiles(diffs, n=4)
        d = statistics.median(diffs)
        row["variants"].append({
            "variant": name, "on_us": statistics.median(times[name]) * 1e6, "overhead_us": d * 1e6,
            "overhead_pct": 100 * d / statistics.median(off), "iqr_us": [q1 * 1e6, q3 * 1e6],
            "critical_path": critical_path(graphs[name], layers), "tail": tail_timeline(graphs[name])})
    row["tail_off"] = tail_timeline(graph_off)
    del graph_off, graphs, probes
    model = None
    torch.cuda.empty_cache()
    return row


def probe_variants_markdown(meta: dict, rows: list) -> str:
    lines = doc_head(
        "The probe's step beside the LM head, launched several ways", meta,
        "The step without the probe and with it, each variant captured in its own graph and all replayed "
        "round-robin (3 replays each a round), each variant's overhead the median of its per-round "
        "difference from the same probe-off replays. Variants: " + "; ".join(
            f"`{k}` = positions {'inside the kernels' if v['positions'] else 'by two torch launches'}, "
            f"{'a PDL chain' if v['chain'] else 'plain launches'}"
            + (f", {v['qkv_splits']} q|k|v splits" if v.get("qkv_splits") else "")
            + (f", {v['priority']} side-stream priority" if v.get("priority") else "")
            for k, v in PROBE_VARIANTS.items()) + ".")
    table = [{**v, "model": r["model"], "batch": r["batch"], "off_us": r["off_us"],
              "iqr": "{:.1f}..{:.1f}".format(*v["iqr_us"])} for r in rows for v in r["variants"]]
    lines.append(bc.md_table(table, [("model", "model", None), ("batch", "batch", None),
                                     ("variant", "variant", None), ("off us", "off_us", "{:.1f}"),
                                     ("on us", "on_us", "{:.1f}"), ("overhead us", "overhead_us", "{:+.2f}"),
                                     ("IQR us", "iqr", None), ("overhead %", "overhead_pct", "{:.3f}")]))
    for r in rows:
        for v in r["variants"]:
            lines += ["", f"## {r['model']} batch {r['batch']}, `{v['variant']}`: the last kernels of one replay",
                      "", "Times relative to the replay's last end; stream as the profiler names it.", "",
                      bc.md_table(v["tail"], [("kernel", "name", None), ("stream", "stream", None),
                                              ("start us", "start_us", "{:.1f}"), ("end us", "end_us", "{:.1f}"),
                                              ("duration us", "duration_us", "{:.1f}")])]
    return "\n".join(lines) + "\n"


def critical_path_delta(off_path: list, on_path: list) -> list:
    """Per kernel name, the increments per replay of two critical paths (critical_path's, already per replay)
    and on - off, largest moves first. (Until session 20 this divided by the replay count a second time: the
    delta tables of diag_probe_path.md read 1/5 of the increments, regenerated from its JSON since.)"""
    off_by = {k["name"]: k["increment_us"] for k in off_path}
    on_by = {k["name"]: k["increment_us"] for k in on_path}
    delta = [{"name": n, "off_us": off_by.get(n, 0.0), "on_us": on_by.get(n, 0.0),
              "diff_us": on_by.get(n, 0.0) - off_by.get(n, 0.0)} for n in set(off_by) | set(on_by)]
    delta.sort(key=lambda d: -abs(d["diff_us"]))
    return delta


def probe_path_markdown(meta: dict, rows: list) -> str:
    lines = doc_head(
        "Where the probe's decode overhead goes", meta,
        "The step without and with the probe (PDL as served), paired rounds of 3 replays; then each graph's "
        "critical path (increments: a kernel's end minus the previous end, both streams in end order), per "
        "replay, and the kernels whose increments moved most.") + [
             bc.md_table([{**r, "iqr": "{:.1f}..{:.1f}".format(*r["iqr_us"])} for r in rows],
                         [("model", "model", None), ("batch", "batch", None), ("context", "context", None),
                          ("off us", "off_us", "{:.1f}"), ("on us", "on_us", "{:.1f}"),
                          ("overhead us", "overhead_us", "{:+.1f}"), ("IQR us", "iqr", None),
                          ("overhead %", "overhead_pct", "{:.2f}")])]
    for r in rows:
        lines += ["", f"## {r['model']} batch {r['batch']}: increments per replay that moved most (on - off)", "",
                  bc.md_table(r["delta"][:16], [("kernel", "name", None), ("off us", "off_us", "{:.2f}"),
                                                ("on us", "on_us", "{:.2f}"), ("diff us", "diff_us", "{:+.2f}")]),
                  "", f"## {r['model']} batch {r['batch']}: the probe-on step's critical path (5 replays)", "",
                  critical_path_table(r["critical_path_on"], 30)]
    return "\n".join(lines) + "\n"


def families_markdown(meta: dict, rows: list) -> str:
    lines = ab_head(
        "PDL with kernel families launched plainly, on the decode step", meta,
        "Same model and inputs: the plain step (no PDL) against PDL with the named kernel families launched "
        "plainly (kernels/pdl.py PDL_PLAIN_FROM_ROWS: their programs still wait and release, so their successors "
        "start early, but they start only once their predecessor has finished; 'none': every kernel a "
        "dependent). Families: gemv (the dense K-loop GEMV; until session 19's second run also its x_once kernel, "
        "now gemv_xonce), attention (the split-loop decode), moe (mlp1 and "
        "mlp2, GEMV and TMA rows), moe_combine. Paired rounds of 3 replays; diff = variant - plain. Bits: the "
        "variant's logits against the plain graph's.",
        rows, ("plain", "plain"), ("PDL", "pdl"))
    for key, title in (("critical_path_plain", "the plain step"), ("critical_path", None)):
        for r in rows:
            cp = r.get(key)
            if cp:
                total = sum(k["increment_us"] for k in cp)
                lines += ["", f"## {r['model']} batch {r['batch']}, {title or r['candidate']}: critical path "
                          f"(profiler, {total:.0f} us of increments)", "", critical_path_table(cp, 20)]
    return "\n".join(lines) + "\n"


def rope_fusion_row(model_name: str, batch: int, context: int, rounds: int, check: int,
                    picks: tuple = (), table_width: int = 0) -> dict:
    """PDL on, the same model and inputs captured twice: RoPE + KV write as its own launch (rope_store_kv)
    vs inside the decode attention's launch (kernels/sink_attention.py, RopeKV: the one-shot kernel's or
    the split loop's); paired rounds, the fused graph's logits against the unfused graph's on `check`
    replays, and (batch 1) the fused step's critical path. `table_width` > context: the KV table as wide
    as that (a server's req_to_token is as wide as the model's context), the requests `context` long."""
    from model_step import MODELS, ModelStep, Sharding

    from sglang_ext.kernels.pdl import set_pdl
    from sglang_ext.kernels.sink_attention import set_rope_fusion

    width = max(table_width, context)
    model = ModelStep(MODELS[model_name], Sharding(1, 1, 1, 0), batch=batch, context=width)
    inputs = model.decode_inputs(context)

    def fusion_with_pdl(on):
        set_pdl(None if on is None else True)
        set_rope_fusion(on)

    graphs, outs, reference, mismatches, timing = capture_ab(model, inputs, fusion_with_pdl, rounds, check)
    row = ab_row(model_name, batch, context, ("unfused", "fused"), check, mismatches, timing, table_width=width)
    # Other one-shot picks for the batch-1 full layers (fused), paired against the unfused graph, before
    # the profiler runs (after it the same graphs replayed ~3 % slower in session 10's run).
    from sglang_ext.kernels import sink_attention as sa

    row["picks"] = []
    table = dict(sa.ONESHOT_PICKS)
    for label, pick in picks if batch == 1 and width <= 8192 else ():  # the picks replace the "<=8k" entry
        holder = {}
        sa.ONESHOT_PICKS[(1, "<=8k")] = pick
        fusion_with_pdl(True)
        try:
            g = bc.capture_graph(lambda: holder.__setitem__("out", model.forward(**inputs)))
        finally:
            fusion_with_pdl(None)
            sa.ONESHOT_PICKS.clear()
            sa.ONESHOT_PICKS.update(table)
        base, var, d, (v1, v3) = paired(graphs[False], g, rounds)
        g.replay()
        torch.cuda.synchronize()
        row["picks"].append({"pick": label, "unfused_us": base * 1e6, "fused_us": var * 1e6, "diff_us": d * 1e6,
                             "iqr_us": [v1 * 1e6, v3 * 1e6],
                             "logits_equal": bool(torch.equal(holder["out"], reference))})
        print(row["picks"][-1], flush=True)
        del g
    if batch == 1:
        row["critical_path"] = critical_path(graphs[True], MODELS[model_name].num_layers)
    graphs.clear()
    outs.clear()
    model = None
    torch.cuda.empty_cache()
    return row


def closeness_row(model_name: str, batch: int, context: int, stems: tuple, switch, rounds: int, check: int) -> dict:
    """capture_ab on a fresh model with `switch`, as an ab_row plus how far the 'on' graph's logits land from
    the 'off' graph's (max abs difference, argmax agreement): for A/Bs whose two sides sum in other orders."""
    from model_step import MODELS, ModelStep, Sharding

    model = ModelStep(MODELS[model_name], Sharding(1, 1, 1, 0), batch=batch, context=context)
    inputs = model.decode_inputs(context)
    graphs, outs, reference, mismatches, timing = capture_ab(model, inputs, switch, rounds, check)
    row = ab_row(model_name, batch, context, stems, check, mismatches, timing)
    graphs[True].replay()
    torch.cuda.synchronize()
    row.update(closeness(outs[True], reference))
    graphs.clear()
    outs.clear()
    model = None
    torch.cuda.empty_cache()
    return row


def wide_tile_row(model_name: str, batch: int, context: int, rounds: int, check: int) -> dict:
    """The same model and inputs captured twice: the dense FP8 GEMMs of 17..64 rows on 32 x 64 tiles with
    split-K (the table before session 12) vs the 64 x 128 TMA tile where N gives enough tiles
    (kernels/fp8_gemm.py WIDE_TILE_MIN_PROGRAMS: qkv and the lm_head, not o); paired rounds. The two tiles
    sum K in other orders, so the logits are compared for closeness, not bits."""
    from sglang_ext.kernels import fp8_gemm

    shipped = fp8_gemm.WIDE_TILE_MIN_PROGRAMS

    def wide(on):
        fp8_gemm.WIDE_TILE_MIN_PROGRAMS = shipped if on in (None, True) else 1 << 30

    return closeness_row(model_name, batch, context, ("narrow", "wide"), wide, rounds, check)


def table_with_row(tokens: int, config):
    """The MoE table with `config` for exactly `tokens` tokens (rows below and above unchanged; the caller
    also empties H200_MANY_PAIRS_CONFIGS, which select_config consults first)."""
    from sglang_ext.kernels import moe

    table = moe.H200_HIDDEN_2880_CONFIGS
    below = tuple(r for r in table if r[0] < tokens)
    above = tuple(r for r in table if r[0] > tokens)
    return below + ((tokens, config),) + above


def moe_row_rows(model_name: str, batch: int, context: int, labels: list, rounds: int, check: int) -> list:
    """One model and inputs: the step captured with the MoE table's row for `batch` tokens, then once per
    candidate (bench_moe.decode_tma_candidates, by label) for exactly that token count; each candidate's graph
    paired against the table's (rounds of 3 replays). The rows sum h / the output in other orders, so the
    logits are compared for closeness, not bits. PDL as the table sets it (on at batch 1..4 only)."""
    from bench_moe import decode_tma_candidates
    from model_step import MODELS, ModelStep, Sharding

    from sglang_ext.kernels import moe

    candidates = decode_tma_candidates()
    table, many_pairs = moe.H200_HIDDEN_2880_CONFIGS, moe.H200_MANY_PAIRS_CONFIGS
    shipped = moe.select_config(batch, MODELS[model_name].num_experts).short()
    model = ModelStep(MODELS[model_name], Sharding(1, 1, 1, 0), batch=batch, context=context)
    inputs = model.decode_inputs(context)
    outs = {}
    base = bc.capture_graph(lambda: outs.__setitem__("table", model.forward(**inputs)))
    base.replay()
    torch.cuda.synchronize()
    reference = outs["table"].clone()
    rows = []
    for label in labels:
        moe.H200_HIDDEN_2880_CONFIGS = table_with_row(batch, candidates[label])
        moe.H200_MANY_PAIRS_CONFIGS = ()
        try:
            assert moe.select_config(batch, MODELS[model_name].num_experts) is candidates[label]
            if candidates[label].short() == shipped:
                raise ValueError(f"--moe-row-ab {label}: that is the table's own row at {batch} tokens")
            graph = bc.capture_graph(lambda: outs.__setitem__("cand", model.forward(**inputs)))
        finally:
            moe.H200_HIDDEN_2880_CONFIGS, moe.H200_MANY_PAIRS_CONFIGS = table, many_pairs
        mismatches = count_mismatches(graph, outs, "cand", reference, check)
        row = ab_row(model_name, batch, context, ("table", "row"), check, mismatches, paired(base, graph, rounds),
                     candidate=label, table_config=shipped,
                     candidate_config=candidates[label].short())
        graph.replay()
        torch.cuda.synchronize()
        row.update(closeness(outs["cand"], reference))
        rows.append(row)
        print(row, flush=True)
        del graph
    del base
    model = None
    outs.clear()
    torch.cuda.empty_cache()
    return rows


def moe_row_markdown(meta: dict, rows: list) -> str:
    lines = ab_head(
        "MoE decode rows in the decode step: the table's against a candidate", meta,
        "Same model and inputs captured with the MoE table's row for the batch's token count, then with a "
        "candidate row (benchmarks/bench_moe.py decode_tma_candidates) for exactly that count. Paired rounds of "
        "3 replays; diff = row - table. The rows sum in other orders: bits are not expected equal (closeness "
        "columns in the second table; on these random-weight models any two summation orders land far apart, "
        "argmax included).", rows, ("table", "table"), ("row", "row"))
    configs = bc.md_table(rows, [("model", "model", None), ("batch", "batch", None), ("candidate", "candidate", None),
                                 ("table's row", "table_config", None), ("candidate's row", "candidate_config", None),
                                 ("logits max abs diff", "logits_max_abs_diff", "{:.3g}"),
                                 ("argmax equal", "argmax_equal", "{:.3f}")])
    return "\n".join(lines + [configs, ""]) + "\n"


# The dense layers as the decode step calls them: qkv on the input norm's FP8 codes, o on attention's bf16 output
GEMV_SHAPES = (("qkv", "prequant"), ("o", "linear"))


def gemv_sweep(batch: int, budget_s: float, iters: int = 20) -> tuple[list, dict]:
    """The dense decode GEMV's candidates at `batch` rows, each layer alone (bench_fp8_gemm.sweep_shape: CUDA
    graphs over enough weight copies to defeat L2). Returns (the sweep's rows, {shape: [(us, config)] fastest
    first}), each config timed in the x form the step calls that shape with (GEMV_SHAPES)."""
    import time

    import bench_fp8_gemm as bf

    mod, fp8 = bf.import_project()
    dev = torch.device("cuda")
    bw, l2 = bf.copy_bandwidth(), bf.l2_bytes()
    deadline = time.time() + budget_s
    rows, ranked = [], {}
    for shape, how in GEMV_SHAPES:
        n, k = bf.SHAPES[shape]
        layer = bf.prepare_shape(fp8, shape, dev, l2, with_bf16=False)
        _, entries = bf.sweep_entries(mod, batch, n, k, dev)
        got = bf.sweep_shape(mod, fp8, shape, layer, batch, iters, deadline, bw)
        assert len(got) == len(entries)
        best: dict = {}
        for r, e in zip(got, entries):
            cfg, form = bf._entry(e)
            if r.get("linear_us") and form == how:
                best[cfg] = r["linear_us"]
        ranked[shape] = sorted(((us, cfg) for cfg, us in best.items()), key=lambda t: t[0])
        rows += got
        del layer
        torch.cuda.empty_cache()
    return rows, ranked


def gemv_candidates(batch: int, ranked: dict, top: int) -> list:
    """(label, {(N, K): config}) for the step A/B: each shape's `top` fastest configs alone that are not the
    table's, then the fastest of each shape together."""
    import bench_fp8_gemm as bf

    from sglang_ext.kernels import fp8_gemm

    out, best = [], {}
    for shape, how in GEMV_SHAPES:
        n, k = bf.SHAPES[shape]
        # split resolved as the sweep's entries are (bench_fp8_gemm.resolve_split), so equal kernels compare equal
        table = bf.resolve_split(fp8_gemm, fp8_gemm.gemm_config(batch, n, k, None, x_prequantized=how == "prequant"),
                                 batch, n, k)  # H200 SM count
        others = [cfg for _, cfg in ranked.get(shape, []) if cfg != table][:top]
        out += [(f"{shape} {cfg.short()}", {(n, k): cfg}) for cfg in others]
        if others:
            best[(n, k)] = others[0]
    if len(best) > 1:
        out.append(("both " + " + ".join(c.short() for c in best.values()), best))
    return out


def gemv_row_rows(model_name: str, batch: int, context: int, candidates: list, rounds: int, check: int) -> list:
    """One model and inputs: the step captured with the dense GEMMs' table configs, then once per candidate
    (gemv_candidates) with those configs for its shapes at `batch` rows (fp8_gemm.gemm_config patched while
    capturing; each candidate must have been asked for, or the A/B would compare the table with itself);
    paired rounds. Other K splits sum in other orders: logits compared for closeness."""
    from model_step import MODELS, ModelStep, Sharding

    from sglang_ext.kernels import fp8_gemm

    shipped = fp8_gemm.gemm_config
    model = ModelStep(MODELS[model_name], Sharding(1, 1, 1, 0), batch=batch, context=context)
    inputs = model.decode_inputs(context)
    outs = {}
    base = bc.capture_graph(lambda: outs.__setitem__("table", model.forward(**inputs)))
    base.replay()
    torch.cuda.synchronize()
    reference = outs["table"].clone()
    rows = []
    for label, override in candidates:
        asked = set()

        def patched(m, n, k, device=None, x_prequantized=False, override=override, asked=asked):
            if m == batch and (n, k) in override:
                asked.add((n, k))
                return override[(n, k)]
            return shipped(m, n, k, device, x_prequantized)

        fp8_gemm.gemm_config = patched
        try:
            graph = bc.capture_graph(lambda: outs.__setitem__("cand", model.forward(**inputs)))
        finally:
            fp8_gemm.gemm_config = shipped
        assert asked == set(override), f"{label}: the step never asked for {set(override) - asked}"
        mismatches = count_mismatches(graph, outs, "cand", reference, check)
        row = ab_row(model_name, batch, context, ("table", "row"), check, mismatches, paired(base, graph, rounds),
                     candidate=label)
        graph.replay()
        torch.cuda.synchronize()
        row.update(closeness(outs["cand"], reference))
        rows.append(row)
        print(row, flush=True)
        del graph
    del base
    model = None
    outs.clear()
    torch.cuda.empty_cache()
    return rows


def gemv_markdown(meta: dict, rows: list, sweep: list) -> str:
    lines = ab_head(
        "Dense FP8 decode GEMV configs in the decode step: the table's against the sweep's fastest", meta,
        "First each dense layer alone at the batch's rows (bench_fp8_gemm.py's decode sweep, CUDA graphs over "
        "weight copies that defeat L2; the five fastest per shape below), then the same model and inputs captured "
        "with the table's configs and with a candidate's for its shape(s) (fp8_gemm.gemm_config patched while "
        "capturing). Paired rounds of 3 replays; diff = row - table. Other K splits sum in other orders: bits are "
        "not expected equal (closeness columns below).", rows, ("table", "table"), ("row", "row"))
    lines += closeness_table(rows)
    for shape, form in GEMV_SHAPES:
        for batch in sorted({r["M"] for r in sweep if r["shape"] == shape}):
            timed = sorted((r for r in sweep if r["shape"] == shape and r["M"] == batch and r.get("linear_us")),
                           key=lambda r: r["linear_us"])
            lines += [f"## {shape} alone at {batch} rows: the five fastest configs in each x form (the step's: "
                      f"{'pre-quantised' if form == 'prequant' else 'bf16 x'})", "",
                      bc.md_table([r for r in timed if r["x"] == form][:5] + [r for r in timed if r["x"] != form][:5],
                                  [("config", "config", None), ("x", "x", None), ("us", "linear_us", "{:.2f}")]), ""]
    return "\n".join(lines) + "\n"


def session17_tables_row(model_name: str, batch: int, context: int, rounds: int, check: int) -> dict:
    """The same model and inputs captured with session 17's decode tables (the MoE's TMA rows gather x by their
    own launch; the dense GEMV at 5..8 rows on the 8-warp 128-wide row for every K) and with today's (no gather
    at 5..128 tokens, MoeConfig.tma_x; o on x_once at 5..8 rows); paired rounds, diff = today - session 17."""
    from dataclasses import replace

    from sglang_ext.kernels import fp8_gemm, moe

    table, many_pairs = moe.H200_HIDDEN_2880_CONFIGS, moe.H200_MANY_PAIRS_CONFIGS
    x_once_blocks = fp8_gemm.X_ONCE_MIN_K_BLOCKS_AT_8_ROWS

    def switch(today):
        if today is False:
            moe.H200_HIDDEN_2880_CONFIGS = tuple((t, replace(c, tma_x=True)) for t, c in table)
            moe.H200_MANY_PAIRS_CONFIGS = tuple((lo, hi, replace(c, tma_x=True)) for lo, hi, c in many_pairs)
            fp8_gemm.X_ONCE_MIN_K_BLOCKS_AT_8_ROWS = 1 << 30
        else:
            moe.H200_HIDDEN_2880_CONFIGS, moe.H200_MANY_PAIRS_CONFIGS = table, many_pairs
            fp8_gemm.X_ONCE_MIN_K_BLOCKS_AT_8_ROWS = x_once_blocks

    return closeness_row(model_name, batch, context, ("s17", "s18"), switch, rounds, check)


def session17_tables_markdown(meta: dict, rows: list) -> str:
    lines = ab_head(
        "Session 18's decode tables against session 17's, in the decode step", meta,
        "Same model and inputs captured with session 17's tables (the MoE's TMA rows gather x in their own launch; "
        "the dense GEMV at 5..8 rows on the 8-warp 128-wide split-K row) and with session 18's (no x gather at "
        "5..128 tokens, MoeConfig.tma_x; o on the x_once kernel at 5..8 rows). Paired rounds of 3 replays; diff = "
        "s18 - s17. o's K splits sum in another order: closeness columns below.", rows, ("s17", "s17"),
        ("s18", "s18"))
    return "\n".join(lines + closeness_table(rows)) + "\n"


def fp8_gemm_backend_row(mode: str, model_name: str, batch: int, context: int, rounds: int, check: int) -> dict:
    """The same model and inputs captured twice: the dense FP8 layers on our kernel (SGLANG_EXT_FP8_GEMM unset)
    vs under SGLANG_EXT_FP8_GEMM=`mode` (sglang_ext/layers/fp8_backend.py: DeepGEMM where that mode sends a GEMM);
    paired rounds. DeepGEMM adds the bias after a bf16 rounding, so bits are compared for closeness only."""
    from sglang_ext.layers import fp8_backend

    def switch(on):
        if on:
            os.environ[fp8_backend.ENV_VAR] = mode
        else:
            os.environ.pop(fp8_backend.ENV_VAR, None)

    return closeness_row(model_name, batch, context, ("ours", mode), switch, rounds, check)


def fp8_gemm_backend_markdown(meta: dict, rows: list, mode: str) -> str:
    lines = ab_head(
        f"The dense FP8 layers on our kernel vs SGLANG_EXT_FP8_GEMM={mode} in the decode step", meta,
        f"Same model and inputs captured twice: our FP8 GEMM for qkv and o vs the backend choice of "
        f"SGLANG_EXT_FP8_GEMM={mode} (sglang_ext/layers/fp8_backend.py; DeepGEMM 1.x from .peers/deepgemm). Paired "
        f"rounds of 3 replays; diff = {mode} - ours. DeepGEMM adds the bias after a bf16 rounding: bits are not "
        "expected equal.", rows, ("ours", "ours"), (mode, mode))
    return "\n".join(lines + closeness_table(rows)) + "\n"


def wide_tile_markdown(meta: dict, rows: list) -> str:
    lines = ab_head(
        "Dense FP8 GEMMs of 17..64 rows: the wide TMA tile in the decode step", meta,
        "Same model and inputs captured twice: the dense GEMMs of 17..64 rows on 32 x 64 tiles with split-K "
        "(narrow, the table before) vs the 64 x 128 TMA tile where N gives >= 32 tiles of 128 rows (wide: qkv, "
        "the lm_head; o keeps the narrow tile). Paired rounds of 3 replays; diff = wide - narrow. The tiles sum "
        "K in other orders: bits are not expected equal (see the closeness columns below).", rows,
        ("narrow", "narrow"), ("wide", "wide"))
    return "\n".join(lines + closeness_table(rows)) + "\n"


def closeness_table(rows: list) -> list:
    """Markdown lines: closeness_row's columns (argmax agreement where the rows carry it)."""
    argmax = [("argmax equal", "argmax_equal", "{:.3f}")] if all("argmax_equal" in r for r in rows) else []
    return [bc.md_table(rows, [("model", "model", None), ("batch", "batch", None),
                               ("logits max abs diff", "logits_max_abs_diff", "{:.3g}"), *argmax]), ""]


# --rope-fusion-ab's picks for the batch-1 full layers at <= 8k, beside the table's own in the main row
ROPE_PICKS = (("c128 v_late", dict(chunk=128, v_late=True)),
              ("c128 v_late r128", dict(chunk=128, v_late=True, max_regs=128)),
              ("c128 r128", dict(chunk=128, max_regs=128)),
              ("c64", dict(chunk=64)),
              ("c64 v_late", dict(chunk=64, v_late=True)))


def ab_table(rows: list, a: tuple, b: tuple) -> str:
    """The A/B rows' table: a / b = (column label, row key stem), e.g. ("plain", "plain") for plain_us
    and tok_s_plain. A "KV table width" column where the rows carry one (--table-widths)."""
    width = [("KV table width", "table_width", None)] if any("table_width" in r for r in rows) else []
    width += [("candidate", "candidate", None)] if any("candidate" in r for r in rows) else []
    return bc.md_table([{**r, "iqr": "{:.1f}..{:.1f}".format(*r["iqr_us"]),
                         "bits": f"{r['bit_checks'] - r['bit_mismatches']}/{r['bit_checks']} equal"} for r in rows],
                       [("model", "model", None), ("batch", "batch", None), ("context", "context", None), *width,
                        (f"{a[0]} us", f"{a[1]}_us", "{:.1f}"), (f"{b[0]} us", f"{b[1]}_us", "{:.1f}"),
                        ("diff us", "diff_us", "{:+.1f}"), ("IQR us", "iqr", None), ("diff %", "diff_pct", "{:+.2f}"),
                        (f"tok/s {a[0]}", f"tok_s_{a[1]}", "{:.0f}"), (f"tok/s {b[0]}", f"tok_s_{b[1]}", "{:.0f}"),
                        ("bits", "bits", None)])


def doc_head(title: str, meta: dict, text: str) -> list:
    """Markdown lines every results file here starts with: title (and GPU), command and date, what it holds."""
    return [f"# {title} ({meta.get('gpu', 'GPU')})", "", f"`{meta['command']}` — {meta.get('date', '')}", "", text, ""]


def ab_head(title: str, meta: dict, text: str, rows: list, a: tuple, b: tuple) -> list:
    """Markdown lines every A/B file starts with: doc_head, then ab_table."""
    return doc_head(title, meta, text) + [ab_table(rows, a, b), ""]


def critical_path_table(cp: list, most: int = 24) -> str:
    """critical_path's list as a markdown table (its first `most` kernels)."""
    return bc.md_table(cp[:most], [("kernel", "name", None), ("calls", "calls", "{:.0f}"),
                                   ("increment us", "increment_us", "{:.1f}"),
                                   ("increment per call", "per_call", "{:.2f}"),
                                   ("duration us", "duration_us", "{:.1f}")])


def critical_path_sections(rows: list, step: str) -> list:
    """Markdown lines: each row's critical path (critical_path's table), titled '<step> step'."""
    lines = []
    for r in rows:
        cp = r.get("critical_path")
        if cp:
            total = sum(k["increment_us"] for k in cp)
            lines += ["", f"## {r['model']} batch {r['batch']}: the {step} step's critical path (profiler, "
                      f"{total:.0f} us of increments)", "",
                      "Increment = a kernel's end minus the previous kernel's end (or its own start after a "
                      "gap): what it adds to the step. Duration includes the time it waited for its "
                      "predecessor after starting early.", "",
                      critical_path_table(cp)]
    return lines


def rope_fusion_markdown(meta: dict, rows: list) -> str:
    lines = ab_head(
        "RoPE + KV write inside the decode attention's launch", meta,
        "PDL on. Same model, inputs and kernels captured twice: rope_store_kv as its own launch before the "
        "attention (unfused) vs RoPE and the KV write inside the decode attention's launch (fused, "
        "kernels/sink_attention.py RopeKV: in the one-shot kernel with the early K/V loads, or in the split "
        "loop). Paired rounds of 3 replays; diff = fused - unfused (median of the per-round differences, "
        "quartiles). Bits: the fused graph's logits against the unfused graph's on every check replay. "
        "KV table width: req_to_token's (a server's is the model's context).",
        rows, ("unfused", "unfused"), ("fused", "fused"))
    pk = [{"model": r["model"], "batch": r["batch"], **v, "iqr": "{:.1f}..{:.1f}".format(*v["iqr_us"])}
          for r in rows for v in r.get("picks", [])]
    if pk:
        lines += ["## Other one-shot picks for the full layers (batch 1), fused, against the unfused graph", "",
                  "rN: register cap (ptxas maxnreg). Logits equal: against the unfused graph's.", "",
                  bc.md_table(pk, [("model", "model", None), ("batch", "batch", None), ("pick", "pick", None),
                                   ("unfused us", "unfused_us", "{:.1f}"), ("fused us", "fused_us", "{:.1f}"),
                                   ("diff us", "diff_us", "{:+.1f}"), ("IQR us", "iqr", None),
                                   ("logits equal", "logits_equal", None)]), ""]
    return "\n".join(lines + critical_path_sections(rows, "fused")) + "\n"


def markdown(meta: dict, rows: list) -> str:
    lines = ab_head(
        "Programmatic dependent launch on the decode step", meta,
        "Same model, inputs and kernels captured twice: plain launches vs programmatic dependents "
        "(kernels/pdl.py). Paired rounds of 3 replays each; diff = PDL - plain (median of the "
        "per-round differences, quartiles in brackets). Bits: the PDL graph's logits against the "
        "plain graph's on every check replay.",
        rows, ("plain", "plain"), ("PDL", "pdl"))
    for r in rows:
        p = r.get("probe_with_pdl")
        if p:
            lines.append(f"- {r['model']} batch {r['batch']}: probe overhead with PDL on {p['overhead_us']:.1f} us = "
                         f"{p['overhead_pct']:.2f} % of {p['off_us']:.1f} us (IQR {p['iqr_us'][0]:.1f}..{p['iqr_us'][1]:.1f} us, "
                         "100 paired rounds)")
    pp = [{"model": r["model"], "batch": r["batch"], **v, "iqr": "{:.1f}..{:.1f}".format(*v["iqr_us"])}
          for r in rows for v in r.get("mlp2_per_pair", [])]
    if pp:
        lines += ["", "## MoE one-shot mlp2 per pair (kernels/moe_decode.py) vs the table's, PDL on", "",
                  "Paired rounds against the table's graph of the same model; logits equal = fraction of "
                  "equal logits (the per-pair kernel sums each output row in its own tile layout).", "",
                  bc.md_table(pp, [("model", "model", None), ("batch", "batch", None), ("mlp2 tile", "tile", None),
                                   ("table us", "table_us", "{:.1f}"), ("per-pair us", "variant_us", "{:.1f}"),
                                   ("diff us", "diff_us", "{:+.1f}"), ("IQR us", "iqr", None),
                                   ("logits equal", "logits_equal", "{:.3f}")])]
    return "\n".join(lines + critical_path_sections(rows, "PDL")) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--models", default="120b,20b")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--check", type=int, default=50)
    ap.add_argument("--mlp2-per-pair", default="", help="block_n:warps,...: also time the MoE's one-shot rows "
                    "with the per-pair mlp2 of these tiles (PDL on), paired against the table")
    ap.add_argument("--no-probe", action="store_true")
    ap.add_argument("--rope-fusion-ab", action="store_true", help="instead: RoPE + KV write in the decode "
                    "attention's launch vs its own launch (PDL on), written to diag_rope_fusion.*")
    ap.add_argument("--wide-tile-ab", action="store_true", help="instead: the dense GEMMs of 17..64 rows on the "
                    "wide TMA tile vs the narrow split-K tile, written to diag_wide_tile.*")
    ap.add_argument("--fp8-gemm-ab", default="", help="instead: the dense FP8 layers on our kernel vs "
                    "SGLANG_EXT_FP8_GEMM=<this mode>, written to diag_fp8_gemm_<mode>.*")
    ap.add_argument("--moe-row-ab", default="", help="instead: candidate MoE rows by label (bench_moe.py "
                    "decode_tma_candidates, comma-separated) for exactly the batch's token count vs the table's row, "
                    "written to diag_moe_row.*")
    ap.add_argument("--session17-ab", action="store_true", help="instead: session 18's decode tables against "
                    "session 17's in the step")
    ap.add_argument("--gemv-ab", action="store_true", help="instead: the dense decode GEMV's sweep at each batch's "
                    "rows (layers alone), then its fastest configs against the table's in the step")
    ap.add_argument("--gemv-top", type=int, default=2, help="--gemv-ab: candidates per shape taken into the step")
    ap.add_argument("--sweep-budget-s", type=float, default=150.0, help="--gemv-ab: time for each batch's sweep")
    ap.add_argument("--table-widths", default="0", help="--rope-fusion-ab: KV table widths to run (0: the "
                    "context; 131072: a server's req_to_token)")
    ap.add_argument("--no-picks", action="store_true", help="--rope-fusion-ab: skip the other one-shot picks")
    ap.add_argument("--families", default="", help="instead: PDL with kernel families launched plainly, "
                    "variants separated by ';', each a comma list or 'none' (e.g. 'none;moe;moe,gemv')")
    ap.add_argument("--no-profile", action="store_true", help="--families: skip the critical paths")
    ap.add_argument("--probe-path", action="store_true", help="instead: the step without and with the probe, "
                    "paired, and where the difference goes (critical paths)")
    ap.add_argument("--probe-variants", default="", help="instead: the probe's step launched each way named "
                    "(comma list of " + ", ".join(PROBE_VARIANTS) + "), round-robin against the probe-off step")
    ap.add_argument("--stem", default="", help="results file stem (default: the mode's)")
    args = ap.parse_args()
    variants = tuple(tuple(int(v) for v in t.split(":")) for t in args.mlp2_per_pair.split(",") if t)
    bc.import_project()
    meta = bc.run_meta("python benchmarks/diag_pdl.py " + " ".join(sys.argv[1:]))
    rows = []
    if args.rope_fusion_ab:
        from sglang_ext.kernels.sink_attention import OneshotPick

        picks = () if args.no_picks else tuple((label, OneshotPick(**kw)) for label, kw in ROPE_PICKS)
        for width in (int(w) for w in args.table_widths.split(",")):
            for m in args.models.split(","):
                for b in (int(x) for x in args.batches.split(",")):
                    rows.append(rope_fusion_row(m, b, args.context, args.rounds, args.check, picks, width))
                    print({k: v for k, v in rows[-1].items() if k != "critical_path"}, flush=True)
        bc.write_results(args.out, args.stem or "diag_rope_fusion", meta, rows, rope_fusion_markdown(meta, rows))
        print(rope_fusion_markdown(meta, rows))
        return
    if args.moe_row_ab:
        labels = args.moe_row_ab.split(",")
        for m in args.models.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                rows += moe_row_rows(m, b, args.context, labels, args.rounds, args.check)
                bc.write_results(args.out, args.stem or "diag_moe_row", meta, rows, moe_row_markdown(meta, rows))
        print(moe_row_markdown(meta, rows))
        return
    if args.session17_ab:
        for m in args.models.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                rows.append(session17_tables_row(m, b, args.context, args.rounds, args.check))
                print(rows[-1], flush=True)
                md = session17_tables_markdown(meta, rows)
                bc.write_results(args.out, args.stem or "diag_session17_tables", meta, rows, md)
        print(md)
        return
    if args.gemv_ab:
        sweep_rows = []
        for b in (int(x) for x in args.batches.split(",")):
            got, ranked = gemv_sweep(b, args.sweep_budget_s)
            sweep_rows += got
            candidates = gemv_candidates(b, ranked, args.gemv_top)
            for m in args.models.split(","):
                rows += gemv_row_rows(m, b, args.context, candidates, args.rounds, args.check)
                md = gemv_markdown(meta, rows, sweep_rows)
                bc.write_results(args.out, args.stem or "diag_gemv_row", {**meta, "sweep": sweep_rows}, rows, md)
        print(md)
        return
    if args.fp8_gemm_ab:
        for m in args.models.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                rows.append(fp8_gemm_backend_row(args.fp8_gemm_ab, m, b, args.context, args.rounds, args.check))
                print(rows[-1], flush=True)
        md = fp8_gemm_backend_markdown(meta, rows, args.fp8_gemm_ab)
        bc.write_results(args.out, args.stem or f"diag_fp8_gemm_{args.fp8_gemm_ab}", meta, rows, md)
        print(md)
        return
    if args.probe_variants:
        for m in args.models.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                rows.append(probe_variants_row(m, b, args.context, args.rounds, args.probe_variants.split(",")))
                md = probe_variants_markdown(meta, rows)
                bc.write_results(args.out, args.stem or "diag_probe_variants", meta, rows, md)
                print(md, flush=True)
        return
    if args.probe_path:
        for m in args.models.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                rows.append(probe_path_row(m, b, args.context, args.rounds))
                md = probe_path_markdown(meta, rows)
                bc.write_results(args.out, args.stem or "diag_probe_path", meta, rows, md)
                print(md, flush=True)
        return
    if args.families:
        variants = [frozenset() if v.strip() == "none" else frozenset(f.strip() for f in v.split(","))
                    for v in args.families.split(";")]
        for m in args.models.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                rows += families_rows(m, b, args.context, variants, args.rounds, args.check, not args.no_profile)
                md = families_markdown(meta, rows)
                bc.write_results(args.out, args.stem or "diag_pdl_families", meta, rows, md)
                print(md, flush=True)
        return
    if args.wide_tile_ab:
        for m in args.models.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                rows.append(wide_tile_row(m, b, args.context, args.rounds, args.check))
                print(rows[-1], flush=True)
        bc.write_results(args.out, args.stem or "diag_wide_tile", meta, rows, wide_tile_markdown(meta, rows))
        print(wide_tile_markdown(meta, rows))
        return
    for m in args.models.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            rows.append(step_row(m, b, args.context, args.rounds, args.check, probe=b == 1 and not args.no_probe,
                                 mlp2_variants=variants if b <= 4 else ()))
            print(rows[-1], flush=True)
    bc.write_results(args.out, args.stem or "diag_pdl", meta, rows, markdown(meta, rows))
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
