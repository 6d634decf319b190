"""SingProbe decode-step cost on one H200 at the real gpt-oss-120b dims (random weights).

Two implementations of one probe decode step for B rows (B requests at context 8192, window 2048):

* current: the 3 taps as eager torch (`rms_normalize(h).to(bf16)` into the features buffer),
  one cuBLAS q|k|v GEMM, K|V scattered into the pool, `probe_attention` (split + combine),
  `probe_tail` (2 launches) -- what sglang_ext/probe_runtime.py runs today;
* new: `probe_tap_normalize` x 3 (one launch per tap) + `probe_decode_step` (3 launches:
  split-K GEMV writing q and K|V, split attention with a last-arriver merge, o_proj spread
  over programs with a last-arriver norm/classifier/sigmoid), kernels/probe_step.py.

Timed as CUDA-graph replays (median of many, after warm-up) of a graph that runs the step
`--repeat` times back to back. L2: the probe's 11.6 MB of weights and a batch-1 K|V window
(0.5 MB) fit the H200's 50 MB L2, so back-to-back steps on the same buffers would be served
from L2, which a real decode step (36 layers, ~6 GB read between two probe steps) never
allows. The "cold" columns therefore rotate `--copies` independent sets of weights,
features, hidden rows and requests (copies x 11.6 MB > L2) so each step reads HBM; the "warm"
columns (same buffers every repeat) are printed beside them for comparison only.

Ceilings measured in the same run: device copy bandwidth, and from it the bytes floor of a
step (probe weights + the K|V window each row reads + the tapped rows). Overheads are quoted
against the measured gpt-oss-120b TP1 decode step of benchmarks/results/bench_decode.md
(batch 1 / 8 / 32) and against the modelled one (bytes / copy bandwidth) at batch 128.

    python -m benchmarks.bench_probe --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from benchmarks import bench_common as bc  # noqa: E402

bc.import_project()
from sglang_ext.kernels.probe_attention import probe_attention  # noqa: E402
from sglang_ext.kernels.probe_step import attn_splits, probe_decode_step, probe_tap_normalize, qkv_config  # noqa: E402
from sglang_ext.kernels.probe_tail import probe_tail  # noqa: E402
from sglang_ext.probe.config import ProbeConfig  # noqa: E402
from sglang_ext.probe.model import SingProbeHead, rms_normalize  # noqa: E402

GPT_OSS_120B_DECODE_BYTES_BS1 = 6.03e9  # issue 7: weights + KV read per decode step, batch 1, ctx 8192
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def measured_120b_step_ms() -> dict:
    """The committed gpt-oss-120b TP1 decode steps at context 8192 (bench_decode.json), by batch."""
    try:
        with open(os.path.join(RESULTS, "bench_decode.json")) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError):
        return {}
    return {r["batch"]: r["step_ms"] for r in rows
            if r.get("model") == "gpt-oss-120b" and r.get("config") == "EP1 DP1 TP1"
            and r.get("kind") == "measured" and r.get("context") == 8192 and "step_ms" in r}
HIDDEN, TAPS, HEADS, HEAD_DIM, LABELS, WINDOW = 2880, 3, 8, 64, 10, 2048


def graph_time(calls, iters=40):
    """Per-call seconds of `calls` captured back to back in one CUDA graph: one graph of one small
    step would mostly time the graph launch (~15 us), not the step."""
    return bc.graph_time_calls(calls, iters=iters)


class Copy:
    """One independent set of probe weights, tapped rows and requests (its own pool slots)."""

    def __init__(self, cfg, batch, ctx, kv_pool, first_req, req_to_token):
        head = SingProbeHead(cfg).to(device="cuda", dtype=torch.bfloat16).requires_grad_(False)
        for p in head.parameters():
            p.data.normal_(0, 0.02)
        head.norm.weight.data.fill_(1.0)
        self.head = head
        self.w_qkv = torch.cat([head.proj_q.weight, head.proj_k.weight, head.proj_v.weight])
        self.hidden = [torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16) * 10.0 ** (i - 1)
                       for i in range(TAPS)]
        self.features = torch.empty(batch, HIDDEN * TAPS, device="cuda", dtype=torch.bfloat16)
        self.req_idx = torch.arange(first_req, first_req + batch, device="cuda", dtype=torch.int64)
        self.row_pos = torch.full((batch,), ctx - 1, device="cuda", dtype=torch.int64)
        self.out_loc = req_to_token[first_req : first_req + batch, ctx - 1].long()
        self.out_cur = torch.zeros(batch, LABELS, device="cuda", dtype=torch.float32)
        self.out_new = torch.zeros(batch, LABELS, device="cuda", dtype=torch.float32)
        self.kv_pool, self.req_to_token = kv_pool, req_to_token

    def taps_current(self):
        for i, h in enumerate(self.hidden):
            self.features[:, i * HIDDEN : (i + 1) * HIDDEN] = rms_normalize(h).to(torch.bfloat16)

    def taps_new(self):
        for i, h in enumerate(self.hidden):
            probe_tap_normalize(h, self.features, i * HIDDEN)

    def step_current(self):
        qkv = torch.nn.functional.linear(self.features, self.w_qkv)
        q = qkv[:, : HEADS * HEAD_DIM].unflatten(-1, (HEADS, HEAD_DIM))
        self.kv_pool[self.out_loc] = qkv[:, HEADS * HEAD_DIM :]
        ctx_ = probe_attention(q, self.kv_pool, self.req_to_token, self.req_idx, self.row_pos, WINDOW, 0.125)
        h = self.head
        probe_tail(q, ctx_, h.o_proj.weight, h.norm.weight, h.classifier.weight, h.classifier.bias, out=self.out_cur)

    def step_new(self, **kw):
        h = self.head
        probe_decode_step(self.features, self.w_qkv, self.kv_pool, self.out_loc, self.req_to_token, self.req_idx,
                          self.row_pos, WINDOW, 0.125, h.o_proj.weight, h.norm.weight, h.classifier.weight,
                          h.classifier.bias, self.out_new, HEADS, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--copies", type=int, default=8, help="rotated weight/request sets (cold-L2 timing)")
    ap.add_argument("--repeat", type=int, default=16, help="steps per graph replay")
    ap.add_argument("--sweep", default="1,8", help="batches at which to sweep the q|k|v GEMV tiling ('' = none)")
    ap.add_argument("--sweep-attn", default="", help="batches at which to sweep the attention's key block and "
                    "splits ('' = none)")
    ap.add_argument("--stem", default="probe_decode_h200", help="result file names (<stem>.json / .md)")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = ProbeConfig.from_dict({
        "architectures": ["SingProbeAttnModel"], "model_type": "sing_probe_attn", "hidden_size": HIDDEN,
        "base_model_layer_ids": [10, 22, 34], "num_attention_heads": HEADS, "head_dim": HEAD_DIM,
        "sliding_window": WINDOW, "num_labels": LABELS, "base_model_name": "openai/gpt-oss-120b",
        "torch_dtype": "bfloat16"})
    t_start = time.time()
    measured_steps = measured_120b_step_ms()
    bw = bc.copy_bandwidth()
    weight_bytes = None
    rows, sweep_rows, attn_rows = [], [], []
    sweep_batches = {int(b) for b in args.sweep.split(",") if b}
    attn_batches = {int(b) for b in args.sweep_attn.split(",") if b}
    for batch in [int(b) for b in args.batches.split(",")]:
        ctx, n_copies = args.context, args.copies
        n_req = n_copies * batch
        slots = n_req * ctx + 1  # slot 0: the padding slot
        kv_pool = torch.randn(slots, 2 * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        req_to_token = (torch.randperm(slots - 1, device="cuda") + 1).view(n_req, ctx).to(torch.int32)
        copies = [Copy(cfg, batch, ctx, kv_pool, c * batch, req_to_token) for c in range(n_copies)]
        weight_bytes = sum(p.numel() * p.element_size() for p in copies[0].head.parameters())
        reps = args.repeat

        def cold(fn_name, **kw):
            return [(lambda c=c: getattr(c, fn_name)(**kw)) for c in (copies * reps)[:reps]]

        def both(c, tap, step, **kw):
            def fn():
                getattr(c, tap)()
                getattr(c, step)(**kw)
            return fn

        # Correctness at full size: the new step against the current one on the same inputs.
        c0 = copies[0]
        c0.taps_current(); feats_cur = c0.features.clone()
        c0.taps_new()
        tap_diff = (c0.features.float() - feats_cur.float()).abs().max().item()
        c0.step_current()
        c0.step_new()
        torch.cuda.synchronize()
        prob_diff = (c0.out_new - c0.out_cur).abs().max().item()
        full_cur = [both(c, "taps_current", "step_current") for c in (copies * reps)[:reps]]
        full_new = [both(c, "taps_new", "step_new") for c in (copies * reps)[:reps]]
        r = {"batch": batch, "window": WINDOW, "context": ctx, "copies": n_copies,
             "current_cold_us": graph_time(full_cur) * 1e6,
             "new_cold_us": graph_time(full_new) * 1e6,
             "current_warm_us": graph_time([both(c0, "taps_current", "step_current")] * reps) * 1e6,
             "new_warm_us": graph_time([both(c0, "taps_new", "step_new")] * reps) * 1e6,
             "current_taps_cold_us": graph_time(cold("taps_current")) * 1e6,
             "new_taps_cold_us": graph_time(cold("taps_new")) * 1e6,
             "new_step_no_taps_cold_us": graph_time(cold("step_new")) * 1e6,
             "current_step_no_taps_cold_us": graph_time(cold("step_current")) * 1e6,
             "max_prob_diff_new_vs_current": prob_diff, "max_feature_diff_new_vs_current": tap_diff}
        kv_bytes = batch * WINDOW * 2 * HEAD_DIM * 2
        tap_bytes = TAPS * batch * HIDDEN * 2 * 2  # read the residual row, write the feature row
        floor_bytes = weight_bytes + kv_bytes + tap_bytes
        kv_per_seq = (18 * 8192 + 18 * 128) * 8 * 64 * 2 * 2  # base model KV read per extra sequence
        modelled_s = (GPT_OSS_120B_DECODE_BYTES_BS1 + (batch - 1) * kv_per_seq) / bw
        measured_ms = measured_steps.get(batch)
        r.update({
            "bytes_floor": floor_bytes, "floor_us": floor_bytes / bw * 1e6,
            "new_cold_vs_floor": r["new_cold_us"] / (floor_bytes / bw * 1e6),
            "speedup_cold": r["current_cold_us"] / r["new_cold_us"],
            "modelled_120b_decode_step_us": modelled_s * 1e6,
            "new_pct_of_modelled_step": r["new_cold_us"] / (modelled_s * 1e6) * 100,
            "measured_120b_decode_step_us": measured_ms * 1e3 if measured_ms else None,
            "new_pct_of_measured_step": r["new_cold_us"] / (measured_ms * 10) if measured_ms else None,
            "current_pct_of_measured_step": r["current_cold_us"] / (measured_ms * 10) if measured_ms else None,
        })
        steps = cold("step_new")
        r["kernels_us"] = {name: us / len(steps) for name, us in
                           bc.kernel_times(lambda: [step() for step in steps], calls=1).items()}
        rows.append(r)
        print(json.dumps(r), flush=True)
        if batch in sweep_batches:
            def splits_run(bn, bk, **kw):  # what qkv_config makes of a request (no empty splits)
                return qkv_config(batch, 640, HIDDEN * TAPS, torch.device("cuda"), block_k=bk, block_n=bn,
                                  **kw)["SPLITS"]

            tiles = [(bn, bk, splits_run(bn, bk, programs_per_sm=pps))
                     for bn, bk, pps in ((64, 64, 2), (64, 64, 4), (64, 64, 8), (32, 64, 4), (32, 128, 4),
                                         (64, 128, 4), (128, 64, 4))]
            if batch > 16:
                # Every split's fp32 partials ([splits, T, 640]) are written and summed back by one last
                # arriver a tile, so past batch 16 fewer splits may beat more streaming programs.
                tiles += [(bn, bk, splits_run(bn, bk, splits=sp)) for bn, bk in ((64, 64), (32, 128), (64, 128))
                          for sp in (2, 4, 8, 16)]
            for bn, bk, splits in dict.fromkeys(tiles):  # each configuration that runs, once
                t = graph_time(cold("step_new", qkv_block_n=bn, qkv_block_k=bk, qkv_splits=splits))
                sweep_rows.append({"batch": batch, "qkv_block_n": bn, "qkv_block_k": bk, "qkv_splits": splits,
                                   "new_step_no_taps_cold_us": t * 1e6})
                print(json.dumps(sweep_rows[-1]), flush=True)
        if batch in attn_batches:
            for block_n_attn in (32, 64, 128):
                # the launcher's own split count beside powers of two (9 at 64 rows, 5 at 128 on an H200)
                own = attn_splits(batch, WINDOW, torch.device("cuda"), block_n_attn)
                for splits in sorted({1, 2, 4, 8, 16, own}):
                    t = graph_time(cold("step_new", block_n_attn=block_n_attn, attn_num_splits=splits))
                    attn_rows.append({"batch": batch, "block_n_attn": block_n_attn, "attn_splits": splits,
                                      "new_step_no_taps_cold_us": t * 1e6})
                    print(json.dumps(attn_rows[-1]), flush=True)
        copies = kv_pool = req_to_token = c0 = full_cur = full_new = None  # free before the next batch
        torch.cuda.empty_cache()

    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "copy_bandwidth_TBps": bw / 1e12,
            "probe_weight_bytes": weight_bytes, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "python -m benchmarks.bench_probe " + " ".join(sys.argv[1:]), "host": platform.node(),
            "copies": args.copies, "repeat": args.repeat, "wall_s": time.time() - t_start}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.stem + ".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "qkv_sweep": sweep_rows, "attn_sweep": attn_rows}, f, indent=2)
    lines = [
        "# SingProbe decode step on one H200 (gpt-oss-120b probe dims, random weights)", "",
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. Copy bandwidth "
        f"{bw / 1e12:.2f} TB/s. Probe weights {weight_bytes / 1e6:.1f} MB (bf16). Window {WINDOW}, context "
        f"{args.context}. Times per step **including the 3 taps**: medians of 40 replays of a CUDA graph running "
        f"{args.repeat} steps back to back. *Cold*: the steps rotate {args.copies} independent weight/request "
        "sets (more than L2 holds), as inside a real decode step; *warm*: the same buffers every time (L2-"
        "flattered, for comparison only). Decode step: measured gpt-oss-120b TP1 step (bench_decode.md) where "
        "one exists, else modelled (bytes / copy bandwidth).", "",
        "| batch | current, cold (us) | new, cold (us) | speedup | new, warm (us) | current, warm (us) | "
        "new taps (us) | current taps (us) | bytes floor (us) | new / floor | 120b step (us) | new % of step | "
        "current % of step | max abs dp |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        meas = r["measured_120b_decode_step_us"]
        step_us = meas if meas else r["modelled_120b_decode_step_us"]
        lines.append(
            f"| {r['batch']} | {r['current_cold_us']:.1f} | {r['new_cold_us']:.1f} | {r['speedup_cold']:.2f}x | "
            f"{r['new_warm_us']:.1f} | {r['current_warm_us']:.1f} | {r['new_taps_cold_us']:.1f} | "
            f"{r['current_taps_cold_us']:.1f} | {r['floor_us']:.1f} | {r['new_cold_vs_floor']:.1f}x | "
            f"{step_us:.0f}{'' if meas else ' (modelled)'} | {r['new_cold_us'] / step_us * 100:.3f} | "
            f"{r['current_cold_us'] / step_us * 100:.3f} | {r['max_prob_diff_new_vs_current']:.1e} |")
    if sweep_rows:
        lines += ["", "q|k|v split-K tiling sweep (new step without taps, cold):", "",
                  "| batch | BLOCK_N | BLOCK_K | splits | us |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {s['batch']} | {s['qkv_block_n']} | {s['qkv_block_k']} | {s['qkv_splits']} | "
                  f"{s['new_step_no_taps_cold_us']:.1f} |" for s in sweep_rows]
    kernels = list(dict.fromkeys(k for r in rows for k in r["kernels_us"]))  # every batch's, first seen first
    lines += ["", "Device time per step by kernel (new step without taps, eager under the profiler, cold):", "",
              "| batch | " + " | ".join(kernels) + " |", "|---:|" + "---:|" * len(kernels)]
    lines += [f"| {r['batch']} | " + " | ".join(f"{r['kernels_us'].get(k, 0.0):.1f}" for k in kernels) + " |"
              for r in rows]
    if attn_rows:
        lines += ["", "Attention key block and splits sweep (new step without taps, cold; q|k|v at the launcher's "
                  "default tile):", "", "| batch | key block | splits | us |", "|---:|---:|---:|---:|"]
        lines += [f"| {s['batch']} | {s['block_n_attn']} | {s['attn_splits']} | {s['new_step_no_taps_cold_us']:.1f} |"
                  for s in attn_rows]
    lines += ["", f"Command: `{meta['command']}` ({meta['wall_s']:.0f} s)"]
    with open(os.path.join(args.out, args.stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
