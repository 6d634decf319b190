"""A wall-clock stack sampler for every Python process of a served run (the GPU machine has no py-spy and may
not allow ptrace): on PYTHONPATH with SGLANG_EXT_STACKS=DIR set, each process started afterwards samples its
threads' Python stacks while DIR/on exists and writes DIR/<process>-<pid>.folded ("thread;frame;... us").

Each sample is weighted by the wall time since the previous one: a thread holding the GIL delays the sampler
by up to the switch interval, and that time belongs to where it was running, not to the sampler.
"""

import os

if os.environ.get("SGLANG_EXT_STACKS"):
    import collections
    import sys
    import threading
    import time

    def _process_name() -> str:
        try:
            with open("/proc/self/cmdline", "rb") as f:
                name = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            name = "python"
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in os.path.basename(name))[:60] or "python"

    def _label(frame) -> str:
        code = frame.f_code
        return f"{code.co_name}@{os.path.basename(code.co_filename)}:{code.co_firstlineno}"

    def _sample(folder: str, interval: float = 0.001) -> None:
        switch = os.path.join(folder, "on")
        me = threading.get_ident()
        weights: collections.Counter = collections.Counter()
        last = last_write = None
        while True:
            if not os.path.exists(switch):
                if weights and last is not None:
                    _write(folder, weights)
                last = None
                time.sleep(0.05)
                continue
            time.sleep(interval)
            now = time.perf_counter()
            if last is None:
                last, last_write = now, now
                continue
            dt_us = int((now - last) * 1e6)
            last = now
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                stack = []
                while frame is not None:
                    stack.append(_label(frame))
                    frame = frame.f_back
                weights[(names.get(tid, str(tid)), tuple(reversed(stack)))] += dt_us
            if now - last_write > 1.0:
                _write(folder, weights)
                last_write = now

    def _write(folder, weights) -> None:
        path = os.path.join(folder, f"{_process_name()}-{os.getpid()}.folded")
        with open(path + ".tmp", "w") as f:
            for (thread, stack), us in weights.items():
                f.write(";".join((thread, *stack)) + f" {us}\n")
        os.replace(path + ".tmp", path)

    os.makedirs(os.environ["SGLANG_EXT_STACKS"], exist_ok=True)
    threading.Thread(target=_sample, args=(os.environ["SGLANG_EXT_STACKS"],), name="stack-sampler",
                     daemon=True).start()
