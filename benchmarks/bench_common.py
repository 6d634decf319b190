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
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

DOLLARS_PER_GPU_HOUR = 3.00
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def set_nccl_env():
    # NVLink multicast stays off on the lent machines (device/KINDS.md).
    for k, v in NCCL_ENV.items():
        os.environ[k] = v


def start_rank(rank: int, world: int, use_cpu: bool, port: int):
    """(cuda, device, group) for one process of a model-step benchmark; NCCL between GPUs."""
    set_nccl_env()
    cuda = torch.cuda.is_available() and not use_cpu
    group = None
    if world > 1:
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        group = dist.group.WORLD
    return cuda, "cuda" if cuda else "cpu", group


def launch(run, args):
    """run(rank, world, args) in --nproc processes (one per GPU), or in this one."""
    if args.nproc > 1:
        import torch.multiprocessing as mp

        mp.spawn(run, args=(args.nproc, args), nprocs=args.nproc)
    else:
        run(0, 1, args)


def dollars_per_million_output(tokens_per_s_total: float, gpus: int) -> float:
    return gpus * DOLLARS_PER_GPU_HOUR / (tokens_per_s_total * 3600) * 1e6


def dollars_per_million_input(latency_s: float, tokens: int, gpus: int) -> float:
    return gpus * DOLLARS_PER_GPU_HOUR * latency_s / 3600 / tokens * 1e6


def event_time(fn, iters: int = 10, warmup: int = 2, device="cuda") -> float:
    """Median seconds of `fn` (CUDA events, synchronised); off CUDA (smoke runs) one timed call."""
    if torch.device(device).type != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
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


def enqueue_time(fn, iters: int = 5) -> float:
    """Median seconds for `fn` to return with nothing else queued (synchronised before each call, not
    after): the host's share of an eager call."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times)


def profile_one_call(fn, warmup: int = 2):
    """`warmup` untimed calls, then one between cudaProfilerStart/Stop: what `ncu
    --profile-from-start off` records (compiles and first-touch costs stay outside)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def kernel_times(fn, calls: int = 5) -> dict:
    """Device time per call of `fn` of each kernel it launches (profiler, eager calls after one untimed), in
    us, slowest first; names cut to 60 characters."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if total:
            times[evt.key[:60]] = round(total / calls, 2)
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


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


def graph_time_calls(calls, iters: int = 20, device="cuda") -> float:
    """Per-call seconds of `calls` (closures) captured back to back in one CUDA graph."""
    if torch.device(device).type != "cuda":
        return event_time(calls[0], device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return event_time(graph.replay, iters=iters) / len(calls)


def copy_bandwidth(device="cuda") -> float:
    """Device copy of 2 GiB: read + write bytes per second (1e9 stands in off CUDA)."""
    if torch.device(device).type != "cuda":
        return 1e9
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / event_time(lambda: dst.copy_(src))


def graph_time(graph, iters: int = 20) -> float:
    """Median seconds of one replay of a captured graph."""
    return event_time(graph.replay, iters=iters, warmup=3)


def measure_ceilings() -> dict:
    """Device copy bandwidth and matmul rates, measured now, on this GPU."""
    copy_bw = copy_bandwidth()
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


def compiled_variants(kernel):
    """(cache key, compiled kernel) of each variant a Triton kernel has compiled so far (the cache layout
    differs between Triton versions: a tuple whose first item is the cache, or the cache)."""
    for caches in kernel.device_caches.values():
        cache = caches[0] if isinstance(caches, tuple) else caches
        yield from cache.items()


def compiled_info(kernel, with_key: bool = False) -> list:
    """Registers, spills and shared memory of each compiled variant of a Triton kernel (best effort:
    the cache layout differs between Triton versions); with_key: the tail of each variant's cache key
    (its constexprs and launch options), to tell the variants apart."""
    out = []
    try:
        for key, compiled in compiled_variants(kernel):
            compiled._init_handles()
            out.append({"regs": compiled.n_regs, "spills": compiled.n_spills,
                        "shared_KB": round(compiled.metadata.shared / 1024, 1),
                        "warps": compiled.metadata.num_warps, **({"key": str(key)[-160:]} if with_key else {})})
    except Exception as exc:  # noqa: BLE001
        out.append({"error": f"{type(exc).__name__}: {exc}"[:200]})
    return out


def import_project():
    """Make `sglang_ext.*` importable from the checkout (the GPU image has no installed package)."""
    try:
        import sglang_ext.layers.fp8  # noqa: F401  (installed: nothing to do)
        import sglang_ext.kernels  # noqa: F401
        return
    except ImportError:
        pass
    import importlib.util
    import types

    for name in [m for m in sys.modules if m == "sglang_ext" or m.startswith("sglang_ext.")]:
        del sys.modules[name]
    pkg = types.ModuleType("sglang_ext")
    pkg.__path__ = [os.path.join(ROOT, "sglang_ext")]
    sys.modules["sglang_ext"] = pkg
    for sub, folder in (("probe", "probe"), ("kernels", "kernels"), ("launch", "launch")):
        spec = importlib.util.spec_from_file_location(
            f"sglang_ext.{sub}", os.path.join(ROOT, folder, "__init__.py"),
            submodule_search_locations=[os.path.join(ROOT, folder)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"sglang_ext.{sub}"] = mod
        spec.loader.exec_module(mod)
        setattr(pkg, sub, mod)


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
