"""One-shot decode MoE for a few tokens (the table's 1..4-token rows): the experts' part of the
gpt-oss FP8 MoE as three launches with no sort, no K loop and no split-K, beside the GEMV path
(gemv.py) of 5..8 tokens.

Why: at batch 1 on an H200 the shipped decode path (`MoeConfig.gemv`, split-K + last-arriver
reduction) runs 120b's mlp1 in 27.7 us over 66 MB of weights (4 experts; a streaming read takes
16.7 us) and mlp2 in 14.4 us over 33 MB (9.2 us). A dense GEMV prototype whose programs each own
a few rows and ALL of K, issuing the whole weight slab in two loads after the (pre-quantised)
activation, read 66 MB in 20 us where the split-K kernel took 26.5 (benchmarks/diag_floor.py,
`_gemv_oneshot_kernel`). Quantising the activation inside every program erased the gain, so here
every activation reaches the GEMVs already in e4m3 (x from the decode front, h from step 2).

Operands as `fused_moe_fp8`: W1 [E, 2I, H] e4m3 with gate/linear rows interleaved (2c gate, 2c+1
linear of column c), W2 [E, H, I], fp32 `scale_inv` per 128x128 block (ragged last block), bf16
biases; x's e4m3 1x128 groups from the decode front (`decode_front` / `route_and_quantize`).
P = T * top_k (token, slot) pairs, pair p = t * top_k + j:

  1. `_mlp1_oneshot_kernel`, grid (P, cdiv(I, mlp1_block_n)): program (p, n) loads its token's x
     codes and scales, the W1 scale vector of its 128-row block (and b1) first, then its
     2 * mlp1_block_n contiguous W1 rows over all of K in two power-of-two chunks of K blocks
     (`pow2_chunks`: 23 -> 16 + 8, masked past H); per 128-block fp32 FMA sums (e4m3 products are
     exact in fp32), each times x_scale * w_scale, summed over the blocks; + b1; the gpt-oss
     activation exactly as `_mlp1_kernel`'s epilogue; h fp32 [P, I].
  2. `_quantize_h_kernel`, grid (P, cdiv(I, 128)): h's 1x128 groups to e4m3 codes + fp32 scales
     by common.py's `_quantize_e4m3` (the helper every existing path's mlp1 epilogue uses; equal
     bit for bit to `quantize_activation_group128`, which `moe_ref` uses). Or, with
     `OneshotConfig.quant_in_mlp2`, mlp2's programs quantise the fp32 h as they load it (same
     helper, same groups: the same bits), one launch fewer for more arithmetic per program.
  3. `_mlp2_combine_oneshot_kernel`, grid (T, cdiv(H, mlp2_block_n)): program (t, n) loads, for
     all top_k pairs of token t at once (a pair axis in every tile), h codes / scales, the W2
     scale vectors and b2, then the top_k W2 slabs [mlp2_block_n rows, all of I]; y_j per pair as
     in step 1 (+ b2), then out[t] = sum_j w_j * y_j over the slots in slot order, in fp32, one
     rounding to out's dtype: `_combine_kernel`'s maths (weights loaded in their dtype and
     widened to fp32, foreign pairs' y = 0, the same `acc += w * y` expression, so the same FMA
     contraction where the compiler contracts), so `out` is what `_combine_kernel` makes of the
     same per-pair outputs (`pair_out` exposes them for that check).
     Or, with `OneshotConfig.mlp2_per_pair` (the table's choice),
     `_mlp2_pair_oneshot_kernel`, grid (P, cdiv(H, mlp2_block_n)): program (p, n) holds one pair's
     W2 rows and that pair's h row only (mlp1's shape of work: h costs I bytes a program, not
     top_k x I), stores y_p, and the last of the token's top_k programs for the tile to reach an
     arrival counter combines the stored y in slot order as above (same bits whatever the arrival
     order) and resets the counter.

Expert parallelism as `fused_moe_fp8`: the weights hold experts expert_offset .. +E_local-1;
pairs routed elsewhere are skipped by mlp1 and the h quantisation and contribute y = 0 to the
combine (a token with no local pair gets zeros); `b2=None` leaves mlp2's bias to the caller.

Numerics vs the existing paths: x's and h's quantisation and the combine are the same
operations; the GEMV sums are the same exact e4m3 products summed in another fp32 order (per
128-block sums, scaled, summed over blocks in one pass; split-K sums per split first), so h can
differ from the split-K path's in its last bits and, rarely, round to the neighbouring e4m3 value
(tests/kernels/test_kernel_moe_decode.py reports the measured differences). No atomic adds of values
(the per-pair mlp2's counters only pick who combines): results are bit-reproducible run to run.
CUDA-graph capturable (no host syncs). Every kernel here is a programmatic dependent launch at
T <= 4 (kernels/pdl.py).

Launch configs: `OneshotConfig`; `oneshot_variants()` lists what the H200 sweep
(benchmarks/bench_moe_decode.py, results benchmarks/results/bench_moe_decode.md) times against the
shipped table. `fused_moe_fp8` runs this path where its table says `MoeConfig.oneshot` (1..4
tokens on the H200: 47.1 -> 40.0 us a 120b layer at T = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import triton
import triton.language as tl

from sglang_ext.kernels.arrival_counters import arrival_counters
from sglang_ext.kernels.pdl import pdl_launch_kwargs, pdl_wait_then_release
from sglang_ext.kernels.reference import BLOCK as QUANT_GROUP, SWIGLU_ALPHA

from .common import (FP8, _check_routing, _check_weights, _check_x, _gpt_oss_activation, _out_buffer, _quantize_e4m3,
                     _round_to_bf16)
from .reference import moe_ref
from .routing import _uses_decode_front, decode_front, route_and_quantize

__all__ = ["OneshotConfig", "DEFAULT_ONESHOT", "oneshot_variants", "fused_moe_decode_oneshot",
           "fused_moe_fp8_oneshot", "quantize_h", "launch_mlp1", "launch_mlp2_combine", "moe_ref"]

# Weight bytes a program holds in registers per thread (its whole slab is in flight at once): the
# prototype's bound (benchmarks/diag_floor.py skipped variants above 512).
ONESHOT_MAX_SLAB_BYTES = 512


# ---------------------------------------------------------------------------------------------
# launch configs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OneshotConfig:
    """mlp1: `mlp1_block_n` intermediate columns per program (2x as many contiguous W1 rows, all
    of K); mlp2: `mlp2_block_n` W2 rows (output columns) per program, for all top_k pairs of one
    token; `quant_in_mlp2`: h quantised inside mlp2 (no step-2 launch)."""

    mlp1_block_n: int = 4
    mlp1_warps: int = 4
    mlp2_block_n: int = 2
    mlp2_warps: int = 4
    quant_in_mlp2: bool = False
    mlp2_per_pair: bool = False  # mlp2 program (pair, rows) + last-arriver combine (`_mlp2_pair_oneshot_kernel`)

    def short(self) -> str:
        return (f"oneshot mlp1 n{self.mlp1_block_n}/w{self.mlp1_warps} mlp2 n{self.mlp2_block_n}/w{self.mlp2_warps}"
                + (" hq-in-mlp2" if self.quant_in_mlp2 else "") + (" per-pair" if self.mlp2_per_pair else ""))

    def slab_bytes_per_thread(self, hidden: int, inter: int, top_k: int = 4) -> tuple[int, int]:
        """(mlp1, mlp2) weight bytes in flight per thread: rows x padded K blocks x 128 / threads."""
        c1 = sum(pow2_chunks(triton.cdiv(hidden, QUANT_GROUP)))
        c2 = sum(pow2_chunks(triton.cdiv(inter, QUANT_GROUP)))
        pairs = 1 if self.mlp2_per_pair else triton.next_power_of_2(top_k)
        return (2 * self.mlp1_block_n * c1 * QUANT_GROUP // (32 * self.mlp1_warps),
                pairs * self.mlp2_block_n * c2 * QUANT_GROUP // (32 * self.mlp2_warps))


# Untuned: 8 W1 rows (24 KB, 2880 programs at batch 1) and 4 pairs x 2 W2 rows (24 KB, 1440
# programs a token), 4 warps, 192 bytes of weight per thread: the size of the prototype's fast
# 66 MB GEMV programs (8 rows, 4 warps). The H200 sweep decides.
DEFAULT_ONESHOT = OneshotConfig()


# ptxas (sm_90a, Triton 3.8 on a CPU box, H = I = 2880, no spills unless said): mlp1 (block_n,
# warps) -> registers: (2, 2) 80, (4, 2) 106, (4, 4) 56, (8, 4) 80, (8, 8) 96, (16, 8) 202; all W1
# loads 16-byte vectors. mlp2 from e4m3 h: (1, 2) 76, (2, 2) 102, (2, 4) 96, (4, 4) 106, (4, 8) 126,
# (8, 8) 178. mlp2 quantising h itself holds 4 pairs' fp32 h (48 KB) beside the slabs: (1, 8) 128,
# (2, 8) 155, (4, 8) 166, (8, 8) 255; (1, 4) 240; at 2 warps it spills 0.9-1.2 KB, (2, 4) 8 bytes,
# (4, 4) 216 bytes: not listed. `_quantize_h_kernel`: 27.
ONESHOT_MLP1_TILES = ((2, 2), (4, 4), (4, 2), (8, 4), (8, 8), (16, 8))
ONESHOT_MLP2_TILES = ((1, 2), (2, 4), (2, 2), (4, 8), (4, 4), (8, 8))
ONESHOT_MLP2_QUANT_TILES = ((1, 8), (2, 8), (4, 8))
# per-pair mlp2 (one expert's W2 rows per program, as mlp1's tiles): 96-384 weight bytes a thread
ONESHOT_MLP2_PAIR_TILES = ((4, 2), (8, 4), (8, 2), (16, 4), (16, 8), (4, 4))


def oneshot_variants() -> list[OneshotConfig]:
    """What benchmarks/bench_moe_decode.py times: every mlp1 tile (4..32 W1 rows, 2..8 warps, 192
    or 384 weight bytes per thread at H = I = 2880) with every mlp2 tile (1..8 W2 rows x 4 pairs),
    h quantised by its own launch, then with the mlp2 tiles that quantise h themselves, then with
    the per-pair mlp2 tiles (4..16 rows of one pair's expert)."""
    C = OneshotConfig
    mlp2 = [(n, w, False) for n, w in ONESHOT_MLP2_TILES] + [(n, w, True) for n, w in ONESHOT_MLP2_QUANT_TILES]
    return ([C(n1, w1, n2, w2, q) for n2, w2, q in mlp2 for n1, w1 in ONESHOT_MLP1_TILES]
            + [C(n1, w1, n2, w2, mlp2_per_pair=True) for n2, w2 in ONESHOT_MLP2_PAIR_TILES
               for n1, w1 in ONESHOT_MLP1_TILES])


def pow2_chunks(kb: int) -> tuple[int, int]:
    """K blocks -> (C1, C2): C1 the largest power of two <= kb, C2 a power of two covering the
    rest (0 if none): 23 -> (16, 8), 3 -> (2, 1), 2 -> (2, 0). (benchmarks/diag_floor.py's rule.)"""
    c1 = 1 << (kb.bit_length() - 1)
    rest = kb - c1
    return c1, (0 if rest == 0 else 1 << (rest - 1).bit_length())


def _check_config(config: OneshotConfig, hidden: int, inter: int, top_k: int) -> None:
    for name in ("mlp1_block_n", "mlp1_warps", "mlp2_block_n", "mlp2_warps"):
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"OneshotConfig.{name} must be a power of two, got {value}")
    # a program's rows stay inside one 128-row scale block
    if config.mlp2_per_pair and config.quant_in_mlp2:
        raise ValueError("OneshotConfig: mlp2_per_pair reads h's e4m3 groups; quant_in_mlp2 does not apply")
    if config.mlp1_block_n > 64 or config.mlp2_block_n > 128 or config.mlp1_warps > 16 or config.mlp2_warps > 16:
        raise ValueError("OneshotConfig: mlp1_block_n <= 64 (2x W1 rows), mlp2_block_n <= 128, warps <= 16")
    b1, b2 = config.slab_bytes_per_thread(hidden, inter, top_k)
    if max(b1, b2) > ONESHOT_MAX_SLAB_BYTES:
        raise ValueError(f"OneshotConfig {config.short()}: {b1} / {b2} weight bytes per thread (mlp1 / mlp2) at "
                         f"H={hidden} I={inter}; at most {ONESHOT_MAX_SLAB_BYTES}: fewer rows or more warps")


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _slab_layout(tile, n_dim, k_dim, ROWS: tl.constexpr, C1: tl.constexpr):
    """Program `tile`'s ROWS weight rows (rows_c: clamped below n_dim, so the slab loads need no row mask)
    and the first of K's two power-of-two chunks of 128-blocks (`pow2_chunks`): (rows, rows_c, K blocks in
    all, offs_k, kb1 [C1], k1 [C1, 128]); the second chunk's blocks start at C1."""
    rows = tile * ROWS + tl.arange(0, ROWS)
    rows_c = tl.minimum(rows, n_dim - 1).to(tl.int64)
    num_kb = (k_dim + 127) // 128
    offs_k = tl.arange(0, 128)
    kb1 = tl.arange(0, C1)
    k1 = kb1[:, None] * 128 + offs_k[None, :]
    return rows, rows_c, num_kb, offs_k, kb1, k1


@triton.jit
def _block_sums(w, a, a_scale, w_scale):
    """Weight rows w [R, C, 128] times one activation row's codes a [C, 128] over C K blocks: per 128-block
    fp32 sums of the exact e4m3 products, each times a_scale * w_scale, summed over the blocks -> [R]. One
    definition, so mlp1 and the per-pair mlp2 sum in the same order."""
    d = tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :, :], axis=2)  # [R, C]
    return tl.sum(d * (a_scale * w_scale)[None, :], axis=1)


@triton.jit(do_not_specialize=["expert_offset", "num_local"])
def _mlp1_oneshot_kernel(
    XQ, XS,  # x e4m3 [T, H], group scales fp32 [T, cdiv(H, 128)]
    TOPK_IDS,  # [T * TOP_K] global expert ids
    W1, W1S, B1,  # [E, 2I, H] e4m3 (gate/linear rows interleaved), [E, cdiv(2I, 128), cdiv(H, 128)] fp32, [E, 2I]
    HF,  # out: h fp32 [T * TOP_K, I]
    hidden, inter, expert_offset, num_local, limit, alpha,
    stride_w1_e, stride_w1_n, stride_w1s_e, stride_w1s_n, stride_b1_e,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,  # intermediate columns: 2 * BLOCK_N contiguous W1 rows
    C1: tl.constexpr,  # K blocks of the first load (a power of two)
    C2: tl.constexpr,  # K blocks of the second (a power of two, or 0), masked past H
    HAS_B1: tl.constexpr,
    USE_PDL: tl.constexpr,  # kernels/pdl.py: the expert ids are the previous launch's output: nothing before the wait
):
    pdl_wait_then_release(USE_PDL)
    pair = tl.program_id(0)
    tile = tl.program_id(1)
    expert = tl.load(TOPK_IDS + pair).to(tl.int32) - expert_offset
    if (expert < 0) | (expert >= num_local):  # routed to another rank's expert
        return
    expert = expert.to(tl.int64)
    token = (pair // TOP_K).to(tl.int64)
    ROWS: tl.constexpr = 2 * BLOCK_N
    rows = tile * ROWS + tl.arange(0, ROWS)
    rows_c = tl.minimum(rows, 2 * inter - 1).to(tl.int64)  # in bounds: no row mask on the slab
    num_kb = (hidden + 127) // 128
    offs_k = tl.arange(0, 128)
    kb1 = tl.arange(0, C1)
    k1 = kb1[:, None] * 128 + offs_k[None, :]  # [C1, 128]
    # x, both scale vectors and the bias first: they are in the queue before the slab
    k_ok1 = k1 < hidden
    x1 = tl.load(XQ + token * hidden + k1, mask=k_ok1, other=0.0)
    xs1 = tl.load(XS + token * num_kb + kb1, mask=kb1 < num_kb, other=0.0)
    ws_ptrs = W1S + expert * stride_w1s_e + (tile * ROWS // 128) * stride_w1s_n  # one 128-row block
    ws1 = tl.load(ws_ptrs + kb1, mask=kb1 < num_kb, other=0.0)
    if C2 > 0:
        kb2 = C1 + tl.arange(0, C2)
        k2 = kb2[:, None] * 128 + offs_k[None, :]
        k_ok2 = k2 < hidden
        x2 = tl.load(XQ + token * hidden + k2, mask=k_ok2, other=0.0)
        xs2 = tl.load(XS + token * num_kb + kb2, mask=kb2 < num_kb, other=0.0)
        ws2 = tl.load(ws_ptrs + kb2, mask=kb2 < num_kb, other=0.0)
    if HAS_B1:
        bias = tl.load(B1 + expert * stride_b1_e + rows_c).to(tl.float32)
    # the whole slab, two loads
    w_rows = W1 + expert * stride_w1_e + rows_c * stride_w1_n
    w1 = tl.load(w_rows[:, None, None] + k1[None, :, :], mask=k_ok1[None, :, :], other=0.0)
    if C2 > 0:
        w2 = tl.load(w_rows[:, None, None] + k2[None, :, :], mask=k_ok2[None, :, :], other=0.0)
    acc = _block_sums(w1, x1, xs1, ws1)
    if C2 > 0:
        acc += _block_sums(w2, x2, xs2, ws2)
    if HAS_B1:
        acc += bias
    # rows 2c, 2c+1 -> column c: gate, linear; `_mlp1_kernel`'s epilogue
    acc_g, acc_l = tl.split(tl.reshape(acc, [BLOCK_N, 2]))
    h = _gpt_oss_activation(acc_g, acc_l, limit, alpha)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(HF + pair.to(tl.int64) * inter + cols, h, mask=cols < inter)


@triton.jit(do_not_specialize=["expert_offset", "num_local"])
def _quantize_h_kernel(HF, HQ, HS, TOPK_IDS, inter, expert_offset, num_local, USE_PDL: tl.constexpr):
    """Program (pair, group): one 1x128 group of h to e4m3 + its scale (`_quantize_e4m3`)."""
    pdl_wait_then_release(USE_PDL)
    pair = tl.program_id(0)
    g = tl.program_id(1)
    expert = tl.load(TOPK_IDS + pair).to(tl.int32) - expert_offset
    if (expert < 0) | (expert >= num_local):
        return
    cols = g * 128 + tl.arange(0, 128)
    ok = (cols < inter)[None, :]
    offs = pair.to(tl.int64) * inter + cols[None, :]
    q, scale = _quantize_e4m3(tl.load(HF + offs, mask=ok, other=0.0), 1)  # [1, 128], [1]
    tl.store(HQ + offs, q, mask=ok)
    tl.store(HS + pair.to(tl.int64) * ((inter + 127) // 128) + g + tl.arange(0, 1), scale)


@triton.jit
def _mlp2_h_side(HQ, HS, HF, h_ptrs, hs_ptrs, k1, kb1, h_ok1, s_ok1, k2, kb2, h_ok2, s_ok2,
                 C2: tl.constexpr, QUANT_H: tl.constexpr):
    """Every pair's h over the K blocks of both loads: (codes, scales) x 2, or (fp32 h, unused) x 2
    with QUANT_H; C2 == 0: the second pair repeats the first (never used)."""
    if QUANT_H:
        ha1 = tl.load(HF + h_ptrs + k1[None, :, :], mask=h_ok1, other=0.0)
        hb1 = tl.zeros_like(s_ok1.to(tl.float32))
    else:
        ha1 = tl.load(HQ + h_ptrs + k1[None, :, :], mask=h_ok1, other=0.0)
        hb1 = tl.load(hs_ptrs + kb1[None, :], mask=s_ok1, other=0.0)
    ha2, hb2 = ha1, hb1
    if C2 > 0:
        if QUANT_H:
            ha2 = tl.load(HF + h_ptrs + k2[None, :, :], mask=h_ok2, other=0.0)
        else:
            ha2 = tl.load(HQ + h_ptrs + k2[None, :, :], mask=h_ok2, other=0.0)
            hb2 = tl.load(hs_ptrs + kb2[None, :], mask=s_ok2, other=0.0)
    return ha1, hb1, ha2, hb2


@triton.jit(do_not_specialize=["expert_offset", "num_local"])
def _mlp2_combine_oneshot_kernel(
    HQ, HS,  # h e4m3 [P, I] and scales [P, cdiv(I, 128)] (not QUANT_H)
    HF,  # h fp32 [P, I] (QUANT_H)
    TOPK_W, TOPK_IDS,  # [T * TOP_K]: weights (any float dtype), global expert ids
    W2, W2S, B2,  # [E, H, I] e4m3, [E, cdiv(H, 128), cdiv(I, 128)] fp32, [E, H]
    OUT,  # [T, H] (row stride stride_out)
    PAIR_Y,  # STORE_Y: fp32 [P, H], y per local pair (b2 included)
    hidden, inter, expert_offset, num_local, stride_out,
    stride_w2_e, stride_w2_n, stride_w2s_e, stride_w2s_n, stride_b2_e,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,  # next_pow2(TOP_K): the pair axis of every tile
    BLOCK_N: tl.constexpr,  # W2 rows (output columns)
    C1: tl.constexpr,
    C2: tl.constexpr,
    HAS_B2: tl.constexpr,
    QUANT_H: tl.constexpr,  # h arrives fp32 and is quantised here (else e4m3 + scales)
    STORE_Y: tl.constexpr,
    USE_PDL: tl.constexpr,  # kernels/pdl.py: ids (two launches back) and the slab before the wait, h after
):
    token = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    offs_p = tl.arange(0, K_PAD)
    p_ok = offs_p < TOP_K
    pairs = token * TOP_K + offs_p
    ids = tl.load(TOPK_IDS + pairs, mask=p_ok, other=0).to(tl.int32) - expert_offset
    local = p_ok & (ids >= 0) & (ids < num_local)
    expert = tl.where(local, ids, 0).to(tl.int64)
    weight = tl.load(TOPK_W + pairs, mask=p_ok, other=0.0).to(tl.float32)
    rows, rows_c, num_kb, offs_k, kb1, k1 = _slab_layout(tile, hidden, inter, BLOCK_N, C1)
    h_ok1 = local[:, None, None] & (k1 < inter)[None, :, :]  # [K_PAD, C1, 128]
    s_ok1 = local[:, None] & (kb1 < num_kb)[None, :]  # [K_PAD, C1]
    h_ptrs = pairs[:, None, None] * inter
    hs_ptrs = HS + pairs[:, None] * num_kb
    ws_ptrs = W2S + expert[:, None] * stride_w2s_e + (tile * BLOCK_N // 128) * stride_w2s_n  # one 128-row block
    kb2 = C1 + tl.arange(0, C2 if C2 > 0 else 1)
    k2 = kb2[:, None] * 128 + offs_k[None, :]
    h_ok2 = local[:, None, None] & (k2 < inter)[None, :, :]
    s_ok2 = local[:, None] & (kb2 < num_kb)[None, :]
    # h and the scales of every pair first, then every pair's slab (with PDL h is the previous
    # launch's output: it follows the slab and the wait)
    if not USE_PDL:
        ha1, hb1, ha2, hb2 = _mlp2_h_side(HQ, HS, HF, h_ptrs, hs_ptrs, k1, kb1, h_ok1, s_ok1, k2, kb2, h_ok2, s_ok2,
                                          C2, QUANT_H)
    ws1 = tl.load(ws_ptrs + kb1[None, :], mask=s_ok1, other=0.0)
    if C2 > 0:
        ws2 = tl.load(ws_ptrs + kb2[None, :], mask=s_ok2, other=0.0)
    if HAS_B2:
        bias = tl.load(B2 + expert[:, None] * stride_b2_e + rows_c[None, :], mask=local[:, None],
                       other=0.0).to(tl.float32)  # [K_PAD, BLOCK_N]
    w_rows = W2 + expert[:, None] * stride_w2_e + rows_c[None, :] * stride_w2_n  # [K_PAD, BLOCK_N]
    w1 = tl.load(w_rows[:, :, None, None] + k1[None, None, :, :], mask=h_ok1[:, None, :, :], other=0.0)
    if C2 > 0:
        w2 = tl.load(w_rows[:, :, None, None] + k2[None, None, :, :], mask=h_ok2[:, None, :, :], other=0.0)
    if USE_PDL:
        pdl_wait_then_release(USE_PDL)
        ha1, hb1, ha2, hb2 = _mlp2_h_side(HQ, HS, HF, h_ptrs, hs_ptrs, k1, kb1, h_ok1, s_ok1, k2, kb2, h_ok2, s_ok2,
                                          C2, QUANT_H)
    if QUANT_H:  # masked groups are all zero: scale 1, codes 0
        hq1, hs1 = _quantize_e4m3(ha1, 2)
        if C2 > 0:
            hq2, hs2 = _quantize_e4m3(ha2, 2)
    else:
        hq1, hs1, hq2, hs2 = ha1, hb1, ha2, hb2
    d1 = tl.sum(w1.to(tl.float32) * hq1.to(tl.float32)[:, None, :, :], axis=3)  # [K_PAD, BLOCK_N, C1]
    y = tl.sum(d1 * (hs1 * ws1)[:, None, :], axis=2)  # [K_PAD, BLOCK_N]
    if C2 > 0:
        d2 = tl.sum(w2.to(tl.float32) * hq2.to(tl.float32)[:, None, :, :], axis=3)
        y += tl.sum(d2 * (hs2 * ws2)[:, None, :], axis=2)
    if HAS_B2:
        y += bias
    y = tl.where(local[:, None], y, 0.0)  # foreign pairs: 0, as `_combine_kernel`'s masked load
    if STORE_Y:
        tl.store(PAIR_Y + pairs[:, None] * hidden + rows[None, :], y, mask=local[:, None] & (rows < hidden)[None, :])
    # `_combine_kernel`: fp32, slot order, acc += w * y, one rounding (picking y_j out of the pair
    # axis adds exact zeros; acc starts at +0 and can never become -0, so no sign of zero differs)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w_j = tl.sum(tl.where(offs_p == j, weight, 0.0), axis=0)
        y_j = tl.sum(tl.where((offs_p == j)[:, None], y, 0.0), axis=0)
        acc += w_j * y_j
    if OUT.dtype.element_ty == tl.bfloat16:
        acc = _round_to_bf16(acc)
    tl.store(OUT + token * stride_out + rows, acc.to(OUT.dtype.element_ty), mask=rows < hidden)


@triton.jit(do_not_specialize=["expert_offset", "num_local"])
def _mlp2_pair_oneshot_kernel(
    HQ, HS,  # h e4m3 [P, I] and scales [P, cdiv(I, 128)]
    TOPK_W, TOPK_IDS,  # [T * TOP_K]: weights (any float dtype), global expert ids
    W2, W2S, B2,  # [E, H, I] e4m3, [E, cdiv(H, 128), cdiv(I, 128)] fp32, [E, H]
    OUT,  # [T, H] (row stride stride_out)
    PAIR_Y,  # fp32 [P, H]: y per pair (b2 included; 0 for another rank's expert), then combined
    COUNTERS,  # int32 [T * cdiv(H, BLOCK_N)], zero between launches
    hidden, inter, expert_offset, num_local, stride_out,
    stride_w2_e, stride_w2_n, stride_w2s_e, stride_w2s_n, stride_b2_e,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,  # W2 rows (output columns) of the pair's expert
    C1: tl.constexpr,
    C2: tl.constexpr,
    HAS_B2: tl.constexpr,
    USE_PDL: tl.constexpr,  # kernels/pdl.py: id (three launches back) and slab before the wait, h after
):
    """mlp2 + combine with mlp1's work split (`OneshotConfig.mlp2_per_pair`): program (pair, tile)
    holds BLOCK_N rows x all of K of ONE pair's expert and that pair's h row, so h costs a
    program I bytes instead of `_mlp2_combine_oneshot_kernel`'s TOP_K x I (which its registers
    then lack for weight bytes in flight). Each program stores its y; the last of a (token,
    tile)'s TOP_K programs to arrive combines them as `_combine_kernel` does (fp32, slot order,
    one rounding; bits independent of arrival order) and resets the counter."""
    pair = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    token = pair // TOP_K
    eid = tl.load(TOPK_IDS + pair).to(tl.int32) - expert_offset
    local = (eid >= 0) & (eid < num_local)
    expert = tl.where(local, eid, 0).to(tl.int64)
    rows, rows_c, num_kb, offs_k, kb1, k1 = _slab_layout(tile, hidden, inter, BLOCK_N, C1)
    kb2 = C1 + tl.arange(0, C2 if C2 > 0 else 1)
    k2 = kb2[:, None] * 128 + offs_k[None, :]
    h_ok1 = local & (k1 < inter)
    h_ok2 = local & (k2 < inter)
    s_ok1 = local & (kb1 < num_kb)
    s_ok2 = local & (kb2 < num_kb)
    h_row = pair * inter
    hs_row = HS + pair * num_kb
    if not USE_PDL:  # h first: its latency overlaps the slab's
        hq1 = tl.load(HQ + h_row + k1, mask=h_ok1, other=0.0)
        hs1 = tl.load(hs_row + kb1, mask=s_ok1, other=0.0)
        if C2 > 0:
            hq2 = tl.load(HQ + h_row + k2, mask=h_ok2, other=0.0)
            hs2 = tl.load(hs_row + kb2, mask=s_ok2, other=0.0)
    ws_ptrs = W2S + expert * stride_w2s_e + (tile * BLOCK_N // 128) * stride_w2s_n  # one 128-row block
    ws1 = tl.load(ws_ptrs + kb1, mask=s_ok1, other=0.0)
    if C2 > 0:
        ws2 = tl.load(ws_ptrs + kb2, mask=s_ok2, other=0.0)
    if HAS_B2:
        bias = tl.load(B2 + expert * stride_b2_e + rows_c, mask=local, other=0.0).to(tl.float32)
    w_rows = W2 + expert * stride_w2_e + rows_c * stride_w2_n
    w1 = tl.load(w_rows[:, None, None] + k1[None, :, :], mask=h_ok1[None, :, :], other=0.0)
    if C2 > 0:
        w2 = tl.load(w_rows[:, None, None] + k2[None, :, :], mask=h_ok2[None, :, :], other=0.0)
    if USE_PDL:
        pdl_wait_then_release(USE_PDL)
        hq1 = tl.load(HQ + h_row + k1, mask=h_ok1, other=0.0)
        hs1 = tl.load(hs_row + kb1, mask=s_ok1, other=0.0)
        if C2 > 0:
            hq2 = tl.load(HQ + h_row + k2, mask=h_ok2, other=0.0)
            hs2 = tl.load(hs_row + kb2, mask=s_ok2, other=0.0)
    y = _block_sums(w1, hq1, hs1, ws1)
    if C2 > 0:
        y += _block_sums(w2, hq2, hs2, ws2)
    if HAS_B2:
        y += bias
    y = tl.where(local, y, 0.0)  # another rank's expert: 0, as `_combine_kernel`'s masked load
    row_ok = rows < hidden
    tl.store(PAIR_Y + pair * hidden + rows, y, mask=row_ok)
    # last arriver of the token's TOP_K programs for this tile (the stores above before the release)
    counter = COUNTERS + token * tl.num_programs(1) + tile
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == TOP_K - 1:
        tl.store(counter, 0)  # for the next launch: no memset per call
        tl.debug_barrier()
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            w_j = tl.load(TOPK_W + token * TOP_K + j).to(tl.float32)
            y_j = tl.load(PAIR_Y + (token * TOP_K + j) * hidden + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
            acc += w_j * y_j
        if OUT.dtype.element_ty == tl.bfloat16:
            acc = _round_to_bf16(acc)
        tl.store(OUT + token * stride_out + rows, acc.to(OUT.dtype.element_ty), mask=row_ok)


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


def quantize_h(h: torch.Tensor, topk_ids: torch.Tensor, expert_offset: int = 0, num_local: int = 1 << 30,
               hq: torch.Tensor | None = None, hs: torch.Tensor | None = None):
    """Step 2 on its own: h fp32 [P, I] (P = topk_ids.numel()) -> (e4m3 [P, I], fp32 scales
    [P, cdiv(I, 128)]); rows of pairs whose expert is outside expert_offset .. +num_local-1 are
    left unwritten."""
    num_pairs, inter = h.shape
    if h.dtype != torch.float32 or not h.is_contiguous() or topk_ids.numel() != num_pairs:
        raise ValueError("quantize_h: h must be contiguous fp32 [T * k, I] with topk_ids [T, k]")
    ids = topk_ids.reshape(-1).contiguous()
    groups = triton.cdiv(inter, QUANT_GROUP)
    hq = torch.empty((num_pairs, inter), dtype=FP8, device=h.device) if hq is None else hq
    hs = torch.empty((num_pairs, groups), dtype=torch.float32, device=h.device) if hs is None else hs
    if num_pairs:
        _quantize_h_kernel[(num_pairs, groups)](h, hq, hs, ids, inter, expert_offset, num_local, num_warps=1,
                                                **pdl_launch_kwargs(h.device, ids.numel() // topk_ids.shape[-1]))
    return hq, hs


def fused_moe_decode_oneshot(
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
    config: OneshotConfig | None = None,
    out: torch.Tensor | None = None,
    *,
    x_fp8: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    pair_out: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' part of the MoE layer in three one-shot launches: `fused_experts_fp8`'s call
    (x [T, H], topk_weights [T, k] any float dtype, topk_ids [T, k] global ids, the FP8 experts,
    `out` [T, H] or None: x's dtype). `x_fp8` [T, H] e4m3 / `x_scale` [T, cdiv(H, 128)] fp32: x's
    groups as the decode front left them (else quantised here, one more launch). `pair_out`
    (fp32 [T * k, H]): also receives each local pair's y (tests: `_combine_kernel` on it must
    give `out`); `h_out` (fp32 [T * k, I]): mlp1 writes h there (rows of local pairs), for the
    tests. No host syncs: capturable in a CUDA graph."""
    _check_x("fused_moe_decode_oneshot", x)
    num_tokens, hidden = x.shape
    num_local, inter = _check_weights(hidden, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2)
    _check_routing("fused_moe_decode_oneshot", x, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    config = config or DEFAULT_ONESHOT
    _check_config(config, hidden, inter, top_k)
    out = _out_buffer("fused_moe_decode_oneshot", x, out)
    num_pairs = num_tokens * top_k
    for name, t, cols in (("pair_out", pair_out, hidden), ("h_out", h_out, inter)):
        if t is not None and (tuple(t.shape) != (num_pairs, cols) or t.dtype != torch.float32 or not t.is_contiguous()):
            raise ValueError(f"fused_moe_decode_oneshot: {name} must be contiguous fp32 [{num_pairs}, {cols}]")
    if num_tokens == 0:
        return out
    if (x_fp8 is None) != (x_scale is None):
        raise ValueError("fused_moe_decode_oneshot: pass both x_fp8 and x_scale, or neither")
    if x_fp8 is None:
        _, _, x_fp8, x_scale = route_and_quantize(None, x)
    elif (tuple(x_fp8.shape) != (num_tokens, hidden) or x_fp8.dtype != FP8 or not x_fp8.is_contiguous()
          or tuple(x_scale.shape) != (num_tokens, triton.cdiv(hidden, QUANT_GROUP))
          or x_scale.dtype != torch.float32 or not x_scale.is_contiguous()):
        raise ValueError("fused_moe_decode_oneshot: x_fp8 must be contiguous e4m3 [T, H], "
                         "x_scale fp32 [T, cdiv(H, 128)]")
    ids = topk_ids.contiguous()
    hf = torch.empty((num_pairs, inter), dtype=torch.float32, device=x.device) if h_out is None else h_out
    launch_mlp1(x_fp8, x_scale, ids, w1, w1_scale_inv, b1, hf, limit, expert_offset, config)
    if config.quant_in_mlp2:
        hq = hs = None
    else:
        hq, hs = quantize_h(hf, ids, expert_offset, num_local)
    launch_mlp2_combine(hq, hs, hf, topk_weights.contiguous(), ids, w2, w2_scale_inv, b2, out, expert_offset, config,
                        pair_out)
    return out


def launch_mlp1(x_fp8, x_scale, ids, w1, w1_scale_inv, b1, h, limit, expert_offset, config):
    """Step 1 (checked operands): h fp32 [T * k, I] <- `_mlp1_oneshot_kernel`."""
    num_local, two_inter, hidden = w1.shape
    num_pairs, inter = h.shape
    c1, c2 = pow2_chunks(triton.cdiv(hidden, QUANT_GROUP))
    _mlp1_oneshot_kernel[(num_pairs, triton.cdiv(inter, config.mlp1_block_n))](
        x_fp8, x_scale, ids, w1, w1_scale_inv, b1 if b1 is not None else w1_scale_inv, h,
        hidden, inter, expert_offset, num_local, float(limit), SWIGLU_ALPHA,
        w1.stride(0), w1.stride(1), w1_scale_inv.stride(0), w1_scale_inv.stride(1),
        b1.stride(0) if b1 is not None else 0,
        TOP_K=ids.shape[-1], BLOCK_N=config.mlp1_block_n, C1=c1, C2=c2, HAS_B1=b1 is not None,
        num_warps=config.mlp1_warps, **pdl_launch_kwargs(h.device, num_pairs // ids.shape[-1]),
    )


PAIR_COUNTERS_OWNER = "moe_decode_mlp2_pair"


def launch_mlp2_combine(hq, hs, h, weights, ids, w2, w2_scale_inv, b2, out, expert_offset, config, pair_out=None):
    """Step 3 (checked operands): out [T, H] <- `_mlp2_combine_oneshot_kernel` from h's e4m3 groups
    (hq, hs), or from fp32 h when `config.quant_in_mlp2`; `_mlp2_pair_oneshot_kernel` when
    `config.mlp2_per_pair`."""
    num_local, hidden, inter = w2.shape
    num_tokens, top_k = ids.shape
    c1, c2 = pow2_chunks(triton.cdiv(inter, QUANT_GROUP))
    if config.mlp2_per_pair:
        tiles = triton.cdiv(hidden, config.mlp2_block_n)
        counters = arrival_counters(PAIR_COUNTERS_OWNER, out.device, num_tokens * tiles)
        if counters is None:  # first call inside a capture: the graph zeroes its own
            counters = torch.zeros(num_tokens * tiles, dtype=torch.int32, device=out.device)
        pair_y = pair_out if pair_out is not None else torch.empty(
            (num_tokens * top_k, hidden), dtype=torch.float32, device=out.device)
        _mlp2_pair_oneshot_kernel[(num_tokens * top_k, tiles)](
            hq, hs, weights, ids, w2, w2_scale_inv, b2 if b2 is not None else w2_scale_inv, out, pair_y, counters,
            hidden, inter, expert_offset, num_local, out.stride(0),
            w2.stride(0), w2.stride(1), w2_scale_inv.stride(0), w2_scale_inv.stride(1),
            b2.stride(0) if b2 is not None else 0,
            TOP_K=top_k, BLOCK_N=config.mlp2_block_n, C1=c1, C2=c2, HAS_B2=b2 is not None,
            num_warps=config.mlp2_warps, **pdl_launch_kwargs(out.device, num_tokens),
        )
        return
    _mlp2_combine_oneshot_kernel[(num_tokens, triton.cdiv(hidden, config.mlp2_block_n))](
        hq if hq is not None else h, hs if hs is not None else h, h, weights, ids,
        w2, w2_scale_inv, b2 if b2 is not None else w2_scale_inv, out, pair_out if pair_out is not None else h,
        hidden, inter, expert_offset, num_local, out.stride(0),
        w2.stride(0), w2.stride(1), w2_scale_inv.stride(0), w2_scale_inv.stride(1),
        b2.stride(0) if b2 is not None else 0,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_N=config.mlp2_block_n, C1=c1, C2=c2,
        HAS_B2=b2 is not None, QUANT_H=config.quant_in_mlp2, STORE_Y=pair_out is not None,
        num_warps=config.mlp2_warps, **pdl_launch_kwargs(out.device, num_tokens),
    )


def fused_moe_fp8_oneshot(
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
    config: OneshotConfig | None = None,
    out: torch.Tensor | None = None,
    return_routing: bool = False,
    *,
    pair_out: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None,
):
    """The whole layer, `fused_moe_fp8`'s call: routing.py's decode front (router GEMV, top-k,
    softmax, x's e4m3 groups; its pair sort is computed and unused) where it applies (T <= 16,
    router operands in x's dtype), else F.linear + `route_and_quantize`; then
    `fused_moe_decode_oneshot` (`pair_out`, `h_out`: its debug outputs)."""
    num_local = w1.shape[0] if w1.dim() == 3 else 0
    if _uses_decode_front(x, router_weight, router_bias):
        front = decode_front(x, router_weight, router_bias, top_k, num_local, expert_offset, block_m=1)
        weights, ids, xq, xs = front["topk_weights"], front["topk_ids"], front["x_fp8"], front["x_scale"]
    else:
        weights, ids, xq, xs = route_and_quantize(F.linear(x, router_weight, router_bias), x, top_k)
    result = fused_moe_decode_oneshot(x, weights, ids, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2, limit,
                                      expert_offset, config, out, x_fp8=xq, x_scale=xs, pair_out=pair_out,
                                      h_out=h_out)
    return (result, weights, ids) if return_routing else result
