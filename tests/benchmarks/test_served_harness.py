"""The GPU serving harness's CPU-checkable parts (benchmarks/served): the sgl_kernel stand-in, the carry's wheel
unpacking and trimming, the linked package under gpu_env (the plugin entry point found, the package importable
from outside the checkout) and the collector's served_gpu.json shape."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVED = ROOT / "benchmarks" / "served"
sys.path.insert(0, str(SERVED))


def test_stub_imports_anything_and_logs_each_call(tmp_path):
    log = tmp_path / "calls.log"
    script = """
import sgl_kernel
from sgl_kernel.kvcacheio import transfer_kv_all_layer
from sgl_kernel.scalar_type import scalar_types
import sgl_kernel.flash_attn as fa
assert scalar_types.uint4b8 is not None and fa.flash_attn_with_kvcache is not None
for f in (sgl_kernel.gemma_rmsnorm, transfer_kv_all_layer, fa.flash_attn_with_kvcache):
    try:
        f(1, x=2)
    except RuntimeError as e:
        assert "is a stub" in str(e), e
    else:
        raise SystemExit("a stub call did not raise")
from sgl_kernel.utils import is_arch_support_pdl  # a real host-side helper: False without CUDA, never logged
assert is_arch_support_pdl() is False
import torch
from sgl_kernel import rmsnorm  # real: SGLang's JIT kernel, or torch at gpt-oss's 2880, which the JIT refuses
x, w = torch.randn(3, 2880).bfloat16(), torch.rand(2880).bfloat16()
want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
assert float((rmsnorm(x, w, 1e-5).double() - want).abs().max()) <= float(want.abs().max()) * 2 ** -7
"""
    env = {**os.environ, "PYTHONPATH": str(SERVED / "sgl_kernel_stub"), "KERNEL_STUB_LOG": str(log)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path)
    names = [line.split(" ", 1)[1] for line in log.read_text().splitlines()]
    assert names == ["sgl_kernel.gemma_rmsnorm", "sgl_kernel.kvcacheio.transfer_kv_all_layer",
                     "sgl_kernel.flash_attn.flash_attn_with_kvcache"]


def test_unpack_wheel_drops_the_trimmed_paths_and_maps_data_dirs(tmp_path):
    import carry

    wheel = tmp_path / "pkg-1.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("sglang/__init__.py", "x = 1\n")
        z.writestr("sglang/srt/rust_extensions/_server.so", b"\0" * 100)
        z.writestr("sglang/multimodal_gen/runtime/a.py", "")
        z.writestr("pkg-1.0.data/purelib/extra_mod.py", "y = 2\n")
        z.writestr("pkg-1.0.data/scripts/tool", "#!/bin/sh\n")
    site = tmp_path / "site"
    written = carry.unpack_wheel(wheel, site, carry.SGLANG_DROP)
    files = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert files == ["bin/tool", "extra_mod.py", "sglang/__init__.py"]
    assert written == len("x = 1\n") + len("y = 2\n") + len("#!/bin/sh\n")


def test_carried_triton_kernels_edits_apply_once_and_still_import(tmp_path):
    """The upstream peer's triton_kernels, edited for the GPU machine's Triton 3.6, still imports here (Triton of
    the pinned SGLang), where both edits must be no-ops."""
    import carry

    carry.copy_triton_kernels(tmp_path / "triton_kernels")
    for name, _text, replacement in carry.TRITON36_EDITS:
        assert replacement in (tmp_path / "triton_kernels" / name).read_text()
    code = ("import triton_kernels, triton_kernels.matmul, triton_kernels.target_info as t; "
            "assert triton_kernels.__file__.startswith(%r); print(t.is_hip_gfx1250)" % str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_gpu_env_links_this_checkout_as_the_installed_plugin(tmp_path):
    import tarfile

    import gpu_env

    carry_dir = tmp_path / "carry"
    (tmp_path / "site" / "sglang").mkdir(parents=True)
    (carry_dir / "vocab").mkdir(parents=True)
    with tarfile.open(carry_dir / "site.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "site", arcname="site")
    env = gpu_env.unpack(carry_dir, tmp_path / "dest")
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(tmp_path / "dest" / "ext"), str(tmp_path / "dest" / "site")]
    script = """
import importlib.metadata as md
eps = [e for e in md.entry_points(group="sglang.srt.plugins") if str(e.dist._path).startswith(%r)]
import sglang_ext.kernels.pdl, sglang_ext.probe.config, sglang_ext.patches, sglang_ext.launch.server
print(",".join(sorted(f"{e.name}={e.value}" for e in eps)), sglang_ext.kernels.pdl.__file__)
""" % str(tmp_path / "dest" / "ext")
    # run from outside the checkout, as on the GPU machine (its root's sglang_ext/ would shadow the link)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**os.environ, **env}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    eps, path = out.stdout.split()
    # the plugin, and its weightless-routing patch alone for the upstream peer's runs
    assert eps.split(",") == ["sglang_ext=sglang_ext.plugin:load",
                              "sglang_ext_weightless_routing=sglang_ext.patches.dummy_routing:register"]
    assert path == str(tmp_path / "dest" / "ext" / "sglang_ext" / "kernels" / "pdl.py")
    assert Path(path).resolve() == (ROOT / "kernels" / "pdl.py").resolve()


def test_collect_writes_the_issue_shape(tmp_path, monkeypatch):
    import collect

    call = tmp_path / "call"
    (call / "probe").mkdir(parents=True)
    (call / "env.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0",
                                               "sglang": "0.5.23", "flags": ["--sampling-backend", "pytorch"],
                                               "host": {"cpu": "x", "cores": 16, "python_loop_ms": 7.5}}))
    (call / "parity.json").write_text(json.dumps({"parity": [
        {"checkpoint": "fp8", "cuda_graph": True, "tokens_match": 48, "tokens_total": 48, "probe_max_abs_err": 0.004,
         "probe_err_truth": 0.003, "logprob_err": 0.01, "ref_err": 0.02, "flip_margin": 0.0,
         "cached_equals_cold": True, "radix_hit_score_gap": 0.0, "prefix_hit_tokens_equal": False,
         "prefix_hit_first_diff": 7, "prefix_hit_flip_margin": 0.01, "prefix_hit_logprob_err": 0.015,
         "prefix_hit_ok": True}], "stub_calls": []}))
    (call / "probe" / "grid_probe.json").write_text(json.dumps({"rows": [
        {"model": "gpt-oss-20b", "bench": "decode", "batch": 1, "context": 8192, "tok_s_per_user": 400.0},
        {"model": "gpt-oss-20b", "bench": "prefill", "length": 8192, "latency_ms": 120.0},
        {"model": "gpt-oss-20b", "bench": "decode", "batch": 128, "context": 8192, "does_not_fit": "KV"}]}))
    (call / "harness_decode.json").write_text(json.dumps({"rows": [
        {"bench": "decode", "batch": 1, "context": 8192, "tok_s_per_user": 460.0, "probe_on_step_ms": 2.5}]}))
    monkeypatch.setattr(collect, "OUT", tmp_path / "served_gpu")
    collect.main(["--call", str(call)])
    result = json.loads((tmp_path / "served_gpu.json").read_text())
    assert {"device", "torch", "triton", "sglang", "flags", "parity", "decode", "prefill"} <= set(result)
    assert set(result["parity"][0]) >= {"checkpoint", "cuda_graph", "tokens_match", "tokens_total",
                                        "probe_max_abs_err", "cached_equals_cold"}
    (decode,) = result["decode"]
    assert decode["probe"] and decode["harness_tok_s_per_user"] == pytest.approx(400.0)  # 1 / 2.5 ms, probe on
    assert decode["served_over_harness"] == pytest.approx(1.0)
    assert decode["host_python_loop_ms"] == 7.5  # the machine's Python speed beside each served row
    assert set(decode) >= {"model", "batch", "context", "probe", "served_tok_s_per_user", "harness_tok_s_per_user"}
    assert set(result["prefill"][0]) >= {"model", "input_tokens", "served_ttft_ms", "harness_ms"}
    assert "KV" in result["checks"][0]["result"]
    assert "parts at 7 (margin 0.010, lp err 0.015) |" in (tmp_path / "served_gpu.md").read_text()
    # a second call replaces rows of the same key and keeps the rest
    collect.main(["--call", str(call)])
    assert len(json.loads((tmp_path / "served_gpu.json").read_text())["decode"]) == 1


def test_collect_records_the_gpu_tests_of_a_call(tmp_path, monkeypatch):
    """run_gpu_tests.sh's junit file (pytest's own, from a run with one pass, one failure and one skip) becomes
    gpu_tests.json (+ .md): the counts, each test's outcome and the failure's reason, with the card and commit."""
    import collect

    call = tmp_path / "call"
    call.mkdir()
    (call / "env.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0"}))
    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no card')\n"
        "def test_skipped(): pass\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={call / 'gpu_tests.xml'}",
                    str(tmp_path / "test_three.py")], capture_output=True, cwd=tmp_path)
    monkeypatch.setattr(collect, "OUT", tmp_path / "served_gpu")
    monkeypatch.setattr(collect, "GPU_TESTS", tmp_path / "gpu_tests")
    collect.main(["--call", str(call), "--commit", "abc1234"])
    got = json.loads((tmp_path / "gpu_tests.json").read_text())
    assert got["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert (got["device"], got["commit"]) == ("NVIDIA H100 80GB HBM3", "abc1234")
    bad = next(t for t in got["tests"] if t["test"].endswith("test_bad"))
    assert bad["outcome"] == "failed" and "one is not two" in bad["reason"]
    md = (tmp_path / "gpu_tests.md").read_text()
    assert "1 passed, 1 failed, 0 errors, 1 skipped" in md and "abc1234" in md


def test_collect_withholds_greedy_weightless_batches(tmp_path, monkeypatch):
    """A weightless grid decoded greedily: its batch > 1 rows are marked invalid (they route alike); batch 1 and a
    grid sampled at temperature 1 are not."""
    import collect

    for name, temperature in (("greedy", ""), ("sampled", " --temperature 1.0")):
        call = tmp_path / name
        (call / "probe").mkdir(parents=True)
        (call / "env.json").write_text(json.dumps({"device": f"card {name}"}))
        (call / "probe" / "grid_probe.json").write_text(json.dumps({
            "meta": {"command": f"python benchmarks/sglang_server_grid.py{temperature} -- --load-format dummy"},
            "rows": [{"model": "gpt-oss-20b", "bench": "decode", "batch": b, "context": 8192, "tok_s_per_user": 100.0}
                     for b in (1, 8)]}))
        monkeypatch.setattr(collect, "OUT", tmp_path / f"served_{name}")
        collect.main(["--call", str(call)])
        rows = {r["batch"]: r for r in json.loads((tmp_path / f"served_{name}.json").read_text())["decode"]}
        assert "note" not in rows[1]
        assert str(rows[8].get("note", "")).startswith("invalid") == (name == "greedy")


def test_collect_reads_decode_rates_from_a_cut_grids_server_log(tmp_path, monkeypatch):
    """A grid killed before one_batch_server wrote its result: the scheduler's own rate lines in the server log
    become rows (median per batch, first interval dropped), beside the same call's harness; a batch that has a
    one_batch_server row keeps only that."""
    import collect

    call = tmp_path / "call"
    (call / "probe").mkdir(parents=True)
    (call / "env.json").write_text(json.dumps({"device": "H100", "host": {"python_loop_ms": 8.0}}))

    def line(batch, rate):
        return (f"[t] Decode batch, #running-req: {batch}, #full token: {8233 * batch}, full token usage: 0.01, "
                f"cuda graph: True, gen throughput (token/s): {rate}, #queue-req: 0\n")

    (call / "probe" / "server_1_1_1.log").write_text(
        "server_args={'model_path': '/tmp/sglang_ext_full/gpt-oss-20b-mxfp4', 'x': 1}\n"
        + line(1, 50.0) + line(1, 440.0) + line(1, 444.0) + line(1, 442.0)
        + line(8, 300.0) + line(8, 2100.0) + line(8, 2200.0) + line(32, 30.0) + line(32, 31.0) + line(32, 32.0)
        + collect.ROUTERS_ONLY_LOG + "\n")
    (call / "harness_decode.json").write_text(json.dumps({"rows": [
        {"bench": "decode", "batch": 1, "context": 8192, "tok_s_per_user": 470.0, "probe_on_step_ms": 2.0}]}))
    (call / "probe" / "grid_probe.json").write_text(json.dumps({"rows": [
        {"model": "gpt-oss-20b", "bench": "decode", "batch": 8, "context": 8192, "tok_s_per_user": 250.0}]}))
    monkeypatch.setattr(collect, "OUT", tmp_path / "served_gpu")
    collect.main(["--call", str(call)])
    result = json.loads((tmp_path / "served_gpu.json").read_text())
    row, row32 = result["scheduler_log"]  # batch 8 has its one_batch_server row
    assert row32["batch"] == 32 and row32["note"] == collect.ROUTERS_ONLY and "note" not in row
    assert (row["model"], row["batch"], row["context"], row["probe"]) == ("gpt-oss-20b", 1, 8233, True)
    assert row["tok_s_per_user"] == 442.0 and row["intervals"] == 3
    assert row["harness_tok_s_per_user"] == 500.0 and row["served_over_harness"] == pytest.approx(0.884)
    assert "| gpt-oss-20b | 1 | 8233 | on | 442.0 | 500.0 | 0.884 | 3 | call | H100 |  |" in (
        tmp_path / "served_gpu.md").read_text()


def test_profile_summary_splits_busy_idle_and_graph_launches():
    import profile_decode

    def kernel(name, ts, dur, graph=True):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"graph id": 1, "graph node id": 7} if graph else {"device": 0}}

    # two steps of 10 us: a graph kernel overlapping another, then a kernel launched outside the graph after a
    # 30 us gap (the host), then 5 us of idle under the 20 us threshold
    events = [kernel("gemm", 0, 10), kernel("attn", 5, 10), kernel("sample", 45, 5, graph=False),
              kernel("gemm", 55, 10), {"ph": "X", "cat": "cpu_op", "name": "aten::argmax", "ts": 40, "dur": 3},
              {"ph": "X", "cat": "python_function", "name": "frame", "ts": 0, "dur": 100}]
    got = profile_decode.summarize(events, decode_steps=2)
    assert got["kernels"] == 4 and got["span_ms"] == pytest.approx(0.065)
    assert got["busy_ms"] == pytest.approx(0.030) and got["idle_ms"] == pytest.approx(0.035)
    assert got["gaps_over_20us"] == 1 and got["gap_ms_over_20us"] == pytest.approx(0.030)
    assert got["outside_graph"] == 1 and got["per_step_busy_ms"] == pytest.approx(0.015)
    assert got["top_kernels"][0] == {"name": "gemm", "count": 2, "total_ms": 0.02, "outside_graph": 0}
    assert [c["name"] for c in got["top_cpu"]] == ["aten::argmax"]  # stack frames are not ops


def test_host_describes_the_cpu_and_times_a_python_loop():
    import gpu_env

    got = gpu_env.host()
    assert got["cores"] == os.cpu_count() and got["python_loop_ms"] > 0 and "loadavg_1m" in got
