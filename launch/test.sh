#!/usr/bin/env bash
# The tests: pytest over tests/ (config in pyproject.toml); GPU tests skip without CUDA.
#   bash launch/test.sh [pytest args...]
# Two pytest-xdist workers, one test file each at a time (a file's server fixture stays on one
# worker): the CPU servers spend much of their time waiting on HTTP, so two files overlap well on
# two cores. SGLANG_EXT_TEST_WORKERS=0 runs in one process.
# With workers, one intra-op thread per process (OMP_NUM_THREADS, kept if set): two workers already fill
# two cores, and torch's default of a thread a core makes every small op wait on a thread the other
# worker descheduled (the CPU servers always get one, from launch/cpu_shims.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
workers="${SGLANG_EXT_TEST_WORKERS:-2}"
if [ "$workers" != "0" ]; then export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"; fi
bash launch/setup.sh --browser-in-background && exec "${SGLANG_EXT_VENV:-.venv}/bin/python" -m pytest -q -n "$workers" --dist loadfile "$@"
