"""benchmarks/run.py, the one benchmark entry point, on this CPU: `--dry-run --suite all` names every suite's
drivers with the shapes of benchmarks/grid.toml, each suite fits one ten-minute GPU call, every driver it names
exists and answers --help, and a run records its environment and each driver's exit code in runs.json."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `pytest` without `python -m`: benchmarks/ is a package of the checkout
    sys.path.insert(0, str(ROOT))

from benchmarks import run as bench_run  # noqa: E402

LINE = re.compile(r"^(\w+)/(\w+) -> (\w+) \(est\. (\d+) s, timeout (\d+) s\): (.*)$")


@pytest.fixture(scope="module")
def dry_run():
    p = subprocess.run([sys.executable, "-m", "benchmarks.run", "--suite", "all", "--dry-run", "--out", "/tmp/r"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.splitlines()


def test_dry_run_lists_every_suite_with_its_shapes(dry_run):
    grid = bench_run.load_grid()
    shapes = grid["grid"]
    runs = [LINE.match(line) for line in dry_run if not line.startswith("#")]
    assert all(runs), [line for line, m in zip(dry_run, runs) if not m]
    by_suite = {}
    for m in runs:
        by_suite.setdefault(m[1], []).append(m)
    assert sorted(by_suite) == sorted(bench_run.SUITES)
    assert sorted(m[2] for m in by_suite["kernels"]) == ["fp8_gemm", "moe", "moe_decode", "probe", "sink_attention"]
    cmds = {f"{m[1]}/{m[2]}": m[6] for m in runs}
    decode = cmds["step/decode"]
    for flag in ("models", "decode_batches", "contexts", "decode_configs"):
        assert shapes[flag] in decode, flag
    assert "--models 120b,20b" in decode and "--out /tmp/r" in decode
    assert f"--lengths {shapes['prefill_lengths']}" in cmds["step/prefill"]
    assert "--nproc 2" in cmds["multi/decode_x2"] and "--nccl /tmp/r/nccl_collectives.json" in cmds["multi/decode_x2"]
    assert "--m 1,4,16,64,256,1024,4096,8192 --shapes qkv,o,lm_head" in cmds["kernels/fp8_gemm"]
    assert "run_full_size.sh" in cmds["server/served_20b"] and "MODEL=20b" in cmds["server/served_20b"]
    # one ten-minute call each: the suite's timeouts and its estimate, as the header says
    for name in bench_run.SUITES:
        header = next(line for line in dry_run if line.startswith(f"# suite {name} "))
        total = sum(int(m[5]) for m in by_suite[name])
        assert f"at most {total} s" in header and total <= bench_run.SUITE_LIMIT_S < 600
        assert sum(int(m[4]) for m in by_suite[name]) < total


def test_every_driver_exists_and_answers_help(dry_run):
    modules, scripts = set(), set()
    for line in dry_run:
        m = LINE.match(line)
        if not m:
            continue
        cmd = m[6]
        if " -m " in cmd:
            modules.add(cmd.split(" -m ")[1].split()[0])
        else:
            scripts.add(next(w for w in cmd.split() if w.endswith(".sh")))
    assert "benchmarks.bench_decode" in modules and len(modules) == 8
    for mod in modules:
        assert (ROOT / (mod.replace(".", "/") + ".py")).is_file(), mod
    for script in scripts:
        assert (ROOT / script).is_file(), script
        assert subprocess.run(["bash", "-n", str(ROOT / script)]).returncode == 0, script
    # every module's --help in one interpreter: torch imports once
    code = (
        "import runpy, sys\n"
        "for mod in sys.argv[1:]:\n"
        "    sys.argv = [mod, '--help']\n"
        "    try:\n"
        "        runpy.run_module(mod, run_name='__main__', alter_sys=True)\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (mod, e.code)\n"
        "    else:\n"
        "        raise AssertionError(mod + ': --help did not exit')\n"
        "    print('ok', mod)\n")
    p = subprocess.run([sys.executable, "-c", code, *sorted(modules)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(line.split()[1] for line in p.stdout.splitlines() if line.startswith("ok ")) == sorted(modules)


def test_a_run_records_its_environment_and_each_driver(tmp_path):
    """A suite of two cheap drivers (one succeeds, one fails on a bad flag): the failure is recorded with its
    log's tail and the suite goes on; runs.json / runs.md name the command, commit, versions and exit codes."""
    grid = tmp_path / "grid.toml"
    cheap = ('[[suite.{s}.run]]\nname = "ok"\ndriver = "benchmarks.plot_results"\nresults = "x"\nest_s = 1\n'
             'timeout_s = 60\nargs = {{ help = true }}\n\n[[suite.{s}.run]]\nname = "bad"\n'
             'driver = "benchmarks.plot_results"\nresults = "y"\nest_s = 1\ntimeout_s = 60\n'
             'args = {{ no-such-flag = true }}\n')
    grid.write_text('[grid]\nmodels = "tiny"\n\n' + "\n".join(
        f'[suite.{s}]\nmachine = "cpu"\ngpus = 0\nabout = "test"\n\n' + cheap.format(s=s)
        for s in bench_run.SUITES))
    out = tmp_path / "out"
    rc = bench_run.main(["--suite", "kernels", "--grid", str(grid), "--out", str(out), "--logs", str(tmp_path / "logs")])
    assert rc == 1  # one driver failed
    record = json.loads((out / "runs.json").read_text())
    assert list(record) == ["kernels"]
    env = record["kernels"]["environment"]
    assert env["command"].startswith("python -m benchmarks.run --suite kernels") and env["torch"] and env["date"]
    assert "commit" in env and "triton" in env
    ok, bad = record["kernels"]["drivers"]
    assert (ok["name"], ok["rc"], bad["name"], bad["rc"]) == ("ok", 0, "bad", 2)
    assert "--no-such-flag" in bad["command"] and "unrecognized arguments" in bad["log_tail"]
    md = (out / "runs.md").read_text()
    assert "## kernels" in md and "| bad | y | 2 |" in md
