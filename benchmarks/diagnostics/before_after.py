"""A restructuring changes no number: the harness of two or more checkouts of this project, in one process
each, on the same GPU, in one call, gives the logits and times side by side.

Per checkout (`--trees NAME=PATH ...`, e.g. `git archive` snapshots before and after a change): the model-step
harness (benchmarks/model_step.py, that checkout's own) at full size with its seeded random weights, batch 1;
the logits of one decode step at `--context` and of a `--prefill` token prefill, saved and compared bit for bit
with the first checkout's; the decode step's CUDA-graph replay time and the prefill's time, each the median of
`--repeats` runs. Weights are drawn by each checkout's own code: logits compare only between checkouts that
draw them alike (the report says which pairs are bit-equal; a change of the harness itself breaks that, by
design, and only the times compare then).

    python benchmarks/diagnostics/before_after.py --trees before=/tmp/a after=/tmp/b --model 20b --out OUT
    python benchmarks/diagnostics/before_after.py --render OUT/before_after.json   # its Markdown again
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, statistics, sys
# this checkout's modules, not an installed sglang-ext's (an editable install maps sglang_ext.* by a finder)
sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "").lower()]
sys.path.insert(0, ".")
import torch
from benchmarks import bench_common as bc
from benchmarks import model_step as ms
import os, sglang_ext.kernels, sglang_ext.layers
for pkg in (sglang_ext.kernels, sglang_ext.layers):  # an installed sglang_ext would compare itself with itself
    where = os.path.realpath(list(pkg.__path__)[0])
    if not where.startswith(os.path.realpath(".") + os.sep):
        raise SystemExit(f"{pkg.__name__} resolves to {where}, not to this checkout: run outside an environment "
                         "with sglang-ext installed")
model, context, prefill, repeats, out, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
layout = ms.parallel_layout(1, 1, 1, 0) if hasattr(ms, "parallel_layout") else ms.Sharding(1, 1, 1, 0)
torch.manual_seed(0)
step = ms.ModelStep(ms.MODELS[model], layout, batch=1, context=max(context, prefill), swa_slots=max(context, prefill),
                    device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
torch.manual_seed(1)
dec = step.decode_inputs(context)
torch.manual_seed(2)
pre = step.prefill_inputs(prefill)
with torch.no_grad():
    logits = {"prefill": step.forward(**pre).float().cpu(), "decode": step.forward(**dec).float().cpu()}
    if device == "cuda":
        graph = bc.capture_graph(lambda: step.forward(**dec))
        decode_ms = [bc.graph_time(graph, iters=50) * 1e3 for _ in range(repeats)]
    else:
        decode_ms = [bc.event_time(lambda: step.forward(**dec), iters=2, warmup=1, device="cpu") * 1e3 for _ in range(repeats)]
    prefill_ms = [bc.event_time(lambda: step.forward(**pre), iters=3, warmup=1, device=device) * 1e3 for _ in range(repeats)]
torch.save(logits, out + ".pt")
gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
json.dump({"decode_ms": decode_ms, "prefill_ms": prefill_ms, "gpu": gpu}, open(out + ".json", "w"))
"""


def markdown(report: dict) -> str:
    rows = report["rows"]
    ref = rows[0]["tree"]
    lines = [f"# Before / after: the {report['model']} harness of each checkout, one GPU, one call", "",
             f"`{report['command']}` on {rows[0].get('gpu', '?')}; decode at context {report['context']} (CUDA graph "
             f"replay), prefill of {report['prefill']} tokens, batch 1, median of each run's times.", ""]
    lines += [f"- {name}: {what}" for name, what in report.get("trees_described", {}).items()]
    lines += ["", f"| tree | decode ms | prefill ms | decode logits = {ref} | prefill logits = {ref} |",
              "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tree']} | error | | | |")
            continue
        same = lambda part: ("reference" if r is rows[0] else  # noqa: E731
                             "bit-equal" if r[f"{part}_logits_bit_equal_to_{ref}"]
                             else f"differ (max {r[f'{part}_logits_max_abs_diff']:.3g})")
        lines.append(f"| {r['tree']} | {r['decode_ms']:.4f} | {r['prefill_ms']:.2f} | {same('decode')} | "
                     f"{same('prefill')} |")
    if report.get("notes"):
        lines += [""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--render", help="write the Markdown beside this before_after.json and stop")
    ap.add_argument("--trees", nargs="+", help="NAME=PATH, the first is the reference")
    ap.add_argument("--model", default="20b")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="on this CPU, torch path, no graphs (a check of the script)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            report = json.load(f)
        with open(os.path.splitext(args.render)[0] + ".md", "w") as f:
            f.write(markdown(report))
        return
    if not args.trees or not args.out:
        ap.error("--trees and --out are needed (or --render)")
    os.makedirs(args.out, exist_ok=True)
    import torch

    rows, first = [], None
    for item in args.trees:
        name, path = item.split("=", 1)
        stem = os.path.join(os.path.abspath(args.out), f"before_after_{name}")
        p = subprocess.run([sys.executable, "-c", WORKER, args.model, str(args.context), str(args.prefill),
                            str(args.repeats), stem, "cpu" if args.cpu else "cuda"], cwd=path, capture_output=True, text=True)
        if p.returncode:
            rows.append({"tree": name, "error": p.stderr[-2000:]})
            continue
        got = json.load(open(stem + ".json"))
        logits = torch.load(stem + ".pt")
        row = {"tree": name, "gpu": got["gpu"], "decode_ms": statistics.median(got["decode_ms"]),
               "decode_ms_runs": got["decode_ms"], "prefill_ms": statistics.median(got["prefill_ms"]),
               "prefill_ms_runs": got["prefill_ms"]}
        if first is None:
            first = (name, logits)
        else:
            for part in ("decode", "prefill"):
                row[f"{part}_logits_bit_equal_to_{first[0]}"] = bool(torch.equal(logits[part], first[1][part]))
                row[f"{part}_logits_max_abs_diff"] = float((logits[part] - first[1][part]).abs().max())
        rows.append(row)
    report = {"command": " ".join(sys.argv), "model": args.model, "context": args.context, "prefill": args.prefill,
              "rows": rows}
    with open(os.path.join(args.out, "before_after.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "before_after.md"), "w") as f:
        f.write(markdown(report))
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if not k.endswith("_runs")}))


if __name__ == "__main__":
    main()
