#!/usr/bin/env bash
# The GPU runs behind benchmarks/results/, one stage per device call (each well inside 10 minutes):
#
#   bash benchmarks/run_h200.sh tests     # the `gpu` tests of the kernels only
#   bash benchmarks/run_h200.sh kernels   # GPU tests of the kernels + the three kernel benchmarks
#   bash benchmarks/run_h200.sh model     # model-step decode + prefill grid on one H200 (+ modelled configs)
#   bash benchmarks/run_h200.sh x2        # NCCL calibration + measured 2-GPU configurations (nvidia-h200-x2)
#   bash benchmarks/run_h200.sh b1        # batch-1 decode: launch floor, GEMV fixed cost, per-kernel times, ncu
#   bash benchmarks/run_h200.sh floor     # how fast a kernel reads 1-1000 MB; a one-shot GEMV prototype
#   bash benchmarks/run_h200.sh moe3      # MoE prefill one-dot gpu tests + prefill sweep
#   bash benchmarks/run_h200.sh moedec    # one-shot decode MoE gpu tests + sweep
#   bash benchmarks/run_h200.sh sweep5    # (x2) one-shot kernels: gpu tests | sink + fp8 GEMV sweeps
#   bash benchmarks/run_h200.sh final5    # (x2) session 5's committed grids, diagnosis and kernel tables
#   bash benchmarks/run_h200.sh final5b   # (x2) sliced quantising norm + probe priority: TP1 decode, b1 diagnosis
#   bash benchmarks/run_h200.sh final5c   # (x2) decode grid with the probe beside the LM head + probe gpu tests
#   bash benchmarks/run_h200.sh pdl       # (x2) programmatic dependent launch: step time + bits | gpu tests with PDL on
#   bash benchmarks/run_h200.sh final6    # (x2) decode grid with PDL (+ 120b b128 ctx 4k) | diag_pdl + PDL gpu tests
#   bash benchmarks/run_h200.sh pair      # (x2) MoE per-pair mlp2: decode MoE sweep + gpu tests | in-step A/B (PDL on)
#   bash benchmarks/run_h200.sh pair1     # (one GPU) per-pair mlp2: in-step A/B on 120b (PDL on) + its gpu tests
#   bash benchmarks/run_h200.sh t8        # (one GPU) one-shot MoE (per-pair mlp2) at 8 tokens, 120b and 20b + MoE gpu tests
#   bash benchmarks/run_h200.sh final6b   # (one GPU) with the per-pair mlp2: PDL bits test, diag_pdl batch 1, TP1 decode rows
#   bash benchmarks/run_h200.sh prefill7  # (one GPU) MoE prefill two-pass mlp1 diagnosis + ncu, extend sweep
#   bash benchmarks/run_h200.sh prefill7b # (one GPU) two-pass mlp1 + register caps, scalar-scale mlp2; MoE gpu tests
#   bash benchmarks/run_h200.sh final7    # (one GPU) prefill grid + MoE tables with the two-pass row; MoE/layer gpu tests
#   bash benchmarks/run_h200.sh ab7       # (one GPU) MoE prefill row A/B on the model step (before / two-pass / before)
#   bash benchmarks/run_h200.sh final7b   # (one GPU) final7 after the width rule and the decode rows' vector W2 scale
#   bash benchmarks/run_h200.sh prefill7c # (one GPU) the prefill grid with 3 warm-up + 5 timed calls per length
#   bash benchmarks/run_h200.sh pdl7      # (one GPU) h quantisation's early release: bits, in-step A/B; TP-shard MoE tests
#   bash benchmarks/run_h200.sh tma8      # (one GPU) TMA prototypes of the prefill GEMMs; extend attention variants
#   bash benchmarks/run_h200.sh tma8b     # (one GPU) TMA rows in the tables: gpu tests, TP1 prefill rows + profile
#   bash benchmarks/run_h200.sh tma8c     # (one GPU) MoE prefill TMA neighbours; prefill host vs device time
#   bash benchmarks/run_h200.sh final8    # (one GPU) prefill grid, FP8 GEMM and MoE tables with the TMA rows
#   bash benchmarks/run_h200.sh host8     # (one GPU) host share of a short prefill and of one MoE layer
#   bash benchmarks/run_h200.sh final8b   # (one GPU) final8's prefill grid + MoE table after the host-side fix
#   bash benchmarks/run_h200.sh tma8d     # (one GPU) TMA tiles at decode sizes: dense M 32..256, MoE 32..128 tokens
#   bash benchmarks/run_h200.sh decode8   # (one GPU) TMA tiles in the decode rows: gpu tests + TP1 decode rows
#   bash benchmarks/run_h200.sh win9      # (one GPU) one-shot sliding-window extend: gpu tests, tiles; warp-specialised
#                                         # GEMM probe; TP1 prefill rows with the profile
#   bash benchmarks/run_h200.sh win9b     # (one GPU) win9's full-shape sink test, window tiles on both slot layouts,
#                                         # dense GEMM tiles by M, ncu of the extend kernels, the WS loop
#   bash benchmarks/run_h200.sh attn9     # (one GPU) extend on raw scores: gpu tests, device-time extend table + tiles,
#                                         # dense GEMM tiles in CUDA graphs
#   bash benchmarks/run_h200.sh tiles9    # (one GPU) shipped dense GEMM on other TMA tiles; TP1 prefill rows + profile
#   bash benchmarks/run_h200.sh final9    # (one GPU) dense M <= 1024 row: gpu tests + GEMM table; TP1 prefill; sink table
#   bash benchmarks/run_h200.sh rope10    # (one GPU) RoPE + KV write in the one-shot decode attention: its gpu
#                                         # tests (sink, rope_kv, PDL bits), the fused vs unfused step A/B
#   bash benchmarks/run_h200.sh dec10     # (one GPU) the sink gpu tests; decode attention fused / unfused / variants
#                                         # with compiled resources, and its ncu; MoE gpu tests + TP1 decode rows
#   bash benchmarks/run_h200.sh dec10b    # (one GPU) sink + rope_kv gpu tests (explicit-FMA RoPE); decode attention
#                                         # variants (register cap, V late with RoPE); in-step picks; MoE gpu tests
#                                         # and the 120b batch-32 profile (the routing launch's pair-comparison sort)
#   bash benchmarks/run_h200.sh final10   # (one GPU) the RoPE sweep in bf16, full-shape sink tests, PDL bits; TP1
#                                         # decode rows with session 10's kernels
#   bash benchmarks/run_h200.sh rope11    # (one GPU) RoPE + KV write in the split-loop decode: its gpu sweep, step
#                                         # A/B at batch 8 and at batch 1 / 4 with a server's 131072-wide KV table;
#                                         # TP1 decode rows
#                                         # (session 11's norm-in-the-MoE-front A/B ran as stage norm11 at d96fc76,
#                                         # its slot-loop mlp2 as stage loop11 at 432834f)
#                                         # (session 12's L2 prefetch of the GEMVs' weights ran as stage l2pf12 at
#                                         # e9583e0, reverted: results/history/diag_l2_prefetch*_REVERTED.md)
#   bash benchmarks/run_h200.sh ncu11     # (one GPU) ncu of the batch-1 MoE layer's kernels (stall reasons)
#   bash benchmarks/run_h200.sh head11    # (one GPU) the opt-in FP8 LM head: error, time, TP1 rows beside the bf16 head
#   bash benchmarks/run_h200.sh final11   # (one GPU) PDL bits, the layers and the full-shape sink tests
#   bash benchmarks/run_h200.sh width11   # (one GPU) decode attention at a 131072-wide table: split loop vs one-shot
#   bash benchmarks/run_h200.sh dg12      # (one GPU) DeepGEMM as a peer of the FP8 GEMM: its smoke test, then the
#                                         # FP8 GEMM table with every peer (carry .peers/deepgemm .peers/sglang_src)
#   bash benchmarks/run_h200.sh rows12    # (one GPU) dense FP8 GEMM tiles at 17..256 rows (x pre-quantised), with the
#                                         # peers (carry .peers/deepgemm .peers/sglang_src)
#   bash benchmarks/run_h200.sh round12   # (one GPU) how often each dense FP8 GEMM tile rounds its bf16 outputs
#                                         # correctly (float64 oracle)
#                                         # (session 13's h quantisation by mlp1's last arrivers ran as stage hq13
#                                         # at 92361bc, and inside the per-pair mlp2 as stage hq13b at fdec0d1;
#                                         # both reverted: results/history/diag_hquant_REVERTED.md,
#                                         # diag_moe_oneshot_quant_in_mlp2_REVERTED.md)
#                                         # (stages rows12b / rows12c ran the wide tile for 17..64 rows at 51b0490,
#                                         # reverted: results/history/*wide_tile*_REVERTED.md)
#   bash benchmarks/run_h200.sh dg13      # (one GPU) DeepGEMM as the dense FP8 backend: gpu test, backend table
#                                         # by M (time, correctly rounded outputs), and round12
#   bash benchmarks/run_h200.sh fa13      # (one GPU) wide tile gpu test, flash-attention prefill prototype, backend
#                                         # table at 16..128 rows
#   bash benchmarks/run_h200.sh prefill13 # (one GPU) the no-prefix prefill attention: gpu tests, TP1 prefill rows
#   bash benchmarks/run_h200.sh decode13  # (one GPU) TP1 decode rows at batch 1, 8, 32, 64
#   bash benchmarks/run_h200.sh dgab13    # (one GPU) SGLANG_EXT_FP8_GEMM=auto vs ours in the decode step
#   bash benchmarks/run_h200.sh check14   # (one GPU) gpu tests of session 13's post-GPU review mends
#   bash benchmarks/run_h200.sh fa14      # (one GPU) prefill attention variants: exp2 polynomial, rotated loop;
#                                         # extend with an 8k cached prefix: key loop vs a gather + TMA prototype
#   bash benchmarks/run_h200.sh win14     # (one GPU) sliding-layer prefill by the prefill kernel: diag, tests, TP1 prefill
#   bash benchmarks/run_h200.sh graph14   # (one GPU) window diag; TP1 prefill eager vs one CUDA graph
#   bash benchmarks/run_h200.sh small14   # (one GPU) prefill's small kernels by launch choice (diag_prefill_small)
#   bash benchmarks/run_h200.sh sort14    # (one GPU) MoE gpu tests + TP1 prefill (eager, graph, profile) after the sort chunk
#                                         # (session 15's grouped one-shot decode MoE ran as stages grp15 / grp15b at
#                                         # f1cf499, reverted: results/history/*grouped*_REVERTED.md)
#                                         # (and its staggered tiles as stage stg15 at 209d548, reverted:
#                                         # results/history/*stagger_REVERTED.md)
#   bash benchmarks/run_h200.sh b128_15   # (one GPU) TP1 decode at batch 128, ctx 8192, probe on/off (20b; 120b if it fits)
#   bash benchmarks/run_h200.sh front15   # (one GPU) MoE front at 17..128 tokens: one-program pair sort vs chunked sort
#   bash benchmarks/run_h200.sh probe16   # (one GPU) the probe's decode step by kernel; its tiles swept at batch 32..128
#   bash benchmarks/run_h200.sh probe16b  # (one GPU) the probe's wide-batch q|k|v tile: gpu tests, step, decode rows A/B
#   bash benchmarks/run_h200.sh gpu16     # (one GPU) every gpu test the session's other stages did not run
#   bash benchmarks/run_h200.sh gpu17     # (one GPU) the gpu tests gpu16 did not reach (not run yet)
#   bash benchmarks/run_h200.sh probe17   # (one GPU) probe attention sweep with its own splits; 20b probe overhead,
#                                         # 200 paired rounds (not run yet)
#   bash benchmarks/run_h200.sh moe17     # (one GPU) the grouped TMA MoE rows at 8 tokens in the decode step (A/B),
#                                         # their kernel sweep at 8 / 16 tokens, then gpu17's tests on 8 workers
#   bash benchmarks/run_h200.sh moe17b    # (one GPU) after the many-pairs rule and the 9..16 TMA row: the 16-token A/B
#                                         # against the old split-K row, 20b at 5..7 tokens, MoE gpu tests, TP1 rows
#   bash benchmarks/run_h200.sh moe17c    # (one GPU) the final rows (7/8 bound, 64-wide mlp2 at 9..16): MoE gpu tests,
#                                         # a 32-token A/B of that mlp2, TP1 rows (20b's probe over 200 rounds)
#   bash benchmarks/run_h200.sh moe17d    # (one GPU) the table with the 64-wide mlp2 at 17..32 too: MoE gpu tests, TP1 rows
#   bash benchmarks/run_h200.sh final18   # (one GPU) session 18's tests and TP1 rows: MoE rows without x gather at
#                                         # 5..128 tokens, o's x_once GEMV at 5..8 rows
#   bash benchmarks/run_h200.sh final18b  # (one GPU) the fp8 GEMM gpu test (cut at 200 s in its run) + session 18's tables vs 17's
#   bash benchmarks/run_h200.sh xptr18    # (one GPU) mlp1 with x's rows by pointers, no gather launch (MoeConfig.tma_x
#                                         # off): gpu tests, layer sweep, step A/B at 8 / 16 / 32 (run in session 18)
#   bash benchmarks/run_h200.sh gemv18    # (one GPU) the dense decode GEMV at 8 rows: sweep + step A/B (diag_pdl
#                                         # --gemv-ab); the 33..128-token MoE row without its x gather, step A/B
#   bash benchmarks/run_h200.sh pdl19     # (one GPU) PDL for the 5..16-row decode chain: bits gpu test, step A/B at 8 / 16
#   bash benchmarks/run_h200.sh pdl19b    # (one GPU) PDL at 4..16 rows with kernel families launched plainly: A/B
#   bash benchmarks/run_h200.sh pdl19c    # (one GPU) the chosen PDL families: bits gpu test, step A/B at 2..16, TP1 rows
#   bash benchmarks/run_h200.sh pdl19d    # (one GPU) qkv's K-loop GEMV plain at 8 rows: A/B; gpu tests of the PDL kernels
#   bash benchmarks/run_h200.sh pdl19e    # (one GPU) the final PDL table: bits gpu test, TP1 rows at batch 8 / 16
#   bash benchmarks/run_h200.sh probe20   # (one GPU) the 20b probe's batch-1 overhead by kernel (run as part of s20a)
#   bash benchmarks/run_h200.sh s20a      # (one GPU) probe20, then the MoE prefill row with x's rows by pointers
#   bash benchmarks/run_h200.sh s20b      # (one GPU) the probe step's positions in its kernels + PDL chain: gpu tests, A/B
#   bash benchmarks/run_h200.sh s20c      # (one GPU) s20b's A/B without the harness's aranges, more variants
#   bash benchmarks/run_h200.sh s20d      # (one GPU) the probe as served after s20c: gpu tests, TP1 rows with the probe
#   bash benchmarks/run_h200.sh s20e      # (one GPU) MoE prefill with bf16 pair outputs: gpu tests, layer A/B, 8k prefill
#                                         # A/B/A on 120b, A/B on 20b
#   bash benchmarks/run_h200.sh s20f      # (one GPU) the prefill row with bf16 pair outputs: MoE gpu tests
#   bash benchmarks/run_h200.sh prefill21 # (one GPU) TP1 prefill rows + profile with bf16 pairs; 1024-token A/B (prepared)
#   bash benchmarks/run_h200.sh ab23      # (one GPU) the 256/1024-token prefill A/B (bf16 pairs vs fp32) in CUDA graphs; Gluon gpu tests
#   bash benchmarks/run_h200.sh host23    # (one GPU) eager prefill on the host (enqueue, graph, blocking calls) per MoE row
#   bash benchmarks/run_h200.sh decode23  # (one GPU) TP1 decode rows with the probe pair: 20b batch 1..128, 120b batch 1 / 8
#   bash benchmarks/run_h200.sh probe23   # (one GPU) the probe's step at 20b batch 32 / 128: overhead and last kernels
#   bash benchmarks/run_h200.sh carve25   # (one GPU) the probe beside an LM head with 8 / 16 SMs carved out; 20b b8 profile
#   bash benchmarks/run_h200.sh carve25b  # (one GPU) the same with the head through cuBLASLt (16 / 32 SMs)
#   bash benchmarks/run_h200.sh b1s25     # (one H200) the 120b batch-1 critical path with today's kernels
#   bash benchmarks/run_h200.sh b1s26     # (one H200) b1s25 (120b batch 1), then 20b batch 1 and 8: today's critical paths
#   bash benchmarks/run_h200.sh decode26  # (one H200) the 20b TP1 decode rows with the probe pair (session 26's sample)
#   bash benchmarks/run_h200.sh attn26    # (one GPU) the probe's attention split other ways beside the LM head, 20b 128 / 64
#   bash benchmarks/run_h200.sh tap26     # (one GPU) the probe's side stream from the deepest tap vs beside the LM
#                                         # head, 20b batch 8..128; a 20b batch-8 decode row
#   bash benchmarks/run_h200.sh gluon22   # (one GPU) the Gluon FP8 GEMMs (one MMA in flight through the scaling)
#                                         # beside ours: the dense GEMM, the 120b MoE layer's variants (ran in session 23)
#   bash benchmarks/run_h200.sh gluon22t  # (one GPU) their gpu tests, the 20b MoE layer's variants (tests ran in ab23; 20b variants not run: 120b lost)
#   bash benchmarks/run_h200.sh gluon22ab # (one GPU) 120b 8k prefill, the MoE row (then the dense tiles too) on Gluon
#                                         # between two table runs (prepared)
#   bash benchmarks/run_h200.sh dgmoe19   # (one GPU) MoE prefill: ours vs DeepGEMM's grouped GEMMs (carry .peers/deepgemm)
#   bash benchmarks/run_h200.sh dgmoe19b  # (one GPU) dgmoe19 with DeepGEMM's K zero-padded to 2944 (carry .peers/deepgemm)
#   bash benchmarks/run_h200.sh sort15    # (one GPU) MoE gpu tests + the decode rows the front's sort rule moved
#   bash benchmarks/run_h200.sh oq14      # (one GPU) prefill attention + o's FP8 groups in one launch: gpu test, 8k prefill
#   bash benchmarks/run_h200.sh xq14      # (one GPU) the MoE reads x's groups from the post-attention norm: gpu test, 8k prefill
#   bash benchmarks/run_h200.sh decode1   # TP1 decode rows only: a quick before/after for a decode-step change
#   bash benchmarks/run_h200.sh sweep     # (nvidia-h200-x2) lane 0: every `gpu` test + bench_probe; lane 1:
#                                         # the decode sweeps of fp8_gemm, moe and sink_attention
#   bash benchmarks/run_h200.sh grid      # (nvidia-h200-x2) lane 0: gpu tests + the 1-GPU decode grid (+ modelled
#                                         # configs) + bench_probe; lane 1: prefill grid + the three kernel tables
#
# On the device tool: run with carry [".peers/sglang_src"] (bash benchmarks/fetch_sglang_peers.sh here
# first) so SGLang's own Triton kernels run as peers, and ".peers/deepgemm" (bash
# benchmarks/fetch_deepgemm_peer.sh) for DeepGEMM's. Everything lands in $OUT/results.tgz (the tool
# returns at most 8 files); unpack it into benchmarks/results/ and commit.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export SGLANG_PEERS_SRC="$PWD/.peers/sglang_src"
OUT="${OUT:-/tmp/sglang_ext_out}"
R="$OUT/results"
mkdir -p "$R"
stage="${1:?stage: tests | kernels | model | decode1 | x2}"
t0=$(date +%s)
step() {  # step NAME TIMEOUT CMD...: run, log, never stop the stage
    local name=$1 limit=$2; shift 2
    echo "== $name ($(( $(date +%s) - t0 )) s in)"
    timeout "$limit" "$@" > "$R/$name.log" 2>&1
    echo "   rc=$? $(tail -n 2 "$R/$name.log" | tr '\n' ' ' | cut -c1-200)"
}
# The image has torch and Triton but not this package: install it without dependencies (offline),
# so `sglang_ext.kernels` etc. import as in CI.
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$R/pip.log" 2>&1 || echo "pip install -e failed (see pip.log)"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$R/gpu.txt" 2>&1
case "$stage" in
tests)
    step gpu_test_fp8_gemm 120 python tests/test_kernel_fp8_gemm.py --gpu
    step gpu_test_moe 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
    step gpu_test_sink_attention 90 python tests/test_kernel_sink_attention.py --gpu
    step gpu_test_probe 90 python -m pytest -q -p no:cacheprovider -m gpu tests/test_probe_kernel.py tests/test_probe_tail.py
    ;;
kernels)
    step gpu_test_fp8_gemm 90 python tests/test_kernel_fp8_gemm.py --gpu
    step gpu_test_moe 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
    step gpu_test_sink_attention 90 python tests/test_kernel_sink_attention.py --gpu
    step bench_fp8_gemm 130 python benchmarks/bench_fp8_gemm.py --out "$R" --budget-s 60
    step bench_moe 130 python benchmarks/bench_moe.py --out "$R" --budget-s 60
    step bench_sink_attention 130 python benchmarks/bench_sink_attention.py --out "$R" --no-sweep
    ;;
model)
    step gpu_test_layers 100 python -m pytest -q -p no:cacheprovider -m gpu tests/test_layers.py
    step bench_decode 300 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32,128 \
        --contexts 8192,32768 --configs 1:1:1,2:1:1,2:2:1,4:1:1,4:4:1,8:1:1,8:8:1 --probe-configs 1:1:1 \
        --profile --out "$R"
    step bench_prefill 150 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1,2:1:1,4:1:1,8:1:1 \
        --lengths 1024,4096,8192,32768 --out "$R"
    ;;
floor)  # read floor by size + one-shot FP8 GEMV prototype (benchmarks/diag_floor.py)
    step diag_floor 400 python benchmarks/diag_floor.py --parts "${FLOOR_PARTS:-read,gemv}" --out "$R"
    ;;
moe3)  # MoE prefill: the one-dot mlp1 variant's gpu tests + the prefill sweep (120b, 8192 tokens)
    step gpu_test_moe_one_dot 150 python -m pytest -q -p no:cacheprovider -m gpu -k one_dot tests/test_kernel_moe.py
    step sweep_moe_prefill 300 python benchmarks/bench_moe.py --out "$R" --sweep-only --sweep-kinds prefill \
        --models 120b --budget-s 220
    (command -v nvcc; ls -d /usr/local/cuda* 2>&1; python -c "import torch.utils.cpp_extension as c; print('CUDA_HOME', c.CUDA_HOME)") > "$R/nvcc_check.txt" 2>&1
    ;;
moedec)  # one-shot decode MoE (kernels/moe_decode.py): gpu tests + the T = 1, 2, 4 sweep vs the shipped path
    step gpu_test_moe_decode 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe_decode.py
    step bench_moe_decode 240 python benchmarks/bench_moe_decode.py --out "$R" --budget-s 150
    ;;
sweep5)  # (nvidia-h200-x2) lane 0: gpu tests of session 5's one-shot kernels; lane 1: their sweeps
    (
        export CUDA_VISIBLE_DEVICES=0
        step gpu_test_fp8_oneshot 120 python tests/test_kernel_fp8_gemm.py --gpu-oneshot
        step gpu_test_residual_norm 60 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_residual_norm.py
        step gpu_test_moe_table 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py \
            -k "full_shapes_and_cuda_graph or routing_bit_exact or decode_front"
        step gpu_test_sink_attention 150 python tests/test_kernel_sink_attention.py --gpu
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        step sweep_sink_oneshot 200 python benchmarks/bench_sink_attention.py --decode-sweep --oneshot --out "$R"
        step sweep_fp8_oneshot 200 python benchmarks/bench_fp8_gemm.py --m "" --sweep-m 1,2,4 --sweep-shapes qkv,o \
            --decode-sweep oneshot --compile-workers 14 --budget-s 90 --out "$R"
    ) &
    wait
    ;;
final5)  # (nvidia-h200-x2) after session 5's one-shot kernels. Lane 0: the GEMV/norm chain's gpu test, the
         # layers' gpu tests, the committed decode grid (1 GPU measured, 2-8 modelled, probe on/off with
         # 100 paired rounds); lane 1: batch-1 diagnosis, prefill grid (+8k breakdown), kernel tables
    (
        export CUDA_VISIBLE_DEVICES=0
        step gpu_test_fp8_oneshot 90 python tests/test_kernel_fp8_gemm.py --gpu-oneshot
        step gpu_test_layers 90 python -m pytest -q -p no:cacheprovider -m gpu tests/test_layers.py
        step bench_decode 400 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32,128 \
            --contexts 8192,32768 --configs 1:1:1,2:1:1,2:2:1,4:1:1,4:4:1,8:1:1,8:8:1 --probe-configs 1:1:1 \
            --probe-rounds 100 --profile --out "$R"
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        step diag_decode_b1 150 python benchmarks/diag_decode_b1.py --out "$R"
        step bench_prefill 160 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1,2:1:1,4:1:1,8:1:1 \
            --lengths 1024,4096,8192,32768 --profile 8192 --out "$R"
        step bench_fp8_gemm 100 python benchmarks/bench_fp8_gemm.py --out "$R" --sweep off
        step bench_moe 120 python benchmarks/bench_moe.py --out "$R" --no-sweep
    ) &
    wait
    ;;
final5b)  # (nvidia-h200-x2) the row-sliced quantising norm and the probe stream priority. Lane 0: gpu tests
          # of the norm and the probe, TP1 decode rows (probe on/off, 100 paired rounds); lane 1: batch-1
          # diagnosis (per-kernel, probe by launch point x priority)
    (
        export CUDA_VISIBLE_DEVICES=0
        step gpu_test_norm_probe 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_residual_norm.py \
            tests/test_probe_cuda_graph.py tests/test_layers.py
        step bench_decode_tp1 300 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32,128 \
            --contexts 8192,32768 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 100 --out "$R" \
            --stem bench_decode_tp1
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        step diag_decode_b1 200 python benchmarks/diag_decode_b1.py --out "$R"
    ) &
    wait
    ;;
final5c)  # (nvidia-h200-x2) the probe launched beside the LM head by default. Lane 0: the committed decode grid;
          # lane 1: the probe's gpu tests (side stream, CUDA graphs) and bench_probe
    (
        export CUDA_VISIBLE_DEVICES=0
        step bench_decode 400 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32,128 \
            --contexts 8192,32768 --configs 1:1:1,2:1:1,2:2:1,4:1:1,4:4:1,8:1:1,8:8:1 --probe-configs 1:1:1 \
            --probe-rounds 100 --profile --out "$R"
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        step gpu_test_probe 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_probe_kernel.py \
            tests/test_probe_tail.py tests/test_probe_step.py tests/test_probe_cuda_graph.py
        step bench_probe 100 python benchmarks/bench_probe.py --out "$R"
    ) &
    wait
    ;;
pdl)  # (nvidia-h200-x2) lane 0: diag_pdl (plain vs PDL graphs, bits, probe with PDL); lane 1: the gpu tests of
      # every kernel that now launches as a programmatic dependent (PDL on: the default on sm90)
    (
        export CUDA_VISIBLE_DEVICES=0
        python -c "import triton; from triton.language.extra.cuda import gdc_wait; print('triton', triton.__version__)" \
            > "$R/pdl_triton.txt" 2>&1
        step diag_pdl 420 python benchmarks/diag_pdl.py --out "$R"
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        step gpu_test_pdl 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl.py
        step gpu_test_fp8_gemm 150 python tests/test_kernel_fp8_gemm.py --gpu
        step gpu_test_kernels 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe_decode.py \
            tests/test_kernel_residual_norm.py tests/test_kernel_rope_kv.py tests/test_layers.py
        step gpu_test_sink_attention 120 python tests/test_kernel_sink_attention.py --gpu
        step gpu_test_moe 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
        step gpu_test_probe_graph 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_probe_cuda_graph.py
    ) &
    wait
    ;;
final6)  # (nvidia-h200-x2) lane 0: the committed decode grid with PDL (final5c's command) and the 120b batch-128
         # row at 4k; lane 1: diag_pdl (PDL only up to 4 rows, critical path) + the gpu checks final-pdl left unrun
    (
        export CUDA_VISIBLE_DEVICES=0
        step bench_decode 420 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32,128 \
            --contexts 8192,32768 --configs 1:1:1,2:1:1,2:2:1,4:1:1,4:4:1,8:1:1,8:8:1 --probe-configs 1:1:1 \
            --probe-rounds 100 --profile --out "$R"
        step bench_decode_120b_b128 120 python benchmarks/bench_decode.py --models 120b --batches 128 --contexts 4096 \
            --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 100 --out "$R" --stem bench_decode_120b_b128_ctx4096
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        step diag_pdl 300 python benchmarks/diag_pdl.py --out "$R"
        step gpu_test_fp8_gemv_oneshot 120 python tests/test_kernel_fp8_gemm.py --gpu-oneshot
        step gpu_test_sink_full 150 python tests/test_kernel_sink_attention.py --gpu-full
    ) &
    wait
    ;;
pair)  # (nvidia-h200-x2) lane 0: the one-shot MoE sweep with the per-pair mlp2 tiles + its gpu tests; lane 1: the
       # decode step with the table's mlp2 vs per-pair tiles, paired graphs, PDL on
    (
        export CUDA_VISIBLE_DEVICES=0
        step bench_moe_decode 300 python benchmarks/bench_moe_decode.py --out "$R" --budget-s 150
        step gpu_test_moe_decode 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe_decode.py
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        step diag_pdl_pair 480 python benchmarks/diag_pdl.py --out "$R/pair" --batches 1,4 --check 20 --rounds 30 \
            --no-probe --mlp2-per-pair 8:4,4:2,16:8,4:4
    ) &
    wait
    ;;
pair1)  # one GPU: pair's lanes one after the other, 120b only, no sweep
    step diag_pdl_pair 330 python benchmarks/diag_pdl.py --out "$R/pair" --models 120b --batches 1,4 --check 20 \
        --rounds 30 --no-probe --mlp2-per-pair 8:4,4:2,16:8
    step gpu_test_moe_decode 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe_decode.py
    ;;
t8)  # one GPU: does the one-shot MoE (per-pair mlp2) beat the 8-token row? + the MoE gpu tests (the table changed)
    step bench_moe_decode_t8_120b 150 python benchmarks/bench_moe_decode.py --out "$R/t8_120b" --tokens 8 \
        --filter per-pair --budget-s 60
    step bench_moe_decode_t8_20b 150 python benchmarks/bench_moe_decode.py --out "$R/t8_20b" --tokens 8 \
        --dims 32,2880,2880 --filter per-pair --budget-s 60
    step gpu_test_moe 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
    ;;
final6b)  # one GPU, the session's last state: PDL bits (gpu test), diag_pdl at batch 1 (critical path split by
          # layer position, probe with PDL), the TP1 decode rows at 8k with the probe
    step gpu_test_pdl 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl.py
    step diag_pdl 250 python benchmarks/diag_pdl.py --out "$R" --batches 1 --check 30
    step bench_decode_tp1 180 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8 --contexts 8192 \
        --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 100 --out "$R" --stem bench_decode_tp1
    ;;
prefill7)  # one GPU: MoE prefill mlp1 in two passes (per-config diagnosis with compiled resources, 120b then a
          # 20b subset; ncu of mlp1/mlp2 for the table and the two-pass config) and the extend sweep (full and
          # sliding layers); the one-dot gpu tests last, with the time left
    step diag_moe_prefill_120b 200 python benchmarks/diag_moe_prefill.py --out "$R" --models 120b
    step extend_sweep 110 python benchmarks/bench_sink_attention.py --extend-sweep --out "$R"
    NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
    step ncu_moe_prefill 100 "$NCU" --clock-control none --profile-from-start off --kernel-name regex:"_mlp[12]_kernel" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section ComputeWorkloadAnalysis \
        python benchmarks/diag_moe_prefill.py --ncu --models 120b --configs table,p2w4s3
    step gpu_test_moe_one_dot 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py -k one_dot
    ;;
prefill7b)  # one GPU: the two-pass mlp1 with register caps and the scalar-scale mlp2 (diagnosis: 120b 8192 tokens,
           # then a subset at 20b and at 1024 tokens), then the MoE gpu tests
    step diag_moe_prefill_120b 170 python benchmarks/diag_moe_prefill.py --out "$R" --models 120b \
        --configs table,before,p2w4s3,p2w4s3r1,p2w4s3r2,p2w4s3r12,p2w4s2r12,p2w4s3r12g8,p2w4s3r2s4
    step diag_moe_prefill_20b 70 python benchmarks/diag_moe_prefill.py --out "$R" --models 20b \
        --configs before,p2w4s3,p2w4s3r2,p2w4s3r12 --stem diag_moe_prefill_20b
    step diag_moe_prefill_1024 80 python benchmarks/diag_moe_prefill.py --out "$R" --models 120b,20b --tokens 1024 \
        --configs before,p2w4s3,p2w4s3r2,p2w4s3r12 --stem diag_moe_prefill_1024
    step gpu_test_moe 220 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
    ;;
final7)  # one GPU, after the two-pass mlp1 row: the committed prefill grid (8k per-kernel breakdown), the MoE
        # tables (peers: carry .peers/sglang_src), then the MoE and layer gpu tests
    step bench_prefill 160 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1,2:1:1,4:1:1,8:1:1 \
        --lengths 1024,4096,8192,32768 --profile 8192 --out "$R"
    step bench_moe 130 python benchmarks/bench_moe.py --out "$R" --no-sweep
    step gpu_test_moe 170 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
    step gpu_test_layers 90 python -m pytest -q -p no:cacheprovider -m gpu tests/test_layers.py
    ;;
ab7)  # one GPU: the MoE prefill row A/B on the whole model step (old two-dot row vs the two-pass row), at the
     # lengths and shards where the final7 grid moved most (20b 1024, 120b TP4 1024 / 4096), 10 timed calls each
    for row in before p2w4s3; do
        step "ab_$row" 140 python benchmarks/prefill_moe_ab.py $row --models 120b,20b --configs 1:1:1,4:1:1 \
            --lengths 1024,4096,8192 --iters 10 --out "$R" --stem "bench_prefill_ab_$row"
    done
    step ab_before_again 140 python benchmarks/prefill_moe_ab.py before --models 120b,20b --configs 1:1:1,4:1:1 \
        --lengths 1024,4096,8192 --iters 10 --out "$R" --stem bench_prefill_ab_before_again
    ;;
final7b)  # one GPU: final7 again after the width rule (two-pass only at TP <= 2) and the decode rows' vector
          # W2 scale, minus the layer test
    step bench_prefill 160 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1,2:1:1,4:1:1,8:1:1 \
        --lengths 1024,4096,8192,32768 --profile 8192 --out "$R"
    step bench_moe 130 python benchmarks/bench_moe.py --out "$R" --no-sweep
    step gpu_test_moe 170 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
    ;;
prefill7c)  # one GPU: the committed prefill grid again with 3 warm-up and 5 timed calls per length
    step bench_prefill 400 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1,2:1:1,4:1:1,8:1:1 \
        --lengths 1024,4096,8192,32768 --profile 8192 --out "$R"
    ;;
pdl7)  # one GPU: the MoE h quantisation's early release (commit a94253b's kernels/pdl.py exception, reverted
      # after this run: slower): the PDL bits test, the in-step A/B (120b batch 1 and 4, paired graphs,
      # logits compared), the TP-shard prefill tests, the one-shot MoE gpu tests. The A/B step needs
      # that commit checked out (--hquant-release-ab went with the revert); the tests run on any commit.
    step gpu_test_pdl 80 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl.py
    step diag_pdl_hq 170 python benchmarks/diag_pdl.py --out "$R/hq" --models 120b --batches 1,4 --check 30 \
        --rounds 30 --no-probe --hquant-release-ab
    step gpu_test_moe_shard 100 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py -k "tp_shard or one_dot"
    step gpu_test_moe_decode 100 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe_decode.py
    ;;
tma8)  # one GPU: TMA-descriptor prototypes of the dense GEMM, mlp1 (x gathered) and mlp2 beside the shipped
      # kernels (at commit f80169d; diag_tma.py now times the shipped kernels, dense only); extend attention's
      # structural variants (one key loop for sliding tiles, sink last) + its gpu test
    step diag_tma 300 python benchmarks/diag_tma.py --out "$R"
    # (the extend variants' bench mode and kernel switches were removed after this run: no gain measured;
    # results/sweeps/bench_sink_attention_extend_variants.md is the record, made at commit f80169d)
    ;;
tma8b)  # one GPU: the TMA tiles in the table (dense GEMM M > 256, MoE prefill row): gpu tests (TMA vs pointer
       # bits), then the TP1 prefill rows with the profile
    step gpu_test_fp8_gemm 150 python tests/test_kernel_fp8_gemm.py --gpu
    step gpu_test_moe 170 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py -k "tp_shard or one_dot"
    step bench_prefill 220 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1 \
        --lengths 1024,4096,8192 --profile 8192 --out "$R"
    ;;
tma8c)  # one GPU: the MoE prefill row's neighbours with TMA tiles (120b, 20b); host vs device time of a prefill
    step diag_moe_prefill_120b 200 python benchmarks/diag_moe_prefill.py --out "$R" --models 120b \
        --configs table,pointer,tma_m128w8,tma_m128w8s3,tma_s5,tma_g8,tma_g1,tma_mlp2s2 --stem diag_moe_prefill_tma
    step diag_moe_prefill_20b 100 python benchmarks/diag_moe_prefill.py --out "$R" --models 20b \
        --configs table,pointer,tma_m128w8,tma_g8 --stem diag_moe_prefill_tma_20b
    step diag_prefill_host 200 python benchmarks/diag_prefill_host.py --out "$R"
    ;;
final8)  # one GPU, carry .peers/sglang_src: the committed prefill grid, FP8 GEMM and MoE tables with the TMA rows
    step bench_prefill 400 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1,2:1:1,4:1:1,8:1:1 \
        --lengths 1024,4096,8192,32768 --profile 8192 --out "$R"
    step bench_fp8_gemm 80 python benchmarks/bench_fp8_gemm.py --out "$R" --sweep off
    step bench_moe 100 python benchmarks/bench_moe.py --out "$R" --no-sweep
    ;;
host8)  # one GPU: the host's share of a short prefill (cumulative profile) and of one MoE layer (TMA vs pointer)
    step diag_prefill_host 120 python benchmarks/diag_prefill_host.py --models 120b --lengths 1024 --out "$R"
    step diag_moe_prefill_enqueue 120 python benchmarks/diag_moe_prefill.py --out "$R" --models 120b \
        --configs table,pointer --stem diag_moe_prefill_enqueue
    ;;
final8b)  # one GPU, carry .peers/sglang_src: final8's prefill grid and MoE table after the host-side fix
    step bench_prefill 400 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1,2:1:1,4:1:1,8:1:1 \
        --lengths 1024,4096,8192,32768 --profile 8192 --out "$R"
    step bench_moe 100 python benchmarks/bench_moe.py --out "$R" --no-sweep
    ;;
tma8d)  # one GPU: TMA tiles at decode sizes: the shipped dense tiles (M 32..256) and the MoE rows of 32..128 tokens
    step diag_tma_dense_decode 120 python benchmarks/diag_tma.py --shipped-dense 32,64,128,256 --out "$R"
    for t in 32 64 128; do
        step diag_moe_decode_tma_$t 100 python benchmarks/diag_moe_prefill.py --decode-tma --tokens $t \
            --models 120b,20b --out "$R" --stem diag_moe_decode_tma_$t
    done
    ;;
decode8)  # one GPU: TMA tiles in the decode rows (dense M 17..256 without split-K, MoE 17..128 tokens): the table's
         # MoE rows compiled at full shapes and in CUDA graphs, then the TP1 decode rows of batch 32 and 128
    step gpu_test_moe_table 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py -k "full_shapes_and_cuda_graph"
    step bench_decode_tp1 150 python benchmarks/bench_decode.py --models 120b,20b --batches 32,128 \
        --contexts 8192 --configs 1:1:1 --probe-configs none --profile --out "$R" --stem bench_decode_tp1_tma
    ;;
win9)  # one GPU: the one-shot sliding-window extend (gpu tests at full shapes, its tiles beside the key loop),
      # the dense GEMM copies (diag_ws.py's default variants; as run in session 9 the script had the warp-specialised
      # loop among them: it timed out, logs/h200_session9_diag_ws_timed_out.log), the GEMM table at M 256 / 1024, then
      # the TP1 prefill rows with the profile
    step gpu_test_sink_attention 200 python tests/test_kernel_sink_attention.py --gpu
    step bench_extend_window 90 python benchmarks/bench_sink_attention.py --extend-window --out "$R"
    step diag_ws 100 python benchmarks/diag_ws.py --out "$R"
    step bench_fp8_gemm_m256_1024 60 python benchmarks/bench_fp8_gemm.py --m 256,1024 --shapes qkv,o --sweep off \
        --out "$R/fp8_gemm_m256"
    step bench_prefill 180 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1 \
        --lengths 1024,8192 --profile 8192 --out "$R"
    ;;
win9b)  # one GPU: win9's full-shape sink test (its 200 s ran out in the sweep), the window tiles on random and
       # contiguous slots, the dense FP8 GEMM's tiles by M (then the warp-specialised loop, last: it may not
       # compile), and Nsight Compute on one full-layer and one sliding-layer extend
    step gpu_test_sink_full 140 python tests/test_kernel_sink_attention.py --gpu-full
    step bench_extend_window 100 python benchmarks/bench_sink_attention.py --extend-window --out "$R"
    step diag_dense_tiles 100 python benchmarks/diag_ws.py --variants copy --stem diag_dense_tiles --out "$R"
    NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
    step ncu_extend 100 "$NCU" --clock-control none --kernel-name regex:"_sink_extend" --launch-count 2 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
        --section WarpStateStats --section InstructionStats --section LaunchStats \
        python benchmarks/bench_sink_attention.py --ncu-extend
    step diag_ws 90 python benchmarks/diag_ws.py --variants ws --m 8192,2048 --out "$R"
    ;;
attn9)  # one GPU: extend with raw scores (the scale in the exponent's FMA, P.V into the rescaled accumulator):
       # gpu tests, device-time extend table on both slot layouts with the tiles; the dense GEMM tiles in CUDA
       # graphs (the prefill rows ran in tiles9)
    step gpu_test_sink_attention 320 python tests/test_kernel_sink_attention.py --gpu
    step bench_extend_graphs 120 python benchmarks/bench_sink_attention.py --extend-window --extend-window-loop --out "$R"
    step diag_dense_tiles 80 python benchmarks/diag_ws.py --variants copy --stem diag_dense_tiles --out "$R"
    ;;
tiles9)  # one GPU: the shipped dense FP8 GEMM launcher on other TMA tiles (CUDA graphs), then the TP1 prefill
        # rows with the profile (raw-score extend, the one-shot window's 64-row tile)
    step diag_dense_cfg 100 python benchmarks/diag_ws.py --variants cfg --stem diag_dense_cfg --out "$R"
    step bench_prefill 150 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1 \
        --lengths 1024,8192 --profile 8192 --out "$R"
    ;;
final9)  # one GPU: the M 257..1024 dense row: fp8 gemm gpu tests (M = 1024 now among them), the GEMM table at
        # M 256..8192 against cuBLAS; the TP1 prefill rows with the profile; the sink table (decode rows on the
        # raw-score key loop)
    step gpu_test_fp8_gemm 150 python tests/test_kernel_fp8_gemm.py --gpu
    step bench_fp8_gemm 80 python benchmarks/bench_fp8_gemm.py --m 256,512,1024,2048,8192 --shapes qkv,o \
        --sweep off --out "$R/fp8_gemm"
    step bench_prefill 150 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1 \
        --lengths 1024,4096,8192 --profile 8192 --out "$R"
    # writes bench_sink_attention.{json,md}; committed as bench_sink_attention_raw_scores.* (no SGLang peers in
    # this run: the committed bench_sink_attention.* keeps session 8's table with them)
    step bench_sink_attention 150 python benchmarks/bench_sink_attention.py --no-sweep --out "$R"
    ;;
rope10)  # one GPU: RoPE + KV write inside the one-shot decode attention (kernels/sink_attention.py RopeKV)
    step gpu_test_sink_attention 150 python tests/test_kernel_sink_attention.py --gpu
    step gpu_test_pdl_rope 100 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl.py \
        tests/test_kernel_rope_kv.py
    step diag_rope_fusion 300 python benchmarks/diag_pdl.py --rope-fusion-ab --models 120b,20b --batches 1,4 \
        --rounds 40 --check 30 --out "$R"
    ;;
dec10)  # one GPU: where the batch-1 decode attention's time goes (fused RoPE or not, one-shot variants, ncu),
       # then the MoE gpu tests and the TP1 decode rows (the routing launch's pair-comparison sort at 17..128 tokens)
    step gpu_test_sink_attention 150 python tests/test_kernel_sink_attention.py --gpu
    step diag_sink_decode 120 python benchmarks/diag_sink_decode.py --out "$R"
    NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
    step ncu_sink_decode 60 "$NCU" --clock-control none --profile-from-start off \
        --kernel-name regex:"_sink_decode|_rope_kv" --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \
        python benchmarks/diag_sink_decode.py --ncu
    step gpu_test_moe_fused_sort 100 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
    step bench_decode_tp1 150 python benchmarks/bench_decode.py --models 120b,20b --batches 1,32 \
        --contexts 8192 --configs 1:1:1 --out "$R" --stem bench_decode_tp1
    ;;
dec10b)  # one GPU: dec10's findings (the fused one-shot kernel at 242 registers, two programs an SM) followed up
    step gpu_test_sink_attention 150 python tests/test_kernel_sink_attention.py --gpu
    step gpu_test_rope_kv 60 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_rope_kv.py
    step diag_sink_decode 60 python benchmarks/diag_sink_decode.py --contexts 8192 --batches 1 --out "$R"
    step diag_rope_fusion 120 python benchmarks/diag_pdl.py --rope-fusion-ab --models 120b,20b --batches 1 \
        --rounds 40 --check 30 --out "$R"
    step gpu_test_moe 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
    step bench_decode_120b_b32 80 python benchmarks/bench_decode.py --models 120b --batches 32 --contexts 8192 \
        --configs 1:1:1 --no-probe --profile --out "$R" --stem bench_decode_120b_b32
    ;;
final10)  # one GPU: session 10's last state (fused RoPE + capped batch-1 pick, the pair-comparison sort)
    step gpu_test_rope_bf16 60 python tests/test_kernel_sink_attention.py --rope bfloat16 --device cuda
    step gpu_test_pdl 70 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl.py
    step gpu_test_sink_full 90 python tests/test_kernel_sink_attention.py --gpu-full
    step bench_decode_tp1 180 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --out "$R" --stem bench_decode_tp1
    ;;
rope11)  # one GPU: RoPE + KV write in the split-loop decode: its GPU sweep, the step A/B at batch 8 and at batch 1
         # with a server's 131072-wide KV table (where the full layers take the split loop)
    step gpu_test_rope_split_loop 110 python tests/test_kernel_sink_attention.py --rope float32,bfloat16 --device cuda
    step diag_rope_split_loop 240 python benchmarks/diag_pdl.py --rope-fusion-ab --no-picks --models 120b,20b \
        --batches 8 --rounds 30 --check 20 --out "$R" --stem diag_rope_split_loop
    step diag_serving_width 200 python benchmarks/diag_pdl.py --rope-fusion-ab --no-picks --models 120b,20b \
        --batches 1,4 --table-widths 131072 --rounds 30 --check 20 --out "$R" --stem diag_rope_serving_width
    step bench_decode_tp1 240 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --out "$R" --stem bench_decode_tp1
    ;;
ncu11)  # one GPU: where the batch-1 MoE layer's kernels stall (front, mlp1, h quantisation, mlp2 per pair; ncu
        # serialises the launches: no PDL overlap)
    NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
    step ncu_moe_decode 150 "$NCU" --clock-control none --profile-from-start off \
        --kernel-name regex:"_decode_front|_mlp1_oneshot|_quantize_h|_mlp2_pair" --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section LaunchStats --section SourceCounters python benchmarks/bench_moe_decode.py --ncu --tokens 1
    ;;
head11)  # one GPU: the opt-in FP8 LM head (sglang_ext/layers/lm_head.py): its logits error and time at full shape,
         # and the TP1 decode rows with the bf16 head and with it, in one run
    step diag_lm_head 90 python benchmarks/diag_lm_head.py --out "$R"
    step bench_decode_head_bf16 170 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32 \
        --contexts 8192 --configs 1:1:1 --no-probe --out "$R" --stem bench_decode_tp1_head_bf16
    step bench_decode_head_fp8 170 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32 \
        --contexts 8192 --configs 1:1:1 --no-probe --fp8-lm-head --out "$R" --stem bench_decode_tp1_head_fp8
    ;;
final11)  # one GPU: session 11's last state: PDL bits in the step (the split loop now fuses RoPE at batch 2-4), the
          # full-shape sink tests (session 10 left them unverified: they compile for minutes), the layers
    step gpu_test_pdl 90 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl.py
    step gpu_test_layers 90 python -m pytest -q -p no:cacheprovider -m gpu tests/test_layers.py tests/test_lm_head.py
    step gpu_test_sink_full 270 python tests/test_kernel_sink_attention.py --gpu-full
    ;;
width11)  # one GPU: the decode attention at a server's 131072-wide KV table (batch 1 full layers take the split
          # loop there): the table's fused split loop vs one-shot variants, 8k and 32k, for a '>8k' pick
    step diag_sink_decode_width 200 python benchmarks/diag_sink_decode.py --contexts 8192,32768 --batches 1 \
        --table-width 131072 --out "$R" --stem diag_sink_decode_serving_width
    ;;
dg12)  # one GPU: DeepGEMM (benchmarks/deepgemm_peer.py, carried .peers/deepgemm) beside ours, cuBLAS and SGLang
    step deepgemm_smoke 120 bash benchmarks/build_deepgemm_peer.sh
    step bench_fp8_gemm 400 python benchmarks/bench_fp8_gemm.py --sweep off --out "$R"
    ;;
rows12)  # one GPU: the dense FP8 GEMM at 17..256 rows (decode batches 32-128), where DeepGEMM ran 1.4-1.5x
         # faster than the table's tiles at M = 64 (dg12): TMA / small-N / split-K tiles on pre-quantised x
    step sweep_fp8_gemm_rows 420 python benchmarks/bench_fp8_gemm.py --m 32,64,128,256 --shapes qkv,o \
        --sweep-m 32,64,128,256 --sweep-shapes qkv,o --compile-workers 12 --budget-s 240 \
        --out "$R/fp8_gemm_rows17_256"
    ;;
round12)  # one GPU: correctly rounded bf16 outputs of the dense FP8 GEMM by tile (wgmma vs mma.sync vs the GEMV)
    step diag_gemm_rounding 150 python benchmarks/diag_gemm_rounding.py --out "$R"
    ;;
dg13)  # one GPU: DeepGEMM as the dense FP8 layers' backend (sglang_ext/layers/fp8_backend.py), through the
       # carried peer (.peers/deepgemm, DeepGEMM's 1.x JIT line): its gpu test, the backend table by M with
       # correctly rounded outputs, and round12's rounding by tile
    export DEEPGEMM_PEER_ROOT="$PWD/.peers/deepgemm" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
    export DG_JIT_CACHE_DIR="$DEEPGEMM_PEER_ROOT/jit_cache" PYTHONPATH="$DEEPGEMM_PEER_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    step deepgemm_smoke 120 bash benchmarks/build_deepgemm_peer.sh
    step gpu_test_fp8_backend 180 python -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_backend.py
    step diag_fp8_backend 280 python benchmarks/diag_fp8_backend.py --out "$R"
    step diag_gemm_rounding 150 python benchmarks/diag_gemm_rounding.py --out "$R"
    ;;
fa13)  # one GPU: the wide tile for 17..64 rows again (gpu test), a textbook flash-attention prefill prototype
       # beside the shipped extend, the backend table at 16..128 rows with the wide tile
    export DEEPGEMM_PEER_ROOT="$PWD/.peers/deepgemm" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
    export DG_JIT_CACHE_DIR="$DEEPGEMM_PEER_ROOT/jit_cache" PYTHONPATH="$DEEPGEMM_PEER_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    step diag_extend_fa 150 python benchmarks/diag_extend_fa.py --out "$R"
    step gpu_test_fp8_gemm 150 python tests/test_kernel_fp8_gemm.py --gpu
    step diag_fp8_backend 200 python benchmarks/diag_fp8_backend.py --m 16,24,32,48,64,96,128 --out "$R"
    ;;
prefill13)  # one GPU: the no-prefix prefill kernel (sink_attention_prefill): its gpu tests, the full-shape sink
            # tests, TP1 prefill rows with the profile
    step gpu_test_prefill 120 python tests/test_kernel_sink_attention.py --prefill float32,bfloat16 --device cuda
    step gpu_test_sink_full 240 python tests/test_kernel_sink_attention.py --gpu-full
    step bench_prefill_tp1 200 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1 \
        --lengths 1024,4096,8192 --profile 8192 --out "$R" --stem bench_prefill_tp1
    ;;
decode13)  # one GPU: TP1 decode rows with session 13's kernels (the wide tile at 17..64 rows), batch 1..64
    step bench_decode_tp1 420 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32,64 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --profile --out "$R" --stem bench_decode_tp1
    ;;
dgab13)  # one GPU: SGLANG_EXT_FP8_GEMM=auto (DeepGEMM for o at 48..128 rows) vs ours in the decode step
    export DEEPGEMM_PEER_ROOT="$PWD/.peers/deepgemm" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
    export DG_JIT_CACHE_DIR="$DEEPGEMM_PEER_ROOT/jit_cache" PYTHONPATH="$DEEPGEMM_PEER_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    step diag_fp8_gemm_auto 240 python benchmarks/diag_pdl.py --fp8-gemm-ab auto --models 120b,20b --batches 64,128 \
        --context 4096 --rounds 20 --check 3 --out "$R"
    ;;
check14)  # one GPU: the gpu tests of code changed after session 13's last GPU call (the review mends: DeepGEMM's
          # architecture gate and contiguous codes, the prefill kernel's head sizes / empty batch / one operand
          # check), with the DeepGEMM peer. Session 14: all passed (logs/h200_session14_check14.log)
    export DEEPGEMM_PEER_ROOT="$PWD/.peers/deepgemm" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
    export DG_JIT_CACHE_DIR="$DEEPGEMM_PEER_ROOT/jit_cache" PYTHONPATH="$DEEPGEMM_PEER_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    step deepgemm_smoke 120 bash benchmarks/build_deepgemm_peer.sh  # its deepgemm_linear is the backend's now
    step gpu_test_fp8_backend 180 python -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_backend.py
    step gpu_test_prefill 120 python tests/test_kernel_sink_attention.py --prefill float32,bfloat16 --device cuda
    step gpu_test_sink_full 240 python tests/test_kernel_sink_attention.py --gpu-full
    ;;
fa14)  # one GPU: the prefill attention prototype's variants, half the exp2s on the FMA pipe and the hand-rotated
       # key loop, beside the shipped tile. Session 14: both slower (bm64: 1251 us shipped tile, rotated 1316,
       # polynomial 1590; diag_extend_fa_variants.md): not ported. Gather-prefix + TMA rows at an 8k prefix:
       # 4426 us (bm128 w8) vs the key loop's 4575, -3 % (diag_extend_prefix.md): not ported either
    step diag_extend_fa 200 python benchmarks/diag_extend_fa.py --variants --out "$R" --stem diag_extend_fa_variants
    step diag_extend_prefix 150 python benchmarks/diag_extend_fa.py --prefix 8192 --tokens 8192 --out "$R"
    ;;
win14)  # one GPU: sliding layers' prefill through sink_attention_prefill(window_left=...): the window kernel vs
        # the prefill kernel's tiles, its gpu tests, TP1 prefill rows with the profile. Session 14: tests passed
        # (logs/h200_session14_gpu_test_prefill_window.log); the diag's shipped row failed to capture (a host tensor
        # in its lambda: fixed, re-run in graph14); its bench_prefill_tp1 was replaced by sort14's
    step diag_extend_window 120 python benchmarks/diag_extend_fa.py --window 127 --tokens 8192 --out "$R"
    step gpu_test_prefill 120 python tests/test_kernel_sink_attention.py --prefill float32,bfloat16 --device cuda
    step bench_prefill_tp1 200 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1 \
        --lengths 1024,4096,8192 --profile 8192 --out "$R" --stem bench_prefill_tp1
    ;;
graph14)  # one GPU: the window diag again (its shipped row could not be captured in win14: fixed), and the TP1
          # prefill rows eager and captured whole in one CUDA graph (what the eager call's launch gaps cost).
          # Session 14: diag_extend_window.md (prefill tile 64x64 s2 123.5 us vs the window kernel's 131.3); the
          # graph rows were superseded by sort14's bench_prefill_tp1.md (same --graph column)
    step diag_extend_window 120 python benchmarks/diag_extend_fa.py --window 127 --tokens 8192 --out "$R"
    step bench_prefill_tp1_graph 300 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1 \
        --lengths 1024,4096,8192 --graph --out "$R" --stem bench_prefill_tp1_graph
    ;;
small14)  # one GPU: the prefill's small kernels (MoE front, pair sort, o's activation quantisation) by launch choice.
          # Session 14: diag_prefill_small.md (sort chunk 256: 53.5 -> 29.7 us, taken; front and quant already best)
    step diag_prefill_small 200 python benchmarks/diag_prefill_small.py --out "$R"
    ;;
sort14)  # one GPU: the prefill row's pair sort in chunks of 256 (diag_prefill_small): the MoE gpu tests, then the TP1
         # prefill rows eager and as one graph, with the profile (the window tile of session 14 included).
         # Session 14: 49 gpu tests passed; 120b 8k 164.3 ms eager / 161.9 graph (bench_prefill_tp1.md)
    step gpu_test_moe 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
    step bench_prefill_tp1 300 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1 \
        --lengths 1024,4096,8192 --graph --profile 8192 --out "$R" --stem bench_prefill_tp1
    ;;
oq14)  # one GPU: the prefill attention writes o's FP8 input groups from its own launch (out_quant): its gpu test
       # (bits against quantize_activation_group128 of the output), then the 8k TP1 prefill rows with the profile.
       # Session 14: bits equal (4 quant cases per dtype) but slower, REVERTED: the prefill attention 27.8 ->
       # 36.1 ms (two heads a program, half the programs), the quantisation launch's 1.5 ms gone; 120b 8k
       # 164.3 -> 168.8 ms (history/bench_prefill_tp1_oquant_REVERTED.md). The stage no longer applies
    step gpu_test_prefill 150 python tests/test_kernel_sink_attention.py --prefill float32,bfloat16 --device cuda
    step bench_prefill_tp1 240 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1 \
        --lengths 8192 --graph --profile 8192 --out "$R" --stem bench_prefill_tp1_oquant
    ;;
xq14)  # one GPU: the post-attention norm writes x's e4m3 groups for the MoE at prefill sizes (x_quant): the gpu test
       # (the norm's groups equal the front's, the MoE's output bits unchanged), then the 8k TP1 prefill rows.
       # Session 14: REVERTED. No gain: the MoE front 1440 -> 194 us a prefill, the norms 4385 -> 5647 (its
       # one-program-a-row quantisation); 120b 8k 163.6 ms eager (history/bench_prefill_tp1_xquant_REVERTED.md).
       # And the gpu test failed: compiled with QUANTIZE the norm's bf16 x_out differs from the plain launch's
       # (logs/h200_session14_gpu_test_x_quant_REVERTED.log; the interpreter agreed). The stage no longer applies
    step gpu_test_x_quant 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py -k x_quant
    step bench_prefill_tp1 240 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1 \
        --lengths 8192 --graph --profile 8192 --out "$R" --stem bench_prefill_tp1_xquant
    ;;
grp15)  # one GPU: the grouped one-shot decode MoE (commit f1cf499: programs per sorted block of one expert's pairs,
        # so an expert chosen by several tokens is read once): its gpu tests, then the MoE layer at 1..8 tokens on
        # 120b's 128 and 20b's 32 experts. Session 15, REVERTED with grp15b's: the first kernels (slab held in
        # registers across the block's loop, 126 registers) were slower everywhere, 20b T=8 261.5 us vs the
        # shipped 180.5 (history/bench_moe_decode_*_grouped_first_REVERTED.md). The stage no longer applies
    step gpu_test_moe_decode 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe_decode.py
    step bench_moe_decode_120b 150 python benchmarks/bench_moe_decode.py --out "$R/grouped_120b" --tokens 1,2,4,8 \
        --filter "n4/w4 mlp2 n8/w4 per-pair" --budget-s 100
    step bench_moe_decode_20b 150 python benchmarks/bench_moe_decode.py --out "$R/grouped_20b" --tokens 2,4,8 \
        --dims 32,2880,2880 --filter "n4/w4 mlp2 n8/w4 per-pair" --budget-s 100
    ;;
grp15b)  # one GPU: the grouped kernels rewritten as the per-pair body in a loop over the block's pairs (93 / 125
         # registers; with caps 64 / 72), the layer, then the whole decode step with the MoE's 2..8-token rows on
         # them vs the shipped table, paired CUDA graphs. Session 15, REVERTED (commit f1cf499 and its revert): the
         # gpu tests passed (11), but every grouped row was slower than the per-pair kernels, even at one pair a
         # block (20b T=4 m2 131.0 vs 111.1 us; T=8 m2 241.7 vs the shipped GEMV row's 182.2), the caps slower
         # still (333.6), and the step A/B (caps 64:72) +57..+65 %. At 8 tokens the two steps' logits are
         # far apart (argmax agreement 0.00 on 120b, 0.25 on 20b; batch 4: bits equal) as every A/B of two
         # summation orders on these random-weight models is (the wide tile's: 0.000 at 120b batch 32,
         # diag_wide_tile_session13.md); the layer's gpu test at T=8 matched moe_ref
         # (history/diag_moe_grouped_REVERTED.md, bench_moe_decode_*_grouped_REVERTED.md). Why slower: the loop
         # serialises each further pair's load latency inside one program and the extra registers halve the
         # programs an SM; whatever the per-pair grid's second pair on an expert costs, it is less (stg15 below:
         # delaying that pair's reads bought nothing either). The stage no longer applies
    step gpu_test_moe_decode 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe_decode.py
    step bench_moe_decode_20b 100 python benchmarks/bench_moe_decode.py --out "$R/grouped_20b" --tokens 4,8 \
        --dims 32,2880,2880 --filter "n4/w4 mlp2 n8/w4 per-pair" --budget-s 60
    step bench_moe_decode_120b 100 python benchmarks/bench_moe_decode.py --out "$R/grouped_120b" --tokens 4,8 \
        --filter "n4/w4 mlp2 n8/w4 per-pair" --budget-s 60
    step diag_moe_grouped 250 python benchmarks/diag_pdl.py --moe-grouped-ab --grouped-caps "${GROUPED_CAPS:-64:72}" \
        --models 20b,120b --batches 8,4 --rounds 30 --check 10 --out "$R"
    ;;
stg15)  # one GPU: the one-shot per-pair MoE with staggered tiles (commits df92535 + 209d548, OneshotConfig.stagger: a
        # pair sharing its expert with earlier pairs walks its tiles rotated, so it reads them from L2): its gpu
        # tests, the layer at 4 and 8 tokens on 20b's 32 and 120b's 128 experts (per-pair row, staggers 16..128,
        # the shipped table), then the whole decode step with 1..8 tokens on the stagger 20b's 8 tokens liked
        # best. Session 15, REVERTED: tests passed (11), the walk is exercised, but no stagger read less: 20b T=8
        # 205.6 us unstaggered, 213.0-219.0 staggered (the rank loads before the slab cost ~7 us a layer, no L2
        # gain seen), T=4 111.2 -> 116.9-118.7; 120b alike; the step A/B (stagger 16) +3.5 % at batch 4, +13.2 %
        # on 20b at batch 8 (there against the GEMV row, 205.6 vs 181.8 alone). So the 20b 8-token one-shot's
        # extra time is not the duplicated experts' second HBM read alone: not pursued
        # (history/*stagger_REVERTED.md). The stage no longer applies
    step gpu_test_moe_decode 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe_decode.py
    step bench_moe_decode_20b 100 python benchmarks/bench_moe_decode.py --out "$R/stagger_20b" --tokens 4,8 \
        --dims 32,2880,2880 --filter "n4/w4 mlp2 n8/w4 per-pair" --budget-s 60
    step bench_moe_decode_120b 100 python benchmarks/bench_moe_decode.py --out "$R/stagger_120b" --tokens 4,8 \
        --filter "n4/w4 mlp2 n8/w4 per-pair" --budget-s 60
    best=$(python -c "
import json; rows = json.load(open('$R/stagger_20b/bench_moe_decode.json'))['rows']
r = [x for x in rows if x.get('part') == 'layer' and x.get('tokens') == 8 and 'stagger' in x['variant'] and 'us' in x]
print(min(r, key=lambda x: x['us'])['variant'].split('stagger ')[1] if r else 64)" 2>/dev/null || echo 64)
    echo "   stagger for the step A/B: $best"
    step diag_moe_stagger 250 python benchmarks/diag_pdl.py --moe-stagger-ab "$best" --models 20b,120b --batches 8,4 \
        --rounds 30 --check 10 --out "$R"
    ;;
b128_15)  # one GPU: the decode grid's missing batch-128 rows at 8k (the probe and bandwidth targets name batch 128):
          # 20b measured, 120b where it fits (else its named 'does not fit' row), probe on/off paired. Session 15:
          # 20b 17.09 ms, 66 % of copy bandwidth, probe +0.34 %; 120b does not fit (bench_decode_tp1_b128.md); the
          # profile (bench_decode_tp1_b128_profile.md, run on the warm device) found the front's 88 us a layer
    step bench_decode_tp1_b128 330 python benchmarks/bench_decode.py --models 20b,120b --batches 128 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --out "$R" --stem bench_decode_tp1_b128
    ;;
front15)  # one GPU: the MoE front above 16 tokens, one-program pair sort vs the chunked sort (diag_front_sort.py).
          # Session 15: same outputs everywhere; chunked faster on 32 experts at 17..128 tokens (89.1 -> 17.1 us at
          # 128), on 128 experts above 64 (101.5 -> 50.3 at 128), fused faster on 128 at <= 64: the rule
          # FUSED_SORT_MAX_TOKENS 64 / FUSED_SORT_MIN_EXPERTS 64 (kernels/moe.py). The whole-step rows that followed
          # ran on the warm device as `python -c` overrides of moe.FUSED_SORT_MAX_TOKENS before the rule landed
          # (results/bench_decode_tp1_*chunked_sort.md say how); stage sort15 repeats them on the rule
    step diag_front_sort 150 python benchmarks/diag_front_sort.py --out "$R"
    ;;
sort15)  # one GPU: the decode rows the front's sort rule moved (20b batch 64 / 128 at 8k, 120b batch 128 at 4k), probe
         # on/off, beside the MoE gpu tests. Not run yet (session 15's device time was spent)
    step gpu_test_moe 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
    step bench_decode_20b 200 python benchmarks/bench_decode.py --models 20b --batches 32,64,128 --contexts 8192 \
        --configs 1:1:1 --probe-configs 1:1:1 --out "$R" --stem bench_decode_tp1_20b_sort15
    step bench_decode_120b 150 python benchmarks/bench_decode.py --models 120b --batches 128 --contexts 4096 \
        --configs 1:1:1 --probe-configs 1:1:1 --out "$R" --stem bench_decode_120b_b128_ctx4096
    ;;
probe16)  # one GPU: the probe's decode step at batch 1..128 with its per-kernel times, the q|k|v tile / splits
          # and the attention's key block / splits swept at 32..128 (the launcher's rule was swept at 1 and 8 only)
    step bench_probe 300 python benchmarks/bench_probe.py --out "$R" --batches 1,8,32,64,128 --sweep 32,64,128 \
        --sweep-attn 32,64,128 --stem probe_decode_h200_sweep16
    ;;
probe16b)  # one GPU: the probe's wide-batch q|k|v tile (kernels/probe_step.py qkv_tile): its gpu tests, the step
           # by kernel, and the decode rows' probe overhead with the tile and, in the same run, with the old one
           # (64 x 64 at 4 programs an SM past 16 rows, forced by replacing qkv_tile)
    step gpu_test_probe 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_probe_step.py \
        tests/test_probe_cuda_graph.py
    step bench_probe 120 python benchmarks/bench_probe.py --out "$R" --batches 1,8,32,64,128 --sweep "" \
        --stem probe_decode_h200_tile16
    dec="--contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 60 --out $R"
    step bench_decode_new 200 python benchmarks/bench_decode.py --models 20b,120b --batches 1,8,32,64,128 $dec \
        --stem bench_decode_tp1_probe_tile16
    step bench_decode_old 200 python -c "
import runpy, sys
import sglang_ext.kernels.probe_step as ps
ps.qkv_tile = lambda t: {'block_n': 32 if t <= 16 else 64, 'block_k': 128 if t <= 16 else 64, 'programs_per_sm': 4}
sys.argv = ['benchmarks/bench_decode.py'] + sys.argv[1:]
runpy.run_path('benchmarks/bench_decode.py', run_name='__main__')" --models 20b,120b --batches 32,64,128 $dec \
        --stem bench_decode_tp1_probe_tile16_old
    ;;
gpu16)  # one GPU: every `gpu` test the session's other stages did not run (those: MoE in sort15, the probe step
        # and its CUDA graph in probe16b), on the final tree, one pytest process a group so a timeout loses one.
        # Ran once: the first group outlived its 300 s after the sink-attention test passed (compiles dominate);
        # a second call, `timeout 250 python -m pytest -p no:cacheprovider -m gpu -rA tests/test_kernel_fp8_gemm.py
        # tests/test_kernel_moe_decode.py tests/test_kernel_residual_norm.py tests/test_kernel_rope_kv.py
        # tests/test_probe_kernel.py`, passed fp8_gemm's 3 and 5 of moe_decode's 8 before its limit. Stage gpu17
        # has the rest, one group a step; a rerun of this stage as it stands times out the same way
    step gpu_test_kernels 300 python -m pytest -q -p no:cacheprovider -m gpu --durations=20 \
        tests/test_kernel_sink_attention.py tests/test_kernel_fp8_gemm.py tests/test_kernel_moe_decode.py \
        tests/test_kernel_residual_norm.py tests/test_kernel_rope_kv.py tests/test_probe_kernel.py
    step gpu_test_layers 240 python -m pytest -q -p no:cacheprovider -m gpu --durations=20 \
        tests/test_layers.py tests/test_pdl.py tests/test_fp8_backend.py tests/test_probe_cuda_graph.py
    ;;
gpu17)  # one GPU: what gpu16 did not reach (prepared in session 16, not run): test_kernel_moe_decode whole, then
        # the residual-norm, RoPE-KV and probe-kernel gpu tests, each group in its own step
    step gpu_test_moe_decode 390 python -m pytest -q -p no:cacheprovider -m gpu --durations=20 \
        tests/test_kernel_moe_decode.py
    step gpu_test_norm_rope_probe 180 python -m pytest -q -p no:cacheprovider -m gpu --durations=20 \
        tests/test_kernel_residual_norm.py tests/test_kernel_rope_kv.py tests/test_probe_kernel.py
    ;;
moe17)  # one GPU (session 17): the TMA rows (two one-dot mlp1 passes, blocks of 16 rows) where the table runs
        # the GEMV path (8 tokens: an expert read once per pair); first in the step, paired against the table
        # (20b, then 120b), then the MoE layer alone at 8 / 16 tokens, then the gpu tests gpu17 has, on 8 xdist
        # workers (their time is the compiles: the CPU's 16 cores, not the GPU)
    step diag_moe_row 230 python benchmarks/diag_pdl.py --out "$R" --models 20b,120b --batches 8 --rounds 40 \
        --check 3 --moe-row-ab tma32,tma32_s3,tma128 --stem diag_moe_row_b8
    step sweep_moe_tma 150 python benchmarks/bench_moe.py --out "$R" --sweep-only --sweep-kinds decode \
        --sweep-batches 8,16 --decode-candidates tma --budget-s 120 --stem bench_moe_tma_rows
    step gpu_test_gpu17 200 python -m pytest -q -p no:cacheprovider -m gpu -n 8 --durations=20 \
        tests/test_kernel_moe_decode.py tests/test_kernel_residual_norm.py tests/test_kernel_rope_kv.py \
        tests/test_probe_kernel.py
    ;;
moe17b)  # one GPU (session 17; ran: its MoE gpu tests ran out of memory on 8 workers, 18 of 51, and passed in
         # moe17c on 2), on the table with the many-pairs rule (20b at 8 tokens) and the TMA row at 9..16:
         # that row against the split-K row it replaced in the step (16 tokens), the 20b layer at 5..7 tokens
         # (below the rule's bound), the MoE gpu tests on 8 workers, then the TP1 decode rows and a 20b batch-8
         # profile
    step diag_moe_row 200 python benchmarks/diag_pdl.py --out "$R" --models 20b,120b --batches 16 --rounds 40 \
        --check 3 --moe-row-ab split16,tma32_n64 --stem diag_moe_row_b16
    step sweep_moe_tma 90 python benchmarks/bench_moe.py --out "$R" --models 20b --sweep-only --sweep-kinds decode \
        --sweep-batches 5,6,7 --decode-candidates tma --budget-s 70 --stem bench_moe_tma_rows_t5_7
    step gpu_test_moe 150 python -m pytest -q -p no:cacheprovider -m gpu -n 8 --durations=20 tests/test_kernel_moe.py \
        tests/test_layers.py
    step bench_decode_tp1 240 python benchmarks/bench_decode.py --models 20b,120b --batches 1,8,16,32,64 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 60 --out "$R" --stem bench_decode_tp1_moe17
    step profile_20b_b8 60 python benchmarks/bench_decode.py --models 20b --batches 8 --contexts 8192 --configs 1:1:1 \
        --no-probe --profile --out "$R" --stem bench_decode_20b_b8_profile
    ;;
moe17c)  # one GPU (session 17), on the table as it then was: the many-pairs bound at 7/8 of the experts and the
         # 64-wide mlp2 at 9..16 tokens (moe17d: at 17..32 too). The MoE gpu tests on 2 workers (8 ran out of memory in moe17b: each
         # worker keeps both models' full-size experts and their fp32 dequantised copies), the layers' serially;
         # the 64-wide mlp2 at 32 tokens in the step; the TP1 decode rows, 20b's probe over 200 paired rounds
    step gpu_test_moe 150 python -m pytest -q -p no:cacheprovider -m gpu -n 2 --durations=20 tests/test_kernel_moe.py
    step gpu_test_layers 90 python -m pytest -q -p no:cacheprovider -m gpu --durations=10 tests/test_layers.py
    step diag_moe_row 90 python benchmarks/diag_pdl.py --out "$R" --models 20b,120b --batches 32 --rounds 40 \
        --check 3 --moe-row-ab tma32_n64 --stem diag_moe_row_b32
    step bench_decode_20b 150 python benchmarks/bench_decode.py --models 20b --batches 1,8,16,32,64,128 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 200 --out "$R" --stem bench_decode_tp1_20b_moe17
    step bench_decode_120b 110 python benchmarks/bench_decode.py --models 120b --batches 1,8,16,32,64 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 60 --out "$R" --stem bench_decode_tp1_120b_moe17
    ;;
moe17d)  # one GPU (session 17): moe17c's tests and TP1 rows on the final table (17..32 tokens with the 64-wide
         # mlp2 as well)
    step gpu_test_moe 150 python -m pytest -q -p no:cacheprovider -m gpu -n 2 --durations=20 tests/test_kernel_moe.py
    step gpu_test_layers 90 python -m pytest -q -p no:cacheprovider -m gpu --durations=10 tests/test_layers.py
    step bench_decode_20b 150 python benchmarks/bench_decode.py --models 20b --batches 1,8,16,32,64,128 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 200 --out "$R" --stem bench_decode_tp1_20b_moe17d
    step bench_decode_120b 110 python benchmarks/bench_decode.py --models 120b --batches 1,8,16,32,64 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 60 --out "$R" --stem bench_decode_tp1_120b_moe17d
    ;;
final18)  # one GPU (session 18): gpu tests and TP1 rows on the final tables (MoE 5..128 tokens without the x gather
          # launch, the dense o GEMV on x_once at 5..8 rows)
    step gpu_test_fp8_gemm 100 python tests/test_kernel_fp8_gemm.py --gpu
    step gpu_test_moe 150 python -m pytest -q -p no:cacheprovider -m gpu -n 2 --durations=20 tests/test_kernel_moe.py
    step gpu_test_layers 90 python -m pytest -q -p no:cacheprovider -m gpu --durations=10 tests/test_layers.py
    step bench_decode_20b 150 python benchmarks/bench_decode.py --models 20b --batches 1,8,16,32,64,128 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 200 --out "$R" --stem bench_decode_tp1_20b_final18
    step bench_decode_120b 110 python benchmarks/bench_decode.py --models 120b --batches 1,8,16,32,64 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 60 --out "$R" --stem bench_decode_tp1_120b_final18
    ;;
final18b)  # one GPU (session 18): final18's fp8 GEMM gpu test, which ran past its 100 s there (now with 8 rows), and
           # today's decode tables against session 17's in one paired run per model and batch. Run: the gemm test
           # ran past 200 s too, in its one-shot section after the full-shape rows (limit now 300)
    step gpu_test_fp8_gemm 300 python tests/test_kernel_fp8_gemm.py --gpu
    step diag_session17_tables 200 python benchmarks/diag_pdl.py --out "$R" --models 20b,120b --batches 8,16,64 \
        --rounds 30 --check 3 --session17-ab --stem diag_session17_tables
    ;;
gemv18)  # one GPU (session 18, run before its table change: tma128_xptr is now the table's row, so its A/B would raise): the dense qkv / o decode GEMV at 8 rows was never swept (its 8-warp 128-wide split-K
         # row came from the 16-row sweep; 513 us of 20b's batch-8 step, ~30 % of copy bandwidth): the layers alone,
         # then the fastest configs in the step, both models; then the 33..128-token MoE row without its x gather
    step diag_gemv_row_b8 330 python benchmarks/diag_pdl.py --out "$R" --models 20b,120b --batches 8 --rounds 40 \
        --check 3 --gemv-ab --gemv-top 2 --sweep-budget-s 140 --stem diag_gemv_row_b8
    step diag_moe_row_b64_128 100 python benchmarks/diag_pdl.py --out "$R" --models 20b --batches 64,128 \
        --rounds 30 --check 3 --moe-row-ab tma128_xptr --stem diag_moe_row_xptr_b64_128
    step diag_moe_row_120b_b64 70 python benchmarks/diag_pdl.py --out "$R" --models 120b --batches 64 \
        --rounds 30 --check 3 --moe-row-ab tma128_xptr --stem diag_moe_row_xptr_120b_b64
    ;;
xptr18)  # one GPU (prepared in session 17, run in session 18 before the table took its rows: its _xptr A/Bs would now raise): the TMA decode rows without their x gather launch (mlp1 reads
         # the block's x rows by pointers, W1 still by TMA): the one-dot gpu tests (compiled: the new cases against
         # the pointer kernels' bits), the layer alone at 8 / 16 / 32 tokens beside the table's rows, then the step:
         # 20b batch 8 (many-pairs row), both models at 16 and 32 (the 64-wide mlp2 rows)
    step gpu_test_one_dot 150 python -m pytest -q -p no:cacheprovider -m gpu -n 2 -k one_dot tests/test_kernel_moe.py
    step sweep_moe_xptr 120 python benchmarks/bench_moe.py --out "$R" --sweep-only --sweep-kinds decode \
        --sweep-batches 8,16,32 --decode-candidates tma --budget-s 100 --stem bench_moe_tma_rows_xptr
    step diag_moe_row_b8 90 python benchmarks/diag_pdl.py --out "$R" --models 20b --batches 8 --rounds 40 \
        --check 3 --moe-row-ab tma32_xptr --stem diag_moe_row_xptr_b8
    step diag_moe_row_b16_32 180 python benchmarks/diag_pdl.py --out "$R" --models 20b,120b --batches 16,32 \
        --rounds 40 --check 3 --moe-row-ab tma32_n64_xptr --stem diag_moe_row_xptr_b16_32
    ;;
probe17)  # one GPU (prepared in session 16, not run): the probe's attention sweep with the launcher's own split
          # counts (9 / 5 at 64 / 128 rows), and the 20b probe overhead over 200 paired rounds, enough to resolve
          # the ~0.1-point differences that 60 rounds could not (IQRs ~0.25 points wide in session 16)
    step bench_probe 200 python benchmarks/bench_probe.py --out "$R" --batches 32,64,128 --sweep "" \
        --sweep-attn 64,128 --stem probe_decode_h200_attn17
    step bench_decode_20b 300 python benchmarks/bench_decode.py --models 20b --batches 1,32,64,128 --contexts 8192 \
        --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 200 --out "$R" --stem bench_decode_tp1_20b_probe17
    ;;
decode1)  # one GPU, TP1 rows only: a quick before/after for a change to the decode step
    step gpu_test_layers 100 python -m pytest -q -p no:cacheprovider -m gpu tests/test_layers.py
    step bench_decode_tp1 240 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --profile --out "$R" --stem bench_decode_tp1
    ;;
sweep)  # two independent lanes, one GPU each, so one device call covers tests and tuning
    (
        export CUDA_VISIBLE_DEVICES=0
        step gpu_test_fp8_gemm 150 python tests/test_kernel_fp8_gemm.py --gpu
        step gpu_test_moe 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
        step gpu_test_sink_attention 120 python tests/test_kernel_sink_attention.py --gpu
        step gpu_test_probe 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_probe_kernel.py \
            tests/test_probe_tail.py tests/test_probe_step.py tests/test_probe_cuda_graph.py
        step bench_probe 150 python benchmarks/bench_probe.py --out "$R"
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        step sweep_moe 210 python benchmarks/bench_moe.py --out "$R" --sweep-only
        step sweep_sink_attention 170 python benchmarks/bench_sink_attention.py --decode-sweep --out "$R"
        step sweep_fp8_gemm 150 python benchmarks/bench_fp8_gemm.py --m 1,4,16 --sweep-m 1,4,16 --sweep-shapes qkv,o,lm_head --budget-s 110 --out "$R"
    ) &
    wait
    ;;
grid)  # the committed tables, one GPU per lane
    (
        export CUDA_VISIBLE_DEVICES=0
        step gpu_test_fp8_gemm 120 python tests/test_kernel_fp8_gemm.py --gpu
        step gpu_test_moe 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
        step gpu_test_sink_attention 120 python tests/test_kernel_sink_attention.py --gpu
        step gpu_test_probe 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_probe_kernel.py \
            tests/test_probe_tail.py tests/test_probe_step.py tests/test_probe_cuda_graph.py tests/test_layers.py
        step bench_decode 300 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32,128 \
            --contexts 8192,32768 --configs 1:1:1,2:1:1,2:2:1,4:1:1,4:4:1,8:1:1,8:8:1 --probe-configs 1:1:1 \
            --profile --out "$R"
        step bench_probe 60 python benchmarks/bench_probe.py --out "$R"
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        step bench_prefill 150 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1,2:1:1,4:1:1,8:1:1 \
            --lengths 1024,4096,8192,32768 --out "$R"
        step bench_fp8_gemm 130 python benchmarks/bench_fp8_gemm.py --out "$R" --sweep off
        step bench_moe 130 python benchmarks/bench_moe.py --out "$R" --no-sweep
        step bench_sink_attention 130 python benchmarks/bench_sink_attention.py --out "$R" --no-sweep
    ) &
    wait
    ;;
diag)  # lane 0: where the 120b batch-8 32k step faults (synchronous launches); lane 1: the 8k grid
    (
        export CUDA_VISIBLE_DEVICES=0 CUDA_LAUNCH_BLOCKING=1
        step diag_off 200 python benchmarks/bench_decode.py --models 120b --batches 8 --contexts 32768 \
            --configs 1:1:1 --probe-configs none --out "$R/diag" --stem diag_off
        step diag_on 200 python benchmarks/bench_decode.py --models 120b --batches 8 --contexts 32768 \
            --configs 1:1:1 --probe-configs 1:1:1 --out "$R/diag" --stem diag_on
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        step bench_decode_8k 400 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32,128 \
            --contexts 8192 --configs 1:1:1,2:1:1,2:2:1,4:1:1,4:4:1,8:1:1,8:8:1 --probe-configs 1:1:1 \
            --profile --out "$R" --stem bench_decode_8k
    ) &
    wait
    ;;
decode)  # lane 0: the 1-GPU decode grid (+ modelled configs); lane 1: the probe's gpu tests + bench_probe
    (
        export CUDA_VISIBLE_DEVICES=0
        step bench_decode 450 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32,128 \
            --contexts 8192,32768 --configs 1:1:1,2:1:1,2:2:1,4:1:1,4:4:1,8:1:1,8:8:1 --probe-configs 1:1:1 \
            --profile --out "$R"
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        step gpu_test_probe 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_probe_kernel.py \
            tests/test_probe_tail.py tests/test_probe_step.py tests/test_probe_cuda_graph.py
        step bench_probe 60 python benchmarks/bench_probe.py --out "$R"
    ) &
    wait
    ;;
recheck)  # one GPU: the three kernels' gpu tests (after a launcher-side change) + bench_probe
    step gpu_test_fp8_gemm 120 python tests/test_kernel_fp8_gemm.py --gpu
    step gpu_test_moe 70 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
    step gpu_test_sink_attention 120 python tests/test_kernel_sink_attention.py --gpu
    step bench_probe 40 python benchmarks/bench_probe.py --out "$R" --sweep ""
    ;;
probe1)  # one GPU: the probe's gpu tests, then the TP1 decode rows with the probe on/off (ctx 8192)
    step gpu_test_probe 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_probe_step.py \
        tests/test_probe_cuda_graph.py
    step bench_decode_tp1 200 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32,128 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --out "$R" --stem bench_decode_tp1
    ;;
fuse)  # one GPU: the gpu tests of this session's fused layers and MoE decode front, then the batch-1
       # diagnosis and the MoE table (step limits sum under the device call's 600 s)
    step gpu_test_new 100 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_rope_kv.py \
        tests/test_kernel_residual_norm.py tests/test_layers.py
    step gpu_test_moe 130 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
    step gpu_test_probe 90 python -m pytest -q -p no:cacheprovider -m gpu tests/test_probe_step.py \
        tests/test_probe_cuda_graph.py
    step diag_decode_b1 120 python benchmarks/diag_decode_b1.py --out "$R"
    step bench_moe 110 python benchmarks/bench_moe.py --out "$R" --no-sweep
    ;;
kernels2)  # one GPU: the decode GEMV fixed-cost variants (sweep + their gpu check) and the sink-attention
           # split merge (gpu test + merge benchmark); step limits sum under the call's 600 s
    step sweep_fp8_gemm_fixed 170 python benchmarks/bench_fp8_gemm.py --m "" --sweep-m 1,4 --sweep-lm-head-m 1 \
        --sweep-shapes qkv,o,lm_head --decode-sweep fixed-cost --compile-workers 12 --budget-s 90 --out "$R"
    step gpu_test_fp8_gemm_decode 90 python tests/test_kernel_fp8_gemm.py --gpu-decode
    step gpu_test_sink_attention 110 python tests/test_kernel_sink_attention.py --gpu
    step bench_sink_attention_merge 150 python benchmarks/bench_sink_attention.py --decode-merge --out "$R"
    ;;
check3)  # one GPU: gpu tests after the merge-kernel and x_once picks, the batch-1 diagnosis (probe launch
         # points), the TP1 decode grid with the probe on/off
    step gpu_test_sink_attention 110 python tests/test_kernel_sink_attention.py --gpu
    step gpu_test_fp8_gemm_decode 60 python tests/test_kernel_fp8_gemm.py --gpu-decode
    step diag_decode_b1 150 python benchmarks/diag_decode_b1.py --out "$R"
    step bench_decode_tp1 240 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32,128 \
        --contexts 8192,32768 --configs 1:1:1 --probe-configs 1:1:1 --profile --out "$R" --stem bench_decode_tp1
    ;;
final)  # one GPU: the committed decode grid (1 GPU measured, 2-8 GPUs modelled, probe on/off) and the
        # prefill grid with a per-kernel breakdown of the 8k prefill
    step bench_decode 400 python benchmarks/bench_decode.py --models 120b,20b --batches 1,8,32,128 \
        --contexts 8192,32768 --configs 1:1:1,2:1:1,2:2:1,4:1:1,4:4:1,8:1:1,8:8:1 --probe-configs 1:1:1 \
        --profile --out "$R"
    step bench_prefill 160 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1,2:1:1,4:1:1,8:1:1 \
        --lengths 1024,4096,8192,32768 --profile 8192 --out "$R"
    ;;
moe2)  # one GPU: the MoE decode GEMV variants (sweep, then their gpu tests on the warm cache), and the
       # probe overhead at 120b batch 128 (context 4096: 8192 does not fit one H200)
    step sweep_moe_gemv 200 python benchmarks/bench_moe.py --gemv-sweep --compile-workers 12 --budget-s 120 --out "$R"
    step gpu_test_moe_gemv 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py -k "gemv or small_dims"
    step bench_decode_120b_b128 90 python benchmarks/bench_decode.py --models 120b --batches 128 --contexts 4096 \
        --configs 1:1:1 --probe-configs 1:1:1 --out "$R" --stem bench_decode_120b_b128_ctx4096
    ;;
b1)  # one GPU: where a batch-1 decode step's time goes (launch floor, GEMV fixed cost, per-kernel
     # device time inside the graph replay) + Nsight Compute on one launch of each batch-1 kernel
    step diag_decode_b1 240 python benchmarks/diag_decode_b1.py --out "$R"
    NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
    step ncu_b1 240 "$NCU" --clock-control none --profile-from-start off --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
        --section SchedulerStats python benchmarks/diag_decode_b1.py --ncu-kernels
    ;;
pdl19)  # one GPU (session 19): PDL for the 5..16-row decode chain (the split-K GEMVs, the split-loop attention,
        # the MoE's GEMV / TMA rows and the combine now wait for their predecessor): the step's bits with and
        # without PDL at 1..16 rows (gpu test), then the step's time PDL on vs off at batch 8 / 16, both models
    step gpu_test_pdl 200 python -m pytest -q -p no:cacheprovider -m gpu --durations=10 tests/test_pdl.py
    step diag_pdl_b8_16 330 python benchmarks/diag_pdl.py --out "$R" --models 20b,120b --batches 8,16 \
        --rounds 40 --check 20 --stem diag_pdl_b8_16
    ;;
pdl19b)  # one GPU (session 19): pdl19 found PDL over the 5..16-row chain -73 us at 20b batch 8 but +103..+218 us
         # elsewhere, the MoE kernels slower as dependents; which families to launch plainly (kernels/pdl.py
         # PDL_PLAIN_FAMILIES), each variant against the plain step, batch 4 (where session 18 ran the GEMVs and
         # the split-loop attention plainly: the last variant), 8 and 16
    step diag_pdl_families 560 python benchmarks/diag_pdl.py --out "$R" --models 20b,120b --batches 4,8,16 \
        --rounds 30 --check 10 --families 'none;moe;moe,gemv;moe,attention;attention,gemv,moe,moe_combine' \
        --stem diag_pdl_families
    ;;
pdl19c)  # one GPU (session 19): the chosen table (kernels/pdl.py PDL_PLAIN_FROM_ROWS: the MoE always, the GEMVs from
         # 9 rows launched plainly): the step's bits with and without PDL, the step A/B at 2..16, TP1 rows
    step gpu_test_pdl 200 python -m pytest -q -p no:cacheprovider -m gpu --durations=10 tests/test_pdl.py
    step diag_pdl_b2_16 200 python benchmarks/diag_pdl.py --out "$R" --models 20b,120b --batches 2,4,8,16 \
        --rounds 40 --check 10 --stem diag_pdl_session19
    step bench_decode_20b 150 python benchmarks/bench_decode.py --models 20b --batches 1,4,8,16 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 200 --out "$R" --stem bench_decode_tp1_20b_pdl19
    step bench_decode_120b 120 python benchmarks/bench_decode.py --models 120b --batches 1,4,8,16 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 60 --out "$R" --stem bench_decode_tp1_120b_pdl19
    ;;
pdl19d)  # one GPU (session 19): at 8 rows, the K-loop GEMV (qkv) plain with o's x_once GEMV still a dependent;
         # then the gpu tests of the kernels that gained the PDL wait (launched as dependents up to 16 rows now)
    step diag_pdl_families_b8 150 python benchmarks/diag_pdl.py --out "$R" --models 20b,120b --batches 8 \
        --rounds 40 --check 10 --no-profile --families 'moe;moe,gemv;moe,gemv,gemv_xonce' --stem diag_pdl_families_b8
    step gpu_test_moe 180 python -m pytest -q -p no:cacheprovider -m gpu -n 2 --durations=10 tests/test_kernel_moe.py
    step gpu_test_fp8_gemm_decode 150 python tests/test_kernel_fp8_gemm.py --gpu-decode
    step gpu_test_sink_full 120 python tests/test_kernel_sink_attention.py --gpu-full
    step gpu_test_layers 90 python -m pytest -q -p no:cacheprovider -m gpu --durations=10 tests/test_layers.py
    ;;
pdl19e)  # one GPU (session 19): the final table (the K-loop GEMV plain at every size): the step's bits with and
         # without PDL (gpu test), TP1 rows at batch 8 / 16
    step gpu_test_pdl 150 python -m pytest -q -p no:cacheprovider -m gpu --durations=10 tests/test_pdl.py
    step bench_decode_20b 100 python benchmarks/bench_decode.py --models 20b --batches 8,16 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 200 --out "$R" --stem bench_decode_tp1_20b_pdl19e
    step bench_decode_120b 80 python benchmarks/bench_decode.py --models 120b --batches 8,16 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 60 --out "$R" --stem bench_decode_tp1_120b_pdl19e
    ;;
probe20)  # one GPU (prepared in session 19, not run): where the 20b probe's batch-1 overhead goes (0.32-0.41 %
          # against 0.25 % in sessions 18-19): the step without and with the probe, paired, and both critical paths
    step diag_probe_path 200 python benchmarks/diag_pdl.py --out "$R" --models 20b,120b --batches 1 --rounds 100 \
        --probe-path --stem diag_probe_path
    ;;
s20a)  # one GPU (session 20): probe20, then the MoE prefill with x's rows by pointers (no gather launch)
    step diag_probe_path 200 python benchmarks/diag_pdl.py --out "$R" --models 20b,120b --batches 1 --rounds 100 \
        --probe-path --stem diag_probe_path
    step diag_moe_prefill_xptr 150 python benchmarks/diag_moe_prefill.py --out "$R" --models 120b,20b \
        --configs table,tma_xptr --stem diag_moe_prefill_xptr
    ;;
s20b)  # one GPU (session 20, ran at 5ce4889, where "served" was today's "chain"): the probe's step with positions
       # inside its kernels and as a PDL chain beside the LM head: its gpu tests, the three launch variants
    step gpu_test_probe 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_probe_step.py \
        tests/test_probe_cuda_graph.py tests/test_probe_kernel.py tests/test_probe_tail.py
    step diag_probe_variants 300 python benchmarks/diag_pdl.py --out "$R" --models 20b,120b --batches 1,8 \
        --rounds 100 --probe-variants before,positions,chain --stem diag_probe_variants
    ;;
s20c)  # one GPU (session 20): s20b's A/B again without the harness's two arange launches (a server has none),
       # with fewer q|k|v programs and the side stream at normal priority as variants, 200 rounds
    step diag_probe_variants2 400 python benchmarks/diag_pdl.py --out "$R" --models 20b,120b --batches 1,8 \
        --rounds 200 --probe-variants before,positions,chain,chain_q6,positions_q6,chain_normal \
        --stem diag_probe_variants2
    ;;
s20d)  # one GPU (session 20): the probe's step as served after s20c (positions in its kernels, plain launches):
       # its gpu tests and the PDL bits test, then TP1 rows with the probe pair (the harness without its aranges)
    step gpu_test_probe 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_probe_step.py \
        tests/test_probe_cuda_graph.py tests/test_pdl.py
    step bench_decode_20b 240 python benchmarks/bench_decode.py --models 20b --batches 1,4,8,16,32,64,128 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 200 --out "$R" --stem bench_decode_tp1_20b_s20
    step bench_decode_120b 240 python benchmarks/bench_decode.py --models 120b --batches 1,4,8,16,32,64 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 100 --out "$R" --stem bench_decode_tp1_120b_s20
    ;;
s20e)  # one GPU (session 20): the MoE prefill row with bf16 pair outputs (MoeConfig.pair_out_bf16): its gpu tests
       # (interpreter-checked maths compiled), the layer A/B, then the whole 8k prefill A/B/A on 120b, A/B on 20b.
       # Ran before the table took bf16 pairs, so its files name the old row "table" and the new one "y16"; now
       # the old row is "y32" and the table the new one
    step gpu_test_moe_one_dot 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py \
        -k "one_dot_small_dims_compiled"
    step diag_moe_prefill_y16 100 python benchmarks/diag_moe_prefill.py --out "$R" --models 120b,20b \
        --configs y32,table --stem diag_moe_prefill_y16
    for v in y32 table y322; do
        step "prefill_ab_120b_$v" 80 python benchmarks/prefill_moe_ab.py "${v%2}" --models 120b --configs 1:1:1 \
            --lengths 8192 --iters 10 --out "$R" --stem "bench_prefill_ab_120b_$v"
    done
    for v in y32 table; do
        step "prefill_ab_20b_$v" 60 python benchmarks/prefill_moe_ab.py "$v" --models 20b --configs 1:1:1 \
            --lengths 8192 --iters 10 --out "$R" --stem "bench_prefill_ab_20b_$v"
    done
    ;;
s20f)  # one GPU (session 20): the table's prefill row with bf16 pair outputs: the MoE gpu tests (the one-dot and
       # bf16-pair cases compiled, full shapes at 512 / 1100 / 8192 tokens)
    step gpu_test_moe 300 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_moe.py
    ;;
prefill21)  # one GPU (prepared in session 20, not run): the TP1 prefill rows with the bf16-pair prefill row (its
           # 129..1024-token use never timed: 1024 here, A/B against the old row) and the 8k profile, one CUDA graph too
    step bench_prefill_tp1 240 python benchmarks/bench_prefill.py --models 120b,20b --configs 1:1:1 \
        --lengths 1024,4096,8192 --graph --profile 8192 --out "$R" --stem bench_prefill_tp1
    for v in y32 table; do  # y32: the row before session 20 (fp32 pair outputs)
        step "prefill_ab_1024_$v" 90 python benchmarks/prefill_moe_ab.py "$v" --models 120b,20b --configs 1:1:1 \
            --lengths 1024 --iters 20 --out "$R" --stem "bench_prefill_ab_1024_$v"
    done
    ;;
ab23)  # one GPU (session 23): prefill21's 1024-token A/B was eager, launch-bound and noisy (120b y32 77.0 / table
       # 52.8 ms, 20b 35.5 / 42.8): again with one CUDA graph per call, 256 and 1024 tokens, the two rows interleaved;
       # then the Gluon kernels' gpu tests (never run on a GPU)
    for v in y32 table y32b tableb; do
        row=${v%b}
        step "prefill_ab_graph_$v" 100 python benchmarks/prefill_moe_ab.py "$row" --models 120b,20b --configs 1:1:1 \
            --lengths 256,1024 --iters 10 --graph --out "$R" --stem "bench_prefill_ab_graph_$v"
    done
    step gpu_test_gluon 300 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_gluon.py
    ;;
host23)  # one GPU (session 23): why ab23's eager calls were 1.6-2x slower with the table row than with y32 while their
        # CUDA graphs were equal: host enqueue time, graph, kernel time and the runtime calls that block the host
    for v in y32 table; do
        step "diag_prefill_host_$v" 200 python benchmarks/diag_prefill_host.py --models 20b,120b --lengths 256,1024 \
            --iters 10 --moe-row "$v" --out "$R" --stem "diag_prefill_host_$v"
    done
    ;;
decode23)  # one GPU (session 23): s20d's decode rows again on today's machine, the code unchanged since: 20b with the
          # probe pair (batch 8's bandwidth, the probe at 64 / 128 against the 0.25 % line), 120b batch 1 and 8
    step bench_decode_20b 240 python benchmarks/bench_decode.py --models 20b --batches 1,4,8,16,32,64,128 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 200 --out "$R" --stem bench_decode_tp1_20b_s23
    step bench_decode_120b 150 python benchmarks/bench_decode.py --models 120b --batches 1,8 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 100 --out "$R" --stem bench_decode_tp1_120b_s23
    ;;
probe23)  # one GPU (session 23): where the probe's step goes at the batches decode23 found it over 0.25 % on 20b
         # (32: 0.26, 64 / 128: 0.32 %): the step's launch variants and the last kernels of one replay
    step diag_probe_variants_b32_128 240 python benchmarks/diag_pdl.py --out "$R" --models 20b --batches 32,128 \
        --rounds 100 --probe-variants positions,chain --stem diag_probe_variants_b32_128
    ;;
carve25)  # one GPU (session 25): the probe's step beside an LM head that leaves 8 / 16 SMs to it (torch's SM
          # carveout on the head's cuBLAS GEMM), 20b batch 32 / 128; then a fresh 20b batch-8 kernel profile (69 % of
          # copy bandwidth in session 23, target 70)
    step carveout_api 30 python -c "import torch; print(torch.__version__, hasattr(torch._C, '_set_sm_carveout_experimental'))"
    step diag_probe_carveout 240 python benchmarks/diag_pdl.py --out "$R" --models 20b --batches 32,128 \
        --rounds 80 --probe-variants positions,carve8,carve16 --stem diag_probe_carveout
    step bench_decode_20b_b8_profile_s25 100 python benchmarks/bench_decode.py --models 20b --batches 8 \
        --contexts 8192 --configs 1:1:1 --no-probe --profile --out "$R" --stem bench_decode_20b_b8_profile_s25
    ;;
carve25b)  # one GPU (session 25): carve25's carveout did not reach the head's cuBLAS kernel (same kernel, same
           # time, the tail still after it); again with the head through cuBLASLt, whose SM-count target it sets
    step diag_probe_carveout_lt 200 python benchmarks/diag_pdl.py --out "$R" --models 20b --batches 128,32 \
        --rounds 80 --probe-variants positions,carve16lt,carve32lt --stem diag_probe_carveout_lt
    ;;
b1s25)  # one H200 (session 25): the 120b batch-1 step's critical path with today's kernels (the README's breakdown is
        # session 6's diag_pdl_b1.md with session 23's step time)
    step diag_pdl_b1_s25 300 python benchmarks/diag_pdl.py --out "$R" --models 120b --batches 1 --rounds 30 \
        --check 10 --no-probe --stem diag_pdl_b1_s25
    ;;
b1s26)  # one H200 (session 26): where each missed decode target's time goes with today's kernels, from the replayed
        # graph's critical path: 120b batch 1 (b1s25's step), 20b batch 1 and batch 8
    step diag_pdl_b1_s26 330 python benchmarks/diag_pdl.py --out "$R" --models 120b --batches 1 --rounds 30 \
        --check 10 --no-probe --stem diag_pdl_b1_s26
    step diag_pdl_20b_s26 200 python benchmarks/diag_pdl.py --out "$R" --models 20b --batches 1,8 --rounds 30 \
        --check 10 --no-probe --stem diag_pdl_20b_s26
    ;;
decode26)  # one H200 (session 26, run by hand on a warm machine as this command): decode23's 20b rows at the batches of
           # the bandwidth and probe targets, another machine's sample of the same code
    step bench_decode_tp1_20b_s26 330 python benchmarks/bench_decode.py --models 20b --batches 1,8,32,64,128 \
        --contexts 8192 --configs 1:1:1 --probe-configs 1:1:1 --probe-rounds 200 --out "$R" --stem bench_decode_tp1_20b_s26
    ;;
attn26)  # one GPU (session 26): the probe's attention with other splits and key blocks (its programs take the SM
         # slots the LM head's waves need: 39-46 us a step at 20b batch 128 against ~18 for its bytes), paired rounds
    step diag_probe_attn 400 python benchmarks/diag_pdl.py --out "$R" --models 20b --batches 128,64 \
        --rounds 60 --probe-variants positions,attn_s1,attn_s2,attn_s3,attn_s10,attn_bn32,attn_bn128,qkv_s2 \
        --stem diag_probe_attn
    ;;
tap26)  # one GPU (session 26): the probe's step started at the deepest tap (beside the last two 20b layers) against
        # beside the LM head, paired rounds at the batches where 20b's overhead sits at or over 0.25 %; then the 20b
        # batch-8 decode row (69 % of copy bandwidth in session 23, target 70)
    step diag_probe_tap 360 python benchmarks/diag_pdl.py --out "$R" --models 20b --batches 128,64,32,8 \
        --rounds 80 --probe-variants positions,tap,tap_normal --stem diag_probe_tap
    step bench_decode_tp1_20b_b8_s26 120 python benchmarks/bench_decode.py --models 20b --batches 8 \
        --contexts 8192 --configs 1:1:1 --out "$R" --stem bench_decode_tp1_20b_b8_s26
    ;;
gluon22)  # one GPU (prepared in sessions 20-21, not run; run first): the Gluon FP8 GEMMs of kernels/fp8_gluon.py and
          # kernels/moe_gluon.py (MMAs run while the previous K block is scaled: wgmma.wait_group 1) beside ours at
          # full size: the dense GEMM (float64 check, bits vs ours), then the 120b MoE layer's variants (bits vs the
          # table, moe_ref, times; the file rewritten after every row: a step cut by its limit keeps what ran)
    step diag_gluon_fp8_gemm 120 python benchmarks/diag_gluon_fp8_gemm.py --out "$R"
    step diag_gluon_moe_120b 330 python benchmarks/diag_gluon_moe.py --out "$R" --models 120b --stem diag_gluon_moe_120b
    ;;
gluon22t)  # one GPU (prepared, not run; before a Gluon form enters the table): the gpu tests (bits vs the Triton
           # tiles on ragged dims and 120b shapes, moe_ref, CUDA graphs), then the 20b layer's main variants
    step gpu_test_gluon 330 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_gluon.py
    step diag_gluon_moe_20b 200 python benchmarks/diag_gluon_moe.py --out "$R" --models 20b --stem diag_gluon_moe_20b \
        --variants gluon,gluon_w8,gluon_p,gluon_w8p
    ;;
gluon22ab)  # one GPU (prepared, not run; after gluon22 if its bits and times hold): the whole 120b 8k prefill with the
            # MoE's table row on Gluon (MoeConfig.mlp1_gluon / mlp2_gluon), its 8-warp persistent form, then the
            # table's tiles with the dense layers' on Gluon too (fp8_gemm.GLUON_PREFILL_TILES), between two table runs
    for v in table gluon gluon_w8p gluondense table2; do
        row=${v%2}; extra=()
        [ "$v" = gluondense ] && row=gluon && extra=(--dense-gluon)
        step "prefill_ab_120b_$v" 80 python benchmarks/prefill_moe_ab.py "$row" "${extra[@]}" --models 120b \
            --configs 1:1:1 --lengths 8192 --iters 10 --out "$R" --stem "bench_prefill_ab_120b_$v"
    done
    ;;
dgmoe19)  # one GPU (session 19): would DeepGEMM's grouped GEMM make the MoE prefill faster? Ours (mlp1 + mlp2 +
          # combine) against DeepGEMM's two grouped GEMMs on the same experts and routing (carry .peers/deepgemm)
    export DEEPGEMM_PEER_ROOT="$PWD/.peers/deepgemm" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
    export DG_JIT_CACHE_DIR="$DEEPGEMM_PEER_ROOT/jit_cache" PYTHONPATH="$DEEPGEMM_PEER_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    step diag_moe_deepgemm 400 python benchmarks/diag_moe_deepgemm.py --out "$R" --models 120b,20b --tokens 8192,1024
    ;;
dgmoe19b)  # one GPU (session 19): dgmoe19 again with DeepGEMM's operands zero-padded to K = 2944 (its grouped entry
           # passes K = 2880 unaligned and the kernel drops the last 64 columns: dgmoe19's 0.17 relative error)
    export DEEPGEMM_PEER_ROOT="$PWD/.peers/deepgemm" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
    export DG_JIT_CACHE_DIR="$DEEPGEMM_PEER_ROOT/jit_cache" PYTHONPATH="$DEEPGEMM_PEER_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    step diag_moe_deepgemm_padded 200 python benchmarks/diag_moe_deepgemm.py --out "$R" --models 120b,20b \
        --tokens 8192 --pad-k --stem diag_moe_deepgemm_padded
    ;;
x2)
    step nccl 60 python benchmarks/perf_model.py --measure-nccl --nproc 2 --out "$R"
    step bench_decode_x2 300 python benchmarks/bench_decode.py --nproc 2 --models 120b,20b --batches 1,8,32,128 \
        --contexts 8192,32768 --configs 2:1:1,2:2:1,2:2:2 --probe-configs none --nccl "$R/nccl_collectives.json" \
        --out "$R" --stem bench_decode_x2
    step bench_prefill_x2 150 python benchmarks/bench_prefill.py --nproc 2 --models 120b,20b --configs 2:1:1 \
        --lengths 1024,4096,8192,32768 --nccl "$R/nccl_collectives.json" --out "$R" --stem bench_prefill_x2
    ;;
esac
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$R"
echo "done in $(( $(date +%s) - t0 )) s"
