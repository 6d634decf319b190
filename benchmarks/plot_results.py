"""Plots and the summary of the model-step benchmarks, from their committed JSON.

  decode_cost_<model>.png : tok/s per user vs $ per million output tokens, one line per
                            configuration, contexts 8192 and 32768 side by side (measured
                            lines solid, modelled dashed), points labelled by batch
  prefill_latency.png     : prefill latency by input length, one line per TP degree and model
  summary.md              : the best configuration per regime (batch 1 latency, cheapest
                            output token at >= 50 tok/s per user, cheapest input token)

    pip install -e '.[bench]' && python -m benchmarks.plot_results --results benchmarks/results
"""

from __future__ import annotations

import argparse
import glob
import json
import os


def load_rows(results: str, prefix: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(results, f"{prefix}*.json"))):
        with open(path) as f:
            data = json.load(f)
        date = (data.get("meta") or {}).get("date", "")
        for r in data.get("rows", []):
            rows.append({**r, "source": os.path.basename(path), "run_date": date})
    return rows


def dedupe(rows: list[dict], key_fields: tuple) -> list[dict]:
    """A measured row replaces a modelled one of the same configuration and shape; between rows of
    the same kind the newer run wins (a re-run of some rows after a kernel change)."""
    best = {}
    for r in rows:
        key = tuple(r.get(k) for k in key_fields)
        old = best.get(key)
        if (old is None or (old.get("kind") == "modelled" and r.get("kind") == "measured")
                or (old.get("kind") == r.get("kind") and r.get("run_date", "") > old.get("run_date", ""))):
            best[key] = r
    return list(best.values())


def plot_decode(rows: list[dict], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for model in sorted({r["model"] for r in rows}):
        contexts = sorted({r["context"] for r in rows if r["model"] == model})
        fig, axes = plt.subplots(1, len(contexts), figsize=(6.5 * len(contexts), 5), squeeze=False)
        for ax, ctx in zip(axes[0], contexts):
            sel = [r for r in rows if r["model"] == model and r["context"] == ctx]
            for (config, kind) in sorted({(r["config"], r["kind"]) for r in sel}):
                pts = sorted((r for r in sel if r["config"] == config and r["kind"] == kind), key=lambda r: r["batch"])
                xs = [r["dollars_per_M_output"] for r in pts]
                ys = [r["tok_s_per_user"] for r in pts]
                line, = ax.plot(xs, ys, "-" if kind != "modelled" else "--", marker="o",
                                label=f"{config} ({kind})")
                for r in pts:
                    ax.annotate(str(r["batch"]), (r["dollars_per_M_output"], r["tok_s_per_user"]), fontsize=7,
                                color=line.get_color(), xytext=(3, 3), textcoords="offset points")
            ax.set_xscale("log")
            ax.set_xlabel(r"\$ per million output tokens (\$3.00 per H200-hour)")
            ax.set_ylabel("decode tok/s per user")
            ax.set_title(f"{model}, context {ctx} (labels: batch)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out, f"decode_cost_{model}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_prefill(rows: list[dict], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for (model, config, kind) in sorted({(r["model"], r["config"], r["kind"]) for r in rows}):
        pts = sorted((r for r in rows if (r["model"], r["config"], r["kind"]) == (model, config, kind)),
                     key=lambda r: r["length"])
        ax.plot([r["length"] for r in pts], [r["latency_ms"] for r in pts], "-" if kind != "modelled" else "--",
                marker="o", label=f"{model} {config} ({kind})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("input tokens (batch 1)")
    ax.set_ylabel("prefill latency (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "prefill_latency.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def model_error(rows: list[dict], key_fields: tuple, value: str) -> list[str]:
    """Where a configuration was both modelled (one GPU) and measured: how far the model was off."""
    modelled = {tuple(r.get(k) for k in key_fields): r for r in rows if r.get("kind") == "modelled"}
    lines = []
    for r in rows:
        if r.get("kind") != "measured":
            continue
        m = modelled.get(tuple(r.get(k) for k in key_fields))
        if m is not None:
            err = 100 * (m[value] - r[value]) / r[value]
            # the run dates: a measured row older than the modelled one was taken with older kernels
            lines.append("| " + " | ".join(str(r.get(k)) for k in key_fields) +
                         f" | {r[value]:.3f} | {m[value]:.3f} | {err:+.1f}% | {r.get('run_date', '')[:16]} / "
                         f"{m.get('run_date', '')[:16]} |")
    if not lines:
        return []
    head = ("| " + " | ".join(key_fields) + f" | measured {value} | modelled {value} | model error "
            "| run dates (measured / modelled) |")
    return [head, "|" + "---|" * (len(key_fields) + 4)] + lines


def summary(decode: list[dict], prefill: list[dict], raw_decode=(), raw_prefill=()) -> str:
    lines = ["# Best configuration per regime", "",
             "From the committed bench_decode*/bench_prefill* results (measured rows preferred over modelled "
             "ones of the same shape; 'modelled' = rank 0's shard timed + modelled collectives).", ""]
    for model in sorted({r["model"] for r in decode}):
        for ctx in sorted({r["context"] for r in decode if r["model"] == model}):
            sel = [r for r in decode if r["model"] == model and r["context"] == ctx]
            b1 = [r for r in sel if r["batch"] == 1]
            if b1:
                best = max(b1, key=lambda r: r["tok_s_per_user"])
                lines.append(f"- {model}, context {ctx}, lowest latency (batch 1): **{best['config']}** "
                             f"({best['kind']}) {best['tok_s_per_user']:.0f} tok/s per user, "
                             f"${best['dollars_per_M_output']:.2f}/M")
            fast = [r for r in sel if r["tok_s_per_user"] >= 50]
            if fast:
                best = min(fast, key=lambda r: r["dollars_per_M_output"])
                lines.append(f"- {model}, context {ctx}, cheapest output at >= 50 tok/s per user: "
                             f"**{best['config']}** batch {best['batch']} ({best['kind']}) "
                             f"${best['dollars_per_M_output']:.3f}/M at {best['tok_s_per_user']:.0f} tok/s per user")
    for model in sorted({r["model"] for r in prefill}):
        sel = [r for r in prefill if r["model"] == model]
        for length in sorted({r["length"] for r in sel}):
            at = [r for r in sel if r["length"] == length]
            fastest = min(at, key=lambda r: r["latency_ms"])
            cheapest = min(at, key=lambda r: r["dollars_per_M_input"])
            # eager calls of a few thousand tokens are partly the host's enqueue (bench_prefill.py --graph)
            graphs = "".join(f"; {r['config']} as one CUDA graph {r['graph_ms']:.0f} ms" for r in at if r.get("graph_ms"))
            lines.append(f"- {model} prefill {length} tokens: fastest **{fastest['config']}** "
                         f"{fastest['latency_ms']:.0f} ms ({fastest['kind']}); cheapest **{cheapest['config']}** "
                         f"${cheapest['dollars_per_M_input']:.4f}/M" + graphs)
    err_d = model_error(list(raw_decode), ("model", "config", "context", "batch"), "step_ms")
    err_p = model_error(list(raw_prefill), ("model", "config", "length"), "latency_ms")
    if err_d or err_p:
        lines += ["", "## How far the performance model was off (configurations both modelled and measured)", ""]
        lines += err_d + ([""] if err_d and err_p else []) + err_p
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    every_decode = [r for r in load_rows(args.results, "bench_decode") if "step_ms" in r]
    # The served default (bf16 LM head) picks the regimes; the opt-in FP8 head gets its own lines
    raw_decode = [r for r in every_decode if r.get("lm_head", "bf16") == "bf16"]
    fp8_head = dedupe([r for r in every_decode if r.get("lm_head") == "fp8"], ("model", "config", "context", "batch"))
    raw_prefill = [r for r in load_rows(args.results, "bench_prefill") if "latency_ms" in r]
    decode = dedupe(raw_decode, ("model", "config", "context", "batch"))
    prefill = dedupe(raw_prefill, ("model", "config", "length"))
    written = []
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the GPU image has none: the summary still follows the results, the PNGs wait
        print("matplotlib absent (pip install -e '.[bench]'): PNGs not redrawn")
    else:
        if decode:
            written += plot_decode(decode, args.results)
        if prefill:
            written += plot_prefill(prefill, args.results)
    path = os.path.join(args.results, "summary.md")
    with open(path, "w") as f:
        f.write(summary(decode, prefill, raw_decode, raw_prefill))
        if fp8_head:
            f.write("\n## With the opt-in FP8 LM head (SGLANG_EXT_FP8_LM_HEAD=1: changes logits)\n\n")
            for r in sorted(fp8_head, key=lambda r: (r["model"], r["context"], r["batch"])):
                f.write(f"- {r['model']}, context {r['context']}, batch {r['batch']}: **{r['config']}** ({r['kind']}) "
                        f"{r['tok_s_per_user']:.0f} tok/s per user, ${r['dollars_per_M_output']:.3f}/M\n")
    written.append(path)
    print("\n".join(written))


if __name__ == "__main__":
    main()
