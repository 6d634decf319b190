"""Launch configurations of the fused MoE, every size regime: `MoeConfig`, the H200 table by token
count (`select_config`), the GEMV sweep's variants (`decode_gemv_variants`) and the config checks.

Invariant: nothing is tuned at run time. A token count (with the router's expert count and top-k)
picks one row of the table, so a batch size always runs the same kernels and compiles once. The
table was chosen from ptxas resource counts (registers, shared memory, no spills) and bandwidth
arithmetic, then corrected by the H200 sweep of benchmarks/bench_moe.py
(benchmarks/results/sweeps/moe.md; see the table's comments).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sglang_ext.kernels.reference import BLOCK as QUANT_GROUP


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
    # Decode for a few tokens (`oneshot.py`): no sort, no K loop, no split-K. mlp1
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
    # 1 token: the one-shot kernels (oneshot.py), no sort, mlp2 per pair, its combine by the last arriver
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
