"""benchmarks/sglang_server_grid.py: the grid against real SGLang servers (issue 7, item 4). Its commands per
configuration, its decode arithmetic, and one whole run against a real SGLang server on this CPU (the tiny
checkpoint) through SGLang's own one_batch_server, which must leave rows in the benchmarks' schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "sglang_server_grid.py"
sys.path.insert(0, str(ROOT / "benchmarks"))


def _run(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_dry_run_names_each_configuration_and_benchmark():
    p = _run("--model-path", "/models/gpt-oss-120b-fp8", "--configs", "1:1:1,4:4:1,8:8:8", "--probe-ckpt",
             "/models/probe", "--dry-run", "--", "--mem-fraction-static", "0.8")
    assert p.returncode == 0, p.stderr[-2000:]
    servers = [line for line in p.stdout.splitlines() if "sglang.launch_server" in line]
    assert len(servers) == 3
    assert "--tp 1" in servers[0] and "--ep-size" not in servers[0] and "--dp" not in servers[0]
    assert "--tp 4 --ep-size 4" in servers[1]
    assert "--tp 8 --ep-size 8 --dp 8 --enable-dp-attention" in servers[2]
    assert all("--probe-ckpt /models/probe" in s and s.endswith("--mem-fraction-static 0.8") for s in servers)
    benches = [line for line in p.stdout.splitlines() if "one_batch_server" in line]
    assert len(benches) == 3 * (2 + 6)  # contexts 8192, 32768; six prefill lengths
    assert all("--dataset-name random-ids" in b for b in benches)  # exact lengths, no hub download
    assert sum("--batch-size 1 8 32 128 --input-len 8192 --output-len 64" in b for b in benches) == 3


def test_decode_row_counts_the_tokens_after_the_first():
    import bench_common as bc
    import sglang_server_grid as grid

    base = {"model": "m", "config": "EP1 DP1 TP2", "gpus": 2, "kind": "sglang-server"}
    row = grid.decode_row(base, {"batch_size": 4, "latency": 1.5, "last_ttft": 0.5, "output_throughput": 29.3},
                          8192, 11, 2)
    assert row["tok_s_per_user"] == pytest.approx(10.0) and row["tok_s_total"] == pytest.approx(40.0)
    assert row["tok_s_per_gpu"] == pytest.approx(20.0) and row["step_ms"] == pytest.approx(100.0)
    assert row["dollars_per_M_output"] == pytest.approx(bc.dollars_per_million_output(40.0, 2))
    with pytest.raises(ValueError, match="no decode time"):
        grid.decode_row(base, {"batch_size": 1, "latency": 0.5, "last_ttft": 0.5}, 8192, 11, 2)
    with pytest.raises(ValueError, match="no decode time"):
        grid.decode_row(base, {"batch_size": 1, "latency": 0.9, "last_ttft": 0.5}, 8192, 1, 2)


def test_grid_against_a_cpu_server(tiny_checkpoints, vocab_dir, tmp_path):
    from sglang_ext.launch.server import free_port

    out = tmp_path / "grid"
    p = _run("--model-path", str(tiny_checkpoints["bf16"]), "--configs", "1:1:1", "--batches", "1,2",
             "--contexts", "24", "--lengths", "16", "--output-len", "4", "--skip-warmup", "--startup-timeout", "600",
             "--vocab-dir", str(vocab_dir), "--port", str(free_port()), "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((out / "sglang_server_grid.json").read_text())["rows"]
    assert not [r for r in rows if "error" in r], rows
    decode = sorted((r for r in rows if r["bench"] == "decode"), key=lambda r: r["batch"])
    prefill = [r for r in rows if r["bench"] == "prefill"]
    assert [r["batch"] for r in decode] == [1, 2] and [r["length"] for r in prefill] == [16]
    for r in decode + prefill:
        assert r["kind"] == "sglang-server" and r["config"] == "EP1 DP1 TP1" and r["gpus"] == 1
    for r in decode:
        assert r["context"] == 24 and r["tok_s_per_user"] > 0 and r["dollars_per_M_output"] > 0
        assert r["latency_s"] > r["ttft_s"] > 0
    assert prefill[0]["latency_ms"] > 0 and prefill[0]["dollars_per_M_input"] > 0
    md = (out / "sglang_server_grid.md").read_text()
    assert "EP1 DP1 TP1" in md and (out / "server_1_1_1.log").exists()


def test_a_server_that_cannot_start_is_a_row(tmp_path):
    from sglang_ext.launch.server import free_port

    out = tmp_path / "grid"
    p = _run("--model-path", str(tmp_path / "no-such-model"), "--configs", "1:1:1", "--startup-timeout", "300",
             "--port", str(free_port()), "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((out / "sglang_server_grid.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["config"] == "EP1 DP1 TP1" and "server exited" in rows[0]["error"], rows
    assert "server exited" in (out / "sglang_server_grid.md").read_text()
