"""FP8 block-128 launch configurations, every size regime: `gemm_config` by M bucket (decode GEMV, mid-row and
prefill tiles), `gemv_config` / `split_k_gemv_config` / `oneshot_config` for decode, `gemv_splits` (the splits
the decode launcher runs), and the variants the benchmark sweeps and the GPU test compare.

Invariant: no autotune and no tensor reads: one fixed kernel per shape from (M, N, K, SM count), so the
interpreter stays fast and a CUDA graph sees one configuration; the picks follow the H200 sweeps cited."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import triton

from sglang_ext.kernels._util import H200_SMS, num_sms

from .quantize import GROUP


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    fuse_quant: bool = False  # fp8_linear: quantise x inside the GEMM's K loop (one launch)
    inline_reduce: bool = True  # split-K: last split sums the partials (else a second kernel)
    # `_fp8_gemm_tma_kernel`: A and W tiles by TMA. Applies to pre-quantised A without split-K where
    # both operands suit the copy engine (kernels/tma.py); elsewhere the pointer kernel runs.
    tma: bool = False

    def short(self) -> str:
        split = f"s{self.split_k}" + ("" if self.split_k == 1 or self.inline_reduce else "k")
        return (f"m{self.block_m}n{self.block_n}{split}w{self.num_warps}st{self.num_stages}"
                + ("fq" if self.fuse_quant else "") + ("tma" if self.tma else ""))


@dataclass(frozen=True)
class Fp8GemvConfig:
    """The decode path (M <= 16 rows per launch): BLOCK_N weight rows per program, K split into
    `split_k` ranges (0: `_auto_split_gemv`), FMA or tensor-core blocks; `_fp8_gemv_kernel`, or
    `_fp8_gemv_kernel_xonce` with `x_once` (its tensor-core K loop keeps num_stages - 1 weight
    blocks in flight: num_stages > K blocks per program puts the whole slab in flight at once)."""
    block_n: int = 64
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True
    inline_reduce: bool = True  # split-K: last split sums the partials (else a second kernel)
    hw_round: bool = True  # x's e4m3 rounding by the cast (bit-equal; the grid rounding when False)
    # `_fp8_gemv_kernel_xonce`: x, its quantisation and the scales once per program for all its K
    # blocks (a power of two of them; split_k is rounded to fit), then only the weight streams
    x_once: bool = False
    # x_once with tensor cores: no K loop, one load and a dot batched over the blocks (mma.sync),
    # at most `XONCE_MAX_SLAB` weight bytes per thread (as FMA x_once)
    batched_dot: bool = False
    # the last arriver loads many splits' partials per load (`_gemv_epilogue`), not one per split
    vector_reduce: bool = False
    # `_fp8_gemv_oneshot_kernel` (M <= 4 per launch): BLOCK_N (<= 128) rows and all of K per
    # program, no split, FMA blocks; only block_n, num_warps and hw_round apply (`oneshot_config`)
    oneshot: bool = False

    def short(self) -> str:
        if self.oneshot:
            return f"gvosn{self.block_n}w{self.num_warps}" + ("" if self.hw_round else "gr")
        split = f"s{self.split_k}" + ("" if self.split_k <= 1 or self.inline_reduce else "k")
        return (f"gv{'dot' if self.use_dot else 'fma'}n{self.block_n}{split}w{self.num_warps}"
                + ("xob" if self.x_once and self.use_dot and self.batched_dot else "xo" if self.x_once else "")
                + ("" if self.x_once and (self.batched_dot or not self.use_dot) else f"st{self.num_stages}")
                + ("" if self.hw_round else "gr") + ("vr" if self.vector_reduce else ""))


def _auto_split(m: int, k: int, tiles: int, sms: int, min_blocks_per_split: int = 4) -> int:
    """Split K only while the output tiles alone leave SMs idle: aim at ~4 programs per SM,
    keeping >= `min_blocks_per_split` K blocks per program so the pipeline has work to overlap,
    and the fp32 partials (written and read back: 8 M N bytes per split) under a quarter of the
    weight bytes (N K), i.e. split <= K / (32 M)."""
    if tiles >= sms:
        return 1
    want = triton.cdiv(4 * sms, tiles)
    return int(max(1, min(want, triton.cdiv(k, GROUP) // min_blocks_per_split, k // (32 * m))))


def _auto_split_gemv(m: int, n: int, k: int, block_n: int, sms: int, programs_per_sm: int = 4) -> int:
    """K splits for the decode kernel: enough (N tile, split) programs for `programs_per_sm` per
    SM (memory-level parallelism: each keeps a weight slab in flight), but fp32 partials (8 M N
    bytes per split, most of it L2 traffic) under ~1/4 of the weight bytes: split <= K / (32 M)."""
    tiles = triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, GROUP)
    want = triton.cdiv(programs_per_sm * sms, tiles)
    split = int(max(1, min(want, k_blocks, k // (32 * m))))
    return triton.cdiv(k_blocks, triton.cdiv(k_blocks, split))  # no empty trailing split


# The one-shot kernel's measured range (benchmarks/results/diag_floor.md, M = 1): N up to 23040,
# K up to 32 blocks (a slab of <= 32 blocks per program: two loads of <= 16 KB at 4 rows).
ONESHOT_MAX_ROWS = 4
ONESHOT_MAX_N = 23040
ONESHOT_MAX_K_BLOCKS = 32
# x quantised in-kernel, every one-shot program redoes all of x: N K / BLOCK_N divisions per row.
# It beat the split-K kernel up to o's 11.8 MB (n8 w8: 6.5 vs 8.2 us) and tied at qkv's 14.7 MB.
ONESHOT_QUANT_MAX_WEIGHT_BYTES = 12_500_000


def oneshot_applies(m: int, n: int, k: int) -> bool:
    return m <= ONESHOT_MAX_ROWS and n <= ONESHOT_MAX_N and triton.cdiv(k, GROUP) <= ONESHOT_MAX_K_BLOCKS


def gemv_config(m: int, n: int, k: int, device: torch.device | str | None = None,
                x_prequantized: bool = False) -> Fp8GemvConfig:
    """Decode (M <= 16). M = 1 takes the one-shot kernel (no split-K; H200,
    benchmarks/results/diag_floor.md) where it measured faster: with x pre-quantised
    (`x_prequantized`: the launcher got `x_quant`, or `fp8_gemm`), 2-row tiles with 2 warps up to
    24 K blocks (qkv 7.0 us vs 9.3; N 256..23040 at K 2880 within 5 % of the best tile) and 4
    warps at 32 (o 5.8 vs 8.2); with x quantised in every program, 8-row tiles / 8 warps up to
    `ONESHOT_QUANT_MAX_WEIGHT_BYTES` (o 6.5 vs 8.2, N 2048 x 2880 5.7 vs 6.8; at qkv 9.3 = no
    gain, so it keeps x_once). Otherwise `split_k_gemv_config`. M = 2..4 stay there: the H200 sweep
    (`bench_fp8_gemm.py --decode-sweep oneshot`, benchmarks/results/sweeps/fp8_gemm_decode_oneshot.md)
    found every one-shot tile slower there (qkv M = 2: best 11.5 us vs x_once's 9.2, pre-quantised;
    its M = 1 picks held: qkv 7.29 vs 9.47 us, o 6.89 vs 8.11)."""
    kb = triton.cdiv(k, GROUP)
    if m == 1 and oneshot_applies(m, n, k):
        if x_prequantized:
            return oneshot_config(2, 2 if kb <= 24 else 4)
        if n * k <= ONESHOT_QUANT_MAX_WEIGHT_BYTES:
            return oneshot_config(8, 8)
    return split_k_gemv_config(m, n, k, device)


# 5..8 rows: from this many K blocks (gpt-oss o: 4096 = 32 blocks) the x_once kernel with 4 K blocks a program
# (64-wide, 4 warps, 5 stages) instead of the 8-warp 128-wide row tuned at 16 rows. Why: the first sweep at 8 rows
# (benchmarks/results/diag_gemv_row_b8.md): o alone from bf16 x (as the step calls it) 11.46 -> 10.56 us;
# in the whole decode step at 8k, paired CUDA graphs, 20b -18.3 us (IQR -23.5..-14.3), 120b -28.3 (-32.6..-24.1).
# qkv (23 blocks) kept its row: 10.81 us pre-quantised against 12.90 for the x_once tile of 4 K blocks a program
# (with the vector split sum), +103.8 / +186.4 us in the step. Measured at 8 rows only, on gpt-oss o's N (45
# 64-wide tiles); where N alone fills the SMs (the lm_head) the split-K row keeps its auto split.
X_ONCE_MIN_K_BLOCKS_AT_8_ROWS = 32


def split_k_gemv_config(m: int, n: int, k: int, device: torch.device | str | None = None) -> Fp8GemvConfig:
    """The split-K decode kernels' pick: tensor-core blocks with W as the 64-row MMA side; their weight slabs
    stream through cp.async stages (num_stages - 1 in flight, no registers held), where the FMA
    variant holds its slab in registers (fp32 converts: ~120 registers at BLOCK_N 64) and gets
    ~4 programs, ~32 KB, in flight per SM: about what HBM's latency needs, no margin. 128-wide
    tiles at M > 4 halve the x quantisation redone per N tile (M x K per tile). Picked from the
    H200 sweep (`benchmarks/results/sweeps/fp8_gemm_decode.md`): at M = 16, 8 warps / 3 stages
    beat 4 / 4 by 13-17 % (qkv 12.4 vs 14.2 us, o 10.5 vs 12.7, lm_head 177 vs 217); at M <= 4
    the 64-wide 4-warp blocks are within 1-8 % of the best row. At M <= 4 x is quantised once per
    program (`x_once`, 5 stages: the whole 4-block slab in flight): the fixed-cost sweep
    (`benchmarks/results/sweeps/fp8_gemm_decode_fixed_cost.md`) measured qkv 9.3 / 10.8 us at M =
    1 / 4 (loop kernel 10.9 / 12.1) and o 8.2 / 8.8 us (10.1 / 11.6); the one-load split sum
    (`vector_reduce`) was no faster there (9.4 / 11.3, 8.2 / 9.6). At 5..8 rows with long K (o) the x_once
    kernel too, 4 K blocks a program (X_ONCE_MIN_K_BLOCKS_AT_8_ROWS)."""
    if m <= 4:
        cfg = Fp8GemvConfig(block_n=64, num_warps=4, num_stages=5, use_dot=True, x_once=True)
    elif (m <= 8 and triton.cdiv(k, GROUP) >= X_ONCE_MIN_K_BLOCKS_AT_8_ROWS
          and triton.cdiv(n, 64) < num_sms(device)):
        # 5..8 rows, long K (gpt-oss o): x_once, 4 K blocks a program (see the constant)
        return Fp8GemvConfig(block_n=64, split_k=triton.cdiv(triton.cdiv(k, GROUP), 4), num_warps=4, num_stages=5,
                             use_dot=True, x_once=True)
    else:
        cfg = Fp8GemvConfig(block_n=128, num_warps=8, num_stages=3, use_dot=True)
    return replace(cfg, split_k=_auto_split_gemv(min(m, 16), n, k, cfg.block_n, num_sms(device)))


def oneshot_config(block_n: int, num_warps: int) -> Fp8GemvConfig:
    """The one-shot decode kernel's config (the fields it does not use at their neutral values)."""
    return Fp8GemvConfig(block_n=block_n, split_k=1, num_warps=num_warps, use_dot=False, oneshot=True)


def dot_tile_decode_config(m: int, n: int, k: int, device: torch.device | str | None = None) -> Fp8GemmConfig:
    """What M <= 16 ran before the decode kernel (16-row tl.dot tiles, x quantised in the K loop),
    kept for comparison in the benchmark sweep and the GPU test."""
    cfg = Fp8GemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=4, fuse_quant=True)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return replace(cfg, split_k=_auto_split(m, k, tiles, num_sms(device)))


# (BLOCK_N, warps) of the one-shot rows in the decode sweep, by rows per launch (1, 2, 4). M = 1:
# the prototype's best few for qkv / o / N 256..23040 (pre-quantised 2x2, 2x4, 4x4, 8x8; x
# quantised in-kernel 8x8, 4x8, 8x4) and a 16-row tile. M = 2, 4: each thread holds its share
# of the slab in fp32 for all rows, so ptxas (sm_90, Triton 3.8) spills at >= 48 weight bytes
# per thread at M = 2 (8x4, 16x8, 4x4 pre-quantised): more warps and narrower tiles.
ONESHOT_SWEEP = {
    1: ((2, 2), (2, 4), (4, 4), (4, 8), (8, 4), (8, 8), (16, 8)),
    2: ((1, 4), (2, 4), (2, 8), (4, 4), (4, 8), (8, 8), (8, 16)),
    4: ((1, 4), (2, 4), (2, 8), (4, 4), (4, 8), (8, 8), (8, 16)),
}


def oneshot_variants(m: int, n: int, k: int) -> list[Fp8GemvConfig]:
    """The one-shot configs the decode sweep times (none outside `oneshot_applies`)."""
    if not oneshot_applies(m, n, k):
        return []
    return [oneshot_config(bn, w) for bn, w in ONESHOT_SWEEP[triton.next_power_of_2(m)]]


def fixed_cost_variants(m: int, n: int, k: int, device: torch.device | str | None = None) -> list[Fp8GemvConfig]:
    """Decode-kernel variants aimed at the GEMV's fixed cost (~6 us per call at M = 1, whatever
    the bytes: benchmarks/results/diag_decode_b1.md), for the benchmark sweep and the GPU test;
    splits resolved (`gemv_splits`), so each short name says what runs. x_once tensor-core
    programs get num_stages = K blocks + 1: the whole slab in flight from the start. At M <= 4
    (not the lm_head) also the one-shot kernel's `oneshot_variants`."""
    kb = triton.cdiv(k, GROUP)
    sms = num_sms(device)
    G = Fp8GemvConfig

    def xo(block_n, per, **kw):  # x_once with `per` K blocks per program (split = K blocks / per)
        per = min(per, max(1, 64 // triton.next_power_of_2(min(m, GEMV_MAX_ROWS))))  # gemv_splits' cap
        kw.setdefault("num_stages", min(per, 8) + 1)
        return G(block_n, triton.cdiv(kb, per), x_once=True, **kw)

    base = gemv_config(m, n, k, device)
    split_base = split_k_gemv_config(m, n, k, device)  # base itself but where the one-shot kernel applies
    if n > 100_000:  # lm_head: thousands of N tiles, split-K is moot: does x_once still stream?
        cands = [xo(64, 4, vector_reduce=True)]
        if m <= 4:
            cands.append(xo(32, 4, use_dot=False, vector_reduce=True))
        if m == 1:
            cands.append(xo(64, 1 << (kb - 1).bit_length(), num_stages=6))
    else:
        all_k = 1 << (kb - 1).bit_length()  # every K block in one program: no split
        cands = [
            split_base, replace(split_base, vector_reduce=True),  # the split-K tail alone
            xo(64, 4), xo(64, 4, vector_reduce=True), xo(64, 1, vector_reduce=True),
            xo(64, 2, vector_reduce=True), xo(64, 8, vector_reduce=True),
            xo(128, 4, num_warps=8, vector_reduce=True),
            xo(64, 4, batched_dot=True, vector_reduce=True),
            G(16, 1, num_stages=8),  # the loop kernel without split-K, for comparison
        ]
        if m <= 4:  # past 4 rows the FMA slab spills (M = 16: 2 KB of stack, 25 s to compile)
            cands.append(xo(32, 4, use_dot=False, vector_reduce=True))
        if m == 1:  # at M = 4 these hold 4 x tiles of K or 4 FMAs per byte: 230-255 registers
            cands += [
                # no split-K at all: no partials, no counters, no tail; narrow tiles for enough programs
                xo(16, all_k, num_stages=8), xo(32, all_k, num_stages=6),
                xo(64, 4, num_warps=8, use_dot=False, vector_reduce=True), xo(16, 8, use_dot=False, vector_reduce=True)]
        cands += oneshot_variants(m, n, k)  # no split at all: the whole K per program, M <= 4
    out = []
    for c in [base] + cands:
        split = gemv_splits(c, min(m, GEMV_MAX_ROWS), n, k, sms)[0]
        c = replace(c, split_k=split)
        if split == 1:  # nothing to reduce: the reduction style is moot
            c = replace(c, inline_reduce=True, vector_reduce=False)
        if c not in out:
            out.append(c)
    return out


# 17..64 rows: the wide TMA tile from this many 128-row N tiles (gpt-oss qkv 40, lm_head 1571; o 23 keeps split-K)
WIDE_TILE_MIN_PROGRAMS = 32


def gemm_config(m: int, n: int, k: int, device: torch.device | str | None = None,
                x_prequantized: bool = False) -> Fp8GemmConfig | Fp8GemvConfig:
    """Launch parameters by M bucket (no autotune: one fixed kernel per shape, fast interpreter).

    M <= 16 (decode): the weight bytes are everything: `gemv_config`, the decode kernel with x
    quantised inside (one launch), split-K where N alone gives too few programs.
    M <= 64: where N gives at least WIDE_TILE_MIN_PROGRAMS tiles of 128 rows, the 64 x 128 TMA tile
    with no split (each weight byte read once, streamed by the copy engine; H200, x pre-quantised,
    benchmarks/results/sweeps/fp8_gemm_rows17_256.md: qkv M = 32 / 64 13.7 -> 11.9 / 16.3 -> 12.1 us,
    DeepGEMM 13.4 / 11.6 in the same run); else (o's 23 tiles) 32-row tiles, split-K by the same rule
    (o M = 32: 11.3 us against 14.2 on the wide tile). The wide tile runs on wgmma, as the decode GEMV's
    tensor-core blocks (2..16 rows) and every tile from 65 rows already did: 93.4-93.7 % of its bf16 outputs
    are the correctly rounded float64 result against 99.99 % on mma.sync tiles, which adds ~0.3 % to the
    output's own rounding error (1.662e-3 vs 1.657e-3; benchmarks/results/diag_gemm_rounding.md).
    M <= 256: 64 x 128 tiles, 4 warps. M <= 1024: the same tile by TMA in 3 stages of 24 KB, so
    three programs share an SM and the few tiles of a short prefill fill the SMs in fewer waves
    (H200, device time in CUDA graphs, benchmarks/results/diag_dense_cfg.md: qkv M = 512 / 1024 30.5
    -> 21.1 / 44.8 -> 40.8 us, o 21.0 -> 18.7 / 40.3 -> 30.3 us; from M = 2048 the 128-row tile is
    1.00-1.09x faster). Larger: 128 x 128 tiles, 8 warps (two Hopper warpgroups),
    4 stages of 32 KB in shared memory, grouped ordering for L2 reuse of the weight tiles, operand
    tiles by TMA (H200, M = 8192: qkv 470 -> 361 us, o 395 -> 295 us, cuBLAS block-scaled 381 /
    306 us; M = 2048: 153 -> 135, 137 -> 135; benchmarks/results/diag_tma.md). The smaller tiles
    load by TMA too where they run without split-K (weights streamed from HBM, H200: qkv M = 64 /
    128 / 256 19.1 -> 15.9, 19.2 -> 12.3, 20.4 -> 14.8 us; o M = 128 / 256 15.5 -> 14.3, 15.4 -> 14.3;
    diag_tma_dense_decode.md); with split-K they keep pointer loads.
    Starting points for an H200; `benchmarks/bench_fp8_gemm.py --sweep` measures alternatives.
    `x_prequantized`: x arrives as e4m3 codes + scales (`fp8_gemm`, `fp8_linear(x_quant=...)`),
    which only the decode pick depends on."""
    sms = num_sms(device)
    if m <= 16:
        return gemv_config(m, n, k, device, x_prequantized)
    if m <= 64 and triton.cdiv(n, 128) >= WIDE_TILE_MIN_PROGRAMS:
        return Fp8GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=4, tma=True)
    if m <= 64:
        cfg = Fp8GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=4)
    elif m <= 256:
        cfg = Fp8GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=4)
    elif m <= 1024:
        return Fp8GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, tma=True)
    else:
        return Fp8GemmConfig(block_m=128, block_n=128, num_warps=8, num_stages=4, tma=True)
    tiles = max(1, triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n))
    split = _auto_split(m, k, tiles, sms)
    return replace(cfg, split_k=split, tma=split == 1)


GEMV_MAX_ROWS = 16
# x_once programs without a K loop (FMA, batched dot) hold their weight slab in registers: at
# most this many bytes per thread, 64 registers of packed e4m3.
XONCE_MAX_SLAB = 256


def gemv_splits(cfg: Fp8GemvConfig, rows: int, n: int, k: int, sms: int = H200_SMS) -> tuple[int, int]:
    """(splits, K blocks per split) the decode launcher runs for `cfg`: the auto or given split,
    no empty trailing split; x_once programs take a power-of-two number of K blocks, at most
    64 / rows of them, and at most `XONCE_MAX_SLAB` weight bytes per thread where the slab is
    one load (FMA, batched dot)."""
    k_blocks = triton.cdiv(k, GROUP)
    if cfg.oneshot:
        return 1, k_blocks
    split = cfg.split_k or _auto_split_gemv(rows, n, k, cfg.block_n, sms)
    per_split = triton.cdiv(k_blocks, max(1, min(split, k_blocks)))
    if cfg.x_once:
        # the x tile [rows, K blocks, 128] stays <= 64 groups (64 registers a thread at 4 warps;
        # 128 spilled at M = 4) and the MMA's x columns (K blocks x rows) <= 64
        per_split = min(triton.next_power_of_2(per_split), max(1, 64 // triton.next_power_of_2(rows)))
        if cfg.batched_dot or not cfg.use_dot:
            cap = max(1, XONCE_MAX_SLAB * 32 * cfg.num_warps // (cfg.block_n * GROUP))
            per_split = min(per_split, 1 << (cap.bit_length() - 1))
    return triton.cdiv(k_blocks, per_split), per_split
