#!/usr/bin/env bash
# On the GPU machine, in one call: full-size gpt-oss served by the real launch_server with this plugin
# (weightless: --load-format dummy on the official config), measured with SGLang's own one_batch_server
# (benchmarks/sglang_server_grid.py), and the harness on the same shapes in the same call. The grids sample at
# temperature 1: greedy, a weightless model's requests repeat a few tokens and route alike (sglang_server_grid.py).
#
#   OUT=... MODEL=20b bash benchmarks/served/run_full_size.sh CARRY_DIR [STAGES]
#
# STAGES (default "default noprobe harness"; also serving, upstream, harness_prefill):
#   default  the MXFP4 config launched with no sglang-ext flag and CUDA graphs at SGLang's defaults,
#            with the probe: decode at batch 1/8/32/128 (context $CONTEXT) and the batch-1 prefill of $PREFILL
#   noprobe  the same server without the probe (the probe's served overhead)
#   harness  benchmarks/bench_decode.py on the same shapes (probe off and on); harness_prefill: bench_prefill.py
#   serving  SGLang's online benchmark (benchmarks/served/serving_grid.py) at concurrency 1/8/32/128
#   profile  where a batch-1 decode step's time goes in the server (benchmarks/served/profile_decode.py: streamed
#            inter-token intervals and SGLang's profiler over 64 steps); profile_noprobe the same without the probe
#   upstream the peer a user would pick instead: SGLang's own gpt-oss with the plugin not loaded (only its weightless
#            routing patch: SGLANG_PLUGINS=sglang_ext_weightless_routing, gpu_env.py), its triton attention backend,
#            its MXFP4 MoE through the carried triton_kernels, its norms, RoPE and positions from SGLang's JIT kernels
#            (nvcc on the machine, ninja from the carry; the stand-in sgl_kernel delegates its two norms to them)
set -u
R="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY="${1:?carry folder}"
STAGES="${2:-default noprobe harness}"
MODEL="${MODEL:-20b}"
CONTEXT="${CONTEXT:-8192}"
PREFILL="${PREFILL-8192}"          # empty: no prefill run
BATCHES="${BATCHES:-1,8,32,128}"
OUTPUT_LEN="${OUTPUT_LEN:-256}"
VARIANT="${VARIANT:-mxfp4}"          # which quantization_config the weightless folder carries
SERVER_EXTRA="${SERVER_EXTRA:-}"     # e.g. "--cuda-graph-max-bs-decode 128" (empty: SGLang's defaults)
FINAL_OUT="$OUT"
OUT=/tmp/sglang_ext_results  # many files: they come back as one archive ($FINAL_OUT/full_size.tgz)
mkdir -p "$OUT"
trap 'cp "${KERNEL_STUB_LOG:-/dev/null}" "$OUT/sgl_kernel_calls.log" 2>/dev/null; cp /tmp/sglang_ext_server_*.log "$OUT/" 2>/dev/null; tar czf "$FINAL_OUT/full_size.tgz" -C "$OUT" .' EXIT
eval "$(python3 "$R/benchmarks/served/gpu_env.py" "$CARRY")"
cd /tmp
python3 "$R/benchmarks/served/gpu_env.py" --describe >"$OUT/env.json"
FULL=/tmp/sglang_ext_full
python3 "$R/benchmarks/served/full_size.py" --out "$FULL" --models "$MODEL" --variants mxfp4,fp8 >/dev/null
# The carry's stand-in sgl_kernel has no sampling kernels and no weak_ref_tensor (SGLang's breakable prefill graphs):
# the only flags this machine adds (gpu_env.SERVER_FLAGS).
MACHINE_FLAGS=(--sampling-backend pytorch --disable-prefill-cuda-graph)
grid() {  # grid NAME PROBE_ARGS...
    local name="$1"; shift
    timeout "${GRID_TIMEOUT:-420}" python3 "$R/benchmarks/sglang_server_grid.py" --model-path "$FULL/gpt-oss-$MODEL-$VARIANT" \
        --model-name "gpt-oss-$MODEL" --device cuda --batches "$BATCHES" --contexts "$CONTEXT" --lengths "$PREFILL" \
        --output-len "$OUTPUT_LEN" --prefill-repeats 3 --startup-timeout 600 --bench-timeout "${BENCH_TIMEOUT:-300}" \
        --temperature 1 --out "$OUT/$name" --stem "grid_$name" "$@" -- --load-format dummy "${MACHINE_FLAGS[@]}" $SERVER_EXTRA \
        >"$OUT/$name.log" 2>&1
    echo "grid $name: exit $?"; tail -5 "$OUT/$name.log"
}
for stage in $STAGES; do
    case "$stage" in
        default) grid probe --probe-ckpt "$FULL/probe-$MODEL" ;;
        noprobe) grid noprobe ;;
        serving)  # SGLang's online benchmark (random-ids) at concurrency 1/8/32/128, probe on
            timeout "${SERVING_TIMEOUT:-420}" python3 "$R/benchmarks/served/serving_grid.py" \
                --model-path "$FULL/gpt-oss-$MODEL-$VARIANT" --model-name "gpt-oss-$MODEL" --probe-ckpt "$FULL/probe-$MODEL" \
                --concurrency "${CONCURRENCY:-1,8,32,128}" --input-len "${SERVING_INPUT:-1024}" --output-len "$OUTPUT_LEN" \
                --out "$OUT/serving_probe.json" -- --load-format dummy "${MACHINE_FLAGS[@]}" $SERVER_EXTRA \
                >"$OUT/serving.log" 2>&1
            echo "serving: exit $?"; tail -4 "$OUT/serving.log" ;;
        upstream)  # the peer: SGLang's own gpt-oss (plugin not loaded), MXFP4 through triton_kernels where present
            python3 -c "import triton_kernels.matmul" >"$OUT/upstream_triton_kernels.txt" 2>&1 \
                && echo "triton_kernels imports under this Triton" >>"$OUT/upstream_triton_kernels.txt"
            # Without the real sgl_kernel, upstream's RMSNorm, RoPE and positions need SGLang's JIT kernels (nvcc, ninja)
            { which nvcc ninja g++; nvcc --version; } >"$OUT/upstream_toolchain.txt" 2>&1
            # Its fused ops as a user gets them (SGLang's JIT kernels), not the torch ones gpu_env forces for our path:
            # forced to torch, its TopK returns the standard format and the triton_kernels MoE runner asserts.
            env -u SGLANG_FORCE_FUSED_OP_BACKEND SGLANG_PLUGINS=sglang_ext_weightless_routing \
                timeout "${GRID_TIMEOUT:-420}" python3 "$R/benchmarks/sglang_server_grid.py" \
                --model-path "$FULL/gpt-oss-$MODEL-mxfp4" --model-name "gpt-oss-$MODEL" --device cuda --batches "$BATCHES" \
                --contexts "$CONTEXT" --lengths "$PREFILL" --output-len "$OUTPUT_LEN" --prefill-repeats 3 \
                --startup-timeout 600 --bench-timeout "${BENCH_TIMEOUT:-300}" --temperature 1 --out "$OUT/upstream" --stem grid_upstream \
                -- --load-format dummy "${MACHINE_FLAGS[@]}" --attention-backend triton $SERVER_EXTRA >"$OUT/upstream.log" 2>&1
            echo "upstream: exit $?"; tail -5 "$OUT/upstream.log" ;;
        profile|profile_noprobe)  # where a served batch-1 decode step's time goes (SGLang's profiler, one server)
            probe_args=(); [ "$stage" = profile ] && probe_args=(--probe-ckpt "$FULL/probe-$MODEL")
            timeout "${PROFILE_TIMEOUT:-300}" python3 "$R/benchmarks/served/profile_decode.py" \
                --model-path "$FULL/gpt-oss-$MODEL-$VARIANT" --model-name "gpt-oss-$MODEL" --context "$CONTEXT" \
                --out "$OUT/$stage" -- --load-format dummy "${MACHINE_FLAGS[@]}" --cuda-graph-max-bs-decode 8 \
                "${probe_args[@]}" $SERVER_EXTRA >"$OUT/$stage.log" 2>&1
            echo "$stage: exit $?"; head -4 "$OUT/$stage/profile_decode.md" 2>/dev/null; find "$OUT/$stage/trace" -type f -size +6M -delete 2>/dev/null ;;
        harness)
            timeout "${HARNESS_TIMEOUT:-300}" python3 "$R/benchmarks/bench_decode.py" --models "$MODEL" \
                --batches "$BATCHES" --contexts "$CONTEXT" --probe-rounds "${PROBE_ROUNDS:-20}" --out "$OUT" \
                --stem harness_decode >"$OUT/harness.log" 2>&1
            echo "harness decode: exit $?"; tail -3 "$OUT/harness.log" ;;
        harness_prefill)
            timeout 200 python3 "$R/benchmarks/bench_prefill.py" --models "$MODEL" --lengths "$PREFILL" --iters 3 \
                --out "$OUT" --stem harness_prefill >>"$OUT/harness.log" 2>&1
            echo "harness prefill: exit $?"; tail -3 "$OUT/harness.log" ;;
    esac
done
