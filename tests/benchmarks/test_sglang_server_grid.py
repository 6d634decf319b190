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

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "sglang_server_grid.py"
if str(ROOT) not in sys.path:  # `pytest` without `python -m`: benchmarks/ is a package of the checkout
    sys.path.insert(0, str(ROOT))


def _run(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_dry_run_names_each_configuration_and_benchmark():
    p = _run("--model-path", "/models/gpt-oss-120b-fp8", "--configs", "1:1:1,4:4:1,8:8:8", "--probe-ckpt",
             "/models/probe", "--device", "cuda", "--dry-run", "--", "--mem-fraction-static", "0.8")
    assert p.returncode == 0, p.stderr[-2000:]
    servers = [line for line in p.stdout.splitlines() if "sglang.launch_server" in line]
    assert len(servers) == 3
    assert "--tp-size 1" in servers[0] and "--ep-size" not in servers[0] and "dp" not in servers[0]
    assert "--tp-size 4 --ep-size 4" in servers[1]
    # SGLang 0.5.23's spelling of data-parallel attention (--dp D --enable-dp-attention is deprecated)
    assert "--tp-size 8 --ep-size 8 --attn-dp-size 8" in servers[2]
    assert all("--probe-ckpt /models/probe" in s and s.endswith("--mem-fraction-static 0.8") for s in servers)
    assert not any("--device cpu" in s for s in servers)  # --device cuda: the GPU commands on any machine
    benches = [line for line in p.stdout.splitlines() if "one_batch_server" in line]
    assert len(benches) == 3 * (2 + 6)  # contexts 8192, 32768; six prefill lengths
    assert all("--dataset-name random-ids" in b for b in benches)  # exact lengths, no hub download
    assert sum("--batch-size 1 8 32 128 --input-len 8192 --output-len 64" in b for b in benches) == 3
    assert sum("--batch-size 1 1 1 --input-len 8192 --output-len 1" in b for b in benches) == 3  # prefill repeats
    assert not any("--temperature" in b for b in benches)  # one_batch_server's greedy default


def test_temperature_reaches_one_batch_server():
    p = _run("--model-path", "/models/gpt-oss-20b", "--device", "cuda", "--temperature", "1", "--dry-run", "--",
             "--load-format", "dummy")
    assert p.returncode == 0, p.stderr[-2000:]
    benches = [line for line in p.stdout.splitlines() if "one_batch_server" in line]
    assert benches and all("--temperature 1.0" in b for b in benches)


def test_every_flag_the_grid_passes_is_one_sglang_parses():
    """The server arguments the grid builds, parsed by SGLang 0.5.23's own ServerArgs parser: each is a
    flag it defines (not a prefix argparse happens to expand), resolving to the asked layout."""
    import argparse

    from benchmarks import sglang_server_grid as grid
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(allow_abbrev=False)  # a prefix would be an error, not a guess
    ServerArgs.add_cli_args(parser)
    ns = argparse.Namespace(probe_ckpt="", server_args=[])
    argv = ["--model-path", "m"] + grid.server_args(ns, 8, 8, 4)
    parsed = parser.parse_args(argv)
    assert (parsed.tp_size, parsed.ep_size, parsed.attn_dp_size) == (8, 8, 4)


def test_the_label_and_gpus_are_what_the_server_resolved():
    from benchmarks import sglang_server_grid as grid

    layout = grid.resolved_layout({"tp_size": 8, "ep_size": 8, "attn_dp_size": 8, "dp_size": 1, "pp_size": 1,
                                   "chunked_prefill_size": 1024, "device": "cuda"})
    assert layout == {"config": "EP8 DP8 TP8", "gpus": 8, "chunked_prefill_size": 1024, "device": "cuda"}
    # replicas (--dp-size without attention DP) are GPUs too; attention DP groups are not
    replicas = grid.resolved_layout({"tp_size": 2, "ep_size": 1, "attn_dp_size": 1, "dp_size": 2, "pp_size": 1})
    assert replicas["config"] == "EP1 DP1 TP2 x2 replicas" and replicas["gpus"] == 4
    with pytest.raises(KeyError):  # a field SGLang names otherwise is an error row, not a guessed label
        grid.resolved_layout({"tp_size": 2, "dp_size": 1, "pp_size": 1})


def test_prefill_is_the_median_of_its_runs():
    from benchmarks import sglang_server_grid as grid

    base = {"model": "m", "config": "EP1 DP1 TP1", "gpus": 1, "kind": "sglang-server"}
    row = grid.prefill_row(base, [{"last_ttft": 0.9}, {"last_ttft": 0.1}, {"last_ttft": 0.2}], 1024, 1)
    assert row["latency_ms"] == pytest.approx(200.0) and row["runs_ms"] == pytest.approx([900.0, 100.0, 200.0])
    assert row["tok_s"] == pytest.approx(1024 / 0.2)


def test_a_batch_one_batch_server_skips_is_a_row_that_says_so(capsys):
    """The skip lines come from SGLang's own guards (printed to stdout, exit 0, no result)."""
    from benchmarks import sglang_server_grid as grid
    from sglang.benchmark import one_batch_server as obs

    assert obs.should_skip_due_to_token_capacity(128, 32768, 64, 1_000_000)
    assert obs.should_skip_due_to_max_running_requests(256, 200)
    stdout = capsys.readouterr().out
    base = {"model": "m", "config": "EP1 DP1 TP1", "gpus": 1, "kind": "sglang-server"}
    got = [{"batch_size": 1}, {"batch_size": 8}]
    rows = grid.missing_rows(base, "decode", 32768, [1, 8, 128, 256, 512], got, stdout)
    assert [r["batch"] for r in rows] == [128, 256, 512]
    assert "kv cache limit" in rows[0]["does_not_fit"] and "running requests" in rows[1]["does_not_fit"]
    assert "does_not_fit" not in rows[2] and "no result for batch 512" in rows[2]["error"]
    assert all(r["context"] == 32768 for r in rows[:2])


def test_decode_row_counts_the_tokens_after_the_first():
    from benchmarks import bench_common as bc
    from benchmarks import sglang_server_grid as grid

    base = {"model": "m", "config": "EP1 DP1 TP2", "gpus": 2, "kind": "sglang-server"}
    row = grid.decode_row(base, {"batch_size": 4, "latency": 1.5, "last_ttft": 0.5, "output_throughput": 29.3},
                          8192, 11, 2)
    assert row["tok_s_per_user"] == pytest.approx(10.0) and row["tok_s_total"] == pytest.approx(40.0)
    assert row["tok_s_per_gpu"] == pytest.approx(20.0) and row["step_ms"] == pytest.approx(100.0)
    assert row["dollars_per_M_output"] == pytest.approx(bc.dollars_per_million_output(40.0, 2))
    assert "short_output" not in row
    # a server that made fewer tokens than asked: the rate of the tokens it made, and the row says so
    short = grid.decode_row(base, {"batch_size": 4, "latency": 1.5, "last_ttft": 0.5, "total_output_tokens": 24},
                            8192, 11, 2)
    assert short["tok_s_per_user"] == pytest.approx(5.0) and "24 tokens made of 44" in short["short_output"]
    with pytest.raises(ValueError, match="no decode time"):
        grid.decode_row(base, {"batch_size": 1, "latency": 0.5, "last_ttft": 0.5}, 8192, 11, 2)
    with pytest.raises(ValueError, match="no decode time"):
        grid.decode_row(base, {"batch_size": 1, "latency": 0.9, "last_ttft": 0.5}, 8192, 1, 2)


# Opt-in (a server start and four one_batch_server runs, ~160 s of CI on two cores): the rows' arithmetic, the
# flags, the failure rows and the server's resolved configuration are checked above without a server, and the
# same driver serves the GPU runs of benchmarks/served/run_full_size.sh (benchmarks/results/served_gpu.md).
@pytest.mark.skipif(os.environ.get("SGLANG_EXT_TEST_GRID_SERVER") != "1",
                    reason="opt-in, ~160 s: SGLANG_EXT_TEST_GRID_SERVER=1 runs the grid against a CPU server")
def test_grid_against_a_cpu_server(tiny_checkpoints, vocab_dir, tmp_path):
    from benchmarks import plot_results

    out = tmp_path / "grid"
    # batch 2000 x 28 tokens is past the CPU server's 16384-token KV pool: one_batch_server skips it
    p = _run("--model-path", str(tiny_checkpoints["bf16"]), "--model-name", "tiny", "--configs", "1:1:1",
             "--batches", "1,2,2000", "--contexts", "24", "--lengths", "16", "--output-len", "4", "--prefill-repeats",
             "2", "--skip-warmup", "--startup-timeout", "600", "--vocab-dir", str(vocab_dir), "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((out / "sglang_server_grid.json").read_text())["rows"]
    assert not [r for r in rows if "error" in r], rows
    decode = sorted((r for r in rows if r["bench"] == "decode" and "step_ms" in r), key=lambda r: r["batch"])
    prefill = [r for r in rows if r["bench"] == "prefill"]
    skipped = [r for r in rows if "does_not_fit" in r]
    assert [r["batch"] for r in decode] == [1, 2] and [r["length"] for r in prefill] == [16]
    # SGLang checks its running-request cap first, then the KV pool: either way the row carries its reason
    assert [r["batch"] for r in skipped] == [2000]
    assert "kv cache limit" in skipped[0]["does_not_fit"] or "running requests" in skipped[0]["does_not_fit"]
    for r in decode + prefill + skipped:
        assert r["kind"] == "sglang-server" and r["config"] == "EP1 DP1 TP1" and r["gpus"] == 1
        assert r["model"] == "tiny" and r["device"] == "cpu" and r["probe"] is False
        assert r["chunked_prefill_size"] and "requested_config" not in r  # from the server's /server_info
    for r in decode:
        assert r["context"] == 24 and r["tok_s_per_user"] > 0 and r["dollars_per_M_output"] > 0
        assert r["latency_s"] > r["ttft_s"] > 0 and "short_output" not in r
    assert len(prefill[0]["runs_ms"]) == 2 and prefill[0]["latency_ms"] > 0 and prefill[0]["dollars_per_M_input"] > 0
    md = (out / "sglang_server_grid.md").read_text()
    assert "EP1 DP1 TP1" in md and "decode context 24 batch 2000: one_batch_server" in md and (out / "server_1_1_1.log").exists()
    # the summary and plots read the grid's own files
    summary = plot_results.summary(plot_results.load_rows(str(out), "bench_decode"),
                                   plot_results.load_rows(str(out), "bench_prefill"))
    assert "tiny, context 24, lowest latency (batch 1): **EP1 DP1 TP1** (sglang-server)" in summary
    assert "tiny prefill 16 tokens" in summary


def test_a_server_that_cannot_start_is_a_row(tmp_path):
    from sglang_ext.launch.server import free_port

    out = tmp_path / "grid"
    p = _run("--model-path", str(tmp_path / "no-such-model"), "--configs", "1:1:1", "--startup-timeout", "300",
             "--port", str(free_port()), "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((out / "sglang_server_grid.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["config"] == "EP1 DP1 TP1" and "server exited" in rows[0]["error"], rows
    assert "server exited" in (out / "sglang_server_grid.md").read_text()


def test_one_bad_batch_result_costs_its_row_only(monkeypatch, tmp_path):
    """run_config on stand-ins for the server and one_batch_server: a batch whose result has no decode time is
    an error row beside the others and the configuration goes on; the label is what the server resolved."""
    import argparse

    from benchmarks import sglang_server_grid as grid

    from sglang_ext.launch import server as launch_server

    class FakeServer:
        url, cpu = "http://127.0.0.1:1", False

        def __init__(self, *a, **kw):
            pass

        def start(self):
            return self

        def stop(self):
            pass

    class Info:
        @staticmethod
        def json():  # an all-to-all MoE backend set ep = tp on a 4-GPU request for EP1
            return {"tp_size": 4, "ep_size": 4, "attn_dp_size": 1, "dp_size": 1, "pp_size": 1,
                    "chunked_prefill_size": 8192, "device": "cuda"}

    def fake_benchmark(args, env, url, batches, tokens, output_len, tmp, name):
        if name.startswith("prefill"):
            return [{"batch_size": 1, "last_ttft": 0.5}], "", None
        return [{"batch_size": 1, "latency": 2.0, "last_ttft": 1.0, "total_output_tokens": 11},
                {"batch_size": 8, "latency": 1.0, "last_ttft": 1.0}], "", None

    monkeypatch.setattr(launch_server, "SGLangServer", FakeServer)
    monkeypatch.setattr(grid.requests, "get", lambda *a, **kw: Info())
    monkeypatch.setattr(grid, "run_benchmark", fake_benchmark)
    args = argparse.Namespace(model_path="/m/gpt-oss-120b", model_name="", probe_ckpt="", server_args=[],
                              batches="1,8", contexts="8192", lengths="1024", output_len=11, prefill_repeats=1,
                              device="cuda", port=0, vocab_dir=None, startup_timeout=1, dry_run=False,
                              out=str(tmp_path), skip_warmup=True, stem="sglang_server_grid")
    seen = []
    rows = grid.run_config(args, 4, 1, 1, progress=lambda partial: seen.append(len(partial)))
    assert seen == [2, 3]  # written after the decode run and after the prefill run: a grid cut short keeps them
    assert len(grid.run_config(argparse.Namespace(**{**vars(args), "lengths": ""}), 4, 1, 1)) == 2  # no prefill
    decode = [r for r in rows if r.get("bench") == "decode"]
    assert [("step_ms" in r, r["batch"]) for r in decode] == [(True, 1), (False, 8)]
    assert "no decode time" in decode[1]["error"]
    assert [r["length"] for r in rows if r.get("bench") == "prefill"] == [1024]
    assert all(r["config"] == "EP4 DP1 TP4" and r["requested_config"] == "EP1 DP1 TP4" and r["gpus"] == 4
               for r in rows)
    grid.write_grid(args, {"command": "c", "date": "d"}, rows)
    md = (tmp_path / "sglang_server_grid.md").read_text()
    assert md.count("- asked EP1 DP1 TP4, the server ran EP4 DP1 TP4") == 1  # once, not once a row
    assert "EP4 DP1 TP4 decode context 8192 batch 8: ValueError('no decode time" in md
    assert json.loads((tmp_path / "bench_decode_sglang_server_grid.json").read_text())["rows"][0]["batch"] == 1
