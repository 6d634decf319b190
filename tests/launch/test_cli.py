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


def test_probe_ckpt_with_a_missing_model_path_fails_with_one_line(tiny_checkpoints, tmp_path):
    # The probe is checked against the model's config before SGLang reads --model-path itself.
    from sglang_ext.launch.make_tiny_probe import generate

    tiny_probe = generate(str(tiny_checkpoints["fp32"].parent / "probe"), base_dir=str(tiny_checkpoints["fp32"]),
                          log=lambda *_: None)
    missing = tmp_path / "no-such-model"
    out = run(["--model-path", str(missing), "--device", "cpu", "--probe-ckpt", str(tiny_probe)])
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == f"--model-path: no such folder: {missing}"
    assert "Traceback" not in out.stderr
    not_gpt_oss = tmp_path / "not-a-model"
    not_gpt_oss.mkdir()
    (not_gpt_oss / "config.json").write_text('{"model_type": "no-such-type"}')
    out = run(["--model-path", str(not_gpt_oss), "--device", "cpu", "--probe-ckpt", str(tiny_probe)])
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode != 0 and last.startswith(f"--model-path {not_gpt_oss}: cannot read its config (")
    assert "Traceback" not in out.stderr


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


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent (or an init) to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_demo_without_a_vocabulary_stops_with_one_line(monkeypatch, capsys):
    """No cached o200k vocabulary and no package index: the demo says so in one line, no traceback."""
    from sglang_ext.launch import demo, tokenizer

    message = "o200k vocabulary: not cached in /x and no package index reachable"

    def offline():
        raise RuntimeError(message)

    monkeypatch.setattr(tokenizer, "ensure_o200k_vocab", offline)
    assert demo.main(["--no-probe"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"ERROR: {message}" and "Traceback" not in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux only")
def test_demo_start_keeps_the_server_it_spawned(tmp_path):
    """The parent-death signal follows the thread that spawned the server: the demo's start_with_progress must
    spawn it from the calling thread. (Spawned from a progress helper thread, the demo's server got SIGKILL as
    that thread returned, right after it came up: every request then met a refused connection.)"""
    from sglang_ext.launch import demo, server

    pidfile = tmp_path / "pid"
    sleeper = [sys.executable, "-c", f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
                                     "time.sleep(120)"]

    class FakeServer:  # start() returns once the child runs, as SGLangServer.start returns once it is ready
        proc = None

        def start(self):
            self.proc = subprocess.Popen(server.with_parent_death(sleeper))
            deadline = time.time() + 30
            while not (pidfile.exists() and pidfile.read_text()) and time.time() < deadline:
                time.sleep(0.05)

    fake = FakeServer()
    try:
        demo.start_with_progress(fake, every=0.05)
        time.sleep(0.5)  # the signal, had it been sent, lands within moments
        assert fake.proc.poll() is None, f"the server died after start_with_progress returned ({fake.proc.poll()})"
    finally:
        if fake.proc is not None:
            fake.proc.kill()
            fake.proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux only")
@pytest.mark.parametrize("tied", [True, False])
def test_server_launcher_dies_with_the_process_that_started_it(tmp_path, monkeypatch, tied):
    """A test run or demo killed by a signal leaves no server behind: SGLangServer starts its launcher through
    with_parent_death, whose command gets SIGKILL when the process that started it dies. Untied (the control),
    the command outlives its killed parent, as the servers of a killed test run did."""
    import os
    import signal

    from sglang_ext.launch import server

    pidfile = tmp_path / "pid"
    sleeper = [sys.executable, "-c", f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
                                     "time.sleep(120)"]
    child = server.with_parent_death(sleeper) if tied else sleeper
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, time; subprocess.Popen({child!r}); "
                                                     "time.sleep(120)"])
    pid = None
    try:
        deadline = time.time() + 30
        while not (pidfile.exists() and pidfile.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        pid = int(pidfile.read_text())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        if tied:  # the kernel's signal: gone within moments
            deadline = time.time() + 10
            while _alive(pid) and time.time() < deadline:
                time.sleep(0.05)
        else:  # untied: still there a while after its parent died
            time.sleep(0.5)
        assert _alive(pid) is not tied, f"tied={tied}: the command is {'alive' if _alive(pid) else 'gone'}"
    finally:
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
    if tied:  # the server's launcher goes through the same wrapper
        started = []

        def recording_popen(args, **kwargs):
            started.append(list(args))
            raise server.ServerFailed("recorded")

        srv = server.SGLangServer("/nonexistent", cpu=True, log_path=tmp_path / "server.log")
        monkeypatch.setattr(server.subprocess, "Popen", recording_popen)
        with pytest.raises(server.ServerFailed, match="recorded"):
            srv.start()
        srv._log.close()
        assert started == [server.with_parent_death(srv.command())]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_group_members_lists_the_live_processes_of_a_group():
    """What SGLangServer.stop() waits on: every process of the server's group until it is gone (a scheduler
    holds a GPU's memory until then), not the launcher alone; a zombie is gone unless a thread of it lives."""
    import os
    import platform
    import signal

    from sglang_ext.launch import server

    group = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    try:
        deadline = time.time() + 10
        while len(server.group_members(group.pid)) < 3 and time.time() < deadline:
            time.sleep(0.05)
        assert len(server.group_members(group.pid)) == 3  # bash and its two sleeps
        # a process elsewhere whose name is not UTF-8 (names are bytes) must not break the scan
        odd = subprocess.Popen([sys.executable, "-c", "import ctypes, time; "
                                "ctypes.CDLL(None).prctl(15, b'odd\\xff\\xfename', 0, 0, 0); time.sleep(60)"])
        try:
            time.sleep(0.3)
            assert len(server.group_members(group.pid)) == 3
        finally:
            odd.kill()
            odd.wait()
    finally:
        os.killpg(group.pid, signal.SIGKILL)
        group.wait()
    deadline = time.time() + 10
    while server.group_members(group.pid) and time.time() < deadline:
        time.sleep(0.05)
    assert server.group_members(group.pid) == []
    sys_exit = {"x86_64": 60, "aarch64": 93}.get(platform.machine())
    if sys_exit is None:
        return
    # a process whose main thread has exited ("Z" in its stat) while another thread still runs is alive
    half = subprocess.Popen([sys.executable, "-c", "import ctypes, os, threading, time; threading.Thread(target="
                             "lambda: (time.sleep(3), os._exit(0))).start(); time.sleep(0.2); "
                             f"ctypes.CDLL(None).syscall({sys_exit}, 0)"], start_new_session=True)
    try:
        time.sleep(1.0)
        with open(f"/proc/{half.pid}/stat", "rb") as f:
            assert f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        assert server.group_members(half.pid) == [half.pid]
    finally:
        half.wait()
    assert server.group_members(half.pid) == []


def test_stop_fails_loudly_when_a_servers_process_outlives_it(tmp_path, monkeypatch):
    from sglang_ext.launch import server

    srv = server.SGLangServer("/nonexistent", cpu=True, log_path=tmp_path / "server.log")
    srv.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    srv._log = open(tmp_path / "server.log", "w")
    monkeypatch.setattr(server, "group_members", lambda pgid: [4242])  # a scheduler that will not go
    with pytest.raises(server.ServerFailed, match=r"\[4242\] still alive"):
        srv.stop(timeout=0.5)
    assert srv.proc is None and srv._log.closed  # nothing left to retry on: the launcher is reaped


@pytest.mark.parametrize("args, ranks", [
    (["--tp", "2"], 2), (["--tp-size", "4"], 4), (["--tp=2", "--dp-size", "3"], 6),
    (["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"], 4),
    (["--tp", "2", "--dp", "2", "--enable-dp-attention"], 2),  # attention DP groups live inside the TP group
    (["--tp-size", "4", "--attn-dp-size", "2"], 4),
    (["--tp-size", "2", "--tp-size", "4"], 4),  # as argparse: the last one counts
])
def test_ranks_counts_the_schedulers_sglang_starts(args, ranks):
    from sglang_ext.launch import server

    assert server.SGLangServer("m", args).ranks() == ranks


def test_a_failure_inside_the_server_block_reports_the_servers_state_and_log(tmp_path, capsys):
    """A request that fails inside `with SGLangServer(...)` (say, a connection dropped mid-/generate) shows
    whether the server was still up and the end of its log beside the failure."""
    from sglang_ext.launch import server

    srv = server.SGLangServer("/nonexistent", cpu=True, log_path=tmp_path / "server.log")
    (tmp_path / "server.log").write_text("scheduler: started\nscheduler: Killed\n")
    srv._log = open(tmp_path / "other.log", "w")
    srv.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(9)"], start_new_session=True)
    srv.proc.wait()
    failure = ConnectionError("Remote end closed connection without response")
    assert not srv.__exit__(ConnectionError, failure, None)  # as `with` calls it: the failure propagates
    err = capsys.readouterr().err
    assert "ConnectionError while the server at" in err and "it is exited with 9" in err
    assert "scheduler: Killed" in err and srv.proc is None
