"""Shared by the model-step benchmarks: ceilings measured in the same run, timing, cost, output.

Cost: a nominal $3.00 per H200-hour (SPEC §4). $/M output tokens = GPUs x $3/h divided by
the decode tokens per hour (all users); $/M input tokens = GPUs x $3/h x prefill latency
divided by the input tokens.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch

DOLLARS_PER_GPU_HOUR = 3.00
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def set_nccl_env():
    # NVLink multicast stays off on the lent machines (device/KINDS.md).
    for k, v in NCCL_ENV.items():
        os.environ[k] = v


def dollars_per_million_output(tokens_per_s_total: float, gpus: int) -> float:
    return gpus * DOLLARS_PER_GPU_HOUR / (tokens_per_s_total * 3600) * 1e6


def dollars_per_million_input(latency_s: float, tokens: int, gpus: int) -> float:
    return gpus * DOLLARS_PER_GPU_HOUR * latency_s / 3600 / tokens * 1e6


def event_time(fn, iters: int = 10, warmup: int = 2) -> float:
    """Median seconds of `fn` (CUDA events, synchronised)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def capture_graph(fn, warmup: int = 2):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_time(graph, iters: int = 20) -> float:
    """Median seconds of one replay of a captured graph."""
    return event_time(graph.replay, iters=iters, warmup=3)


def measure_ceilings() -> dict:
    """Device copy bandwidth and matmul rates, measured now, on this GPU."""
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    t = event_time(lambda: b.copy_(a), iters=10)
    copy_bw = 2 * a.numel() * 2 / t
    del a, b
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = event_time(lambda: x @ y, iters=10)
    bf16_rate = 2 * n ** 3 / t
    out = {"copy_bandwidth_Bps": copy_bw, "bf16_matmul_flops": bf16_rate}
    try:
        xf = x.to(torch.float8_e4m3fn)
        yf = y.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        t = event_time(lambda: torch._scaled_mm(xf, yf, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), iters=10)
        out["fp8_matmul_flops"] = 2 * n ** 3 / t
    except Exception as exc:  # recorded, not fatal: the ceiling is context, not the result
        out["fp8_matmul_error"] = repr(exc)[:200]
    torch.cuda.empty_cache()
    return out


def run_meta(command: str, extra: dict | None = None) -> dict:
    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "torch": torch.__version__,
        "command": command,
        "dollars_per_gpu_hour": DOLLARS_PER_GPU_HOUR,
    }
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name()
        meta["gpus_visible"] = torch.cuda.device_count()
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    meta.update(extra or {})
    return meta


def write_results(out_dir: str, stem: str, meta: dict, rows: list, markdown: str):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(markdown)


def md_table(rows: list, columns: list) -> str:
    """columns: (header, key, format) triples."""
    head = "| " + " | ".join(h for h, _, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for _, key, fmt in columns:
            v = r.get(key)
            cells.append("—" if v is None else (fmt.format(v) if fmt else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
