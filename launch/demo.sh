#!/usr/bin/env bash
# The demo: a real SGLang server with sglang-ext on this CPU, a tiny random gpt-oss, streamed tokens.
#   bash launch/demo.sh [--port N] [--max-tokens N] [--keep-cache] [--write-benchmark]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup.sh && exec .venv/bin/python -m sglang_ext.launch.demo "$@"
