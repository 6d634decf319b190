#!/usr/bin/env bash
# On the GPU machine, in one call: the `gpu` tests (every file that holds one, or the paths given) under the carry's
# environment (benchmarks/served/gpu_env.py), so that a call cut short still names what failed and why:
#   - each result line goes to $OUT/gpu_tests.log as it comes (-v, unbuffered);
#   - a test past $PER_TEST seconds fails (pytest-timeout) rather than holding the run past the call's limit, so
#     pytest's summary with each failure's reason is written (and $OUT/gpu_tests.xml);
#   - $WORKERS processes share the one card, each with its own CUDA cache (a full-shape MoE test holds a few GB);
#   - servers a previous stage left behind are stopped first: they would hold most of the card's memory.
#
#   OUT=... [WORKERS=4] [PER_TEST=240] bash benchmarks/served/run_gpu_tests.sh CARRY_DIR [TEST_PATH...]
set -u
R="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY="${1:?carry folder}"
shift
PATHS=("$@")
if [ ${#PATHS[@]} -eq 0 ]; then
    PATHS=("$R/tests/kernels" "$R/tests/layers/test_fp8_backend.py" "$R/tests/layers/test_layers.py"
           "$R/tests/launch/test_mxfp4_convert.py" "$R/tests/probe/test_probe_cuda_graph.py")
fi
pkill -9 -f "sglang.launch_server|sglang::" 2>/dev/null && sleep 3
eval "$(python3 "$R/benchmarks/served/gpu_env.py" "$CARRY")"
cd /tmp  # the checkout's root would shadow the linked package (gpu_env.py)
PYTHONUNBUFFERED=1 python3 -m pytest -v -p no:cacheprovider -p no:benchmark -m gpu -n "${WORKERS:-4}" \
    --timeout "${PER_TEST:-240}" --tb=short -rfE -c "$R/pyproject.toml" --rootdir "$R" \
    --junitxml "$OUT/gpu_tests.xml" "${PATHS[@]}" >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests: exit $?"
grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT/gpu_tests.log" | tail -40
