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
rounding of h (tests/test_kernel_moe.py states the tolerances); where y is stored as bf16
(`MoeConfig.pair_out_bf16`: the prefill row, bf16 x) each y's rounding comes on top, which
`moe_ref(pair_out_bf16=True)` reproduces (compiled, y from the tensor cores' FP8 accumulation can
round to the other bf16 neighbour; the tests bound that against the fp32-pair kernel).

Launch configs come from a table by token count (`select_config`) for hidden 2880 on an H200;
nothing is autotuned at run time. The table was chosen from ptxas resource counts (registers,
shared memory, no spills) and bandwidth arithmetic, then corrected by the H200 sweep of
benchmarks/bench_moe.py (benchmarks/results/sweeps/moe.md; see the table's comment).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sglang_ext.kernels.arrival_counters import arrival_counters
from sglang_ext.kernels.pdl import pdl_launch_kwargs, pdl_wait_then_release
from sglang_ext.kernels.tma import descriptor, tma_2d_ok
from sglang_ext.kernels.reference import (
    BLOCK as QUANT_GROUP,
    SWIGLU_ALPHA,
    dequantize_activation_group128,
    dequantize_weight_block128,
    quantize_activation_group128,
    route,
    swiglu_oai,
)

FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------
# launch configs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeConfig:
    """One launch configuration. `mlp1_block_n` counts intermediate columns (each one gate row
    and one linear row of W1); a multiple of 128 makes mlp1 requantise h in its epilogue."""

    block_m: int
    mlp1_block_n: int
    mlp1_warps: int
    mlp1_stages: int
    mlp2_block_n: int
    mlp2_warps: int
    mlp2_stages: int
    group_m: int = 1  # m-blocks that share each weight tile back to back (L2 reuse in prefill)
    align_chunk: int = 128  # pairs per program of the sort (one program up to 4 chunks)
    # Split-K (decode): more programs than 4 experts x 23 tiles fill 132 SMs. mlp1's splits
    # leave fp32 partials; the last to arrive (a counter per tile) sums them in split order and
    # runs the epilogue; mlp2's splits leave one slab each, summed in order by the combine.
    mlp1_split_k: int = 1
    mlp2_split_k: int = 1
    # Decode GEMV path (`_mlp1_gemv_kernel`, `_mlp2_gemv_kernel`): `block_m` (1..16) pairs of
    # one expert per program (the sort's block), `mlp1_block_n` intermediate columns (2x as many
    # W1 rows, <= 128) and `mlp2_block_n` W2 rows per program, each K range
    # (`*_split_k`: K blocks per program = cdiv(K blocks, split)) streamed once as a weight slab;
    # the last arriver of each h group (mlp1) or output tile (mlp2) reduces all splits.
    gemv: bool = False
    # Grouped mlp1 (not gemv): one dot per K step over 2 * mlp1_block_n contiguous W1 rows (gate
    # and linear interleaved as stored) into one accumulator, split into gate / linear in the
    # epilogue, instead of two dots over row-stride-2 tiles. Why: at 8 warps and block_m 64 the
    # two dots are each split over 2 warpgroups as m64n64 wgmmas (A re-read from shared memory
    # per small-N MMA); one dot gives m64n128 per warpgroup and contiguous weight rows.
    mlp1_one_dot: bool = False
    # mlp1_one_dot, prefill: the program's mlp1_block_n columns in this many passes over K, each one
    # dot over 2 * mlp1_block_n / passes contiguous W1 rows (<= 128: one scale block, a scalar scale
    # per K step), h of the earlier passes kept in registers until the last pass, then all of it
    # requantised together. Why: a 128-column h group needs 256 W1 rows, whose one-dot accumulator
    # plus its per-K-step dot result (the block scales are applied per K step) is 256 fp32 registers
    # a thread on one warpgroup; in passes a warpgroup holds m64 x n128 (128 registers), the shape of
    # the dense GEMM's tile (`_fp8_gemm_kernel`, 578-612 TFLOP/s at M = 8192 against mlp1's 397).
    mlp1_passes: int = 1
    # Decode for a few tokens (`kernels/moe_decode.py`): no sort, no K loop, no split-K. mlp1
    # programs own `mlp1_block_n` intermediate columns of one pair over all of K (the weight slab
    # in two loads), h is quantised by its own small launch, and mlp2 programs own `mlp2_block_n`
    # output columns of one token over its top-k pairs, the weighted combine included (or, with
    # mlp2_per_pair, rows of one pair's expert, combined by the last arriver). Only the block_n /
    # warps fields and mlp2_per_pair apply.
    oneshot: bool = False
    mlp2_per_pair: bool = False  # oneshot: mlp2 per (pair, rows) + last-arriver combine (OneshotConfig)
    # Grouped rows of 17+ tokens (two-pass mlp1, fp8 h, no split-K): operand tiles by TMA (kernels/tma.py). x is first
    # gathered into the sorted pair order (`_gather_rows_kernel`: its rows become one contiguous
    # tile a block), W1 / W2 are read as [E * rows, K] matrices, h as it is. Where an operand does
    # not suit the copy engine (e.g. 360-wide h at 120b TP8) that kernel keeps its pointer loads.
    # Why: H200, 8192 tokens, same bits (benchmarks/results/diag_tma.md): 120b mlp1 2105 -> 1879 us
    # (gather included), mlp2 1013 -> 904; 20b 1862 -> 1716, 862 -> 785; 120b TP4 (I 720) mlp1
    # 797 (its two-dot row) -> 578, mlp2 450 -> 451.
    tma: bool = False
    # tma: x's tiles by TMA too, from x gathered into the sorted order by its own launch (True), or mlp1 loads
    # the block's x rows by pointers straight from the front's codes, W1 still by TMA, and no gather launch
    # (False). Why: at decode x is a few KB that mlp1 reads from L2, and the gather is one more launch a layer
    # (2.5 us of 20b's ~230 us at batch 8, benchmarks/results/bench_decode_20b_b8_profile.md). H200, the whole
    # decode step at 8k, paired CUDA graphs, bits equal (benchmarks/results/diag_moe_row_xptr_b8.md,
    # diag_moe_row_xptr_b16_32.md): 20b batch 8 / 16 / 32 -88.3 / -82.1 / -80.4 us, 120b batch 16 / 32
    # -141.7 / -149.3; the 33..128 row (diag_moe_row_xptr_b64_128.md, diag_moe_row_xptr_120b_b64.md): 20b batch
    # 64 / 128 -117.4 / -220.7, 120b batch 64 -360.0. So the table's 5..128-token rows run without the gather
    # (the layer alone gains only 1-5 us at 8..32 tokens: most of the step's gain is the launch and its gap,
    # bench_moe_tma_rows_xptr.md). The prefill row (129+ tokens, x tens of MB) keeps it: not measured.
    tma_x: bool = True
    # Grouped rows: each pair's mlp2 output y (bias included) stored as bf16, not fp32, for the combine to
    # read. y is rounded to bf16 once (ties to even) before the weighted fp32 sum, as Hugging Face's bf16
    # GptOssExperts rounds each expert's output before weighting it. Why: at 8192 tokens y is 377 MB in
    # fp32 a 120b layer (32768 pairs x 2880), written by mlp2 and read back by the combine, a bandwidth-bound
    # launch (~104 us a layer); bf16 halves both. Needs mlp2_split_k 1 (split slabs are summed in fp32). For
    # bf16 x only: fp16 / fp32 x keep fp32 pairs (y would otherwise lose bits their own output keeps).
    pair_out_bf16: bool = False

    @property
    def fused_requant(self) -> bool:
        """h leaves mlp1's stage as e4m3 groups (quantised once), not fp32 for mlp2 to quantise."""
        return self.gemv or self.oneshot or self.mlp1_block_n % QUANT_GROUP == 0

    def short(self) -> str:
        if self.oneshot:
            return (f"oneshot mlp1 n{self.mlp1_block_n}/w{self.mlp1_warps} mlp2 n{self.mlp2_block_n}/w{self.mlp2_warps}"
                    + (" per-pair" if self.mlp2_per_pair else ""))
        if self.gemv:
            return (f"gemv m{self.block_m} "
                    f"mlp1 n{self.mlp1_block_n}/w{self.mlp1_warps}/s{self.mlp1_stages}/k{self.mlp1_split_k} "
                    f"mlp2 n{self.mlp2_block_n}/w{self.mlp2_warps}/s{self.mlp2_stages}/k{self.mlp2_split_k}")
        text = (f"m{self.block_m} mlp1 n{self.mlp1_block_n}/w{self.mlp1_warps}/s{self.mlp1_stages}"
                + ("/1dot" if self.mlp1_one_dot else "")
                + (f"/p{self.mlp1_passes}" if self.mlp1_passes > 1 else "")
                + f" mlp2 n{self.mlp2_block_n}/w{self.mlp2_warps}/s{self.mlp2_stages}"
                + f" g{self.group_m}"
                + (" tma" if self.tma else "") + (" xptr" if self.tma and not self.tma_x else "")
                + (" y16" if self.pair_out_bf16 else ""))
        if self.mlp1_split_k > 1 or self.mlp2_split_k > 1:
            text += f" k{self.mlp1_split_k}/{self.mlp2_split_k}"
        if self.align_chunk != 128:
            text += f" a{self.align_chunk}"
        return text


# The 16-row TMA blocks of 9..128 tokens (and of 5..8 with many pairs): mlp1 in two one-dot passes of 128
# W1 rows, operand tiles by TMA, x's rows loaded by pointers from the front's codes (no gather launch).
TMA_DECODE_ROW_XPTR = MoeConfig(block_m=16, mlp1_block_n=128, mlp1_warps=4, mlp1_stages=4, mlp2_block_n=32,
                                mlp2_warps=4, mlp2_stages=4, mlp1_one_dot=True, mlp1_passes=2, tma=True, tma_x=False)
TMA_DECODE_ROW_WIDE_MLP2_XPTR = replace(TMA_DECODE_ROW_XPTR, mlp2_block_n=64)
# The same rows with x gathered into the sorted order by its own launch (tma_x): the benchmarks' comparison.
TMA_DECODE_ROW = replace(TMA_DECODE_ROW_XPTR, tma_x=True)
TMA_DECODE_ROW_WIDE_MLP2 = replace(TMA_DECODE_ROW_WIDE_MLP2_XPTR, tma_x=True)

# By token count (upper bound inclusive), for hidden 2880 / intermediate 2880 on an H200; nothing is tuned
# at run time. Every row requantises h once, in mlp1's epilogue (quantising fp32 h in mlp2's K loop would make
# decode's mlp2 compute bound). The measurements behind each row: docs/decisions.md and this table's history.
H200_HIDDEN_2880_CONFIGS: tuple[tuple[int, MoeConfig], ...] = (
    # 1 token: the one-shot kernels (moe_decode.py), no sort, mlp2 per pair, its combine by the last arriver
    (1, MoeConfig(1, 4, 4, 1, 8, 4, 1, oneshot=True, mlp2_per_pair=True)),
    # 2..4 tokens: the same; each pair re-reads its expert, cheaper than a sort while pairs are few
    (4, MoeConfig(1, 4, 4, 1, 8, 4, 1, oneshot=True, mlp2_per_pair=True)),
    # 5..8 tokens: the GEMV path, one pair a program, each expert's slab streamed once through 5 stages, K in 3
    (8, MoeConfig(1, 32, 4, 5, 64, 4, 5, mlp1_split_k=3, mlp2_split_k=3, gemv=True)),
    # 9..16 tokens: 16-row sorted blocks, so an expert picked by several tokens is read once; 64-wide mlp2 tiles
    (16, TMA_DECODE_ROW_WIDE_MLP2_XPTR),
    # 17..32 tokens: the same row
    (32, TMA_DECODE_ROW_WIDE_MLP2_XPTR),
    # 33..128 tokens: the same blocks, mlp1 in 3 stages (more programs an SM as the touched experts grow)
    (128, MoeConfig(block_m=16, mlp1_block_n=128, mlp1_warps=4, mlp1_stages=3,
                    mlp2_block_n=64, mlp2_warps=4, mlp2_stages=4, mlp1_one_dot=True, mlp1_passes=2, tma=True,
                    tma_x=False)),
    # prefill (compute bound): 64-row blocks, m64n128 passes on one warpgroup as the dense GEMM's tile, x gathered
    # for TMA, grouped for L2 reuse, the sort in 256-pair chunks, bf16 pair outputs (half the combine's bytes)
    (1 << 62, MoeConfig(block_m=64, mlp1_block_n=128, mlp1_warps=4, mlp1_stages=4,
                        mlp2_block_n=128, mlp2_warps=4, mlp2_stages=3, group_m=4, mlp1_one_dot=True, mlp1_passes=2,
                        tma=True, align_chunk=256, pair_out_bf16=True)),
)


# (min tokens, max tokens, config) taken before H200_HIDDEN_2880_CONFIGS where the pairs are at least 7/8 of the
# router's experts (8 * tokens * top_k >= 7 * E), so many touched experts carry more than one pair: the GEMV row
# (one pair a program) would stream such an expert from HBM once per pair, a block of 16 sorted pairs reads it
# once (20b at 7..8 tokens; 120b's 128 experts keep the GEMV row).
H200_MANY_PAIRS_CONFIGS: tuple[tuple[int, int, MoeConfig], ...] = ((5, 8, TMA_DECODE_ROW_XPTR),)


def select_config(num_tokens: int, num_experts: int = 0, top_k: int = 4) -> MoeConfig:
    """The table's row for `num_tokens` routed top-`top_k` over the router's `num_experts` (all experts, not
    this rank's: what sets how many pairs land on one expert; 0: not known, the table's row as for few pairs)."""
    if num_experts and 8 * num_tokens * top_k >= 7 * num_experts:
        for low, high, config in H200_MANY_PAIRS_CONFIGS:
            if low <= num_tokens <= high:
                return config
    for max_tokens, config in H200_HIDDEN_2880_CONFIGS:
        if num_tokens <= max_tokens:
            return config
    raise AssertionError("the last table row covers every token count")


def decode_gemv_variants(num_tokens: int) -> list[MoeConfig]:
    """GEMV-path configs for decode batches (T <= 8) that the H200 sweep (benchmarks/bench_moe.py
    --gemv-sweep) times against the table's pick and the GPU test checks; the table takes the
    sweep's winner (the third below) for T <= 8.

    Registers and shared memory per program (ptxas, sm_90a, Triton 3.6; mlp1 / mlp2, one row per
    program; `_mlp1_kernel` of the table: 200 and 68 KB): the base, 64 W1 rows x 4 K blocks
    (32 KB of weight), 5 stages (the whole slab in flight from the start): 46 / 48 registers,
    50 KB (4 programs an SM: ~128 KB in flight per SM, ~4x what HBM's latency needs at 4.2 TB/s);
    2 K blocks, 3 stages: 71 / 40, 30 KB; 8 blocks, 5 or 9 stages: 40 / 40 or 57, 50 or 90 KB;
    128-row tiles: 64 / 97 (4 warps), 40 / 40 (8 warps), 90 KB. 2 rows: mlp1 64; 4 rows: mlp1 110 (its
    last arriver's loads), mlp2 40. No spills. Not listed: 8 rows (mlp1 128-254 registers)."""
    C = MoeConfig
    base = C(1, 32, 4, 5, 64, 4, 5, mlp1_split_k=6, mlp2_split_k=6, gemv=True)
    out = [
        base,
        replace(base, mlp1_stages=3, mlp2_stages=3, mlp1_split_k=12, mlp2_split_k=12),  # 16 KB programs
        replace(base, mlp1_split_k=3, mlp2_split_k=3),  # 64 KB programs, half of them in flight
        replace(base, mlp1_stages=9, mlp2_stages=9, mlp1_split_k=3, mlp2_split_k=3),  # all in flight
        replace(base, mlp1_block_n=64, mlp2_block_n=128),  # 128-row tiles
        replace(base, mlp1_block_n=64, mlp2_block_n=128, mlp1_warps=8, mlp2_warps=8),
    ]
    # rows of one expert per program: worth it only where an expert is picked by several tokens
    out += [replace(base, block_m=bm) for bm in (2, 4) if bm <= num_tokens]
    return out


def _check_config(config: MoeConfig) -> None:
    for name in ("block_m", "mlp1_block_n", "mlp2_block_n", "align_chunk"):
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"MoeConfig.{name} must be a power of two, got {value}")
    if config.oneshot:
        if config.gemv or config.mlp1_one_dot or config.mlp1_passes != 1 or config.tma or config.pair_out_bf16:
            raise ValueError("MoeConfig.oneshot: its own kernels; gemv, mlp1_one_dot, mlp1_passes, tma, "
                             "pair_out_bf16 do not apply")
        return
    if config.gemv:
        # W rows per program within one 128-row scale block; >= 16 for tl.dot (64 feeds wgmma)
        if not (config.block_m <= 16 and 8 <= config.mlp1_block_n <= 64 and 16 <= config.mlp2_block_n <= 128):
            raise ValueError("MoeConfig.gemv: block_m <= 16, mlp1_block_n 8..64, mlp2_block_n 16..128")
        if not (1 <= config.mlp1_split_k <= 64 and 1 <= config.mlp2_split_k <= 64):
            raise ValueError("MoeConfig.gemv: split_k must be in 1..64")
        if config.mlp1_one_dot or config.mlp1_passes != 1 or config.tma or config.pair_out_bf16:
            raise ValueError("MoeConfig.mlp1_one_dot, mlp1_passes, tma, pair_out_bf16: the grouped kernels only, "
                             "not gemv")
        return
    if config.mlp2_per_pair:
        raise ValueError("MoeConfig.mlp2_per_pair: the one-shot path only")
    if config.mlp1_passes != 1:
        if config.mlp1_passes != 2 or not config.mlp1_one_dot or config.mlp1_split_k != 1:
            raise ValueError(f"MoeConfig.mlp1_passes: 1, or 2 with mlp1_one_dot and no mlp1 split-K, "
                             f"got {config.mlp1_passes}")
        if not 16 <= config.mlp1_block_n <= 128:
            raise ValueError("MoeConfig.mlp1_passes: 16..128 W1 rows a pass (mlp1_block_n, two passes)")
    if config.tma and (config.mlp1_passes != 2 or config.mlp2_split_k != 1 or not config.fused_requant
                       or max(config.block_m, config.mlp2_block_n) > 256):
        raise ValueError("MoeConfig.tma: two mlp1 passes, h requantised by mlp1, no mlp2 split-K, tiles of "
                         "<= 256 rows (the copy engine's box)")
    if config.pair_out_bf16 and config.mlp2_split_k != 1:
        raise ValueError("MoeConfig.pair_out_bf16: mlp2's K splits are summed in fp32 (mlp2_split_k 1)")
    if not config.tma_x and not config.tma:
        raise ValueError("MoeConfig.tma_x: x's loads with TMA or by pointers apply to the TMA rows only (tma)")
    if config.block_m < 16 or config.mlp1_block_n < 16 or config.mlp2_block_n < 16:
        raise ValueError("MoeConfig: block_m and block_n must be >= 16 (tensor-core tile)")
    if not (1 <= config.mlp1_split_k <= 8 and 1 <= config.mlp2_split_k <= 8):
        raise ValueError("MoeConfig: split_k must be in 1..8")


# ---------------------------------------------------------------------------------------------
# shared device helpers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _quantize_e4m3(v, AXIS: tl.constexpr):
    """fp32 v in groups along AXIS -> (e4m3 values, fp32 scale per group), as fp8.py's
    quantize_*: scale = amax / 448 (IEEE division; 1 for an all-zero group), q = v / scale
    clamped to +-448, rounded to nearest e4m3, ties to even.

    The rounding is done here in fp32 and the cast after it is exact, because Triton's
    interpreter cast drops the carry when rounding crosses a power of two (31.7 -> 16): one
    code path, equal to torch's `.to(float8_e4m3fn)` on CPU and GPU. Normals keep 3 of fp32's
    23 mantissa bits; below 2^-6 e4m3 steps by 2^-9, fp32's ulp in [2^14, 2^15).
    (One helper, not three: each nested jit call costs the interpreter ~6 ms.)"""
    amax = tl.max(tl.abs(v), axis=AXIS)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    q = tl.math.div_rn(v, tl.expand_dims(scale, AXIS))
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    bits = q.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (q + 24576.0) - 24576.0
    q = tl.where(tl.abs(q) < 0.015625, subnormal, normal)
    # a negative value that rounds to zero stays -0.0 (its own e4m3 code, as torch casts it)
    q = (q.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _gpt_oss_activation(acc_g, acc_l, limit, alpha):
    """gpt-oss's clamped SwiGLU on mlp1's fp32 gate / linear sums (every mlp1 kernel's epilogue):
    gate clamped above at `limit`, linear to +-limit, gate * sigmoid(alpha * gate) * (linear + 1)."""
    gate = tl.minimum(acc_g, limit)
    lin = tl.minimum(tl.maximum(acc_l, -limit), limit)
    return gate * tl.sigmoid(gate * alpha) * (lin + 1.0)


@triton.jit
def _round_to_bf16(v):
    """fp32 v rounded to the nearest bf16 value (ties to even), still fp32: the cast after it is
    exact. The interpreter's fp32 -> bf16 cast truncates; this keeps one code path (on a GPU
    the cast rounds the same way by itself). NaN passes through."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)
    return tl.where(v == v, rounded, v)


# ---------------------------------------------------------------------------------------------
# the sort: pairs by local expert into BLOCK_M-padded segments (inside 2., or on its own)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _local_one_hot(TOPK_IDS, pairs, num_pairs, expert_offset, num_local, offs_e):
    """[CHUNK, E_PAD] int32: 1 where pair p goes to local expert e (foreign or past the end: none)."""
    ok = pairs < num_pairs
    local = tl.load(TOPK_IDS + pairs, mask=ok, other=0).to(tl.int32) - expert_offset
    local = tl.where(ok & (local >= 0) & (local < num_local), local, -1)
    return (local[:, None] == offs_e[None, :]).to(tl.int32)


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(TOPK_IDS, CHUNK_COUNTS, num_pairs, expert_offset, num_local,
                  CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    c = tl.program_id(0)
    offs_e = tl.arange(0, E_PAD)
    pairs = c * CHUNK + tl.arange(0, CHUNK)
    one_hot = _local_one_hot(TOPK_IDS, pairs, num_pairs, expert_offset, num_local, offs_e)
    tl.store(CHUNK_COUNTS + c * E_PAD + offs_e, tl.sum(one_hot, axis=0))


@triton.jit
def _align_body(
    pid,
    TOPK_IDS,  # [T * TOP_K] global expert ids
    CHUNK_COUNTS,  # [NUM_CHUNKS, E_PAD] int32 from _count_kernel (unused when SINGLE)
    SORTED_PAIRS,  # [MAX_BLOCKS * BLOCK_M] int32 out: pair index, num_pairs in padding slots
    BLOCK_EXPERT,  # [MAX_BLOCKS] int32 out: local expert of each block, -1 past the last
    num_pairs,
    expert_offset,
    num_local,
    num_chunks,
    max_blocks,
    blocks_per_program,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    E_PAD: tl.constexpr,
    SINGLE: tl.constexpr,  # one program does everything (decode): no _count_kernel launch
):
    # T-dependent sizes are run-time values, so one compiled kernel serves every batch size
    offs_e = tl.arange(0, E_PAD)
    offs_c = tl.arange(0, CHUNK)
    if SINGLE:
        totals = tl.zeros([E_PAD], tl.int32)
        for c in range(num_chunks):
            one_hot = _local_one_hot(TOPK_IDS, c * CHUNK + offs_c, num_pairs, expert_offset, num_local, offs_e)
            totals += tl.sum(one_hot, axis=0)
        before = tl.zeros([E_PAD], tl.int32)
        first_chunk = 0
        last_chunk = num_chunks
    else:
        # every program sums all chunks' counts (from L2), in slabs that stay in registers; a
        # wide slab, as each step waits a full L2 round trip (prefill 8k: 256 chunks, 4 steps)
        SLAB: tl.constexpr = 64
        offs_s = tl.arange(0, SLAB)
        totals = tl.zeros([E_PAD], tl.int32)
        before = tl.zeros([E_PAD], tl.int32)
        for c0 in range(0, num_chunks, SLAB):
            chunks = c0 + offs_s
            counts = tl.load(CHUNK_COUNTS + chunks[:, None] * E_PAD + offs_e[None, :],
                             mask=(chunks < num_chunks)[:, None], other=0)
            totals += tl.sum(counts, axis=0)
            before += tl.sum(tl.where((chunks < pid)[:, None], counts, 0), axis=0)
        first_chunk = pid
        last_chunk = pid + 1
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    seg_start = tl.cumsum(padded, axis=0) - padded

    # Each pair goes to its expert's segment start + pairs of that expert in earlier chunks +
    # its rank among that expert's pairs in this chunk: stable, no atomics.
    running = before
    for c in range(first_chunk, last_chunk):
        pairs = c * CHUNK + offs_c
        one_hot = _local_one_hot(TOPK_IDS, pairs, num_pairs, expert_offset, num_local, offs_e)
        rank = tl.sum(tl.cumsum(one_hot, axis=0) * one_hot, axis=1) - 1
        base = tl.sum(one_hot * (seg_start + running)[None, :], axis=1)
        tl.store(SORTED_PAIRS + base + rank, pairs, mask=rank >= 0)
        running += tl.sum(one_hot, axis=0)

    # Block -> expert, and the padding slots of used blocks (disjoint from the slots above).
    seg_end_block = (seg_start + padded) // BLOCK_M
    used_blocks = tl.sum(padded, axis=0) // BLOCK_M
    BLOCKS_PER_STEP: tl.constexpr = 64
    offs_b = tl.arange(0, BLOCKS_PER_STEP)
    offs_m = tl.arange(0, BLOCK_M)
    for b0 in range(pid * blocks_per_program, (pid + 1) * blocks_per_program, BLOCKS_PER_STEP):
        blocks = b0 + offs_b
        in_range = (blocks < max_blocks) & (blocks < (pid + 1) * blocks_per_program)
        expert = tl.sum((seg_end_block[None, :] <= blocks[:, None]).to(tl.int32), axis=1)
        used = blocks < used_blocks
        tl.store(BLOCK_EXPERT + blocks, tl.where(used, expert, -1), mask=in_range)
        owner = (expert[:, None] == offs_e[None, :]).to(tl.int32)
        start = tl.sum(owner * seg_start[None, :], axis=1)
        count = tl.sum(owner * totals[None, :], axis=1)
        slots = blocks[:, None] * BLOCK_M + offs_m[None, :]
        padding = (slots - start[:, None]) >= count[:, None]
        tl.store(SORTED_PAIRS + slots, tl.zeros_like(slots) + num_pairs,
                 mask=padding & (in_range & used)[:, None])


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks", "blocks_per_program"])
def _align_kernel(TOPK_IDS, CHUNK_COUNTS, SORTED_PAIRS, BLOCK_EXPERT, num_pairs, expert_offset, num_local,
                  num_chunks, max_blocks, blocks_per_program,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, SINGLE: tl.constexpr):
    _align_body(tl.program_id(0), TOPK_IDS, CHUNK_COUNTS, SORTED_PAIRS, BLOCK_EXPERT, num_pairs, expert_offset,
                num_local, num_chunks, max_blocks, blocks_per_program, BLOCK_M, CHUNK, E_PAD, SINGLE)


# ---------------------------------------------------------------------------------------------
# 2. routing, quantisation of x and (decode) the sort: one launch
# ---------------------------------------------------------------------------------------------


@triton.jit
def _topk_softmax(v, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                  TORCH_CPU_SOFTMAX: tl.constexpr, ROUND_BF16: tl.constexpr):
    """fp32 logits [BLOCK_T, E_PAD] (values of the router dtype; -inf past the experts, finite
    rows past T) -> (weights [BLOCK_T, K_PAD] fp32, ids [BLOCK_T, K_PAD] int32) as `route`: top-k
    descending, ties to the lower expert id, softmax over those k as torch computes it."""
    offs_e = tl.arange(0, E_PAD)
    offs_k = tl.arange(0, K_PAD)
    top_v = tl.full([BLOCK_T, K_PAD], float("-inf"), tl.float32)
    top_i = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):  # descending, like torch.topk(sorted=True)
        m, i = tl.max(v, axis=1, return_indices=True)
        top_v = tl.where(offs_k[None, :] == j, m[:, None], top_v)
        top_i = tl.where(offs_k[None, :] == j, i[:, None], top_i)
        v = tl.where(offs_e[None, :] == i[:, None], float("-inf"), v)
    shifted = top_v - tl.max(top_v, axis=1)[:, None]  # lanes >= TOP_K stay -inf: exp gives 0
    if TORCH_CPU_SOFTMAX:
        # torch's CPU softmax (reduced-precision input): fp32 exp (correctly rounded, via
        # fp64: numpy's fp32 exp is off by ulps), sequential sum, multiply by 1/sum.
        e = tl.exp(shifted.to(tl.float64)).to(tl.float32)
        total = tl.sum(tl.where(offs_k[None, :] == 0, e, 0.0), axis=1)
        for j in tl.static_range(1, TOP_K):
            total += tl.sum(tl.where(offs_k[None, :] == j, e, 0.0), axis=1)
        w = e * (1.0 / total)[:, None]
    else:
        # torch's CUDA warp softmax: expf, a butterfly sum over next_pow2(k) lanes
        # ((e0+e2)+(e1+e3) for k=4), IEEE division.
        e = libdevice.exp(shifted)
        part = e  # lane j + width/2 folds into lane j until two lanes are left
        if K_PAD == 8:
            part = tl.sum(tl.reshape(part, [BLOCK_T, 2, 4]), axis=1)
        if K_PAD >= 4:
            part = tl.sum(tl.reshape(part, [BLOCK_T, 2, 2]), axis=1)
        total = tl.sum(part, axis=1)
        w = tl.math.div_rn(e, total[:, None])
    if ROUND_BF16:
        w = _round_to_bf16(w)
    return w, top_i


@triton.jit
def _route_rows(pid, LOGITS, TOPK_W, TOPK_IDS, num_tokens, stride_logits, num_experts,
                TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                TORCH_CPU_SOFTMAX: tl.constexpr):
    """Top-k of BLOCK_T tokens' logits, softmax over those k in the logits' dtype, as `route`."""
    tokens = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    tokens = tokens.to(tl.int64)
    offs_e = tl.arange(0, E_PAD)
    offs_k = tl.arange(0, K_PAD)
    v = tl.load(LOGITS + tokens[:, None] * stride_logits + offs_e[None, :],
                mask=token_ok[:, None] & (offs_e < num_experts)[None, :], other=float("-inf")).to(tl.float32)
    v = tl.where(token_ok[:, None], v, 0.0)  # rows past T: finite, so no inf - inf below
    w, top_i = _topk_softmax(v, TOP_K, K_PAD, E_PAD, BLOCK_T, TORCH_CPU_SOFTMAX,
                             TOPK_W.dtype.element_ty == tl.bfloat16)
    out_offs = tokens[:, None] * TOP_K + offs_k[None, :]
    keep = token_ok[:, None] & (offs_k < TOP_K)[None, :]
    tl.store(TOPK_W + out_offs, w.to(TOPK_W.dtype.element_ty), mask=keep)
    tl.store(TOPK_IDS + out_offs, top_i, mask=keep)


@triton.jit
def _quantize_x_column(q, X, XQ, XS, num_tokens, stride_x, hidden, QUANT_BLOCK_T: tl.constexpr):
    """Program q of the quantisation: one 1x128 group column of QUANT_BLOCK_T tokens, so all its
    loads are in flight at once (a loop over the 23 groups of one token would pay 23 DRAM
    latencies)."""
    num_groups = (hidden + 127) // 128
    g = q % num_groups
    tokens = (q // num_groups) * QUANT_BLOCK_T + tl.arange(0, QUANT_BLOCK_T)
    token_ok = tokens < num_tokens
    tokens = tokens.to(tl.int64)
    cols = g * 128 + tl.arange(0, 128)
    ok = token_ok[:, None] & (cols < hidden)[None, :]
    xv = tl.load(X + tokens[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    xq, scale = _quantize_e4m3(xv, 1)
    tl.store(XQ + tokens[:, None] * hidden + cols[None, :], xq, mask=ok)
    tl.store(XS + tokens * num_groups + g, scale, mask=token_ok)


@triton.jit(do_not_specialize=["num_tokens", "num_heads", "max_blocks"])
def _front_kernel(
    LOGITS,  # [T, E] router dtype (ROUTE)
    X,  # [T, H] (QUANT)
    XQ,  # [T, H] e4m3
    XS,  # [T, cdiv(H, 128)] fp32
    TOPK_W,  # [T, TOP_K] router dtype (written when ROUTE)
    TOPK_IDS,  # [T, TOP_K] int32 (written when ROUTE, read when ALIGN)
    SORTED_PAIRS, BLOCK_EXPERT, SORT_SCRATCH,  # the sort's outputs and its P_PAD int32 (ALIGN)
    num_tokens, stride_logits, stride_x, num_experts, hidden, expert_offset, num_local,
    num_heads,  # programs 0..num_heads-1 route (and sort); the rest quantise x
    max_blocks,  # the sort's, when ALIGN
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    ROUTE_BLOCK_T: tl.constexpr,
    QUANT_BLOCK_T: tl.constexpr,
    ROUTE: tl.constexpr,
    QUANT: tl.constexpr,
    ALIGN: tl.constexpr,  # num_heads == 1: the head program also sorts all pairs
    TORCH_CPU_SOFTMAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    P_PAD: tl.constexpr,  # the sort's: >= T * TOP_K
    COLS: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_heads:
        if ROUTE:
            if ALIGN:
                # the one head routes every token, a tile at a time: a [128, 128] tile of logits
                # spilled (255 registers, sm_90a)
                for tile in range(0, (num_tokens + ROUTE_BLOCK_T - 1) // ROUTE_BLOCK_T):
                    _route_rows(tile, LOGITS, TOPK_W, TOPK_IDS, num_tokens, stride_logits, num_experts,
                                TOP_K, K_PAD, E_PAD, ROUTE_BLOCK_T, TORCH_CPU_SOFTMAX)
            else:
                _route_rows(pid, LOGITS, TOPK_W, TOPK_IDS, num_tokens, stride_logits, num_experts,
                            TOP_K, K_PAD, E_PAD, ROUTE_BLOCK_T, TORCH_CPU_SOFTMAX)
        if ALIGN:
            # the ids were just stored by other threads of this program: a CTA barrier makes
            # them visible (global memory, same block)
            tl.debug_barrier()
            _sort_pairs_compare(TOPK_IDS, SORT_SCRATCH, SORTED_PAIRS, BLOCK_EXPERT, num_tokens * TOP_K,
                                expert_offset, num_local, max_blocks, BLOCK_M, P_PAD, COLS)
    else:
        if QUANT:
            _quantize_x_column(pid - num_heads, X, XQ, XS, num_tokens, stride_x, hidden, QUANT_BLOCK_T)


# ---------------------------------------------------------------------------------------------
# 1.+2. for decode: router GEMV, routing, quantisation of x and the sort in one launch
# ---------------------------------------------------------------------------------------------


@triton.jit
def _sort_few_pairs(top_i, tokens, num_tokens, expert_offset, num_local, max_blocks, SORTED_PAIRS, BLOCK_EXPERT,
                    TOP_K: tl.constexpr, K_PAD: tl.constexpr, T_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """`_align_body`'s layout from ids in registers [T_PAD, K_PAD], by comparing every pair with
    every other ([P, P], P = T_PAD * K_PAD <= 64): the work depends on the pair count only,
    where a sweep over the expert axis ([pairs, E] one-hots and a scan over E) grows with E."""
    P_PAD: tl.constexpr = T_PAD * K_PAD
    offs_k = tl.arange(0, K_PAD)
    num_pairs = num_tokens * TOP_K
    ok2 = (tokens < num_tokens)[:, None] & (offs_k < TOP_K)[None, :]
    local2 = tl.where(ok2, top_i - expert_offset, -1)
    local2 = tl.where((local2 >= 0) & (local2 < num_local), local2, -1)  # -1: no local expert
    pair = tl.reshape(tokens[:, None] * TOP_K + offs_k[None, :], [P_PAD])
    local = tl.reshape(local2, [P_PAD])
    mine = local >= 0
    same = ((local[:, None] == local[None, :]) & mine[:, None]).to(tl.int32)
    rank = tl.sum(tl.where(pair[None, :] < pair[:, None], same, 0), axis=1)  # stable: pair order
    count = tl.sum(same, axis=1)
    first = mine & (rank == 0)  # one pair stands for each expert's segment
    padded = tl.where(first, (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    start = tl.sum(tl.where(local[None, :] < local[:, None], padded[None, :], 0), axis=1)
    tl.store(SORTED_PAIRS + start + rank, pair, mask=mine)
    # Block b belongs to the segment that holds its first row; slots past that segment's pairs
    # are padding (disjoint from the slots above). max_blocks <= pairs, so P_PAD rows cover all.
    offs_b = tl.arange(0, P_PAD)
    row0 = offs_b * BLOCK_M
    own = first[None, :] & (start[None, :] <= row0[:, None]) & (row0[:, None] < (start + padded)[None, :])
    used = tl.sum(own.to(tl.int32), axis=1) > 0
    expert = tl.sum(tl.where(own, local[None, :], 0), axis=1)
    seg_start = tl.sum(tl.where(own, start[None, :], 0), axis=1)
    seg_count = tl.sum(tl.where(own, count[None, :], 0), axis=1)
    in_range = offs_b < max_blocks
    tl.store(BLOCK_EXPERT + offs_b, tl.where(used, expert, -1), mask=in_range)
    slots = row0[:, None] + tl.arange(0, BLOCK_M)[None, :]
    padding = (slots - seg_start[:, None]) >= seg_count[:, None]
    tl.store(SORTED_PAIRS + slots, tl.zeros_like(slots) + num_pairs, mask=padding & (used & in_range)[:, None])


@triton.jit
def _local_ids(TOPK_IDS, pairs, num_pairs, expert_offset, num_local):
    """Local expert of each pair, -1 for a foreign expert or a pair past the end."""
    ok = pairs < num_pairs
    local = tl.load(TOPK_IDS + pairs, mask=ok, other=0).to(tl.int32) - expert_offset
    return tl.where(ok & (local >= 0) & (local < num_local), local, -1)


@triton.jit
def _sort_pairs_compare(TOPK_IDS, SCRATCH, SORTED_PAIRS, BLOCK_EXPERT, num_pairs, expert_offset, num_local,
                        max_blocks, BLOCK_M: tl.constexpr, P_PAD: tl.constexpr, COLS: tl.constexpr):
    """`_align_body`'s layout for up to P_PAD pairs in one program, by comparing pairs with pairs as
    `_sort_few_pairs` does, every pair a row of registers and the other pairs in [P_PAD, COLS] tiles:
    the work grows with the pair count only. `_align_body`'s [pairs, E] one-hots and scan over the
    pair axis cost 45 us at 32 tokens with 128 experts (255 registers and spills, sm_90a) against 5 at
    32 experts. ``SCRATCH`` (P_PAD int32) carries each expert's padded size from its first pair to the
    second pass; TOPK_IDS was stored by this program (the caller's barrier makes it visible)."""
    pair = tl.arange(0, P_PAD)
    local = _local_ids(TOPK_IDS, pair, num_pairs, expert_offset, num_local)
    mine = local >= 0
    offs_c = tl.arange(0, COLS)
    rank = tl.zeros([P_PAD], tl.int32)  # earlier pairs of the same expert: stable, pair order
    count = tl.zeros([P_PAD], tl.int32)  # pairs of the same expert
    for c0 in range(0, num_pairs, COLS):
        cols = c0 + offs_c
        same = (local[:, None] == _local_ids(TOPK_IDS, cols, num_pairs, expert_offset, num_local)[None, :])
        same = same & mine[:, None]
        count += tl.sum(same.to(tl.int32), axis=1)
        rank += tl.sum((same & (cols[None, :] < pair[:, None])).to(tl.int32), axis=1)
    first = mine & (rank == 0)  # one pair stands for each expert's segment
    padded = tl.where(first, (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    tl.store(SCRATCH + pair, padded)
    tl.debug_barrier()  # every thread's sizes stored before any thread reads them
    start = tl.zeros([P_PAD], tl.int32)  # segments of lower experts come first
    for c0 in range(0, num_pairs, COLS):
        cols = c0 + offs_c
        lower = _local_ids(TOPK_IDS, cols, num_pairs, expert_offset, num_local)[None, :] < local[:, None]
        start += tl.sum(tl.where(lower, tl.load(SCRATCH + cols)[None, :], 0), axis=1)
    tl.store(SORTED_PAIRS + start + rank, pair, mask=mine)
    # Block b belongs to the segment that holds its first row; its slots past that segment's
    # pairs are padding (disjoint from the slots above).
    used_blocks = tl.sum(padded, axis=0) // BLOCK_M
    BLOCKS: tl.constexpr = COLS
    offs_m = tl.arange(0, BLOCK_M)
    for b0 in range(0, max_blocks, BLOCKS):
        blocks = b0 + tl.arange(0, BLOCKS)
        row0 = blocks * BLOCK_M
        own = first[None, :] & (start[None, :] <= row0[:, None]) & (row0[:, None] < (start + padded)[None, :])
        expert = tl.sum(tl.where(own, local[None, :], 0), axis=1)
        seg_start = tl.sum(tl.where(own, start[None, :], 0), axis=1)
        seg_count = tl.sum(tl.where(own, count[None, :], 0), axis=1)
        used = blocks < used_blocks
        in_range = blocks < max_blocks
        tl.store(BLOCK_EXPERT + blocks, tl.where(used, expert, -1), mask=in_range)
        slots = row0[:, None] + offs_m[None, :]
        padding = (slots - seg_start[:, None]) >= seg_count[:, None]
        tl.store(SORTED_PAIRS + slots, tl.zeros_like(slots) + num_pairs, mask=padding & (used & in_range)[:, None])


@triton.jit(do_not_specialize=["num_tokens", "max_blocks"])
def _decode_front_kernel(
    X,  # [T, H] in the router's dtype
    RW, RB,  # router weight [E, H], bias [E] (HAS_BIAS)
    PART,  # [NUM_SPLITS, T, E] fp32: the router programs' partial logits
    COUNTER,  # one int32 arrival counter, zero between launches
    LOGITS,  # [T, E] router dtype, out (what F.linear would have returned, up to summation order)
    TOPK_W, TOPK_IDS,  # [T, TOP_K] router dtype, int32, out
    XQ, XS,  # x's e4m3 groups, out
    SORTED_PAIRS, BLOCK_EXPERT,  # the sort's outputs, as `_align_body` leaves them
    num_tokens, stride_x, stride_rw, num_experts, hidden, expert_offset, num_local, max_blocks,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    T_PAD: tl.constexpr,  # >= T: every token in one tile
    EXPERTS_PER_PROGRAM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # cdiv(H, BLOCK_K)
    ROW_LOOP: tl.constexpr,  # the dot one router row at a time (else one [T_PAD, EPP, BLOCK_K] product)
    HAS_BIAS: tl.constexpr,
    QUANT_BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TORCH_CPU_SOFTMAX: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py: the router rows before the wait, x after it
):
    # Programs 0 .. R-1 each read EXPERTS_PER_PROGRAM router rows over one BLOCK_K slice of H
    # (R = 96 for both gpt-oss sizes: the 737 KB of a 128-expert router is in flight at once on
    # 96 SMs instead of cuBLAS's 4 CTAs + a split-K reduce launch); the last of them to arrive
    # sums the slices, routes and sorts. The programs after them quantise x meanwhile.
    pid = tl.program_id(0)
    num_router = (num_experts + EXPERTS_PER_PROGRAM - 1) // EXPERTS_PER_PROGRAM * NUM_SPLITS
    if pid < num_router:
        split = pid % NUM_SPLITS
        first_expert = (pid // NUM_SPLITS) * EXPERTS_PER_PROGRAM
        tokens = tl.arange(0, T_PAD)
        token_ok = tokens < num_tokens
        cols = split * BLOCK_K + tl.arange(0, BLOCK_K)
        col_ok = cols < hidden
        offs_j = tl.arange(0, EXPERTS_PER_PROGRAM)
        experts = first_expert + offs_j
        if USE_PDL and not ROW_LOOP:
            rows = tl.load(RW + experts.to(tl.int64)[:, None] * stride_rw + cols[None, :],
                           mask=(experts < num_experts)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        pdl_wait_then_release(USE_PDL)
        xv = tl.load(X + tokens.to(tl.int64)[:, None] * stride_x + cols[None, :],
                     mask=token_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        if ROW_LOOP:
            # a row at a time: [16, EPP, BLOCK_K] products would not fit in registers
            acc = tl.zeros([T_PAD, EXPERTS_PER_PROGRAM], tl.float32)
            for j in tl.static_range(EXPERTS_PER_PROGRAM):
                e = first_expert + j
                row = tl.load(RW + e.to(tl.int64) * stride_rw + cols, mask=col_ok & (e < num_experts), other=0.0)
                dot = tl.sum(xv * row.to(tl.float32)[None, :], axis=1)  # bf16 products are exact in fp32
                acc = tl.where(offs_j[None, :] == j, dot[:, None], acc)
        else:
            if not USE_PDL:
                rows = tl.load(RW + experts.to(tl.int64)[:, None] * stride_rw + cols[None, :],
                               mask=(experts < num_experts)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            acc = tl.sum(xv[:, None, :] * rows[None, :, :], axis=2)
        tl.store(PART + (split * num_tokens + tokens[:, None]) * num_experts + experts[None, :], acc,
                 mask=token_ok[:, None] & (experts < num_experts)[None, :])
        # last arriver, as mlp1's split-K: partials stored by all threads before the release
        tl.debug_barrier()
        arrived = tl.atomic_add(COUNTER, 1, sem="acq_rel", scope="gpu")
        if arrived == num_router - 1:
            tl.store(COUNTER, 0)  # for the next launch: no memset per call
            tl.debug_barrier()  # the acquire above before any thread reads the other partials
            offs_e = tl.arange(0, E_PAD)
            e_ok = offs_e < num_experts
            ok = token_ok[:, None] & e_ok[None, :]
            part_ptrs = PART + tokens[:, None] * num_experts + offs_e[None, :]
            # slices summed in split order (bits independent of arrival order), then the bias,
            # then one rounding to the router dtype, as F.linear's fp32-accumulating GEMM does
            v = tl.load(part_ptrs, mask=ok, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, NUM_SPLITS):
                v += tl.load(part_ptrs + s * num_tokens * num_experts, mask=ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                v += tl.load(RB + offs_e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
            if LOGITS.dtype.element_ty == tl.bfloat16:
                v = _round_to_bf16(v)
            elif LOGITS.dtype.element_ty == tl.float16:
                v = v.to(tl.float16).to(tl.float32)
            tl.store(LOGITS + tokens[:, None] * num_experts + offs_e[None, :], v.to(LOGITS.dtype.element_ty),
                     mask=ok)
            v = tl.where(ok, v, float("-inf"))
            v = tl.where(token_ok[:, None], v, 0.0)  # rows past T: finite, so no inf - inf
            w, top_i = _topk_softmax(v, TOP_K, K_PAD, E_PAD, T_PAD, TORCH_CPU_SOFTMAX,
                                     TOPK_W.dtype.element_ty == tl.bfloat16)
            offs_k = tl.arange(0, K_PAD)
            out_offs = tokens[:, None] * TOP_K + offs_k[None, :]
            keep = token_ok[:, None] & (offs_k < TOP_K)[None, :]
            tl.store(TOPK_W + out_offs, w.to(TOPK_W.dtype.element_ty), mask=keep)
            tl.store(TOPK_IDS + out_offs, top_i, mask=keep)
            _sort_few_pairs(top_i, tokens, num_tokens, expert_offset, num_local, max_blocks, SORTED_PAIRS,
                            BLOCK_EXPERT, TOP_K, K_PAD, T_PAD, BLOCK_M)
    else:
        pdl_wait_then_release(USE_PDL)
        _quantize_x_column(pid - num_router, X, XQ, XS, num_tokens, stride_x, hidden, QUANT_BLOCK_T)


# ---------------------------------------------------------------------------------------------
# 3./4. grouped FP8 GEMMs
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_pairs"])
def _gather_rows_kernel(XQ, XG, SORTED_PAIRS, BLOCK_EXPERT, num_pairs, hidden, TOP_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """MoeConfig.tma: xg[r] = x codes of sorted pair r's token (zeros for padding slots), so that a
    block's x rows are one contiguous tile for the copy engine (Hopper's TMA cannot gather rows).
    BLOCK_R divides BLOCK_M: a program's rows lie in one sort block; blocks past the last segment
    (expert -1, pair ids never written) are skipped, as mlp1 skips them."""
    if tl.load(BLOCK_EXPERT + tl.program_id(0) * BLOCK_R // BLOCK_M) < 0:
        return
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    pairs = tl.load(SORTED_PAIRS + rows)
    ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    for h0 in range(0, hidden, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        in_h = (offs < hidden)[None, :]
        v = tl.load(XQ + tokens[:, None] * hidden + offs[None, :], mask=ok[:, None] & in_h, other=0.0)
        tl.store(XG + rows.to(tl.int64)[:, None] * hidden + offs[None, :], v, mask=in_h)


@triton.jit
def _mlp1_pass(XQ, XS, W1, W1S, B1, tokens, row_ok, expert, first_row, k_first, k_last, hidden, inter, limit, alpha,
               stride_w1_e, stride_w1_n, stride_w1s_e, stride_w1s_n, stride_b1_e,
               BLOCK_M: tl.constexpr, ROWS: tl.constexpr, HAS_B1: tl.constexpr, DOT_FP32: tl.constexpr,
               x_desc=None, w1_desc=None, block_row=0, TMA: tl.constexpr = False, X_TMA: tl.constexpr = True):
    """One pass of `_mlp1_kernel` with MoeConfig.mlp1_passes: W1 rows [first_row, first_row + ROWS)
    (ROWS <= 128 and first_row a multiple of ROWS: one 128-row scale block, so one scalar scale per K
    step) against the block's x rows over K blocks [k_first, k_last), bias and activation applied:
    h [BLOCK_M, ROWS // 2]. The sums are the one-dot path's, element for element.

    TMA (MoeConfig.tma): the W1 tile from w1_desc (W1 as [E * 2I, H]), zero-filled past H by the copy
    engine; rows of a pass past 2I read the next expert's rows (or zeros past the last) into h columns
    the store drops. With X_TMA the x tile from x_desc (x gathered into the sorted order: its rows
    block_row .. + BLOCK_M), else x's rows by pointers as without TMA."""
    BLOCK_K: tl.constexpr = 128
    offs_k = tl.arange(0, BLOCK_K)
    num_k_groups = tl.cdiv(hidden, BLOCK_K)
    w_rows = first_row + tl.arange(0, ROWS)
    w_row_ok = w_rows < 2 * inter
    a_ptrs = XQ + tokens[:, None] * hidden + k_first * BLOCK_K + offs_k[None, :]
    xs_ptrs = XS + tokens * num_k_groups
    w_ptrs = (W1 + expert * stride_w1_e + w_rows.to(tl.int64)[None, :] * stride_w1_n + k_first * BLOCK_K
              + offs_k[:, None])
    w_coord = (expert * 2 * inter + first_row).to(tl.int32)
    ws_ptr = W1S + expert * stride_w1s_e + (first_row // 128) * stride_w1s_n
    acc = tl.zeros([BLOCK_M, ROWS], dtype=tl.float32)
    for kb in range(k_first, k_last):
        if TMA:
            if X_TMA:
                a = x_desc.load([block_row, kb * BLOCK_K])
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k < hidden - kb * BLOCK_K)[None, :], other=0.0)
            w = tl.trans(w1_desc.load([w_coord, kb * BLOCK_K]))
        else:
            k_ok = offs_k < hidden - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & w_row_ok[None, :], other=0.0)
        a_s = tl.load(xs_ptrs + kb, mask=row_ok, other=0.0)
        w_s = tl.load(ws_ptr + kb, mask=first_row < 2 * inter, other=0.0)  # a pass past 2I: no block
        scale = a_s[:, None] * w_s
        if DOT_FP32:
            a = a.to(tl.float32)[:, :, None]
            if BLOCK_M * BLOCK_K * ROWS <= 1048576:
                prod = tl.sum(a * w.to(tl.float32)[None, :, :], axis=1)
            else:  # the interpreter's tensor cap (2^20 elements): gate and linear columns apart
                wg, wl = tl.split(tl.reshape(w.to(tl.float32), [BLOCK_K, ROWS // 2, 2]))
                prod = tl.join(tl.sum(a * wg[None, :, :], axis=1), tl.sum(a * wl[None, :, :], axis=1))
                prod = tl.reshape(prod, [BLOCK_M, ROWS])
            acc += prod * scale
        else:
            acc += tl.dot(a, w) * scale
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_B1:
        acc += tl.load(B1 + expert * stride_b1_e + w_rows, mask=w_row_ok, other=0.0).to(tl.float32)[None, :]
    acc_g, acc_l = tl.split(tl.reshape(acc, [BLOCK_M, ROWS // 2, 2]))
    return _gpt_oss_activation(acc_g, acc_l, limit, alpha)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _mlp1_kernel(
    XQ, XS,  # x in e4m3 [T, H] and its group scales [T, cdiv(H, 128)]
    W1, W1S, B1,  # [E, 2I, H] e4m3, [E, cdiv(2I, 128), cdiv(H, 128)] fp32, [E, 2I]
    SORTED_PAIRS, BLOCK_EXPERT,
    HQ, HS,  # FUSED_REQUANT: h in e4m3 [rows, I] and scales [rows, cdiv(I, 128)]
    HF,  # otherwise: h fp32 [rows, I]
    PART, COUNTERS,  # SPLIT_K > 1: fp32 partials [SPLIT_K, 2, rows, I] (ONE_DOT: [SPLIT_K, rows, 2I]);
                     # int32 per tile, zero between launches
    num_pairs, hidden, inter, num_blocks_m, limit, alpha,
    stride_w1_e, stride_w1_n, stride_w1s_e, stride_w1s_n, stride_b1_e,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # intermediate columns: BLOCK_N gate rows + BLOCK_N linear rows of W1
    GROUP_M: tl.constexpr,
    HAS_B1: tl.constexpr,
    FUSED_REQUANT: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: the dot as an fp32 multiply-and-sum (see _experts)
    SPLIT_K: tl.constexpr,
    ONE_DOT: tl.constexpr = False,  # MoeConfig.mlp1_one_dot: one dot over 2 * BLOCK_N contiguous W1 rows
    PASSES: tl.constexpr = 1,  # MoeConfig.mlp1_passes (ONE_DOT, SPLIT_K 1): 1 or 2 passes of _mlp1_pass
    x_desc=None, w1_desc=None,  # TMA: descriptors of x gathered into sorted order and of W1 as [E * 2I, H]
    TMA: tl.constexpr = False,  # MoeConfig.tma (two passes): W1 tiles by TMA
    X_TMA: tl.constexpr = True,  # with TMA: x's tiles too (MoeConfig.tma_x), else x's rows by pointers from XQ
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py: nothing before the wait (the routing, x's rows: recent launches')
):
    BLOCK_K: tl.constexpr = 128  # = the quantisation group: one scale per row per K step
    pdl_wait_then_release(USE_PDL)
    tl.static_assert(PASSES == 1 or (ONE_DOT and SPLIT_K == 1), "mlp1 passes: one-dot, no split-K")
    tl.static_assert(not TMA or PASSES == 2, "mlp1 TMA: the two-pass kernel")
    # GROUP_M m-blocks visit each n tile back to back, so a weight tile is reused from L2
    # (written out, not a helper: nested jit calls are slow in the interpreter)
    num_n = tl.cdiv(inter, BLOCK_N)
    pid = tl.program_id(0) % (num_blocks_m * num_n)
    split = tl.program_id(0) // (num_blocks_m * num_n)  # slowest: every tile's first split runs first
    width = GROUP_M * num_n
    first_m = pid // width * GROUP_M
    group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    expert = tl.load(BLOCK_EXPERT + pid_m)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # positions in the sorted, padded order
    pairs = tl.load(SORTED_PAIRS + rows)
    row_ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    gate_rows = (2 * cols).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    num_k_groups = tl.cdiv(hidden, BLOCK_K)
    k_per_split = tl.cdiv(num_k_groups, SPLIT_K)
    k_first = split * k_per_split
    k_last = tl.minimum(k_first + k_per_split, num_k_groups)

    a_ptrs = XQ + tokens[:, None] * hidden + k_first * BLOCK_K + offs_k[None, :]
    xs_ptrs = XS + tokens * num_k_groups
    if PASSES == 2:
        # columns [c0, c0 + BLOCK_N / 2) then the rest, each h half [BLOCK_M, BLOCK_N / 2]; together
        # [BLOCK_M, BLOCK_N] in column order for the requantisation below
        ROWS: tl.constexpr = BLOCK_N  # W1 rows a pass: 2 * BLOCK_N / PASSES
        h_lo = _mlp1_pass(XQ, XS, W1, W1S, B1, tokens, row_ok, expert, pid_n * (2 * BLOCK_N), k_first, k_last,
                          hidden, inter, limit, alpha, stride_w1_e, stride_w1_n, stride_w1s_e, stride_w1s_n,
                          stride_b1_e, BLOCK_M, ROWS, HAS_B1, DOT_FP32, x_desc, w1_desc, pid_m * BLOCK_M, TMA, X_TMA)
        h_hi = _mlp1_pass(XQ, XS, W1, W1S, B1, tokens, row_ok, expert, pid_n * (2 * BLOCK_N) + ROWS, k_first,
                          k_last, hidden, inter, limit, alpha, stride_w1_e, stride_w1_n, stride_w1s_e, stride_w1s_n,
                          stride_b1_e, BLOCK_M, ROWS, HAS_B1, DOT_FP32, x_desc, w1_desc, pid_m * BLOCK_M, TMA,
                          X_TMA)
        h = tl.reshape(tl.permute(tl.join(h_lo, h_hi), (0, 2, 1)), [BLOCK_M, BLOCK_N])
    elif ONE_DOT:
        # W1 rows 2c (gate), 2c+1 (linear) of the tile's columns, contiguous as stored: one
        # [BLOCK_K, 2 * BLOCK_N] tile and one accumulator, split into gate / linear at the end
        w_rows = pid_n * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
        w_row_ok = w_rows < 2 * inter
        w_ptrs = (W1 + expert * stride_w1_e + w_rows.to(tl.int64)[None, :] * stride_w1_n + k_first * BLOCK_K
                  + offs_k[:, None])
        ws_ptrs = W1S + expert * stride_w1s_e + (w_rows // 128) * stride_w1s_n
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for kb in range(k_first, k_last):
            k_ok = offs_k < hidden - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & w_row_ok[None, :], other=0.0)
            a_s = tl.load(xs_ptrs + kb, mask=row_ok, other=0.0)
            w_s = tl.load(ws_ptrs + kb, mask=w_row_ok, other=0.0)
            scale = a_s[:, None] * w_s[None, :]
            if DOT_FP32:
                a = a.to(tl.float32)[:, :, None]
                if BLOCK_M * BLOCK_K * 2 * BLOCK_N <= 1048576:
                    prod = tl.sum(a * w.to(tl.float32)[None, :, :], axis=1)
                else:  # the interpreter's tensor cap (2^20 elements): gate and linear columns apart
                    wg, wl = tl.split(tl.reshape(w.to(tl.float32), [BLOCK_K, BLOCK_N, 2]))
                    prod = tl.join(tl.sum(a * wg[None, :, :], axis=1), tl.sum(a * wl[None, :, :], axis=1))
                    prod = tl.reshape(prod, [BLOCK_M, 2 * BLOCK_N])
                acc += prod * scale
            else:
                acc += tl.dot(a, w) * scale
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    else:
        wg_ptrs = W1 + expert * stride_w1_e + gate_rows[None, :] * stride_w1_n + k_first * BLOCK_K + offs_k[:, None]
        # gate row 2c and linear row 2c+1 always share a 128-row scale block
        ws_ptrs = W1S + expert * stride_w1s_e + (gate_rows // 128) * stride_w1s_n

        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_l = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(k_first, k_last):
            k_ok = offs_k < hidden - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            wl = tl.load(wg_ptrs + stride_w1_n, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            a_s = tl.load(xs_ptrs + kb, mask=row_ok, other=0.0)
            w_s = tl.load(ws_ptrs + kb, mask=col_ok, other=0.0)
            scale = a_s[:, None] * w_s[None, :]
            if DOT_FP32:
                a = a.to(tl.float32)[:, :, None]
                acc_g += tl.sum(a * wg.to(tl.float32)[None, :, :], axis=1) * scale
                acc_l += tl.sum(a * wl.to(tl.float32)[None, :, :], axis=1) * scale
            else:
                acc_g += tl.dot(a, wg) * scale
                acc_l += tl.dot(a, wl) * scale
            a_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K

    ok = row_ok[:, None] & col_ok[None, :]
    out_offs = rows.to(tl.int64)[:, None] * inter + cols[None, :]
    if SPLIT_K > 1 and PASSES == 1:
        # Deterministic split-K: every split stores its partials; the split that arrives last
        # (the counter's old value) sums all of them in split order, so the bits never depend
        # on arrival order, and resets the counter for the next launch (no memset per call).
        # A split's slab: [2, rows, I] (gate, linear), or [rows, 2I] interleaved (ONE_DOT).
        slab = num_blocks_m.to(tl.int64) * (BLOCK_M * inter)
        if ONE_DOT:
            wide_offs = rows.to(tl.int64)[:, None] * (2 * inter) + w_rows[None, :]
            wide_ok = row_ok[:, None] & w_row_ok[None, :]
            tl.store(PART + split * (2 * slab) + wide_offs, acc, mask=wide_ok)
        else:
            part_ptrs = PART + split * (2 * slab) + out_offs
            tl.store(part_ptrs, acc_g, mask=ok)
            tl.store(part_ptrs + slab, acc_l, mask=ok)
        tl.debug_barrier()  # all threads' partials before the release below
        tile = pid_m * num_n + pid_n
        arrived = tl.atomic_add(COUNTERS + tile, 1, sem="acq_rel", scope="gpu")
        if arrived != SPLIT_K - 1:
            return
        tl.store(COUNTERS + tile, 0)
        tl.debug_barrier()  # the acquire above before any thread reads the other partials
        if ONE_DOT:
            acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(PART + s * (2 * slab) + wide_offs, mask=wide_ok, other=0.0, cache_modifier=".cg")
        else:
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_l = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: from L2, never a stale L1 line
                acc_g += tl.load(PART + s * (2 * slab) + out_offs, mask=ok, other=0.0, cache_modifier=".cg")
                acc_l += tl.load(PART + s * (2 * slab) + slab + out_offs, mask=ok, other=0.0,
                                 cache_modifier=".cg")

    if PASSES == 1:
        if ONE_DOT:
            if HAS_B1:
                acc += tl.load(B1 + expert * stride_b1_e + w_rows, mask=w_row_ok, other=0.0).to(tl.float32)[None, :]
            # [m, 2c + j] -> [m, c, j]: j = 0 gate, 1 linear
            acc_g, acc_l = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        elif HAS_B1:
            b1_ptrs = B1 + expert * stride_b1_e + gate_rows
            acc_g += tl.load(b1_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_l += tl.load(b1_ptrs + 1, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        h = _gpt_oss_activation(acc_g, acc_l, limit, alpha)
    h = tl.where(ok, h, 0.0)
    if FUSED_REQUANT:
        GROUPS: tl.constexpr = BLOCK_N // 128
        q3, scale3 = _quantize_e4m3(tl.reshape(h, [BLOCK_M, GROUPS, 128]), 2)  # scale3 [BLOCK_M, GROUPS]
        q = tl.reshape(q3, [BLOCK_M, BLOCK_N])
        tl.store(HQ + out_offs, q, mask=ok)
        num_i_groups = tl.cdiv(inter, 128)
        groups = pid_n * GROUPS + tl.arange(0, GROUPS)
        tl.store(HS + rows.to(tl.int64)[:, None] * num_i_groups + groups[None, :], scale3,
                 mask=row_ok[:, None] & (groups < num_i_groups)[None, :])
    else:
        tl.store(HF + out_offs, h, mask=ok)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _mlp2_kernel(
    HQ, HS, HF,  # h as _mlp1_kernel left it (fp8 + scales, or fp32)
    W2, W2S, B2,  # [E, H, I] e4m3, [E, cdiv(H, 128), cdiv(I, 128)] fp32, [E, H]
    SORTED_PAIRS, BLOCK_EXPERT,
    PAIR_OUT,  # [SPLIT_K, T * TOP_K, H] fp32 (or bf16: MoeConfig.pair_out_bf16), row = pair index, a slab per K split
    num_pairs, hidden, inter, num_blocks_m,
    stride_w2_e, stride_w2_n, stride_w2s_e, stride_w2s_n, stride_b2_e,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_B2: tl.constexpr,
    A_IS_FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SPLIT_K: tl.constexpr,
    h_desc=None, w2_desc=None,  # TMA: descriptors of h codes [rows, I] and of W2 as [E * H, I]
    TMA: tl.constexpr = False,  # MoeConfig.tma (fp8 h): h and W2 tiles by TMA
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py: nothing before the wait
):
    BLOCK_K: tl.constexpr = 128
    pdl_wait_then_release(USE_PDL)
    # GROUP_M m-blocks visit each n tile back to back, so a weight tile is reused from L2
    # (written out, not a helper: nested jit calls are slow in the interpreter)
    num_n = tl.cdiv(hidden, BLOCK_N)
    pid = tl.program_id(0) % (num_blocks_m * num_n)
    split = tl.program_id(0) // (num_blocks_m * num_n)
    width = GROUP_M * num_n
    first_m = pid // width * GROUP_M
    group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    expert = tl.load(BLOCK_EXPERT + pid_m)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SORTED_PAIRS + rows)
    row_ok = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    offs_k = tl.arange(0, BLOCK_K)
    num_k_groups = tl.cdiv(inter, BLOCK_K)
    k_per_split = tl.cdiv(num_k_groups, SPLIT_K)
    k_first = split * k_per_split
    k_last = tl.minimum(k_first + k_per_split, num_k_groups)

    h_offs = rows.to(tl.int64)[:, None] * inter + k_first * BLOCK_K + offs_k[None, :]
    hs_ptrs = HS + rows.to(tl.int64) * num_k_groups
    w_ptrs = W2 + expert * stride_w2_e + cols.to(tl.int64)[None, :] * stride_w2_n + k_first * BLOCK_K + offs_k[:, None]
    # A tile of <= 128 columns (a power of two) lies in one 128-row scale block of W2: one scalar
    # scale per K step instead of a per-column vector (the same values). Prefill blocks only (64+
    # rows): there mlp2 read 1194 us a 120b layer at 8192 tokens before and 965-983 us after (two
    # runs). The decode rows (16-row blocks) keep the vector load: with the scalar their layers
    # read 4-8 % slower at 32-128 tokens, across two runs with other routing (1-4 points per
    # byte), so not shown to be slower, but not shown faster either.
    SCALAR_WS: tl.constexpr = BLOCK_N <= 128 and BLOCK_M >= 64
    if SCALAR_WS:
        ws_ptrs = W2S + expert * stride_w2s_e + (pid_n * BLOCK_N // 128) * stride_w2s_n
    else:
        ws_ptrs = W2S + expert * stride_w2s_e + (cols // 128) * stride_w2s_n

    tl.static_assert(not TMA or A_IS_FP8, "mlp2 TMA: fp8 h")
    # TMA: W2 rows of a tile past H are the next expert's (zeros past the last), dropped by the store
    w_coord = (expert * hidden + pid_n * BLOCK_N).to(tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(k_first, k_last):
        k_ok = offs_k < inter - kb * BLOCK_K
        a_mask = row_ok[:, None] & k_ok[None, :]
        if TMA:
            a = h_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
            a_s = tl.load(hs_ptrs + kb, mask=row_ok, other=0.0)
            w = tl.trans(w2_desc.load([w_coord, kb * BLOCK_K]))
        elif A_IS_FP8:
            a = tl.load(HQ + h_offs, mask=a_mask, other=0.0)
            a_s = tl.load(hs_ptrs + kb, mask=row_ok, other=0.0)
        else:
            a, a_s = _quantize_e4m3(tl.load(HF + h_offs, mask=a_mask, other=0.0), 1)
        if not TMA:
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if SCALAR_WS:
            scale = a_s[:, None] * tl.load(ws_ptrs + kb)
        else:
            scale = a_s[:, None] * tl.load(ws_ptrs + kb, mask=col_ok, other=0.0)[None, :]
        if DOT_FP32:
            acc += tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1) * scale
        else:
            acc += tl.dot(a, w) * scale
        h_offs += BLOCK_K
        w_ptrs += BLOCK_K

    if HAS_B2:
        if split == 0:
            acc += tl.load(B2 + expert * stride_b2_e + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = PAIR_OUT + (split * num_pairs + pairs).to(tl.int64)[:, None] * hidden + cols[None, :]
    if PAIR_OUT.dtype.element_ty == tl.bfloat16:  # MoeConfig.pair_out_bf16
        acc = _round_to_bf16(acc)
    tl.store(out_ptrs, acc.to(PAIR_OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------------------------------------
# 3./4. decode GEMV path (MoeConfig.gemv): each touched expert's weights streamed as GEMV slabs
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gemv_slab(W_ROWS, w_row_ok, X_COLS, x_col_ok, col_kb, sc, k_len, kb_count,
               ROWS: tl.constexpr, BLOCK_W: tl.constexpr, NCOL: tl.constexpr, DOT_FP32: tl.constexpr):
    """One program's weight slab (BLOCK_W rows x kb_count <= NCOL // ROWS K blocks) times its ROWS
    activation rows -> [ROWS, BLOCK_W] fp32: per 128-block sums, each scaled by a_scale * w_scale.

    W_ROWS [BLOCK_W]: pointers to the rows at the slab's first K; X_COLS [NCOL]: the pointer of
    each x-side column at that K, column c = (block c // ROWS, row c % ROWS); col_kb its block (-1:
    a padding column); x_col_ok false for padding and for rows past the pairs; sc [NCOL] the
    column's a_scale * w_scale (0 where not ok); k_len: valid K from the slab's start.

    Swap-AB, as fp8_gemm's decode GEMV: the weight is the MMA's 64+-row side, x the
    NCOL >= 16 side: iteration i loads x only into block i's columns (the rest are masked, so
    the copy writes zeros without reading), so column (i, r) of dot_i is block i's sum for row r
    and every other column an exact 0. Each column thus collects its one block, scaled by a
    loop-invariant factor, and one sum over the block axis after the loop gives the rows. The x
    tile rides the weight's cp.async stages: nothing in the loop waits on any other load (in
    `_mlp1_kernel` each iteration waited for its x and weight scales, never pipelined)."""
    offs_k = tl.arange(0, 128)
    CB: tl.constexpr = NCOL // ROWS  # column blocks: >= the slab's K blocks
    acc_c = tl.zeros([BLOCK_W, NCOL], dtype=tl.float32)
    w_ptrs = W_ROWS[:, None] + offs_k[None, :]
    x_ptrs = X_COLS[:, None] + offs_k[None, :]
    for i in range(0, kb_count):
        k_ok = offs_k < k_len - i * 128
        w = tl.load(w_ptrs, mask=w_row_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_ptrs, mask=(x_col_ok & (col_kb == i))[:, None] & k_ok[None, :], other=0.0)
        if DOT_FP32:  # interpreter: exact products, fp32 sums (its tl.dot is a slow numpy loop)
            d = tl.sum(w.to(tl.float32)[:, None, :] * xt.to(tl.float32)[None, :, :], axis=2)
        else:
            d = tl.dot(w, tl.trans(xt))  # [BLOCK_W, NCOL]
        acc_c += d * sc[None, :]
        w_ptrs += 128
        x_ptrs += 128
    return tl.trans(tl.sum(tl.reshape(acc_c, [BLOCK_W, CB, ROWS]), axis=1))


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _mlp1_gemv_kernel(
    XQ, XS,  # x e4m3 [T, H], scales [T, cdiv(H, 128)]
    W1, W1S, B1,  # [E, 2I, H] e4m3, [E, cdiv(2I, 128), cdiv(H, 128)] fp32, [E, 2I]
    SORTED_PAIRS, BLOCK_EXPERT,  # the sort's layout with BLOCK_M = ROWS
    HQ, HS,  # out: h e4m3 [rows, I], scales [rows, cdiv(I, 128)] (rows in the sorted order)
    PART, COUNTERS,  # fp32 [SPLITS, rows, 2I]; int32 per (block, h group), zero between launches
    num_pairs, hidden, inter, num_blocks, limit, alpha,
    stride_w1_e, stride_w1_n, stride_w1s_e, stride_w1s_n, stride_b1_e,
    TOP_K: tl.constexpr,
    ROWS: tl.constexpr,  # pairs per program: one sorted block, all of one expert
    BLOCK_W: tl.constexpr,  # W1 rows per program (<= 128: one scale block; interleaved gate/linear)
    KBP: tl.constexpr,  # K blocks per program
    NCOL: tl.constexpr,  # x-side MMA columns: max(16, next_pow2(KBP * ROWS))
    SPLITS: tl.constexpr,  # cdiv(cdiv(H, 128), KBP)
    RED_CHUNK: tl.constexpr,  # splits per load in the last arriver's sum
    HAS_B1: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py: wait before anything (the routing is the previous launch's)
):
    """Decode mlp1: program (split, block, tile) streams BLOCK_W rows of its block's expert over
    KBP K blocks and stores the fp32 partial; the last of the (tiles of one 128-column h group) x
    (splits) programs to arrive sums their partials (all splits per load, in fixed order: bits
    independent of arrival order), adds b1, applies the gpt-oss activation and requantises the
    group; then resets its counter (no memset per call)."""
    if USE_PDL:  # kernels/pdl.py: the routing is the previous launch's (inline: no nested call to interpret)
        gdc_wait()
        gdc_launch_dependents()
    # Program -> (split, block, tile), the split fastest: an h group's programs run close together,
    # so its last arriver's epilogue overlaps other programs' streaming rather than all of them
    # waiting for the last wave; then the block: programs of a duplicated expert run side by side
    # (the second read of a slab hits L2).
    pid = tl.program_id(0)
    split = pid % SPLITS
    block = (pid // SPLITS) % num_blocks
    tile = pid // SPLITS // num_blocks
    # x-side column c = (K block c // ROWS of this program, row c % ROWS of the block); -1: padding.
    # The pairs load is issued beside the expert's (in bounds; an unused block's slots are never
    # used), so the x copies wait one L2 round trip, not two in series.
    offs_c = tl.arange(0, NCOL)
    col_row = block * ROWS + offs_c % ROWS
    col_pair = tl.load(SORTED_PAIRS + col_row)
    expert = tl.load(BLOCK_EXPERT + block)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    two_inter = 2 * inter
    num_kb = tl.cdiv(hidden, 128)
    k_first = split * KBP
    kb_count = tl.minimum(KBP, num_kb - k_first)
    col_kb = tl.where((offs_c < KBP * ROWS) & (offs_c // ROWS < kb_count), offs_c // ROWS, -1)
    col_ok = (col_pair < num_pairs) & (col_kb >= 0)
    col_token = (col_pair // TOP_K).to(tl.int64)
    wrows = tile * BLOCK_W + tl.arange(0, BLOCK_W)
    w_row_ok = wrows < two_inter
    # both scales for all of this program's blocks, once, off the K loop
    x_scale = tl.load(XS + col_token * num_kb + k_first + col_kb, mask=col_ok, other=0.0)
    w_scale = tl.load(W1S + expert * stride_w1s_e + (tile * BLOCK_W // 128) * stride_w1s_n + k_first + col_kb,
                      mask=col_ok, other=0.0)
    w_rows = W1 + expert * stride_w1_e + wrows.to(tl.int64) * stride_w1_n + k_first * 128
    x_cols = XQ + col_token * hidden + k_first * 128
    acc = _gemv_slab(w_rows, w_row_ok, x_cols, col_ok, col_kb, x_scale * w_scale, hidden - k_first * 128,
                     kb_count, ROWS, BLOCK_W, NCOL, DOT_FP32)  # [ROWS, BLOCK_W]

    offs_r = tl.arange(0, ROWS)
    rows = (block * ROWS + offs_r).to(tl.int64)
    row_ok = tl.load(SORTED_PAIRS + rows) < num_pairs
    slab = num_blocks.to(tl.int64) * (ROWS * two_inter)
    tl.store(PART + split * slab + rows[:, None] * two_inter + wrows[None, :], acc,
             mask=row_ok[:, None] & w_row_ok[None, :])
    # last arriver of the h group: the partials stored by all threads before the release
    group = tile * BLOCK_W // 256
    tiles_in_group = tl.cdiv(tl.minimum(256, two_inter - group * 256), BLOCK_W)
    counter = COUNTERS + block * tl.cdiv(inter, 128) + group
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived != tiles_in_group * SPLITS - 1:
        return
    tl.store(counter, 0)
    tl.debug_barrier()  # the acquire above before any thread reads the other partials

    # every split's partials of the group, RED_CHUNK splits per load, gate and linear rows apart
    offs_c = tl.arange(0, 128)
    cols = group * 128 + offs_c  # intermediate columns: W1 rows 2c (gate) and 2c + 1 (linear)
    c_ok = cols < inter
    offs_s = tl.arange(0, RED_CHUNK)
    ok3 = row_ok[None, :, None] & c_ok[None, None, :]
    g_ptrs = PART + rows[None, :, None] * two_inter + 2 * cols[None, None, :]
    acc_g = tl.zeros([ROWS, 128], dtype=tl.float32)
    acc_l = tl.zeros([ROWS, 128], dtype=tl.float32)
    for s0 in tl.static_range(0, SPLITS, RED_CHUNK):
        s = s0 + offs_s
        ptrs = g_ptrs + (s.to(tl.int64) * slab)[:, None, None]
        ok = (s < SPLITS)[:, None, None] & ok3
        acc_g += tl.sum(tl.load(ptrs, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
        acc_l += tl.sum(tl.load(ptrs + 1, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
    if HAS_B1:
        b1_ptrs = B1 + expert * stride_b1_e + 2 * cols
        acc_g += tl.load(b1_ptrs, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        acc_l += tl.load(b1_ptrs + 1, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    h = _gpt_oss_activation(acc_g, acc_l, limit, alpha)
    ok = row_ok[:, None] & c_ok[None, :]
    q, scale = _quantize_e4m3(tl.where(ok, h, 0.0), 1)
    tl.store(HQ + rows[:, None] * inter + cols[None, :], q, mask=ok)
    tl.store(HS + rows * tl.cdiv(inter, 128) + group, scale, mask=row_ok)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _mlp2_gemv_kernel(
    HQ, HS,  # h as `_mlp1_gemv_kernel` left it
    W2, W2S, B2,  # [E, H, I] e4m3, [E, cdiv(H, 128), cdiv(I, 128)] fp32, [E, H]
    SORTED_PAIRS, BLOCK_EXPERT,
    PAIR_OUT,  # fp32 [T * TOP_K, H]: y per pair (b2 included)
    PART, COUNTERS,  # fp32 [SPLITS, rows, H]; int32 per (block, n tile)
    num_pairs, hidden, inter, num_blocks,
    stride_w2_e, stride_w2_n, stride_w2s_e, stride_w2s_n, stride_b2_e,
    TOP_K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # W2 rows (output columns) per program, <= 128
    KBP: tl.constexpr,
    NCOL: tl.constexpr,
    SPLITS: tl.constexpr,
    RED_CHUNK: tl.constexpr,
    HAS_B2: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py: wait and release once the slab's addresses are known
):
    """Decode mlp2: as `_mlp1_gemv_kernel`, over W2; the last of a (block, n tile)'s splits sums
    their partials in fixed order and adds b2 (no split: the program itself)."""
    num_n = tl.cdiv(hidden, BLOCK_N)
    pid = tl.program_id(0)
    split = pid % SPLITS  # as in `_mlp1_gemv_kernel`
    block = (pid // SPLITS) % num_blocks
    tile = pid // SPLITS // num_blocks
    offs_c = tl.arange(0, NCOL)
    col_row = block * ROWS + offs_c % ROWS
    col_pair = tl.load(SORTED_PAIRS + col_row)
    expert = tl.load(BLOCK_EXPERT + block)
    # An unused block exits before any wait and stores nothing. If every block is unused (no local pair), the
    # launch ends without waiting for mlp1: harmless, since mlp1's blocks are all unused then too and it
    # stores nothing.
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    num_kb = tl.cdiv(inter, 128)
    k_first = split * KBP
    kb_count = tl.minimum(KBP, num_kb - k_first)
    col_kb = tl.where((offs_c < KBP * ROWS) & (offs_c // ROWS < kb_count), offs_c // ROWS, -1)
    col_ok = (col_pair < num_pairs) & (col_kb >= 0)
    col_row = col_row.to(tl.int64)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < hidden
    w_scale = tl.load(W2S + expert * stride_w2s_e + (tile * BLOCK_N // 128) * stride_w2s_n + k_first + col_kb,
                      mask=col_ok, other=0.0)
    w_rows = W2 + expert * stride_w2_e + cols.to(tl.int64) * stride_w2_n + k_first * 128
    if USE_PDL:  # kernels/pdl.py: h is the previous launch's
        gdc_wait()
        gdc_launch_dependents()
    x_scale = tl.load(HS + col_row * num_kb + k_first + col_kb, mask=col_ok, other=0.0)  # h's: after the wait
    x_cols = HQ + col_row * inter + k_first * 128
    acc = _gemv_slab(w_rows, n_ok, x_cols, col_ok, col_kb, x_scale * w_scale, inter - k_first * 128,
                     kb_count, ROWS, BLOCK_N, NCOL, DOT_FP32)  # [ROWS, BLOCK_N]

    offs_r = tl.arange(0, ROWS)
    rows = (block * ROWS + offs_r).to(tl.int64)
    pairs = tl.load(SORTED_PAIRS + rows)
    row_ok = pairs < num_pairs
    ok = row_ok[:, None] & n_ok[None, :]
    if SPLITS > 1:
        slab = num_blocks.to(tl.int64) * (ROWS * hidden)
        part_ptrs = PART + rows[:, None] * hidden + cols[None, :]
        tl.store(part_ptrs + split * slab, acc, mask=ok)
        counter = COUNTERS + block * num_n + tile
        tl.debug_barrier()
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived != SPLITS - 1:
            return
        tl.store(counter, 0)
        tl.debug_barrier()
        offs_s = tl.arange(0, RED_CHUNK)
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for s0 in tl.static_range(0, SPLITS, RED_CHUNK):
            s = s0 + offs_s
            acc += tl.sum(tl.load(part_ptrs[None, :, :] + (s.to(tl.int64) * slab)[:, None, None],
                                  mask=(s < SPLITS)[:, None, None] & ok[None, :, :], other=0.0,
                                  cache_modifier=".cg"), axis=0)
    if HAS_B2:
        acc += tl.load(B2 + expert * stride_b2_e + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = PAIR_OUT + pairs.to(tl.int64)[:, None] * hidden + cols[None, :]
    tl.store(y_ptrs, acc, mask=ok)




# ---------------------------------------------------------------------------------------------
# 5. weighted combine
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_tokens"])
def _combine_kernel(PAIR_OUT, TOPK_W, TOPK_IDS, OUT, num_tokens, hidden, stride_out, expert_offset, num_local,
                    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT_K: tl.constexpr,
                    USE_PDL: tl.constexpr = False):
    if USE_PDL:  # kernels/pdl.py: mlp2's pairs, then the next layer's kernels may start
        gdc_wait()
        gdc_launch_dependents()
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    tokens = tokens.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = token_ok[:, None] & (cols < hidden)[None, :]
    slab = num_tokens.to(tl.int64) * (TOP_K * hidden)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pairs = tokens * TOP_K + j
        local = tl.load(TOPK_IDS + pairs, mask=token_ok, other=0).to(tl.int32) - expert_offset
        mine = (local >= 0) & (local < num_local)
        weight = tl.load(TOPK_W + pairs, mask=token_ok, other=0.0).to(tl.float32)
        # foreign pairs' rows were never written: mask the load, never multiply garbage by 0
        y_ptrs = PAIR_OUT + pairs[:, None] * hidden + cols[None, :]
        y = tl.load(y_ptrs, mask=ok & mine[:, None], other=0.0).to(tl.float32)  # bf16 y: MoeConfig.pair_out_bf16
        for s in tl.static_range(1, SPLIT_K):  # mlp2's K splits, summed in split order
            y += tl.load(y_ptrs + s * slab, mask=ok & mine[:, None], other=0.0).to(tl.float32)
        acc += weight[:, None] * y
    if OUT.dtype.element_ty == tl.bfloat16:
        acc = _round_to_bf16(acc)
    tl.store(OUT + tokens[:, None] * stride_out + cols[None, :], acc.to(OUT.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


ROUTE_BLOCK_T = 16  # tokens per routing program when the sort runs on its own (prefill)
GATHER_BLOCK_R = 16  # MoeConfig.tma: sorted rows per program of the x gather (block_m is a multiple)
QUANT_BLOCK_T = 16  # tokens per quantisation program (one 1x128 group column each)
COMBINE_BLOCK_T = 4
# Up to this many tokens (and 4 chunks of pairs), with at least FUSED_SORT_MIN_EXPERTS local experts,
# one program routes every token and sorts every pair inside the routing launch (decode: one launch
# instead of three). Its pair comparisons grow with the pairs squared, the chunked sort's expert sweeps
# with the experts: H200, routing + x groups + sort, us, fused / chunked (benchmarks/results/
# diag_front_sort.md, same outputs): 128 experts 14.3 / 20.4 at 17 tokens, 29.5 / 32.1 at 64, 79.6 / 41.4
# at 96, 101.5 / 50.3 at 128; 32 experts 11.2 / 8.6 at 17, 19.4 / 11.3 at 64, 89.1 / 17.1 at 128. In the
# decode step (separate runs, not paired; results/bench_decode_tp1_*chunked_sort.md): 20b ctx 8192
# batch 128 17.09 -> 15.61 ms (66 -> 72 % of copy bandwidth), batch 64 11.34 -> 11.06; 120b batch 128 at ctx
# 4096 42.26 -> 39.82 ms. 64 local experts (120b EP2) not measured.
FUSED_SORT_MAX_TOKENS = 64
FUSED_SORT_MIN_EXPERTS = 64
SORT_MAX_SINGLE_CHUNKS = 4
# The fused sort's pair-comparison tiles, [P_PAD, COLS]: 32 int32 a thread at 8 warps (64 took
# 249 registers at 512 pairs, sm_90a).
SORT_TILE_VALUES = 8192
# Up to this many tokens `_decode_front_kernel` computes the router logits too (one launch for
# router + routing + quantisation + sort, instead of cuBLAS's GEMM and split-K reduce and
# `_front_kernel`). At 16 its last program's sort compares [64, 64] pairs and its router
# programs hold [16, 1024] x tiles (<= 128 registers, no spills, ptxas sm_90a); a 32-token
# tile would need narrower K slices, so more partials for the last arriver to read. Batches
# above 16 keep F.linear + `_front_kernel` unchanged (not measured against this path).
DECODE_FRONT_MAX_TOKENS = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _experts_pad(num_experts: int) -> int:
    """Expert-axis tile width: a power of two, at least 32, so expert counts of 1..32 (EP
    shards, the tests' 8) share the 32-expert model's compiled kernels."""
    return max(32, _next_pow2(num_experts))


COUNTERS_OWNER = "moe_mlp1_split_k"
ROUTER_COUNTER_OWNER = "moe_decode_router"


def _split_counters(n: int, dev: torch.device) -> torch.Tensor:
    """n arrival counters for mlp1's split-K tiles, all zero (`arrival_counters`). Inside a capture
    that would need them made, the graph gets its own zeroed ones (the zeroing is captured too)."""
    buf = arrival_counters(COUNTERS_OWNER, dev, max(n, 4096))
    return buf if buf is not None else torch.zeros(n, dtype=torch.int32, device=dev)


def _max_blocks(num_pairs: int, num_local: int, block_m: int) -> int:
    """Bound on the used blocks from shapes only: each holds >= 1 pair, each expert pads < 1 block."""
    return max(1, min(num_pairs, _cdiv(num_pairs, block_m) + num_local))


def _check_weights(hidden, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2):
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe_fp8: w1/w2 must be [E, out, in], got {tuple(w1.shape)}/{tuple(w2.shape)}")
    num_local, two_inter, h1 = w1.shape
    inter = two_inter // 2
    if two_inter % 2 or h1 != hidden:
        raise ValueError(f"fused_moe_fp8: w1 must be [E, 2I, {hidden}], got {tuple(w1.shape)}")
    if tuple(w2.shape) != (num_local, hidden, inter):
        raise ValueError(f"fused_moe_fp8: w2 must be [{num_local}, {hidden}, {inter}], got {tuple(w2.shape)}")
    if w1.dtype != FP8 or w2.dtype != FP8:
        raise ValueError(f"fused_moe_fp8: expert weights must be float8_e4m3fn, got {w1.dtype}/{w2.dtype}")
    want1 = (num_local, _cdiv(two_inter, QUANT_GROUP), _cdiv(hidden, QUANT_GROUP))
    want2 = (num_local, _cdiv(hidden, QUANT_GROUP), _cdiv(inter, QUANT_GROUP))
    for name, s, want in (("w1_scale_inv", w1_scale_inv, want1), ("w2_scale_inv", w2_scale_inv, want2)):
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"fused_moe_fp8: {name} must be fp32 {list(want)}, got {s.dtype} {tuple(s.shape)}")
    if b1 is not None and tuple(b1.shape) != (num_local, two_inter):
        raise ValueError(f"fused_moe_fp8: b1 must be [{num_local}, {two_inter}], got {tuple(b1.shape)}")
    if b2 is not None and tuple(b2.shape) != (num_local, hidden):
        raise ValueError(f"fused_moe_fp8: b2 must be [{num_local}, {hidden}], got {tuple(b2.shape)}")
    for name, t in (("w1", w1), ("w2", w2), ("w1_scale_inv", w1_scale_inv), ("w2_scale_inv", w2_scale_inv),
                    ("b1", b1), ("b2", b2)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"fused_moe_fp8: {name} needs a unit last stride")
    return num_local, inter


def _sort_chunk(num_pairs: int, chunk: int) -> int:
    """Pairs per sort step: the config's, or 32 for a few pairs (T <= 8 at k=4). Two sizes only,
    so the kernels compile twice, not once per batch size."""
    return min(chunk, 32) if num_pairs <= 32 else chunk


def _launch_sort(ids, num_pairs, num_local, expert_offset, block_m, chunk, sorted_pairs, block_expert, max_blocks):
    """The sort on its own: one program for a few chunks of pairs, else counts per chunk first."""
    e_pad = _experts_pad(num_local)
    chunk = _sort_chunk(num_pairs, chunk)
    num_chunks = max(1, _cdiv(num_pairs, chunk))
    single = num_chunks <= SORT_MAX_SINGLE_CHUNKS
    chunk_counts = block_expert  # unused when single
    if not single:
        chunk_counts = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=ids.device)
        _count_kernel[(num_chunks,)](ids, chunk_counts, num_pairs, expert_offset, num_local,
                                     CHUNK=chunk, E_PAD=e_pad, num_warps=8)
    programs = 1 if single else num_chunks
    _align_kernel[(programs,)](
        ids, chunk_counts, sorted_pairs, block_expert, num_pairs, expert_offset, num_local,
        num_chunks, max_blocks, _cdiv(max_blocks, programs),
        BLOCK_M=block_m, CHUNK=chunk, E_PAD=e_pad, SINGLE=single, num_warps=8,
    )


def _front(x, logits, topk_ids, top_k, sort=None):
    """Routing (from `logits`, else `topk_ids` is given), x's e4m3 groups and, with `sort` =
    (num_local, expert_offset, block_m, chunk), the pair sort. One launch when one program can
    route and sort everything (decode); else the routing/quantisation launch, then the sort's.
    Returns (weights, ids, xq, xs, sorted_pairs, block_expert, max_blocks); no host syncs."""
    ref = logits if logits is not None else (x if x is not None else topk_ids)
    t = ref.shape[0]
    dev = ref.device
    route = logits is not None
    weights = ids = xq = xs = sorted_pairs = block_expert = None
    max_blocks = 0
    num_experts, e_pad, hidden, stride_logits = 1, 1, 1, 0
    if route:
        if logits.dim() != 2 or logits.stride(-1) != 1:
            raise ValueError("route_and_quantize: logits must be [T, E] with a unit last stride")
        num_experts = logits.shape[1]
        if not 1 <= top_k <= min(8, num_experts):
            raise ValueError(f"route_and_quantize: top_k must be in 1..min(8, E), got {top_k}")
        e_pad, stride_logits = _experts_pad(num_experts), logits.stride(0)
        weights = torch.empty((t, top_k), dtype=logits.dtype, device=dev)
        ids = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    else:
        ids = topk_ids if topk_ids is None or topk_ids.is_contiguous() else topk_ids.contiguous()
    if x is not None:
        if x.dim() != 2 or x.stride(-1) != 1 or x.shape[0] != t:
            raise ValueError("route_and_quantize: x must be [T, H] with a unit last stride")
        hidden = x.shape[1]
        xq = torch.empty((t, hidden), dtype=FP8, device=dev)
        xs = torch.empty((t, _cdiv(hidden, QUANT_GROUP)), dtype=torch.float32, device=dev)
    num_pairs = t * top_k
    fused_sort = False
    align = dict(BLOCK_M=16, P_PAD=16, COLS=16)
    num_local = expert_offset = 0
    sort_scratch = None
    if sort is not None:
        num_local, expert_offset, block_m, chunk = sort
        max_blocks = _max_blocks(num_pairs, num_local, block_m)
        sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
        block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
        num_chunks = _cdiv(num_pairs, _sort_chunk(num_pairs, chunk))
        fused_sort = (t <= FUSED_SORT_MAX_TOKENS and num_local >= FUSED_SORT_MIN_EXPERTS
                      and num_chunks <= SORT_MAX_SINGLE_CHUNKS)
    # one program routing everything takes 16 or 32 tokens a step, and sorts in pair tiles sized by
    # a power of two of the pairs: one compile per bucket
    route_block_t = (16 if t <= 16 else 32) if fused_sort else ROUTE_BLOCK_T
    if fused_sort:
        p_pad = _next_pow2(max(16, t)) * _next_pow2(top_k)
        align = dict(BLOCK_M=block_m, P_PAD=p_pad, COLS=max(1, min(p_pad, SORT_TILE_VALUES // p_pad)))
        sort_scratch = torch.empty(p_pad, dtype=torch.int32, device=dev)
    if t == 0:
        return weights, ids, xq, xs, sorted_pairs, block_expert, max_blocks
    heads = 1 if fused_sort else (_cdiv(t, route_block_t) if route else 0)
    quant_programs = _cdiv(t, QUANT_BLOCK_T) * _cdiv(hidden, QUANT_GROUP) if x is not None else 0
    dummy = ref
    _front_kernel[(heads + quant_programs,)](
        logits if route else dummy, x if x is not None else dummy, xq if xq is not None else dummy,
        xs if xs is not None else dummy, weights if weights is not None else dummy,
        ids if ids is not None else dummy,
        sorted_pairs if fused_sort else dummy, block_expert if fused_sort else dummy,
        sort_scratch if fused_sort else dummy,
        t, stride_logits, x.stride(0) if x is not None else 0, num_experts, hidden, expert_offset, num_local,
        heads, max_blocks,
        TOP_K=top_k, K_PAD=_next_pow2(top_k), E_PAD=e_pad, ROUTE_BLOCK_T=route_block_t,
        QUANT_BLOCK_T=QUANT_BLOCK_T, ROUTE=route, QUANT=x is not None, ALIGN=fused_sort,
        TORCH_CPU_SOFTMAX=dev.type == "cpu", **align, num_warps=8 if fused_sort else 4,
    )
    if sort is not None and not fused_sort:
        _launch_sort(ids, num_pairs, num_local, expert_offset, block_m, chunk, sorted_pairs, block_expert, max_blocks)
    return weights, ids, xq, xs, sorted_pairs, block_expert, max_blocks


@dataclass(frozen=True)
class RouterTiling:
    """How the decode front splits the router GEMV: `block_k` columns of H per program
    (`splits` = cdiv(H, block_k) programs per expert group), `experts` router rows per program,
    `row_loop`: one dot per row (a [T_PAD, experts, block_k] product would take too many
    registers)."""

    block_k: int
    splits: int
    experts: int
    row_loop: bool


def router_tiling(num_experts: int, hidden: int, t_pad: int, interpreted: bool = False) -> RouterTiling:
    """Three K slices (2880 -> 1024 + 1024 + 832; ragged small dims get three too) and about 32
    expert groups: both gpt-oss sizes run 96 router programs of 2-8 KB of weight each (all of a
    128-expert router's 737 KB in flight at once), and the last arriver reads 3 partials per
    logit. A program holds [T_PAD, experts, block_k] products when that is <= 16K values (64
    registers a thread at 8 warps), else it loops over its rows. The interpreter pays ~5 ms per
    program and per reduction, so there a program takes up to 32 rows, in one product."""
    block_k = min(1024, max(128, _next_pow2(_cdiv(hidden, 3))))
    experts = 1
    while experts < 8 and experts * 64 <= num_experts:
        experts *= 2
    if interpreted:
        experts = min(32, _next_pow2(num_experts))
    row_loop = not interpreted and t_pad * experts * block_k > 16384
    return RouterTiling(block_k, _cdiv(hidden, block_k), experts, row_loop)


def _decode_token_pad(num_tokens: int) -> int:
    """Token tile of the decode front: three buckets (three compiles), batch 1 on its own."""
    return 1 if num_tokens == 1 else 4 if num_tokens <= 4 else 16


def _uses_decode_front(x, router_weight, router_bias) -> bool:
    """The decode front takes over where its tile holds every token and the operands are those
    F.linear would accept (else F.linear raises, as before)."""
    return (1 <= x.shape[0] <= DECODE_FRONT_MAX_TOKENS and router_weight.dtype == x.dtype
            and router_weight.stride(-1) == 1 and x.device == router_weight.device
            and (router_bias is None or (router_bias.dtype == x.dtype and router_bias.dim() == 1
                                         and router_bias.is_contiguous())))


def _decode_front(x, router_weight, router_bias, top_k, sort, tiling=None):
    """`F.linear` + `_front` for 1 <= T <= DECODE_FRONT_MAX_TOKENS in one launch (no cuBLAS):
    returns (`_front`'s tuple, logits [T, E] in the router dtype)."""
    t, hidden = x.shape
    num_experts = router_weight.shape[0]
    if not 1 <= top_k <= min(8, num_experts):
        raise ValueError(f"fused_moe_fp8: top_k must be in 1..min(8, E), got {top_k}")
    dev, dtype = x.device, router_weight.dtype
    num_local, expert_offset, block_m, _ = sort
    num_pairs = t * top_k
    max_blocks = _max_blocks(num_pairs, num_local, block_m)
    t_pad = _decode_token_pad(t)
    tiling = tiling or router_tiling(num_experts, hidden, t_pad, interpreted=dev.type == "cpu")
    part = torch.empty((tiling.splits, t, num_experts), dtype=torch.float32, device=dev)
    counter = arrival_counters(ROUTER_COUNTER_OWNER, dev, 1)
    if counter is None:  # first call inside a capture: the graph zeroes its own
        counter = torch.zeros(1, dtype=torch.int32, device=dev)
    logits = torch.empty((t, num_experts), dtype=dtype, device=dev)
    weights = torch.empty((t, top_k), dtype=dtype, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    xq = torch.empty((t, hidden), dtype=FP8, device=dev)
    xs = torch.empty((t, _cdiv(hidden, QUANT_GROUP)), dtype=torch.float32, device=dev)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    router_programs = _cdiv(num_experts, tiling.experts) * tiling.splits
    quant_programs = _cdiv(t, QUANT_BLOCK_T) * _cdiv(hidden, QUANT_GROUP)
    _decode_front_kernel[(router_programs + quant_programs,)](
        x, router_weight, router_bias if router_bias is not None else router_weight, part, counter, logits,
        weights, ids, xq, xs, sorted_pairs, block_expert,
        t, x.stride(0), router_weight.stride(0), num_experts, hidden, expert_offset, num_local, max_blocks,
        TOP_K=top_k, K_PAD=_next_pow2(top_k), E_PAD=_experts_pad(num_experts), T_PAD=t_pad,
        EXPERTS_PER_PROGRAM=tiling.experts, BLOCK_K=tiling.block_k, NUM_SPLITS=tiling.splits,
        ROW_LOOP=tiling.row_loop, HAS_BIAS=router_bias is not None,
        QUANT_BLOCK_T=QUANT_BLOCK_T, BLOCK_M=block_m, TORCH_CPU_SOFTMAX=dev.type == "cpu",
        num_warps=8 if t_pad > 4 else 4, **pdl_launch_kwargs(dev, t),
    )
    return (weights, ids, xq, xs, sorted_pairs, block_expert, max_blocks), logits


def decode_front(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None, top_k: int,
                 num_local: int, expert_offset: int = 0, block_m: int = 16,
                 tiling: RouterTiling | None = None) -> dict:
    """The decode front on its own (tests, benchmarks): router logits, routing, x's e4m3
    groups and the pair sort, as a dict of tensors; `tiling` overrides `router_tiling`."""
    if not _uses_decode_front(x, router_weight, router_bias):
        raise ValueError(f"decode_front: needs 1 <= T <= {DECODE_FRONT_MAX_TOKENS} and router operands "
                         "F.linear accepts (x's dtype, unit last stride)")
    front, logits = _decode_front(x, router_weight, router_bias, top_k, (num_local, expert_offset, block_m, 0),
                                  tiling)
    names = ("topk_weights", "topk_ids", "x_fp8", "x_scale", "sorted_pairs", "block_expert", "max_blocks")
    return dict(zip(names, front), logits=logits)


def route_and_quantize(logits: torch.Tensor | None, x: torch.Tensor | None, top_k: int = 4):
    """One launch: (topk_weights [T, k] in logits' dtype, topk_ids [T, k] int32) as `route`
    computes them from these logits, and/or (x_fp8 [T, H], x_scale [T, cdiv(H, 128)]) as
    `quantize_activation_group128`. Pass None for the half not wanted."""
    weights, ids, xq, xs, *_ = _front(x, logits, None, top_k)
    return (weights, ids if logits is not None else None, xq, xs)


def route_and_align(logits: torch.Tensor, x: torch.Tensor | None, top_k: int, num_local: int, expert_offset: int,
                    block_m: int, chunk: int = 128) -> dict:
    """The MoE front as `fused_moe_fp8` runs it above the decode front's batches: routing from
    `logits`, x's e4m3 groups (x may be None) and the pair sort, in one launch up to
    FUSED_SORT_MAX_TOKENS tokens on FUSED_SORT_MIN_EXPERTS+ local experts (the sort fused), else two.
    A dict of tensors (tests, benchmarks)."""
    front = _front(x, logits, None, top_k, (num_local, expert_offset, block_m, chunk))
    names = ("topk_weights", "topk_ids", "x_fp8", "x_scale", "sorted_pairs", "block_expert", "max_blocks")
    return dict(zip(names, front))


def align_pairs(topk_ids: torch.Tensor, num_local: int, expert_offset: int, block_m: int, chunk: int = 128):
    """(sorted_pairs [max_blocks * block_m] int32, block_expert [max_blocks] int32, max_blocks).

    Pairs are `token * k + slot`; each local expert's pairs sit in token order in a segment
    padded to a multiple of `block_m` (padding slots hold `T * k`); blocks past the last
    segment have expert -1; max_blocks = min(T*k, cdiv(T*k, block_m) + E_local)."""
    num_pairs = topk_ids.numel()
    max_blocks = _max_blocks(num_pairs, num_local, block_m)
    dev = topk_ids.device
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    if num_pairs:
        _launch_sort(topk_ids.reshape(-1).contiguous(), num_pairs, num_local, expert_offset, block_m, chunk,
                     sorted_pairs, block_expert, max_blocks)
    return sorted_pairs, block_expert, max_blocks


def _check_call(x, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2, config, out, num_experts=0, top_k=4):
    """Every host-side check, before anything is launched: (num_local, inter, config, out). Without a
    `config`, the table's row for x's tokens over `num_experts` router experts (select_config)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"fused_moe_fp8: x must be [T, H] with a unit last stride, got {tuple(x.shape)}")
    num_local, inter = _check_weights(x.shape[1], w1, w1_scale_inv, b1, w2, w2_scale_inv, b2)
    config = config or select_config(x.shape[0], num_experts, top_k)
    _check_config(config)
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"fused_moe_fp8: out must be {tuple(x.shape)} with a unit last stride")
    return num_local, inter, config, out


GEMV_COUNTERS_OWNER = "moe_gemv"  # mlp1's and mlp2's GEMV kernels: one stream, each leaves zeros
# The last arriver's sum loads at most this many fp32 partials per thread at once.
GEMV_REDUCE_MAX_REGS = 64


def gemv_shape(k_dim: int, rows: int, split_k: int) -> tuple[int, int, int]:
    """(K blocks per program, splits, x-side columns) of a GEMV launch over K = k_dim: the
    config's split, no empty trailing split; NCOL = (K blocks, rows) columns as a power of two,
    at least 16 for the MMA."""
    num_kb = _cdiv(k_dim, QUANT_GROUP)
    kbp = _cdiv(num_kb, min(split_k, num_kb))
    ncol = _next_pow2(kbp * rows)
    return kbp, _cdiv(num_kb, kbp), max(16, ncol)


def _gemv_red_chunk(splits: int, per_split_values: int, warps: int) -> int:
    cap = max(1, GEMV_REDUCE_MAX_REGS * 32 * warps // per_split_values)
    return min(_next_pow2(splits), 1 << (cap.bit_length() - 1))


def _counters(owner: str, n: int, dev: torch.device) -> torch.Tensor:
    buf = arrival_counters(owner, dev, max(n, 4096))
    return buf if buf is not None else torch.zeros(n, dtype=torch.int32, device=dev)


def _experts_gemv(x, topk_weights, topk_ids, xq, xs, sorted_pairs, block_expert, max_blocks, w1, w1_scale_inv, b1,
                  w2, w2_scale_inv, b2, limit, expert_offset, num_local, inter, config, out):
    """The decode GEMV path: `_mlp1_gemv_kernel`, `_mlp2_gemv_kernel`, `_combine_kernel`."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    dev = x.device
    bm = config.block_m
    rows = max_blocks * bm
    interpreted = dev.type == "cpu"
    chain = pdl_launch_kwargs(dev, num_tokens, "moe")  # kernels/pdl.py: each launch a dependent of the one before
    block_w = 2 * config.mlp1_block_n
    kbp1, splits1, ncol1 = gemv_shape(hidden, bm, config.mlp1_split_k)
    kbp2, splits2, ncol2 = gemv_shape(inter, bm, config.mlp2_split_k)
    hq = torch.empty((rows, inter), dtype=FP8, device=dev)
    hs = torch.empty((rows, _cdiv(inter, QUANT_GROUP)), dtype=torch.float32, device=dev)
    part1 = torch.empty((splits1, rows, 2 * inter), dtype=torch.float32, device=dev)
    block_n = config.mlp2_block_n
    n2 = _cdiv(hidden, block_n)
    # mlp1: one per (block, h group); mlp2: per (block, n tile)
    counters = _counters(GEMV_COUNTERS_OWNER, max(max_blocks * _cdiv(inter, QUANT_GROUP), max_blocks * n2), dev)
    _mlp1_gemv_kernel[(splits1 * max_blocks * _cdiv(2 * inter, block_w),)](
        xq, xs, w1, w1_scale_inv, b1 if b1 is not None else w1_scale_inv, sorted_pairs, block_expert,
        hq, hs, part1, counters,
        num_pairs, hidden, inter, max_blocks, float(limit), SWIGLU_ALPHA,
        w1.stride(0), w1.stride(1), w1_scale_inv.stride(0), w1_scale_inv.stride(1),
        b1.stride(0) if b1 is not None else 0,
        TOP_K=top_k, ROWS=bm, BLOCK_W=block_w, KBP=kbp1, NCOL=ncol1, SPLITS=splits1,
        RED_CHUNK=_gemv_red_chunk(splits1, 2 * bm * QUANT_GROUP, config.mlp1_warps),
        HAS_B1=b1 is not None, DOT_FP32=interpreted,
        num_warps=config.mlp1_warps, num_stages=config.mlp1_stages, **chain,
    )
    pair_out = torch.empty((num_pairs, hidden), dtype=torch.float32, device=dev)
    part2 = torch.empty((splits2, rows, hidden), dtype=torch.float32, device=dev) if splits2 > 1 else pair_out
    _mlp2_gemv_kernel[(splits2 * max_blocks * n2,)](
        hq, hs, w2, w2_scale_inv, b2 if b2 is not None else w2_scale_inv, sorted_pairs, block_expert,
        pair_out, part2, counters,
        num_pairs, hidden, inter, max_blocks,
        w2.stride(0), w2.stride(1), w2_scale_inv.stride(0), w2_scale_inv.stride(1),
        b2.stride(0) if b2 is not None else 0,
        TOP_K=top_k, ROWS=bm, BLOCK_N=block_n, KBP=kbp2, NCOL=ncol2, SPLITS=splits2,
        RED_CHUNK=_gemv_red_chunk(splits2, bm * block_n, config.mlp2_warps),
        HAS_B2=b2 is not None, DOT_FP32=interpreted,
        num_warps=config.mlp2_warps, num_stages=config.mlp2_stages, **chain,
    )
    block_h = min(1024, _next_pow2(hidden))
    _combine_kernel[(_cdiv(num_tokens, COMBINE_BLOCK_T), _cdiv(hidden, block_h))](
        pair_out, topk_weights, topk_ids, out, num_tokens, hidden, out.stride(0), expert_offset, num_local,
        TOP_K=top_k, BLOCK_T=COMBINE_BLOCK_T, BLOCK_H=block_h, SPLIT_K=1, num_warps=4,
        **pdl_launch_kwargs(dev, num_tokens, "moe_combine"),
    )
    return out


def _experts(x, front, topk_weights, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2,
             limit, expert_offset, num_local, inter, config, out):
    """mlp1, mlp2 and the combine over the front's routing, x quantisation and sort."""
    _, topk_ids, xq, xs, sorted_pairs, block_expert, max_blocks = front
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return out
    if config.oneshot:
        from .moe_decode import ONESHOT_MAX_SLAB_BYTES, OneshotConfig, fused_moe_decode_oneshot

        one = OneshotConfig(config.mlp1_block_n, config.mlp1_warps, config.mlp2_block_n, config.mlp2_warps,
                            mlp2_per_pair=config.mlp2_per_pair)
        if x.device.type == "cpu" and config == select_config(num_tokens):
            # The interpreter pays per program, and each output element's sums do not depend on
            # the tile width, so the served model's interpreted runs (tests) take the table's
            # row with wide tiles: the same bits, ~4x faster (tiny model decode step 70 -> 19 s).
            # Explicit configs run as given.
            wide = OneshotConfig(max(one.mlp1_block_n, 32), one.mlp1_warps, max(one.mlp2_block_n, 16), one.mlp2_warps,
                                 mlp2_per_pair=one.mlp2_per_pair)
            if max(wide.slab_bytes_per_thread(hidden, inter, top_k)) <= ONESHOT_MAX_SLAB_BYTES:
                one = wide
        return fused_moe_decode_oneshot(x, topk_weights, topk_ids, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2, limit,
                                        expert_offset, one, out, x_fp8=xq, x_scale=xs)
    if config.gemv:
        if not topk_weights.is_contiguous():
            topk_weights = topk_weights.contiguous()
        return _experts_gemv(x, topk_weights, topk_ids, xq, xs, sorted_pairs, block_expert, max_blocks, w1,
                             w1_scale_inv, b1, w2, w2_scale_inv, b2, limit, expert_offset, num_local, inter, config,
                             out)
    bm = config.block_m
    num_pairs = num_tokens * top_k
    dev = x.device
    if not topk_weights.is_contiguous():
        topk_weights = topk_weights.contiguous()
    rows = max_blocks * bm
    fused = config.fused_requant
    # Kernels see CPU tensors only under TRITON_INTERPRET, where tl.dot is a numpy matmul loop
    # without BLAS (55 ms per 64x128x128 tile); an fp32 multiply-and-sum of the same e4m3
    # values (exact products, fp32 sums) takes ~3 ms and differs only in summation order.
    interpreted = dev.type == "cpu"
    chain = pdl_launch_kwargs(dev, num_tokens, "moe")  # kernels/pdl.py: each launch a dependent of the one before
    if fused:
        hq = torch.empty((rows, inter), dtype=FP8, device=dev)
        hs = torch.empty((rows, _cdiv(inter, QUANT_GROUP)), dtype=torch.float32, device=dev)
        hf = hs
    else:
        hf = torch.empty((rows, inter), dtype=torch.float32, device=dev)
        hq = hs = hf
    n1 = _cdiv(inter, config.mlp1_block_n)
    split1, split2 = config.mlp1_split_k, config.mlp2_split_k
    part = counters = hs
    if split1 > 1:
        part = torch.empty((split1, 2, rows, inter), dtype=torch.float32, device=dev)
        counters = _split_counters(max_blocks * n1, dev)
    x_desc = w1_desc = h_desc = w2_desc = None
    if config.tma:
        w1_rows = w1.view(-1, hidden) if w1.is_contiguous() else None  # [E * 2I, H]
        if w1_rows is not None and tma_2d_ok(xq) and tma_2d_ok(w1_rows):
            if config.tma_x:
                xg = torch.empty((rows, hidden), dtype=FP8, device=dev)
                _gather_rows_kernel[(rows // GATHER_BLOCK_R,)](
                    xq, xg, sorted_pairs, block_expert, num_pairs, hidden, TOP_K=top_k, BLOCK_M=bm,
                    BLOCK_R=GATHER_BLOCK_R, BLOCK_H=min(1024, _next_pow2(hidden)), num_warps=4)
            x_desc = descriptor(xg, [bm, QUANT_GROUP]) if config.tma_x else None
            w1_desc = descriptor(w1_rows, [config.mlp1_block_n, QUANT_GROUP])
        w2_rows = w2.view(-1, inter) if w2.is_contiguous() else None  # [E * H, I]
        if w2_rows is not None and tma_2d_ok(hq) and tma_2d_ok(w2_rows):
            h_desc = descriptor(hq, [bm, QUANT_GROUP])
            w2_desc = descriptor(w2_rows, [config.mlp2_block_n, QUANT_GROUP])
    _mlp1_kernel[(split1 * max_blocks * n1,)](
        xq, xs, w1, w1_scale_inv, b1 if b1 is not None else w1_scale_inv,
        sorted_pairs, block_expert, hq, hs, hf, part, counters,
        num_pairs, hidden, inter, max_blocks, float(limit), SWIGLU_ALPHA,
        w1.stride(0), w1.stride(1), w1_scale_inv.stride(0), w1_scale_inv.stride(1),
        b1.stride(0) if b1 is not None else 0,
        TOP_K=top_k, BLOCK_M=bm, BLOCK_N=config.mlp1_block_n, GROUP_M=config.group_m,
        HAS_B1=b1 is not None, FUSED_REQUANT=fused, DOT_FP32=interpreted, SPLIT_K=split1,
        ONE_DOT=config.mlp1_one_dot, PASSES=config.mlp1_passes,
        x_desc=x_desc, w1_desc=w1_desc, TMA=w1_desc is not None, X_TMA=x_desc is not None,
        num_warps=config.mlp1_warps, num_stages=config.mlp1_stages, **chain,
    )
    pair_bf16 = config.pair_out_bf16 and x.dtype == torch.bfloat16  # the kernels follow the buffer's dtype
    pair_out = torch.empty((split2, num_pairs, hidden), dtype=torch.bfloat16 if pair_bf16 else torch.float32,
                           device=dev)
    n2 = _cdiv(hidden, config.mlp2_block_n)
    _mlp2_kernel[(split2 * max_blocks * n2,)](
        hq, hs, hf, w2, w2_scale_inv, b2 if b2 is not None else w2_scale_inv,
        sorted_pairs, block_expert, pair_out,
        num_pairs, hidden, inter, max_blocks,
        w2.stride(0), w2.stride(1), w2_scale_inv.stride(0), w2_scale_inv.stride(1),
        b2.stride(0) if b2 is not None else 0,
        BLOCK_M=bm, BLOCK_N=config.mlp2_block_n, GROUP_M=config.group_m,
        HAS_B2=b2 is not None, A_IS_FP8=fused, DOT_FP32=interpreted, SPLIT_K=split2,
        h_desc=h_desc, w2_desc=w2_desc, TMA=h_desc is not None,
        num_warps=config.mlp2_warps, num_stages=config.mlp2_stages, **chain,
    )
    block_h = min(1024, _next_pow2(hidden))
    _combine_kernel[(_cdiv(num_tokens, COMBINE_BLOCK_T), _cdiv(hidden, block_h))](
        pair_out, topk_weights, topk_ids, out, num_tokens, hidden, out.stride(0), expert_offset, num_local,
        TOP_K=top_k, BLOCK_T=COMBINE_BLOCK_T, BLOCK_H=block_h, SPLIT_K=split2, num_warps=4,
        **pdl_launch_kwargs(dev, num_tokens, "moe_combine"),
    )
    return out


def fused_moe_fp8(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None,
    w1: torch.Tensor,
    w1_scale_inv: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    b2: torch.Tensor | None,
    top_k: int = 4,
    limit: float = 7.0,
    expert_offset: int = 0,
    config: MoeConfig | None = None,
    out: torch.Tensor | None = None,
    return_routing: bool = False,
):
    """The gpt-oss MoE layer on FP8 experts: out [T, H] in x's dtype.

    x [T, H]; router_weight [E, H], router_bias [E] (the router's dtype is the routing dtype,
    bf16 for the real model); w1 [E_local, 2I, H] e4m3 with w1_scale_inv fp32 [E_local,
    cdiv(2I, 128), cdiv(H, 128)], b1 [E_local, 2I] (interleaved gate/linear rows, as loaded);
    w2 [E_local, H, I] e4m3 with w2_scale_inv [E_local, cdiv(H, 128), cdiv(I, 128)], b2
    [E_local, H] or None (tensor parallelism: the caller adds it once, `add_down_bias`).
    The weights are this rank's experts, global ids expert_offset .. expert_offset+E_local-1.
    `config` overrides the table (`select_config`); `out` receives the result (CUDA-graph
    buffers); with `return_routing` also returns (topk_weights, topk_ids int32).
    No host syncs: capturable in a CUDA graph."""
    num_local, inter, config, out = _check_call(x, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2, config, out,
                                                num_experts=router_weight.shape[0] if router_weight.dim() == 2 else 0,
                                                top_k=top_k)
    if router_weight.dim() != 2 or router_weight.shape[1] != x.shape[1]:
        raise ValueError(f"fused_moe_fp8: router_weight must be [E, {x.shape[1]}], got {tuple(router_weight.shape)}")
    if expert_offset < 0 or expert_offset + num_local > router_weight.shape[0]:
        raise ValueError(f"fused_moe_fp8: experts {expert_offset}..{expert_offset + num_local - 1} "
                         f"outside the router's {router_weight.shape[0]}")
    sort = (num_local, expert_offset, config.block_m, config.align_chunk)
    if _uses_decode_front(x, router_weight, router_bias):
        front, _ = _decode_front(x, router_weight, router_bias, top_k, sort)
    else:
        front = _front(x, F.linear(x, router_weight, router_bias), None, top_k, sort)
    topk_weights, topk_ids = front[0], front[1]
    result = _experts(x, front, topk_weights, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2,
                      limit, expert_offset, num_local, inter, config, out)
    return (result, topk_weights, topk_ids) if return_routing else result


def fused_experts_fp8(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w1: torch.Tensor,
    w1_scale_inv: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    b2: torch.Tensor | None,
    limit: float = 7.0,
    expert_offset: int = 0,
    config: MoeConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fused_moe_fp8` with the routing given: topk_weights [T, k] (any float dtype, used in
    fp32) and topk_ids [T, k] (global expert ids, int32 or int64), e.g. from `route`."""
    num_local, inter, config, out = _check_call(x, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2, config, out)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError("fused_experts_fp8: topk_weights and topk_ids must both be [T, k]")
    front = _front(x, None, topk_ids, topk_ids.shape[1], (num_local, expert_offset, config.block_m, config.align_chunk))
    return _experts(x, front, topk_weights, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2,
                    limit, expert_offset, num_local, inter, config, out)


# ---------------------------------------------------------------------------------------------
# plain-torch reference
# ---------------------------------------------------------------------------------------------


def _fake_quant(a: torch.Tensor) -> torch.Tensor:
    """a [N, K] through e4m3 1x128 groups and back, fp32 (what the kernel's dots see)."""
    return dequantize_activation_group128(*quantize_activation_group128(a))


def moe_ref(
    x: torch.Tensor,
    router_weight: torch.Tensor | None,
    router_bias: torch.Tensor | None,
    w1: torch.Tensor,
    w1_scale_inv: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    b2: torch.Tensor | None,
    top_k: int = 4,
    limit: float = 7.0,
    expert_offset: int = 0,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
    quantize_activations: bool = True,
    pair_out_bf16: bool = False,
) -> torch.Tensor:
    """`fused_moe_fp8` in plain torch: routing by `route` (or `routing` = (weights, ids) given),
    weights dequantised per block, x and h quantised per 1x128 group (`quantize_activations`),
    fp32 GEMMs, bias, `swiglu_oai` in fp32, fp32 combine (of each pair's output rounded to bf16 first
    with `pair_out_bf16`, as MoeConfig.pair_out_bf16), one rounding to x's dtype. One expert
    at a time (dequantised weights of all experts at full size would not fit)."""
    if routing is None:
        routing = route(x, router_weight, router_bias, top_k)
    topk_weights, topk_ids = routing
    num_tokens, top_k = topk_ids.shape
    num_local = w1.shape[0]
    xf = _fake_quant(x.float()) if quantize_activations else x.float()
    local_ids = topk_ids.reshape(-1).long() - expert_offset
    pair_out = torch.zeros(num_tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    on_this_rank = (local_ids >= 0) & (local_ids < num_local)
    for expert in torch.unique(local_ids[on_this_rank]).tolist():
        pairs = torch.nonzero(local_ids == expert).flatten()
        h = xf[pairs // top_k] @ dequantize_weight_block128(w1[expert], w1_scale_inv[expert]).t()
        if b1 is not None:
            h = h + b1[expert].float()
        h = swiglu_oai(h, limit)
        if quantize_activations:
            h = _fake_quant(h)
        y = h @ dequantize_weight_block128(w2[expert], w2_scale_inv[expert]).t()
        if b2 is not None:
            y = y + b2[expert].float()
        pair_out[pairs] = y.to(torch.bfloat16).float() if pair_out_bf16 else y
    weights = topk_weights.reshape(-1).float() * on_this_rank
    return (pair_out * weights[:, None]).view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
