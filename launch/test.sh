#!/usr/bin/env bash
# The tests: pytest over tests/ (config in pyproject.toml); GPU tests skip without CUDA.
#   bash launch/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup.sh && exec .venv/bin/python -m pytest -q "$@"
