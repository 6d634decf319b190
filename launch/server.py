"""Start and stop a real SGLang server on 127.0.0.1 with sglang-ext on this CPU.

Used by the demo, the server tests and the CPU benchmark: one way to start, wait
for readiness, and stop the process tree that *we* started (by PID, never by name).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from sglang_ext.launch.cpu_shims import cpu_server_env, has_cuda_driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# For servers that only see token ids (ids in, ids / logprobs / scores out): no tokenizer is
# loaded. SGLang 0.5.23 loads it several times in each of its three processes, ~30 s of a ~75 s
# start on two cores.
IDS_ONLY_ARGS = ("--skip-tokenizer-init",)


class ServerFailed(RuntimeError):
    pass


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid`. A zombie counts as alive to kill(0), and where no init reaps
    orphans (a container) zombies stay: so read /proc, where a zombie is gone once its last thread is (a
    process whose main thread exited shows "Z" while another thread may still hold the GPU). Elsewhere:
    [pgid] while kill(0) says the group exists."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()  # bytes: a process name is any bytes, not always UTF-8
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and ")", so split after the last ")"
            fields = stat[stat.rindex(b")") + 2:].split()
            if int(fields[2]) != pgid or fields[0] == b"X":
                continue
            if fields[0] == b"Z" and len(os.listdir(entry / "task")) <= 1:
                continue
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile, or not a stat line this parser knows
        members.append(int(entry.name))
    return members


# Sets the parent-death signal (prctl PR_SET_PDEATHSIG = 1, SIGKILL = 9), then execs the command: the
# setting survives exec, and the kernel sends SIGKILL once the thread that started the wrapper exits.
_DIE_WITH_PARENT = "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9); os.execv(sys.argv[1], sys.argv[1:])"


def with_parent_death(command: list[str]) -> list[str]:
    """`command`, started so that it gets SIGKILL when the thread that started it exits, however that ends
    (the thread, not the process: spawn it from the thread that lives as long as it should, e.g. the main one).
    Why: servers run in their own session (so stop() can kill their whole group), so a test run or demo killed
    by a signal, whose stop() never ran, left its servers and their schedulers running beside the next run
    (SGLang's own subprocesses die with the launcher). A wrapper, not Popen's preexec_fn, which may deadlock
    in a process with threads. Linux only: elsewhere the command as it is."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-c", _DIE_WITH_PARENT, *command]


class SGLangServer:
    """`with SGLangServer(model, extra_args) as srv:` -> srv.url; stopped on exit."""

    def __init__(self, model_path, extra_args=(), port=None, log_path=None, vocab_dir=None,
                 startup_timeout=300.0, cpu=None, ready_path="/health_generate"):
        self.model_path = str(model_path)
        self.extra_args = [str(a) for a in extra_args]
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/sglang_ext_server_{self.port}.log")
        self.vocab_dir = vocab_dir
        self.startup_timeout = startup_timeout
        self.cpu = (not has_cuda_driver()) if cpu is None else cpu
        self.proc: subprocess.Popen | None = None
        self.ready_path = ready_path  # answers 200 once the server serves (a test of a failing one picks another)

    def command(self) -> list[str]:
        # -P: the checkout's top-level `kernels/` (our sources, installed as sglang_ext.kernels) must not hide
        # the PyPI `kernels` package SGLang loads FA3 through when the server starts from the checkout root.
        cmd = [sys.executable, "-P", "-m", "sglang.launch_server", "--model-path", self.model_path,
               "--host", "127.0.0.1", "--port", str(self.port)]
        if self.cpu:
            # --sleep-on-idle: an idle scheduler otherwise spins a whole core polling.
            cmd += ["--device", "cpu", "--skip-server-warmup", "--max-total-tokens", "16384", "--sleep-on-idle"]
        return cmd + self.extra_args

    def ranks(self) -> int:
        """Scheduler processes the server starts: tp x pp x dp replicas. Attention DP groups (--attn-dp-size,
        or the deprecated --dp D --enable-dp-attention, which SGLang resolves to attn_dp_size D, dp_size 1)
        live inside the TP group and add none. As argparse, the last of a repeated flag counts."""
        args = self.extra_args

        def value(*flags: str) -> int:
            found = 1
            for i, arg in enumerate(args):
                if arg in flags and i + 1 < len(args):
                    found = int(args[i + 1])
                elif arg.split("=", 1)[0] in flags and "=" in arg:
                    found = int(arg.split("=", 1)[1])
            return found

        tp = value("--tp-size", "--tp", "--tensor-parallel-size")
        pp = value("--pp-size", "--pipeline-parallel-size")
        dp = value("--dp-size", "--dp", "--data-parallel-size")
        return tp * pp if "--enable-dp-attention" in args else tp * pp * dp

    def start(self) -> "SGLangServer":
        env = cpu_server_env(vocab_dir=self.vocab_dir) if self.cpu else dict(os.environ)
        ranks = self.ranks()
        if self.cpu and ranks > 1:
            # SGLang on a CPU binds each rank's OpenMP threads to cores and refuses more ranks than NUMA nodes
            # unless told which cores each rank takes: one core each, shared round robin past the core count.
            cores = sorted(os.sched_getaffinity(0))
            env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(cores[r % len(cores)]) for r in range(ranks)))
        self._log = open(self.log_path, "w")
        # Own process group: stop() signals the launcher and every child it spawned; and tied to the thread
        # that starts it (the one that stops it), in case that never happens.
        self.proc = subprocess.Popen(with_parent_death(self.command()), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"server exited with {self.proc.returncode}; log: {self.log_path}\n"
                                   + self.log_tail())
            try:
                if requests.get(self.url + self.ready_path, timeout=30).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerFailed(f"server not ready after {self.startup_timeout:.0f} s; log: {self.log_path}\n"
                           + self.log_tail())

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        keep = [line for line in text if "warnings.warn" not in line and "UserWarning" not in line]
        return "\n".join(keep[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        # SIGKILL to the whole process group at once: these servers hold nothing worth a graceful
        # shutdown, and SGLang's SIGTERM path costs 5-10 s on a small CPU (a scheduler killed by the
        # group's SIGTERM counts as crashed and the launcher sleeps 5 s for crash diagnostics; a
        # SIGTERM to the launcher alone drains for ~10 s), each time a test's server stops.
        if self.proc is None:
            return
        group = self.proc.pid  # start_new_session: the launcher leads its own group
        # A launcher start() already reaped, with no process of its group left: its id may name another's
        # group by now, so nothing is signalled.
        if self.proc.returncode is None or group_members(group):
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ServerFailed(f"server launcher {self.proc.pid} still alive {timeout:.0f} s after SIGKILL "
                               f"(uninterruptible?); log: {self.log_path}") from exc
        # The launcher is gone, but its schedulers (they hold the GPUs' memory and ports) may still be
        # exiting: a server started next on the same GPUs would find less memory free.
        deadline = time.time() + timeout
        while (left := group_members(group)) and time.time() < deadline:
            time.sleep(0.1)
        self._log.close()
        self.proc = None
        if left:
            raise ServerFailed(f"server processes {left} still alive {timeout:.0f} s after SIGKILL; "
                               f"log: {self.log_path}")

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and self.proc is not None:
            # The body failed (a request refused, a connection dropped): whether the server was still up and what it
            # logged last go beside the failure, since its log file is per port and a later server may reuse it.
            code = self.proc.poll()
            state = "still running" if code is None else f"exited with {code}"
            print(f"sglang_ext: {exc_type.__name__} while the server at {self.url} was serving; it is {state}; "
                  f"the end of {self.log_path}:\n{self.log_tail()}", file=sys.stderr)
        try:
            self.stop()
        except ServerFailed as stop_failed:
            if exc_type is None:
                raise
            # the body's own failure is the one to report; this one goes beside it
            print(f"sglang_ext: while handling {exc_type.__name__}: {stop_failed}", file=sys.stderr)
