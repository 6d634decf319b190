"""Sink attention, decode launch tables: ``decode_config`` (split loop or one-shot by batch, window and
max context, from the H200 sweeps), ``oneshot_config``, ``ONESHOT_PICKS`` and the merge tile (``_merge_tile``).

Invariant: every choice comes from host-known values only (batch, window, req_to_token's width, SM count), so
a CUDA graph captures one configuration per batch size; the split count on the device is decided from each
request's length within these bounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

import triton

from sglang_ext.kernels._util import num_sms

from .common import MAX_SPLITS


@dataclass(frozen=True)
class DecodeConfig:
    """Launch choices of the decode kernel; all host constants, so a CUDA graph captures one of them
    per batch size. ``num_splits`` is the most splits of one (request, kv head); how many carry keys
    is decided on the device from its length (``_split_range``). ``merge_heads`` / ``merge_splits``
    override the merge's tile (_merge_tile), for tests and sweeps."""
    num_splits: int = 1
    block_n: int = 64
    min_split_blocks: int = 2
    num_warps: int = 4
    num_stages: int = 3
    fused_merge: bool = True
    prefetch: bool = True  # next block's K/V loads in flight during this block's maths
    # The merge's tile (0: _merge_tile's choice): q heads per merge-kernel program, splits per load.
    merge_heads: int = 0
    merge_splits: int = 0
    # The one-shot decode (_sink_decode_oneshot_kernel): each split is one chunk of block_n keys (a power of
    # two >= 16) read in one K and one V load, no key loop; num_splits covers max_context / block_n chunks up
    # to MAX_SPLITS (oneshot_config). Its merge is always the merge kernel (fused_merge and prefetch are not
    # read). v_late: V's load is issued after the scores instead of with K.
    oneshot: bool = False
    v_late: bool = False
    # One-shot only: a register cap per thread (ptxas maxnreg; 0: none), so that more programs fit an SM
    # (65536 registers: 4 programs of 4 warps need <= 128 each, and the batch-1 8k grid is 512 programs).
    max_regs: int = 0


SHORT_KEYS = 256  # at most this many keys (a gpt-oss sliding layer: 128): one pass, no split
LONG_KEYS = 8192  # above this max context the batch-1 and batch-4 choices change (sweep below)


class OneshotPick(NamedTuple):
    """A one-shot decode variant (oneshot_config's arguments): keys per split, V after the scores, warps,
    the split cap."""
    chunk: int = 128
    v_late: bool = False
    num_warps: int = 4
    max_splits: int = MAX_SPLITS
    max_regs: int = 0


ONESHOT_MAX_BATCH = 4
# Where decode_config returns the one-shot decode instead of the split loop: (batch, keys) -> OneshotPick
# for batch 1 .. ONESHOT_MAX_BATCH (batch 3 takes batch 4's entry), keys "short" (at most SHORT_KEYS: the
# sliding layers), "<=8k" or ">8k" (max_context past LONG_KEYS: serving, where max_context is the model's
# context length). A missing entry keeps the split loop's choice. The entries are the winners of the H200
# sweep of the one-shot variants (benchmarks/bench_sink_attention.py --decode-sweep --oneshot).
#
# That sweep (benchmarks/results/sweeps/bench_sink_attention_decode_oneshot.md): the one-shot
# decode wins only by a little, and only here: batch 1 at max context <= 8k, full layers, chunk 128 / V late
# 12.2 vs 13.1 us; sliding layers (one 128-key chunk) 3.8 vs 4.0 us (batch 1), 4.2 vs 4.4 (2), 4.8 vs 5.0
# (4). Everywhere else the split loop is faster (batch 2-4 at 8k by 5-14 %, every 32k point); at batch 1
# with max context 131072 it was 1.05x at 8k but slower at 32k, so ">8k" keeps the split loop. Its
# programs still wait three memory latencies in a row (length -> slot ids -> K/V), which the merge
# launch adds to: the read floor of 16.8 MB is 5.6 us (diag_floor.md).
#
# Why the register cap (benchmarks/results/diag_sink_decode.md, ncu): at 135
# registers that pick ran 3 programs an SM, so its 512 programs took two waves (1.29 waves a launch); with
# RoPE + the KV write in the launch (RopeKV) it held 192-242. Capped at 128 (4 spills) the 8k grid fits one
# wave: fused 11.6 us vs 14.7 uncapped (unfused chain 15.1); in the whole step, paired graphs, 120b batch 1
# -78 us against the unfused step, 20b -49, logits bit-equal (diag_rope_fusion.md; uncapped -30 / -26).
ONESHOT_PICKS: dict = {(1, "<=8k"): OneshotPick(chunk=128, v_late=True, max_regs=128),
                       **{(b, "short"): OneshotPick(chunk=128) for b in (1, 2, 4)}}


def _keys_kind(keys: int) -> str:
    return "short" if keys <= SHORT_KEYS else ">8k" if keys > LONG_KEYS else "<=8k"


def oneshot_config(batch: int, num_kv_heads: int, window_left: int, max_context: int, chunk: int = 128,
                   v_late: bool = False, num_warps: int = 4, max_splits: int = MAX_SPLITS,
                   max_regs: int = 0) -> DecodeConfig:
    """The one-shot decode from host-known values only (CUDA-graph safe): one split per ``chunk`` keys
    that a request may have (max_context, or the window's keys), at most ``max_splits``; a request longer
    than max_splits * chunk keys folds several chunks per split. ``batch`` and ``num_kv_heads`` do not
    enter (the grid grows with them), kept for decode_config's signature."""
    del batch, num_kv_heads
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"oneshot_config: chunk must be a power of two >= 16, got {chunk}")
    keys = max_context if window_left < 0 else min(max_context, window_left + 1)
    splits = max(1, min(max_splits, triton.cdiv(keys, chunk)))
    return DecodeConfig(num_splits=splits, block_n=chunk, min_split_blocks=1, num_warps=num_warps, num_stages=1,
                        fused_merge=False, prefetch=False, oneshot=True, v_late=v_late, max_regs=max_regs)


def decode_config(batch: int, num_kv_heads: int, window_left: int, max_context: int,
                  device: torch.device) -> DecodeConfig:
    """Decode launch choices from host-known values only (CUDA-graph safe): the batch, the window and
    ``max_context`` (req_to_token's width, an upper bound on any request's length; under SGLang that is
    the model's context length, so serving takes the "> 8k" rows).

    Decode reads every key once and is bound by memory, so the grid must hold enough programs to keep
    the HBM busy, but every split adds a partial write and read. The rule follows the H200 sweep
    (benchmarks/results/sweeps/bench_sink_attention_decode_sweep.md, gpt-oss 64/8 heads, D 64, bf16,
    triton 3.6; "p/SM" = splits for p programs per SM, capped by max_context / (64 * m) for m blocks
    at least per split). Each choice is that sweep's winner at its points (tests check this against the
    .json):

      sliding (<= 256 keys)   one program per (request, kv head), one 128-key block, 4 warps:
                              4.5-7.0 us at batch 1-32 (old 2 splits + merge kernel: 7.4-12.2; 8 warps
                              4.6-7.6)
      batch 1, ctx <= 8k      old: 2/SM, m1, merge kernel, no prefetch: 21.8 us (4/SM m2 w2: 24.0)
      batch 1, ctx > 8k       4/SM, m2, 2 warps, fused merge, prefetch: 39.8 us at 32k (old 44.9)
      batch 2                 same: 23.7 us at 8k (old 25.9), 53.7 at 32k (old 69.6)
      batch 3-4, ctx <= 8k    same: 32.7 us at batch 4 (old 39.5)
      batch 3-4, ctx > 8k     4/SM, m2, 4 warps, fused merge, no prefetch: 94.1 us at 32k (old 117.4;
                              2 warps with prefetch 113.7)
      batch 5-15              8/SM, m2, 4 warps, fused merge, no prefetch: batch 8: 59.0 us at 8k
                              (old 61.4), 172.4 at 32k (old 200.4)
      batch >= 16             old: 164.5 us at batch 32, 8k (best new 174.9), 589.6 at 32k (678.4).
                              Batch 16 was not measured; it takes the old choice, the safe side.

    Since the merge kernel loads every split at once (no serial loop: 2-3 us, was 9.8 at batch 1),
    it beats the fused last-arriver merge wherever both were timed
    (benchmarks/results/sweeps/bench_sink_attention_merge.md): batch 1, 4/SM m2 w2 prefetch: 13.1 vs
    24.5 us at 8k, 28.9 vs 40.6 at 32k; batch 8: 49.3 vs 64.9 at 8k, 156.9 vs 203.3 at 32k. So the
    rows above that said "fused merge" keep their split/warp/prefetch choice and use the merge kernel.

    At batch 1 .. ONESHOT_MAX_BATCH, an entry of ONESHOT_PICKS replaces the rows above with the one-shot
    decode (oneshot_config).
    """
    keys = max_context if window_left < 0 else min(max_context, window_left + 1)
    if batch <= ONESHOT_MAX_BATCH:
        pick = ONESHOT_PICKS.get((4 if batch == 3 else batch, _keys_kind(keys)))
        if pick is not None:
            return oneshot_config(batch, num_kv_heads, window_left, max_context, *pick)
    if keys <= SHORT_KEYS:
        block_n = max(16, min(128, triton.next_power_of_2(max(keys, 1))))
        return DecodeConfig(num_splits=1, block_n=block_n, num_warps=4, prefetch=False)
    sms = num_sms(device, off_gpu=1)

    def splits(programs_per_sm: int, min_split_blocks: int, cap: int = MAX_SPLITS) -> int:
        return max(1, min(cap, triton.cdiv(programs_per_sm * sms, batch * num_kv_heads),
                          triton.cdiv(keys, 64 * min_split_blocks)))

    long = keys > LONG_KEYS
    if batch >= 16 or (batch == 1 and not long):
        # ~2 programs per SM (at most 32 splits), one key block at least per split, the plain key loop
        return DecodeConfig(num_splits=splits(2, 1, cap=32), block_n=64, min_split_blocks=1, num_warps=4,
                            num_stages=3, fused_merge=False, prefetch=False)
    if batch <= 2 or (batch <= 4 and not long):
        return DecodeConfig(num_splits=splits(4, 2), block_n=64, min_split_blocks=2, num_warps=2, num_stages=3,
                            fused_merge=False, prefetch=True)
    return DecodeConfig(num_splits=splits(4 if batch <= 4 else 8, 2), block_n=64, min_split_blocks=2, num_warps=4,
                        num_stages=3, fused_merge=False, prefetch=False)


MERGE_LOAD_PER_THREAD = 64  # fp32 partial values one merge load brings to each thread (registers)
MERGE_PROGRAM_ELEMS = 2048  # merge kernel: group q heads into one program until its load holds this many


def _merge_tile(config: DecodeConfig, group: int, d: int, num_warps: int, fused: bool) -> tuple:
    """(q heads per merge program, splits per merge load), powers of two. The merge reads every split's
    partial once and is bound by how many bytes its programs have in flight, so each load is as large as
    the registers allow (MERGE_LOAD_PER_THREAD). The fused merge runs in a decode program: the whole
    group per load. The merge kernel: every split in one load where that fits (up to 128 splits at D 64),
    and fewer heads per program the more splits there are (batch 1, 32 splits: one q head per program,
    64 programs on 64 SMs instead of 8 looping), so large batches with 2-3 splits still get a group per
    program rather than a program per handful of values."""
    group_pad = triton.next_power_of_2(group)
    values = MERGE_LOAD_PER_THREAD * 32 * num_warps
    if fused:
        # Not capped by the split count: the decode kernel keeps one compiled variant for all batches.
        chunk = config.merge_splits or max(1, values // (group_pad * d))
        return group_pad, triton.next_power_of_2(chunk)
    chunk = min(triton.next_power_of_2(config.num_splits),
                triton.next_power_of_2(config.merge_splits or max(1, values // d)))
    heads = config.merge_heads or max(1, MERGE_PROGRAM_ELEMS // (chunk * d))
    return min(group_pad, triton.next_power_of_2(heads)), chunk
