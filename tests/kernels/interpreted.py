"""Run a test file as a script under ``TRITON_INTERPRET=1`` (the variable must be set before Triton is
imported, so the kernel checks of a pytest process run in a child) and return the JSON lines it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_interpreted(script: str, args: list, timeout: float = 600) -> list[dict]:
    """`python script *args` with TRITON_INTERPRET=1; every stdout line that starts with "{", parsed. A
    non-zero exit fails the calling test with the tail of both streams."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, os.path.abspath(script), *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"interpreted run {args} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
