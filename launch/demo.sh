#!/usr/bin/env bash
# The demo: a real SGLang server with sglang-ext on this CPU, a tiny random gpt-oss with a SingProbe head,
# streamed tokens with their per-token scores, and a request stopped by the guard.
#   bash launch/demo.sh [--port N] [--max-tokens N] [--keep-cache] [--no-probe] [--playground] [--write-benchmark]
# (the browser of the tests is not installed here: SGLANG_EXT_SETUP_BROWSER=0)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SGLANG_EXT_SETUP_BROWSER=0 bash launch/setup.sh && exec "${SGLANG_EXT_VENV:-.venv}/bin/python" -m sglang_ext.launch.demo "$@"
