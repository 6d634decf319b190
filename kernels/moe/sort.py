"""The MoE pair sort for every regime that reads sorted blocks (the GEMV path's blocks of 1..4
pairs, the grouped GEMMs' 16 / 64): the (token, slot) pairs grouped by local expert into
BLOCK_M-padded segments, blocks past the last segment marked with expert -1.

Two forms leave one layout. Sweeps over the expert axis (`_count_kernel` per chunk of pairs, then
`_align_kernel`), whose cost grows with the experts, for many pairs; comparisons of every pair
with every other (`_sort_few_pairs`, `_sort_pairs_compare`), whose cost grows with the pairs
squared, inside the routing launches (routing.py) for few pairs.

Invariant: stable (an expert's pairs keep token order), no atomics, and sized for the worst case
from the pair count alone (`_max_blocks`), so nothing is read back to the host (CUDA-graph safe)
and one compiled kernel serves every batch size.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from .common import _cdiv, _experts_pad


# ---------------------------------------------------------------------------------------------
# by sweeps over the expert axis: many pairs (on its own, after the routing launch)
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
# by comparing pairs with pairs: few pairs (inside the routing launches)
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


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


# One program sorts up to this many chunks of pairs (`_align_kernel` with SINGLE; the routing
# launch's fused sort too); more chunks are counted per chunk first.
SORT_MAX_SINGLE_CHUNKS = 4


def _max_blocks(num_pairs: int, num_local: int, block_m: int) -> int:
    """Bound on the used blocks from shapes only: each holds >= 1 pair, each expert pads < 1 block."""
    return max(1, min(num_pairs, _cdiv(num_pairs, block_m) + num_local))


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
