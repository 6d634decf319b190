"""Fused FP8 mixture of experts for gpt-oss (Triton), beside its plain-torch reference `moe_ref`.

The maths is `route` and `swiglu_oai` (kernels/reference.py, the layers' `experts_torch` too) on FP8
operands as kernels/reference.py defines them: expert weights e4m3 [E, out, in] with fp32 `scale_inv`
per 128x128 block (ragged last block, 2880 = 22.5 x 128), activations e4m3 with one fp32 scale
per token per 128 columns (scale = amax / 448). One MoE layer, T tokens, k experts each:

  1. router logits = F.linear(x, Wr, br): the op `route` runs, so the same logits;
  2. `_front_kernel`: top-k of the logits and softmax over those k in the router's dtype, x
     quantised to e4m3 in 1x128 groups (mlp1's A operand, one group column per program), and
     the (token, slot) pairs sorted by local expert into BLOCK_M-padded segments, stable
     (token order kept), sized for the worst case from T alone, so nothing is read back to
     the host (CUDA-graph safe). Up to 64 tokens on 64+ local experts it does all of it in one
     launch (the sort by comparing pairs with pairs, `_sort_pairs_compare`); otherwise the sort
     runs after it (`_count_kernel` per chunk of pairs, `_align_kernel`): see FUSED_SORT_MAX_TOKENS;
  1.+2. decode (T <= DECODE_FRONT_MAX_TOKENS = 16): `_decode_front_kernel` replaces both in one
     launch. 96 programs each multiply x by 1-4 router rows over a third of H (a 128-expert
     router's 737 KB in flight at once; cuBLAS ran 4 CTAs and a split-K reduce launch, ~6 us);
     the last to arrive (arrival counter, as mlp1's split-K) sums the three fp32 partials in
     fixed order, adds the bias, rounds once to the router dtype, then does step 2's top-k and
     softmax and the sort, with [4T, 4T] pair comparisons instead of `_align_body`'s sweeps
     over the expert axis (whose cost grew with E: 7.6 us at 128 experts vs 3.2 at 32, batch 1,
     H200). Other programs quantise x meanwhile;
  3. `_mlp1_kernel`: per segment block, x W1^T with FP8 dots promoted to fp32 every 128 of K
     (DeepGEMM's scheme: block scales applied per K step). W1's gate and linear rows are
     interleaved (2c, 2c+1), so the program loads them as two tiles and each (gate, linear)
     pair meets in one program (`mlp1_one_dot`: one contiguous tile, one dot, one accumulator
     split into gate and linear after the bias; with `mlp1_passes` 2, the table's rows of 17+
     tokens, the program's columns in two such passes of 128 rows, each on one warpgroup, h of the
     first kept until the second; with `MoeConfig.tma` x is first gathered into the sorted order,
     `_gather_rows_kernel`, and the x / W1 tiles come by TMA, as do mlp2's h / W2 tiles); epilogue:
     bias, clamp, swiglu, and h
     requantised in 1x128 groups (the table's tiles span whole groups; narrower tiles store
     fp32 h for mlp2 to quantise as it loads it, a slower path kept for the sweep and the tests);
  4. `_mlp2_kernel`: h W2^T (+ b2) per pair, fp32, in pair order (bf16 with `MoeConfig.pair_out_bf16`, the
     prefill row's, for bf16 x: each y rounded once);
  5. `_combine_kernel`: out[t] = sum_j w_j * y_j in fp32, one rounding to x's dtype.
  3.-5. decode GEMV path (`MoeConfig.gemv`, the table's 5..8-token row; `decode_gemv_variants`
     lists the configs the H200 sweep compares with it): `_mlp1_gemv_kernel` and
     `_mlp2_gemv_kernel` treat each sorted block of `block_m` (1..4) pairs of one expert as GEMV
     rows. Program (K split, block, row tile) streams a weight slab of 64-128 rows x 2-8 K blocks
     once through cp.async stages, swap-AB against a block-diagonal x tile (`_gemv_slab`), both
     scales loaded once before its K loop; the last arriver of each 128-column h group loads all
     splits' fp32 partials at once (fixed order), adds b1, applies the activation and
     requantises h; mlp2's adds b2, and step 5 combines. Why: at batch 1 `_mlp1_kernel` (200 registers, 184 programs,
     1.4 an SM) waited each K iteration on x and scale loads Triton does not pipeline: 58% of
     copy bandwidth (H200, ncu), mlp2 52%.

Split-K (config `mlp1_split_k` / `mlp2_split_k`, for decode, where 4 experts x 23 tiles leave
SMs idle): each split of mlp1 stores fp32 partials and bumps a per-tile counter; the split that
arrives last sums all partials in split order (so the bits never depend on arrival order), runs
the epilogue and resets the counter (counters are kept per device, zero between launches: no
memset per call). mlp2's splits write one slab each (b2 in the first), which the combine sums
in split order. Results are reproducible run to run; they differ from split 1 in fp32 order.

Parallelism hooks, as `experts_torch`: the weights hold this rank's experts, global ids
`expert_offset .. expert_offset + E_local - 1` (expert parallelism; other experts contribute
nothing), and `b2=None` leaves mlp2's bias to the caller (tensor parallelism adds it once after
the all-reduce: the layers' `add_down_bias`).

Numerics. Routing equals `route` bit for bit on bf16 logits without ties (the model's routing
dtype): the kernel reproduces torch's own softmax on the tensors' device (CUDA: expf,
butterfly sum, IEEE division; CPU: sequential sum, reciprocal multiply); fp32 logits on a CPU
keep last-ulp differences of exp. Tied logits go to the lower expert id first (torch.topk
leaves the order among equals unspecified; the values picked are the same). The decode
front's logits are F.linear's maths (bf16 products exact in fp32, fp32 sums, then the bias,
one rounding to the router dtype) in another summation order than cuBLAS's: where an exact
logit lies within fp32 rounding noise of a bf16 rounding boundary (rare: the tests allow 1%
and see ~0) it lands one bf16 ulp from cuBLAS's, which moves that token's weights by an ulp,
or picks the other of two experts whose logits are within that ulp. The routing from its own
logits is bit for bit `route`'s top-k + softmax, and fixed run to run (split order, not
arrival order). x's quantisation equals `quantize_activation_group128` bit for bit. The
expert GEMMs differ from `moe_ref` only by fp32 summation order, which can flip a rare e4m3
rounding of h (tests/kernels/test_kernel_moe.py states the tolerances); where y is stored as bf16
(`MoeConfig.pair_out_bf16`: the prefill row, bf16 x) each y's rounding comes on top, which
`moe_ref(pair_out_bf16=True)` reproduces (compiled, y from the tensor cores' FP8 accumulation can
round to the other bf16 neighbour; the tests bound that against the fp32-pair kernel).

Launch configs come from a table by token count (`select_config`) for hidden 2880 on an H200;
nothing is autotuned at run time. The table was chosen from ptxas resource counts (registers,
shared memory, no spills) and bandwidth arithmetic, then corrected by the H200 sweep of
benchmarks/bench_moe.py (benchmarks/results/sweeps/moe.md; see the table's comment).

Layout, by size regime (each module's docstring says what it serves and the invariant it keeps):

  config.py     `MoeConfig`, the H200 table by token count (`select_config`), the GEMV variants, the checks;
  common.py     the device helpers every regime shares (e4m3 quantisation, activation, bf16 rounding) and
                the host's arithmetic and weight checks;
  routing.py    1.+2.: `_front_kernel`, `_decode_front_kernel` and their launchers (`decode_front`,
                `route_and_quantize`, `route_and_align`);
  sort.py       the pair sort (`_count_kernel` / `_align_kernel`, the pair-comparison sorts), `align_pairs`;
  oneshot.py    3.-5. for 1..4 tokens: the one-shot kernels (no sort, no K loop, no split-K);
  gemv.py       3.-5. for 5..8 tokens: the GEMV path;
  grouped.py    3./4. for 9+ tokens up to prefill: the grouped GEMMs (`_mlp1_kernel`, `_mlp2_kernel`);
  combine.py    5.: `_combine_kernel`;
  dispatch.py   `fused_moe_fp8`, `fused_experts_fp8`: the checks, the front, the regime's launches;
  reference.py  `moe_ref`.

This package re-exports every name the single module had, so `from sglang_ext.kernels.moe import X`
and `moe.X` keep working. To replace a name for a test (a kernel, a table, a rule), set it on the
module that looks it up (e.g. `moe.routing._front_kernel`, `moe.dispatch.select_config`): the
package's attribute is a copy of the binding.
"""

from __future__ import annotations

from .combine import (  # noqa: F401
    COMBINE_BLOCK_T,
    _combine_kernel,
)
from .common import (  # noqa: F401
    FP8,
    _cdiv,
    _check_weights,
    _experts_pad,
    _gpt_oss_activation,
    _next_pow2,
    _quantize_e4m3,
    _round_to_bf16,
)
from .config import (  # noqa: F401
    H200_HIDDEN_2880_CONFIGS,
    H200_MANY_PAIRS_CONFIGS,
    TMA_DECODE_ROW,
    TMA_DECODE_ROW_WIDE_MLP2,
    TMA_DECODE_ROW_WIDE_MLP2_XPTR,
    TMA_DECODE_ROW_XPTR,
    MoeConfig,
    decode_gemv_variants,
    select_config,
    _check_config,
)
from .dispatch import (  # noqa: F401
    fused_experts_fp8,
    fused_moe_fp8,
    _check_call,
    _experts,
)
from .gemv import (  # noqa: F401
    GEMV_COUNTERS_OWNER,
    GEMV_REDUCE_MAX_REGS,
    gemv_shape,
    _counters,
    _experts_gemv,
    _gemv_red_chunk,
    _gemv_slab,
    _mlp1_gemv_kernel,
    _mlp2_gemv_kernel,
)
from .grouped import (  # noqa: F401
    COUNTERS_OWNER,
    GATHER_BLOCK_R,
    _gather_rows_kernel,
    _mlp1_kernel,
    _mlp1_pass,
    _mlp2_kernel,
    _split_counters,
)
from .oneshot import (  # noqa: F401
    DEFAULT_ONESHOT,
    OneshotConfig,
    fused_moe_decode_oneshot,
    fused_moe_fp8_oneshot,
    launch_mlp1,
    launch_mlp2_combine,
    oneshot_variants,
    quantize_h,
)
from .reference import (  # noqa: F401
    moe_ref,
    _fake_quant,
)
from .routing import (  # noqa: F401
    DECODE_FRONT_MAX_TOKENS,
    FUSED_SORT_MAX_TOKENS,
    FUSED_SORT_MIN_EXPERTS,
    QUANT_BLOCK_T,
    ROUTER_COUNTER_OWNER,
    ROUTE_BLOCK_T,
    SORT_TILE_VALUES,
    RouterTiling,
    decode_front,
    route_and_align,
    route_and_quantize,
    router_tiling,
    _decode_front,
    _decode_front_kernel,
    _decode_token_pad,
    _front,
    _front_kernel,
    _quantize_x_column,
    _route_rows,
    _topk_softmax,
    _uses_decode_front,
)
from .sort import (  # noqa: F401
    SORT_MAX_SINGLE_CHUNKS,
    align_pairs,
    _align_body,
    _align_kernel,
    _count_kernel,
    _launch_sort,
    _local_ids,
    _local_one_hot,
    _max_blocks,
    _sort_chunk,
    _sort_few_pairs,
    _sort_pairs_compare,
)

__all__ = [
    "COMBINE_BLOCK_T",
    "COUNTERS_OWNER",
    "DECODE_FRONT_MAX_TOKENS",
    "DEFAULT_ONESHOT",
    "FP8",
    "FUSED_SORT_MAX_TOKENS",
    "FUSED_SORT_MIN_EXPERTS",
    "GATHER_BLOCK_R",
    "GEMV_COUNTERS_OWNER",
    "GEMV_REDUCE_MAX_REGS",
    "H200_HIDDEN_2880_CONFIGS",
    "H200_MANY_PAIRS_CONFIGS",
    "MoeConfig",
    "OneshotConfig",
    "QUANT_BLOCK_T",
    "ROUTER_COUNTER_OWNER",
    "ROUTE_BLOCK_T",
    "RouterTiling",
    "SORT_MAX_SINGLE_CHUNKS",
    "SORT_TILE_VALUES",
    "TMA_DECODE_ROW",
    "TMA_DECODE_ROW_WIDE_MLP2",
    "TMA_DECODE_ROW_WIDE_MLP2_XPTR",
    "TMA_DECODE_ROW_XPTR",
    "align_pairs",
    "decode_front",
    "decode_gemv_variants",
    "fused_experts_fp8",
    "fused_moe_decode_oneshot",
    "fused_moe_fp8",
    "fused_moe_fp8_oneshot",
    "gemv_shape",
    "launch_mlp1",
    "launch_mlp2_combine",
    "moe_ref",
    "oneshot_variants",
    "quantize_h",
    "route_and_align",
    "route_and_quantize",
    "router_tiling",
    "select_config",
]
