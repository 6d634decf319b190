"""The one benchmark entry point: runs a suite of benchmarks/grid.toml, records the environment, leaves JSON +
Markdown in benchmarks/results/ and redraws the summary and plots.

    python -m benchmarks.run --suite kernels            # each kernel alone, beside its peers (one GPU)
    python -m benchmarks.run --suite step               # decode + prefill grid of the whole forward (one GPU)
    python -m benchmarks.run --suite multi              # the 2-GPU configurations + NCCL calibration (two GPUs)
    python -m benchmarks.run --suite server             # gpt-oss-20b served by SGLang (needs --carry)
    python -m benchmarks.run --suite all --dry-run      # what would run, with every shape, and nothing else
    python -m benchmarks.run --regenerate               # summary.md, plots and README table from committed results

Each suite fits one ten-minute GPU call (grid.toml says how). On the device tool, write under $OUT and copy
back: `python -m benchmarks.run --suite step --out $OUT/results`, then copy those files into benchmarks/results/
and commit. Drivers run one after another as `python -m <driver>`, each under its timeout; a driver that fails
is recorded (exit code, log tail) and the suite goes on. `runs.json` / `runs.md` in the output folder say, per
suite, the machine (GPU, torch, Triton, commit, date), the command of this run and each driver's command,
exit code and seconds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
GRID = ROOT / "benchmarks" / "grid.toml"
RESULTS = ROOT / "benchmarks" / "results"
SUITES = ("kernels", "step", "multi", "server")
SUITE_LIMIT_S = 570  # a device call is ten minutes; the rest is the machine's start and the copy back
LOG_TAIL = 2000


def load_grid(path: Path = GRID) -> dict:
    with open(path, "rb") as f:
        grid = tomllib.load(f)
    for name in SUITES:
        suite = grid["suite"][name]
        total = sum(r["timeout_s"] for r in suite["run"])
        if total > SUITE_LIMIT_S:
            raise ValueError(f"suite {name}: timeouts add up to {total} s, over {SUITE_LIMIT_S} s")
    return grid


def driver_args(run: dict, shapes: dict) -> list[str]:
    """`args` of one [[suite.X.run]] as a command line: key -> --key value; true -> --key; {name} from [grid]
    (and {out}, the output folder)."""
    out = []
    for key, value in run.get("args", {}).items():
        if value is True:
            out.append(f"--{key}")
        elif value is not False:
            out += [f"--{key}", str(value).format(**shapes)]
    return out


def command(run: dict, shapes: dict, out_dir: Path, carry: Path) -> list[str]:
    """The driver's command: a Python driver as a module writing into out_dir; the served shell driver with its
    carry and stages (it writes an archive under $OUT, see finish_server)."""
    if run["driver"].endswith(".sh"):
        return ["bash", run["driver"], str(carry), run["args"]["stages"]]
    return [sys.executable, "-m", run["driver"], *driver_args(run, {**shapes, "out": out_dir}), "--out", str(out_dir)]


def plan(grid: dict, suites: list[str], out_dir: Path, carry: Path) -> list[tuple[str, dict, list[str]]]:
    return [(name, run, command(run, grid["grid"], out_dir, carry))
            for name in suites for run in grid["suite"][name]["run"]]


def environment(argv: list[str]) -> dict:
    """The machine and versions behind a run, and the command that made it."""
    env = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "host": platform.node(),
           "python": platform.python_version(), "command": "python -m benchmarks.run " + shlex.join(argv)}
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                       check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        env["dirty"] = bool(dirty)
    except (OSError, subprocess.CalledProcessError):
        env["commit"] = "unknown (no git here: a copy of the working tree)"
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        env["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if env["gpus"]:
            env["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        env["torch"] = None
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def ensure_package():
    """The GPU image has torch and Triton but not this package: install it without dependencies (offline), so
    `sglang_ext.kernels` imports as in CI."""
    try:
        import sglang_ext.kernels  # noqa: F401

        return
    except ImportError:
        pass
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-e", str(ROOT)], check=False)


def run_driver(name: str, run: dict, cmd: list[str], out_dir: Path, logs: Path) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{k: str(v) for k, v in run.get("env", {}).items()})
    staging = None
    if run["driver"].endswith(".sh"):
        staging = logs / f"{run['name']}_call"
        staging.mkdir(parents=True, exist_ok=True)
        env["OUT"] = str(staging)
    log = logs / f"{run['name']}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=run["timeout_s"]).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    record = {"suite": name, "name": run["name"], "command": shlex.join(cmd), "rc": rc,
              "seconds": round(time.monotonic() - t0, 1), "est_s": run["est_s"], "results": run["results"]}
    if rc != 0:
        record["log_tail"] = log.read_text(errors="replace")[-LOG_TAIL:]
    if staging is not None:
        finish_server(staging, out_dir, record)
    print(f"== {name}/{run['name']}: rc={rc} in {record['seconds']} s", flush=True)
    return record


def finish_server(staging: Path, out_dir: Path, record: dict):
    """run_full_size.sh leaves one archive; benchmarks/served/collect.py merges it into served_gpu.{json,md}."""
    archive = staging / "full_size.tgz"
    if not archive.exists():
        record["collect"] = "no full_size.tgz"
        return
    call = staging / "call"
    with tarfile.open(archive) as tar:
        tar.extractall(call, filter="data")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "served" / "collect.py"), "--call", str(call)],
                       cwd=ROOT, capture_output=True, text=True)
    record["collect"] = p.returncode
    if out_dir.resolve() != RESULTS.resolve():
        for suffix in (".json", ".md"):
            src = RESULTS / f"served_gpu{suffix}"
            if src.exists():
                shutil.copy(src, out_dir / src.name)


def regenerate(out_dir: Path, readme: bool) -> list[dict]:
    """summary.md and the plots from the decode / prefill results in out_dir; the README table from
    served_gpu.json (only for the committed results: its hardware line names the results' commit)."""
    done = []
    steps = [[sys.executable, "-m", "benchmarks.plot_results", "--results", str(out_dir)]]
    if readme and (ROOT / "benchmarks" / "readme_table.py").exists():
        steps.append([sys.executable, "-m", "benchmarks.readme_table"])
    for cmd in steps:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        done.append({"command": shlex.join(cmd), "rc": p.returncode, "output": (p.stdout + p.stderr)[-LOG_TAIL:]})
        print(f"== {shlex.join(cmd[1:])}: rc={p.returncode}", flush=True)
    return done


def write_record(out_dir: Path, suites: dict):
    """runs.json / runs.md: per suite, the latest run's environment and drivers (other suites' entries stay)."""
    path = out_dir / "runs.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(suites)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    lines = ["# Benchmark runs (python -m benchmarks.run)", ""]
    for name in sorted(data):
        s = data[name]
        e = s["environment"]
        lines += [f"## {name}", "", f"`{e['command']}` — {e.get('gpu', 'no GPU')} x{e.get('gpus', 0)}, "
                  f"torch {e.get('torch')}, Triton {e.get('triton')}, commit {e.get('commit')}"
                  f"{' (dirty)' if e.get('dirty') else ''}, {e['date']}", "",
                  "| driver | results | rc | seconds (est.) | command |", "|---|---|---|---|---|"]
        lines += [f"| {d['name']} | {d['results']} | {d['rc']} | {d['seconds']} ({d['est_s']}) | `{d['command']}` |"
                  for d in s["drivers"]]
        lines.append("")
    (out_dir / "runs.md").write_text("\n".join(lines))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=(*SUITES, "all"))
    ap.add_argument("--grid", type=Path, default=GRID)
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the drivers write (default benchmarks/results)")
    ap.add_argument("--carry", type=Path, default=ROOT / ".carry", help="the server suite's SGLang carry")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/sglang_ext_bench_logs"),
                    help="each driver's full output (results/ keeps results only; runs.json has failures' tails)")
    ap.add_argument("--only", default="", help="comma-separated run names of the suite (default: all of them)")
    ap.add_argument("--dry-run", action="store_true", help="print each driver's command and shapes, run nothing")
    ap.add_argument("--regenerate", action="store_true",
                    help="only redraw summary.md, the plots and the README table from the results in --out")
    args = ap.parse_args(argv)
    if args.regenerate:
        regenerate(args.out, readme=args.out.resolve() == RESULTS.resolve())
        return 0
    if not args.suite:
        ap.error("--suite is required (or --regenerate)")
    grid = load_grid(args.grid)
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    only = set(filter(None, args.only.split(",")))
    todo = [(s, r, c) for s, r, c in plan(grid, suites, args.out, args.carry) if not only or r["name"] in only]
    if args.dry_run:
        for name in suites:
            suite = grid["suite"][name]
            runs = [(r, c) for s, r, c in todo if s == name]
            print(f"# suite {name} ({suite['machine']}, {suite['gpus']} GPU): {suite['about']}; "
                  f"est. {sum(r['est_s'] for r, _ in runs)} s, at most {sum(r['timeout_s'] for r, _ in runs)} s")
            for run, cmd in runs:
                env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in run.get("env", {}).items())
                print(f"{name}/{run['name']} -> {run['results']} (est. {run['est_s']} s, timeout {run['timeout_s']} s): "
                      f"{env + ' ' if env else ''}{shlex.join(['python', *cmd[1:]] if cmd[0] == sys.executable else cmd)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_package()
    env = environment(argv)
    logs = args.logs
    logs.mkdir(parents=True, exist_ok=True)
    record = {}
    for name in suites:
        need = grid["suite"][name]["gpus"]
        runs = [(r, c) for s, r, c in todo if s == name]
        if env.get("gpus", 0) < need:
            print(f"== suite {name}: needs {need} GPU(s), {env.get('gpus', 0)} here; skipped", flush=True)
            continue
        if name == "server" and not args.carry.is_dir():
            print(f"== suite server: no carry at {args.carry} (python benchmarks/served/carry.py); skipped", flush=True)
            continue
        drivers = [run_driver(name, run, cmd, args.out, logs) for run, cmd in runs]
        record[name] = {"environment": env, "drivers": drivers}
    if {"step", "multi"} & set(record):  # the summary and plots read the decode / prefill grids
        redrawn = regenerate(args.out, readme=False)
        for name in {"step", "multi"} & set(record):
            record[name]["regenerated"] = redrawn
    if record:
        write_record(args.out, record)
    failed = [d for s in record.values() for d in s["drivers"] if d["rc"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
