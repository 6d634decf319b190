"""The launcher's command line with the plugin: the flag, a bad path, a wrong SGLang version."""

import subprocess
import sys
import time

import pytest

from sglang_ext.launch.cpu_shims import cpu_server_env

pytestmark = pytest.mark.server

LAUNCH = [sys.executable, "-m", "sglang.launch_server"]


def run(args, timeout=300, pre=""):
    if pre:
        cmd = [sys.executable, "-c", pre + "\nimport runpy, sys\nsys.argv = ['launch_server'] + sys.argv[1:]\n"
               "runpy.run_module('sglang.launch_server', run_name='__main__')", *args]
    else:
        cmd = LAUNCH + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=cpu_server_env(),
                          stdin=subprocess.DEVNULL)


def test_help_lists_probe_ckpt_and_backend():
    out = run(["--help"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--probe-ckpt PATH" in out.stdout
    assert "ext_sinks" in out.stdout


def test_missing_probe_ckpt_fails_fast_with_one_line(tiny_checkpoints, tmp_path):
    missing = tmp_path / "no-such-probe"
    t0 = time.time()
    out = run(["--model-path", str(tiny_checkpoints["fp32"]), "--device", "cpu", "--probe-ckpt", str(missing)])
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last == f"--probe-ckpt: no such file or directory: {missing}"
    assert "Traceback" not in out.stderr
    # Stopped during argument parsing: no scheduler started, no weights loaded.
    assert "Load weight" not in out.stderr + out.stdout and "scheduler" not in out.stderr.lower()
    print(f"failed after {time.time() - t0:.1f} s")


def test_wrong_sglang_version_fails_with_one_line():
    fake = (
        "import importlib.metadata as md\n"
        "_real = md.version\n"
        "md.version = lambda name: '0.5.22' if name == 'sglang' else _real(name)\n"
    )
    out = run(["--help"], pre=fake)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("sglang-ext ") and "needs sglang==0.5.23" in last and "sglang==0.5.22 is installed" in last
    assert "Traceback" not in out.stderr


def test_plugin_is_idempotent():
    from sglang.srt.plugins import hook_registry

    from sglang_ext import plugin
    from sglang_ext.patches import register_all

    register_all()
    before = {k: len(v) for k, v in hook_registry.HookRegistry._hooks.items()}
    plugin.load()
    plugin.load()
    register_all()
    after = {k: len(v) for k, v in hook_registry.HookRegistry._hooks.items()}
    assert before == after


def test_cpu_servers_skip_sglangs_other_model_modules(monkeypatch):
    """The shims hand SGLang's own SGLANG_DISABLED_MODEL_ARCHS every model module but gpt_oss (the served
    tests show the registry still finds gpt-oss); a value already set is kept."""
    monkeypatch.delenv("SGLANG_DISABLED_MODEL_ARCHS", raising=False)
    skipped = cpu_server_env()["SGLANG_DISABLED_MODEL_ARCHS"].split(",")
    assert "gpt_oss" not in skipped and "registry" not in skipped
    assert {"llama", "qwen2", "deepseek_v2"} <= set(skipped)
    monkeypatch.setenv("SGLANG_DISABLED_MODEL_ARCHS", "llama")
    assert cpu_server_env()["SGLANG_DISABLED_MODEL_ARCHS"] == "llama"


def test_cpu_servers_run_one_intra_op_thread(monkeypatch):
    """The shims give SGLang's CPU processes one OpenMP / torch intra-op thread (beside another busy process,
    torch's default of one a core stalls every small op of the tiny model); a value already set is kept."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_server_env()["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_server_env()["OMP_NUM_THREADS"] == "2"
