"""The MoE front, every size regime: top-k routing with softmax over those k as `route` computes
it, x quantised to e4m3 1x128 groups (mlp1's A operand), and the pair sort, in as few launches as
the batch allows.

Decode (1..DECODE_FRONT_MAX_TOKENS tokens): `_decode_front_kernel` computes the router logits too
(a split GEMV whose last arriver sums the partials in split order, then routes and sorts), so
router, routing, quantisation and sort are one launch. Above that F.linear's logits feed
`_front_kernel`, which sorts as well up to FUSED_SORT_MAX_TOKENS tokens on FUSED_SORT_MIN_EXPERTS+
local experts; otherwise the sort (sort.py) is launched after it.

Invariant: the routing equals `route` bit for bit on the logits it is given (torch's softmax as the
device computes it: CUDA expf, butterfly sum, IEEE division; CPU sequential sum, reciprocal
multiply; ties to the lower expert id), x's groups equal `quantize_activation_group128`'s, and
nothing is read back to the host (CUDA-graph safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import triton
import triton.language as tl
from triton.language.extra import libdevice

from sglang_ext.kernels.arrival_counters import arrival_counters
from sglang_ext.kernels.pdl import pdl_launch_kwargs, pdl_wait_then_release
from sglang_ext.kernels.reference import BLOCK as QUANT_GROUP

from .common import FP8, _cdiv, _experts_pad, _next_pow2, _quantize_e4m3, _round_to_bf16
from .sort import SORT_MAX_SINGLE_CHUNKS, _launch_sort, _max_blocks, _sort_chunk, _sort_few_pairs, _sort_pairs_compare


# ---------------------------------------------------------------------------------------------
# 2. routing, quantisation of x and (few pairs) the sort: one launch
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
# launchers
# ---------------------------------------------------------------------------------------------


ROUTE_BLOCK_T = 16  # tokens per routing program when the sort runs on its own (prefill)
QUANT_BLOCK_T = 16  # tokens per quantisation program (one 1x128 group column each)
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


ROUTER_COUNTER_OWNER = "moe_decode_router"


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
