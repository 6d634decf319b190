"""The tiny CPU server's intra-op threads, alone and beside another busy process (why the shims set one).

Starts the tiny fp32 gpt-oss with the tiny SingProbe on this CPU (`launch/server.py`, ids only), and times
the workload of `tests/served/test_probe_serving.py::test_eight_concurrent_streams_equal_each_alone`: eight
prompts of 30..289 tokens, 12 greedy tokens each, one after another and then all eight at once. Each
server runs with OMP_NUM_THREADS=1 (what `launch/cpu_shims.py` now gives it) or with torch's default
(one thread a core), on an idle machine or beside a "neighbour": a torch matmul loop at torch's default
thread count, standing in for the second test worker. One server start per row.

    python benchmarks/bench_cpu_threads.py          # writes benchmarks/results/cpu_threads.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
NEIGHBOUR = "import torch\nx = torch.randn(300, 300)\nwhile True:\n    x = x @ x\n    x /= x.norm()\n"


def generate(url: str, ids: list, n: int = 12) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def one_row(checkpoint: Path, probe: str, threads: str, neighbour: bool) -> dict:
    from sglang_ext.launch.make_tiny import random_prompt
    from sglang_ext.launch.server import SGLangServer

    saved = os.environ.get("OMP_NUM_THREADS")
    # the server's environment comes from os.environ (cpu_server_env keeps a value that is set)
    os.environ["OMP_NUM_THREADS"] = threads if threads != "default" else str(os.cpu_count())
    try:
        server = SGLangServer(checkpoint, ["--dtype", "float32", "--probe-ckpt", probe, "--skip-tokenizer-init"])
        t0 = time.time()
        server.start()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    hog = None
    try:
        start_s = time.time() - t0
        prompts = [random_prompt(30 + 37 * i, seed=10 + i) for i in range(8)]
        generate(server.url, prompts[0], 2)  # warm-up
        if neighbour:
            env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
            hog = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], env=env)
            time.sleep(1.0)
        t = time.time()
        alone = [generate(server.url, p) for p in prompts]
        t_seq = time.time() - t
        t = time.time()
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda p: generate(server.url, p), prompts))
        t_conc = time.time() - t
        assert [a["output_ids"] for a in alone] == [b["output_ids"] for b in together]
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        server.stop()
    return {"server_threads": threads, "neighbour": neighbour, "server_start_s": start_s,
            "eight_one_by_one_s": t_seq, "eight_at_once_s": t_conc, "total_s": t_seq + t_conc}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    from sglang_ext.launch.make_tiny import generate as make_tiny
    from sglang_ext.launch.make_tiny_probe import generate as make_probe

    tiny = ROOT / ".cache" / "tiny"
    fp32 = Path(make_tiny(str(tiny), log=lambda *_: None)["fp32"])  # made once, then reused as the tests do
    probe = make_probe(str(tiny / "probe"), base_dir=str(fp32), log=lambda *_: None)
    rows = []
    for neighbour in (False, True):
        for threads in ("1", "default"):
            rows.append(one_row(fp32, probe, threads, neighbour))
            print(json.dumps(rows[-1]), flush=True)
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(), "host": platform.node(),
            "load_avg_before": os.getloadavg(), "command": "python benchmarks/bench_cpu_threads.py"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_threads.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = ["# The tiny CPU server's intra-op threads, alone and beside a busy neighbour", "",
             f"`{meta['command']}` — {meta['date']}, {meta['cpus']} CPUs. Tiny fp32 gpt-oss + tiny SingProbe, ids "
             "only; eight prompts of 30..289 tokens, 12 greedy tokens each, one by one then all at once (the "
             "workload of test_eight_concurrent_streams_equal_each_alone). Neighbour: a torch matmul loop at "
             "torch's default thread count (a stand-in for the second test worker). 'default' = one thread a "
             "core, torch's own choice.", "",
             "| server threads | neighbour | one by one s | at once s | total s | server start s |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['server_threads']} | {'yes' if r['neighbour'] else 'no'} | {r['eight_one_by_one_s']:.2f} | "
                     f"{r['eight_at_once_s']:.2f} | {r['total_s']:.2f} | {r['server_start_s']:.1f} |")
    by = {(r["server_threads"], r["neighbour"]): r["total_s"] for r in rows}
    lines += ["", f"Default / one thread: {by[('default', False)] / by[('1', False)]:.2f}x idle, "
                  f"{by[('default', True)] / by[('1', True)]:.2f}x beside the neighbour."]
    (args.out / "cpu_threads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
