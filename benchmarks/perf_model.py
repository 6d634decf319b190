"""The small performance model behind the "modelled" rows, and its calibration.

A configuration with more GPUs than a run has is modelled as: rank 0's step measured
at its own shard shapes (heads / experts / intermediate slice; bench_decode and
bench_prefill do that in one process) + the collectives that step would issue, timed
by a latency-bandwidth model calibrated on NCCL collectives measured on 2 GPUs:

    t(all_reduce, n bytes, N GPUs)   = alpha(N) + 2 (N-1)/N * n / busbw
    t(all_gather or reduce_scatter)  = alpha(N) +   (N-1)/N * n / busbw
    alpha(N) = alpha(2) * log2(N)  (NCCL's tree / LL protocols on an NVSwitch node)

alpha(2) and busbw are fitted to the 2-GPU measurement (`--measure-nccl`), written to
benchmarks/results/nccl_collectives.json. Without it, defaults of 10 us and 300 GB/s stand
in and every modelled row says "uncalibrated". Load imbalance between EP ranks and any
overlap of communication with compute are not modelled.

    python -m benchmarks.perf_model --measure-nccl --nproc 2 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.distributed as dist

DEFAULT_ALPHA_S = 10e-6
DEFAULT_BUSBW = 300e9


class CollectiveModel:
    def __init__(self, alpha_s: float = DEFAULT_ALPHA_S, busbw: float = DEFAULT_BUSBW, calibrated: bool = False,
                 source: str = ""):
        self.alpha_s, self.busbw, self.calibrated, self.source = alpha_s, busbw, calibrated, source

    @classmethod
    def load(cls, path: str) -> "CollectiveModel":
        if path and os.path.exists(path):
            with open(path) as f:
                fit = json.load(f)["fit"]
            return cls(fit["alpha_s"], fit["busbw_Bps"], True, os.path.basename(path))
        return cls()

    def describe(self) -> str:
        state = f"calibrated on {self.source}" if self.calibrated else "uncalibrated defaults"
        return f"alpha(2) {self.alpha_s * 1e6:.1f} us, busbw {self.busbw / 1e9:.0f} GB/s, {state}"

    def alpha(self, n: int) -> float:
        return self.alpha_s * math.log2(n) if n > 1 else 0.0

    def all_reduce(self, nbytes: float, n: int) -> float:
        return 0.0 if n == 1 else self.alpha(n) + 2 * (n - 1) / n * nbytes / self.busbw

    def gather_or_scatter(self, nbytes: float, n: int) -> float:
        return 0.0 if n == 1 else self.alpha(n) + (n - 1) / n * nbytes / self.busbw

    def step_seconds(self, dims, layout, tokens_local: int, tokens_all: int) -> float:
        """Collectives of one forward (`layout`: a ParallelLayout): o_proj's all-reduce over attention TP,
        the MoE's all-reduce over TP (with DP attention, between the gather of every group's tokens and the
        scatter back, a local slice: models/gpt_oss_core.GptOssMLP)."""
        row = dims.hidden * 2  # bf16
        per_layer = self.all_reduce(tokens_local * row, layout.attn_tp_size)
        per_layer += self.all_reduce(tokens_all * row, layout.tp_size)
        if layout.attn_dp_size > 1:
            per_layer += self.gather_or_scatter(tokens_all * row, layout.tp_size)
        return dims.num_layers * per_layer

    def decode_step_seconds(self, dims, layout, batch: int) -> float:
        local = batch if layout.attn_dp_size == 1 else -(-batch // layout.attn_dp_size)
        return self.step_seconds(dims, layout, local, batch)

    def prefill_seconds(self, dims, layout, length: int) -> float:
        return self.step_seconds(dims, layout, length, length)


def kernel_breakdown(model, context: int, top: int = 15, inputs: dict | None = None) -> list[dict]:
    """Per-kernel GPU time of one eager forward (torch profiler), largest first: a decode step at
    `context`, or the forward of `inputs` (a prefill) when given."""
    from torch.profiler import ProfilerActivity, profile

    if inputs is None:
        inputs = model.decode_inputs(context)
        model.forward(**inputs)  # warm: the profile has no compile or first-call work
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.forward(**inputs)
        torch.cuda.synchronize()
    stats = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if us <= 0:
            continue
        name = evt.key[:80]
        calls, total = stats.get(name, (0, 0.0))
        stats[name] = (calls + evt.count, total + us)
    total = sum(v[1] for v in stats.values()) or 1.0
    rows = [{"name": k, "calls": c, "us": t, "pct": 100 * t / total} for k, (c, t) in stats.items()]
    rows.sort(key=lambda r: -r["us"])
    return rows[:top]


def _measure(rank: int, world: int, args):
    from benchmarks import bench_common as bc

    bc.set_nccl_env()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{args.port}")
    rows = []
    for nbytes in [2880 * 2 * b for b in (1, 8, 32, 128, 1024, 8192)] + [64 << 20]:
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        gathered = torch.empty(world * x.numel(), device="cuda", dtype=torch.bfloat16)
        res = {"bytes": nbytes}
        for name, fn in (("all_reduce", lambda: dist.all_reduce(x)),
                         ("all_gather", lambda: dist.all_gather_into_tensor(gathered, x))):
            # Inside a CUDA graph, as the decode step issues them.
            graph = bc.capture_graph(lambda: [fn() for _ in range(10)])
            res[f"{name}_us"] = bc.graph_time(graph) / 10 * 1e6
        rows.append(res)
        if rank == 0:
            print(res, flush=True)
    if rank == 0:
        small = min(rows, key=lambda r: r["bytes"])
        large = max(rows, key=lambda r: r["bytes"])
        alpha = small["all_reduce_us"] * 1e-6
        busbw = 2 * (world - 1) / world * large["bytes"] / (large["all_reduce_us"] * 1e-6 - alpha)
        meta = bc.run_meta("python -m benchmarks.perf_model --measure-nccl --nproc %d" % world, {"world": world})
        fit = {"alpha_s": alpha, "busbw_Bps": busbw, "from": "smallest all_reduce (alpha), 64 MiB all_reduce (busbw)"}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "nccl_collectives.json"), "w") as f:
            json.dump({"meta": meta, "fit": fit, "rows": rows}, f, indent=2)
        cols = [("bytes", "bytes", None), ("all_reduce us", "all_reduce_us", "{:.1f}"),
                ("all_gather us", "all_gather_us", "{:.1f}")]
        md = (f"# NCCL collectives on {world} x {meta.get('gpu')} (CUDA graph, 10 per replay)\n\n"
              f"`{meta['command']}` — {meta['date']}. Fit: alpha {alpha * 1e6:.1f} us, busbw {busbw / 1e9:.0f} GB/s "
              f"(NCCL_NVLS_ENABLE=0).\n\n" + bc.md_table(rows, cols) + "\n")
        with open(os.path.join(args.out, "nccl_collectives.md"), "w") as f:
            f.write(md)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure-nccl", action="store_true")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--port", type=int, default=29541)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.measure_nccl:
        import torch.multiprocessing as mp

        mp.spawn(_measure, args=(args.nproc, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
