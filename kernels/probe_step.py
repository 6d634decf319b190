"""The SingProbe decode step in four launches: three taps (one per tapped layer) and three step kernels.

At batch 1 the step is launch- and latency-bound, not byte-bound (11.6 MB of probe weights is 2.8 us
of HBM on an H200), so the work is regrouped by dependency, not by layer of the head:

1. the taps (once per tapped layer, inside the base model's forward): weight-less RMS norm of the
   tapped residual row in fp32, cast to the model dtype, written into the features buffer. The
   served model writes them in its residual-add + RMSNorm launch (``residual_norm.py``);
   ``probe_tap_normalize`` is the one-launch tap for callers whose norm does not.
2. ``_qkv_splitk_kernel``: q|k|v = features @ W_qkv^T as a split-K GEMV (grid: N tiles x K splits x
   T tiles, hundreds of programs so the 11 MB of weights stream from every SM). Each split writes an
   fp32 partial; the *last arriver* of a tile (atomic counter) sums the partials in split order
   (deterministic), rounds to the weight dtype like the reference GEMM, and writes q to a scratch
   buffer and K|V straight into the probe's pool at ``out_cache_loc`` (no separate scatter).
3. ``_attn_split_kernel``: windowed paged MQA, each row's key range split over programs
   (flash-decoding); the last arriver of a row merges the splits (fixed order) into ctx.
4. ``_tail_kernel``: h = q + ctx @ Wo^T spread over HD / BLOCK_O programs per row; the last arriver
   of a row runs RMSNorm, classifier and sigmoid and writes the row's probabilities.

Counters live in a workspace, are zero between steps (every last arriver resets its own) and are
never reallocated under a captured graph, so the launcher is CUDA-graph safe: grids come from shapes,
no tensor value is read on the host. Last-arriver (not spin-wait) synchronisation cannot deadlock,
also under TRITON_INTERPRET, where programs run one after another.

Precision: every accumulator, softmax and the tail are fp32; 16-bit x 16-bit products are exact in
fp32, so compiled bf16 dots lose nothing against the reference (cuBLAS bf16 GEMM with fp32
accumulation, then rounding q|k|v to bf16). What differs is the summation order, so q|k|v may differ
from the reference by one ulp of the weight dtype in rare elements; probabilities then agree to ~1e-5.

References: ``probe_tap_normalize_ref`` (= ``rms_normalize(h).to(dtype)`` of probe/model.py) and
``probe_decode_step_ref`` (F.linear + ``probe_attention_ref`` + ``probe_tail_ref``).
"""

from __future__ import annotations

from typing import Optional

import torch

import triton
import triton.language as tl

from ._util import interpreted, num_sms
from .pdl import pdl_launch_kwargs, pdl_wait_then_release
from .probe_attention import _attend_key_range, probe_attention_ref
from .probe_tail import _norm_classify_store, probe_tail_ref

RMS_EPS = 1e-6  # probe/model.py RMS_EPS (kernels import nothing from probe/)


def _dot16(*dtypes: torch.dtype) -> bool:
    """Tensor-core dots when all operands share one 16-bit type. Not bf16 under the interpreter, whose
    bf16 tl.dot returns garbage: there bf16 is upcast right after the load (same maths, fp32 products)."""
    if len(set(dtypes)) != 1 or dtypes[0] not in (torch.float16, torch.bfloat16):
        return False
    return not (interpreted() and dtypes[0] == torch.bfloat16)


# --------------------------------------------------------------------------------------------------------
# 1. tap: weight-less RMS norm into the features buffer
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _tap_normalize_kernel(X, OUT, stride_x, stride_o, col0, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    # Same formula as rms_normalize: x * rsqrt(mean(x^2) + eps), all fp32.
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(OUT + row * stride_o + col0 + offs, (x * r).to(OUT.dtype.element_ty), mask=ok)


def probe_tap_normalize(hidden: torch.Tensor, features: torch.Tensor, column_offset: int,
                        eps: float = RMS_EPS) -> torch.Tensor:
    """features[:T, off:off+C] = rms_normalize(hidden).to(features.dtype) for hidden [T, C]; one launch.

    Equal to the reference except where the fp32 scale differs in its last bit (different summation
    order) and that flips the rounding to the features dtype: at most 1 ulp, in a few elements per
    thousand rows. Rows of ``features`` past T are untouched. Returns ``features``."""
    if hidden.dim() != 2 or features.dim() != 2:
        raise ValueError(f"probe_tap_normalize: hidden and features must be 2-D, got {tuple(hidden.shape)}, "
                         f"{tuple(features.shape)}")
    t, c = hidden.shape
    if features.shape[0] < t or not 0 <= column_offset <= features.shape[1] - c:
        raise ValueError(f"probe_tap_normalize: hidden {tuple(hidden.shape)} does not fit features "
                         f"{tuple(features.shape)} at column {column_offset}")
    if hidden.stride(-1) != 1 or features.stride(-1) != 1:
        raise ValueError("probe_tap_normalize: hidden and features need a unit last stride")
    if t:
        block = triton.next_power_of_2(c)
        _tap_normalize_kernel[(t,)](hidden, features, hidden.stride(0), features.stride(0), column_offset, c,
                                    float(eps), BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return features


def probe_tap_normalize_ref(hidden, features, column_offset, eps: float = RMS_EPS):
    x = hidden.float()
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    features[: hidden.shape[0], column_offset : column_offset + hidden.shape[1]] = y.to(features.dtype)
    return features


# --------------------------------------------------------------------------------------------------------
# 2. split-K q|k|v GEMV, last arriver writes q and K|V
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _qkv_splitk_kernel(
    X,  # [T, K] features (row stride stride_x)
    W,  # [N, K] q|k|v weights, N = HQ + 2D, contiguous
    PART,  # [SPLITS, T, N] fp32 partials
    COUNT,  # [T tiles * N tiles] int32, zero between steps
    Q_OUT,  # [T, HQ] in W's dtype
    KV,  # [num_slots, 2D] probe pool
    OUT_LOC,  # [T] slot of each row's new token
    ROW_POS,  # [T] position of the row + POS_OFFSET (a sequence length: 1); < POS_OFFSET: padding, no KV write
    T, K, stride_x, stride_kv,
    HQ: tl.constexpr, N: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr, SPLITS: tl.constexpr, DOT16: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py: launched plainly, releases the attention at once
    POS_OFFSET: tl.constexpr = 0,
):
    pdl_wait_then_release(USE_PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_t = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    t_ok = offs_t < T
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    k0 = split * (K_ITERS * BLOCK_K)
    for it in tl.static_range(K_ITERS):
        kk = k0 + it * BLOCK_K + offs_k
        k_ok = kk < K
        x = tl.load(X + offs_t[:, None].to(tl.int64) * stride_x + kk[None, :],
                    mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + offs_n[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT16:
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    tile_ok = t_ok[:, None] & n_ok[None, :]
    if SPLITS > 1:
        part = PART + offs_t[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part + split * T * N, acc, mask=tile_ok)
        tl.debug_barrier()  # every thread's partial is stored before the counter is released
        tile = pid_t * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(COUNT + tile, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            # Last arriver: all partials are visible; sum in split order (deterministic).
            acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            for s in range(SPLITS):
                acc += tl.load(part + s * T * N, mask=tile_ok, other=0.0, cache_modifier=".cg")
            tl.store(COUNT + tile, 0)
            _qkv_epilogue(acc, offs_t, offs_n, t_ok, n_ok, Q_OUT, KV, OUT_LOC, ROW_POS, stride_kv, HQ, POS_OFFSET)
    else:
        _qkv_epilogue(acc, offs_t, offs_n, t_ok, n_ok, Q_OUT, KV, OUT_LOC, ROW_POS, stride_kv, HQ, POS_OFFSET)


@triton.jit
def _qkv_epilogue(acc, offs_t, offs_n, t_ok, n_ok, Q_OUT, KV, OUT_LOC, ROW_POS, stride_kv, HQ: tl.constexpr,
                  POS_OFFSET: tl.constexpr):
    # Round to the weight dtype first, as the reference GEMM's output is: q and K|V are those values.
    val = acc.to(Q_OUT.dtype.element_ty)
    is_q = offs_n < HQ
    tl.store(Q_OUT + offs_t[:, None].to(tl.int64) * HQ + offs_n[None, :], val,
             mask=t_ok[:, None] & (n_ok & is_q)[None, :])
    # Padding rows (pos < 0) keep their hands off the pool, whatever slot out_cache_loc names.
    pos = tl.load(ROW_POS + offs_t, mask=t_ok, other=-1) - POS_OFFSET
    loc = tl.load(OUT_LOC + offs_t, mask=t_ok, other=0).to(tl.int64)
    row_ok = t_ok & (pos >= 0)
    tl.store(KV + loc[:, None] * stride_kv + (offs_n - HQ)[None, :], val.to(KV.dtype.element_ty),
             mask=row_ok[:, None] & (n_ok & (offs_n >= HQ))[None, :])


# --------------------------------------------------------------------------------------------------------
# 3. windowed paged MQA, split key ranges, last arriver merges
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _attn_split_kernel(
    Q,  # [T, H*D] (weight dtype)
    KV, REQ_TO_TOKEN, REQ_IDX, ROW_POS,
    PART,  # [T, SPLITS, H, D] fp32
    LSE,  # [T, SPLITS, H] fp32
    COUNT,  # [T] int32
    CTX,  # [T, H*D] fp32
    stride_kv, stride_r2t, window, scale,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, DOT16: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py: a dependent of the q|k|v GEMV (q and this K|V are its)
    POS_OFFSET: tl.constexpr = 0,  # as the GEMV's
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    req = tl.load(REQ_IDX + row).to(tl.int64)  # the batch's, written before the step
    pos = tl.load(ROW_POS + row).to(tl.int64) - POS_OFFSET
    pdl_wait_then_release(USE_PDL)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    head_ok = offs_h < H
    q = tl.load(Q + row * (H * D) + offs_h[:, None] * D + offs_d[None, :], mask=head_ok[:, None], other=0.0)
    if not DOT16:
        q = q.to(tl.float32)

    acc, m_i, l_i = _attend_key_range(q, KV, REQ_TO_TOKEN, req, pos, split, window, scale, stride_kv, stride_r2t,
                                      D, BLOCK_H, BLOCK_N, SPLITS, DOT16)

    has_keys = l_i > 0  # false only for padding rows (pos < 0) and empty splits: zeros, not NaN
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    hd = offs_h[:, None] * D + offs_d[None, :]
    if SPLITS == 1:
        tl.store(CTX + row * (H * D) + hd, out, mask=head_ok[:, None])
    else:
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(PART + (row * SPLITS + split) * (H * D) + hd, out, mask=head_ok[:, None])
        tl.store(LSE + (row * SPLITS + split) * H + offs_h, lse, mask=head_ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(COUNT + row, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
            for sp in range(SPLITS):
                m = tl.maximum(m, tl.load(LSE + (row * SPLITS + sp) * H + offs_h, mask=head_ok,
                                          other=float("-inf"), cache_modifier=".cg"))
            m_safe = tl.where(m > float("-inf"), m, 0.0)
            den = tl.zeros([BLOCK_H], dtype=tl.float32)
            acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
            for sp in range(SPLITS):
                lse_s = tl.load(LSE + (row * SPLITS + sp) * H + offs_h, mask=head_ok, other=float("-inf"),
                                cache_modifier=".cg")
                w_s = tl.exp(lse_s - m_safe)  # 0 for empty splits
                acc += w_s[:, None] * tl.load(PART + (row * SPLITS + sp) * (H * D) + hd, mask=head_ok[:, None],
                                              other=0.0, cache_modifier=".cg")
                den += w_s
            tl.store(CTX + row * (H * D) + hd, acc / tl.where(den > 0, den, 1.0)[:, None], mask=head_ok[:, None])
            tl.store(COUNT + row, 0)


# --------------------------------------------------------------------------------------------------------
# 4. tail: o_proj spread over programs, last arriver of a row: RMSNorm, classifier, sigmoid
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _tail_kernel(Q, CTX, WO, NORM_W, WC, BC, H_BUF, COUNT, OUT, eps,
                 HD: tl.constexpr, L: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_O: tl.constexpr,
                 USE_PDL: tl.constexpr = False):  # kernels/pdl.py: a dependent of the attention (ctx is its)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    n_blk: tl.constexpr = HD // BLOCK_O
    offs_o = blk * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_k = tl.arange(0, HD)
    wo = tl.load(WO + offs_o[:, None] * HD + offs_k[None, :]).to(tl.float32)  # weights: before the wait
    pdl_wait_then_release(USE_PDL)
    ctx = tl.load(CTX + row * HD + offs_k)
    # o_proj in fp32 from the fp32 ctx, as probe_tail does (the reference rounds ctx and o to the weight
    # dtype first; the difference is within the tail's test tolerance and the fp32 path is the better one).
    h = tl.load(Q + row * HD + offs_o).to(tl.float32) + tl.sum(wo * ctx[None, :], axis=1)
    tl.store(H_BUF + row * HD + offs_o, h)
    if n_blk > 1:
        tl.debug_barrier()
        arrived = tl.atomic_add(COUNT + row, 1, sem="acq_rel")
        last = arrived == n_blk - 1
    else:
        last = True
    if last:
        hh = tl.load(H_BUF + row * HD + offs_k, cache_modifier=".cg")
        _norm_classify_store(hh, NORM_W, WC, BC, OUT, row, offs_k, eps, HD, L, BLOCK_L)
        if n_blk > 1:
            tl.store(COUNT + row, 0)


# --------------------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------------------


class ProbeStepWorkspace:
    """Scratch and zeroed counters for :func:`probe_decode_step`, reused across steps and graphs.

    Buffers grow on demand but are never freed: a captured graph keeps raw pointers to the buffers it
    was captured with, so a replaced buffer stays alive (in ``_retired``). Sizes depend on the batch in
    both directions (smaller batches use narrower q|k|v tiles and more attention splits), so any capture
    may grow a buffer; run each shape eagerly before capturing it (SGLang's warm-up does): zeroed
    counters made inside a capture are zeroed only by the graph's replays, not for eager steps.
    Counters are zero between steps (each last arriver resets its own). Steps must not run concurrently
    on two streams with one workspace."""

    def __init__(self, device="cuda"):
        self.device = torch.device(device)
        self._bufs: dict[str, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []

    def get(self, name: str, numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            if buf is not None:
                self._retired.append(buf)
            alloc = torch.zeros if zero else torch.empty
            buf = alloc(max(numel, 1), dtype=dtype, device=self.device)
            self._bufs[name] = buf
        return buf[:numel]


_WORKSPACES: dict[torch.device, ProbeStepWorkspace] = {}


def default_workspace(device: torch.device) -> ProbeStepWorkspace:
    device = torch.device(device)
    if device not in _WORKSPACES:
        _WORKSPACES[device] = ProbeStepWorkspace(device)
    return _WORKSPACES[device]


def qkv_config(t: int, n: int, k: int, device: torch.device, block_k: int = 64, block_n: int = 64,
               programs_per_sm: int = 4, splits: Optional[int] = None) -> dict:
    """Tile sizes and K splits from host-known values only (T, N, K, SM count): enough programs to stream
    the weights from every SM (about ``programs_per_sm`` per SM), no more (partials cost bytes)."""
    block_t = 16 if t <= 16 else (32 if t <= 32 else 64)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(t, block_t)
    k_blocks = triton.cdiv(k, block_k)
    if splits is None:
        splits = max(1, min(k_blocks, triton.cdiv(programs_per_sm * num_sms(device, off_gpu=4), tiles)))
    k_iters = triton.cdiv(k_blocks, splits)
    splits = triton.cdiv(k_blocks, k_iters)  # no empty splits
    return {"BLOCK_T": block_t, "BLOCK_N": block_n, "BLOCK_K": block_k, "K_ITERS": k_iters, "SPLITS": splits}


def qkv_tile(t: int) -> dict:
    """The q|k|v split-K GEMV's tile for T rows. H200 sweeps (benchmarks/results/probe_decode_h200*.md,
    cold step without taps, us): 32 x 128 tiles against 64 x 64 ones, 23.5 vs 24.2 at 1 row, 24.6 vs
    30.0 at 8, 32.9 vs 37.9 at 32, 43.7 vs 51.5 at 64, 58.1 vs 69.5 at 128 (the 64 x 64 tiles at 4
    programs an SM: 27 splits; at 128 rows the two sides are separate runs, since the
    sweep had not timed this rule's 7 splits). Past 16 rows about two programs an SM (14 splits at
    32 / 64 rows, 7 at 128) beat four: each split's fp32 partials ([splits, T, N]) are written and summed
    back by one last arriver a tile, which costs more than the extra streaming programs gain once T is
    that wide."""
    return {"block_n": 32, "block_k": 128, "programs_per_sm": 4 if t <= 16 else 2}


def qkv_launch_config(t: int, n: int, k: int, device: torch.device, block_n: Optional[int] = None,
                      block_k: Optional[int] = None, splits: Optional[int] = None) -> dict:
    """What ``probe_decode_step`` launches the q|k|v GEMV with: ``qkv_tile``'s rule, where the caller names
    no block size or split count of its own."""
    tile = qkv_tile(t)
    return qkv_config(t, n, k, device, block_k=block_k or tile["block_k"], block_n=block_n or tile["block_n"],
                      programs_per_sm=tile["programs_per_sm"], splits=splits)


def attn_splits(t: int, window: int, device: torch.device, block_n: int, max_splits: int = 16) -> int:
    """Key-range splits per row (same rule as probe_attention.auto_num_splits): decode rows are a serial
    chain of gathers, so few rows need splitting to fill the GPU; many rows do not."""
    sms = num_sms(device, off_gpu=4)
    if t >= 2 * sms:
        return 1
    max_blocks = triton.cdiv(window, block_n) if window else max_splits
    return int(max(1, min(max_splits, max_blocks // 2, triton.cdiv(4 * sms, t))))


def probe_decode_step(
    features: torch.Tensor,
    w_qkv: torch.Tensor,
    kv_pool: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    row_pos: Optional[torch.Tensor],
    window: Optional[int],
    scale: float,
    wo: torch.Tensor,
    norm_w: torch.Tensor,
    wc: torch.Tensor,
    bc: torch.Tensor,
    out_scores: torch.Tensor,
    num_heads: int,
    eps: float = RMS_EPS,
    workspace: Optional[ProbeStepWorkspace] = None,
    block_n_attn: int = 64,
    attn_num_splits: Optional[int] = None,
    qkv_splits: Optional[int] = None,
    qkv_block_n: Optional[int] = None,
    qkv_block_k: Optional[int] = None,
    seq_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One probe decode step for T rows (one per request) in three launches; returns ``out_scores``.

    features [T, K] (the tapped, normalised rows, model dtype); w_qkv [HQ + 2D, K] = proj_q|proj_k|proj_v
    (HQ = num_heads * D); kv_pool [slots, 2D]; out_cache_loc [T] (slot of each row's new token);
    req_to_token [max_reqs, max_ctx]; req_pool_indices [T]; row_pos [T] (= seq_lens - 1: the new token's
    position; < 0 marks a padding row), or None with seq_lens [T] given instead (the kernels subtract the 1:
    no launch of its own in the chain); window None/0 = full causal; wo [HQ, HQ]; norm_w [HQ];
    wc [L, HQ]; bc [L]; out_scores [T, L] fp32, written in place (rows [:T] of a static buffer).

    Side effect: kv_pool[out_cache_loc[i]] = K|V of row i for rows with row_pos >= 0 (seq_lens >= 1). Rows with
    row_pos < 0 (seq_lens <= 0) write nothing, attend to no key (ctx = 0) and get finite scores
    sigmoid(classifier(RMSNorm(q))). SGLang's decode graphs pad with seq_len 1 (row_pos 0) and slot 0
    instead: such rows write slot 0, SGLang's reserved padding slot, and attend to it.
    CUDA-graph safe (grids from shapes; counters/scratch from ``workspace``, default: one per device)."""
    t, k = features.shape
    n = w_qkv.shape[0]
    hq = wo.shape[0]
    d = (n - hq) // 2
    num_labels = wc.shape[0]
    if hq != num_heads * d or n != hq + 2 * d or w_qkv.shape[1] != k:
        raise ValueError(f"probe_decode_step: w_qkv {tuple(w_qkv.shape)} is not q|k|v for {num_heads} heads "
                         f"and o_proj {tuple(wo.shape)} over {k} features")
    if kv_pool.dim() != 2 or kv_pool.shape[1] != 2 * d:
        raise ValueError(f"probe_decode_step: kv_pool must be [slots, {2 * d}], got {tuple(kv_pool.shape)}")
    if d & (d - 1) or hq & (hq - 1):
        raise ValueError(f"probe_decode_step: head_dim {d} and q width {hq} must be powers of two")
    if (row_pos is None) == (seq_lens is None):
        raise ValueError("probe_decode_step: give row_pos or seq_lens, one of them")
    pos_source = row_pos if row_pos is not None else seq_lens
    pos_offset = 1 if row_pos is None else 0
    for name, v in (("out_cache_loc", out_cache_loc), ("req_pool_indices", req_pool_indices),
                    ("row_pos" if row_pos is not None else "seq_lens", pos_source)):
        if tuple(v.shape) != (t,):
            raise ValueError(f"probe_decode_step: {name} must be [{t}], got {tuple(v.shape)}")
    if out_scores.dtype != torch.float32 or out_scores.shape[0] < t or out_scores.shape[1] != num_labels \
            or not out_scores.is_contiguous():
        raise ValueError(f"probe_decode_step: out_scores must be contiguous fp32 [>={t}, {num_labels}]")
    for name, v in (("features", features), ("kv_pool", kv_pool), ("req_to_token", req_to_token)):
        if v.stride(-1) != 1:
            raise ValueError(f"probe_decode_step: {name} needs a unit last stride")
    if t == 0:
        return out_scores
    w_qkv, wo, wc = w_qkv.contiguous(), wo.contiguous(), wc.contiguous()
    dev = features.device
    ws = workspace if workspace is not None else default_workspace(dev)
    # The three launches can run as a programmatic-dependent chain (kernels/pdl.py, family "probe"): the
    # attention's and the tail's programs then take SM slots while the GEMV runs, instead of waiting beside
    # the LM head for the slots its programs free. Measured slower, so PDL_PLAIN_FROM_ROWS launches them
    # plainly (the waits return at once); benchmarks/diag_pdl.py --probe-variants compares both. Only the
    # plain form is served and covered by the GPU tests.
    chain = pdl_launch_kwargs(dev, t, "probe")

    # 2. q|k|v + K|V write
    cfg = qkv_launch_config(t, n, k, dev, block_n=qkv_block_n, block_k=qkv_block_k, splits=qkv_splits)
    n_tiles, t_tiles = triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(t, cfg["BLOCK_T"])
    q_buf = ws.get("q", t * hq, w_qkv.dtype)
    part = ws.get("qkv_part", cfg["SPLITS"] * t * n if cfg["SPLITS"] > 1 else 1, torch.float32)
    _qkv_splitk_kernel[(n_tiles, cfg["SPLITS"], t_tiles)](
        features, w_qkv, part, ws.get("qkv_count", n_tiles * t_tiles, torch.int32, zero=True), q_buf,
        kv_pool, out_cache_loc, pos_source, t, k, features.stride(0), kv_pool.stride(0),
        HQ=hq, N=n, DOT16=_dot16(features.dtype, w_qkv.dtype),
        # launched plainly: its predecessor is another stream's (or the event joining them)
        num_warps=4, USE_PDL=chain["USE_PDL"], POS_OFFSET=pos_offset, **cfg,
    )

    # 3. attention (+ merge)
    splits = attn_num_splits or attn_splits(t, int(window or 0), dev, block_n_attn)
    block_h = max(16, triton.next_power_of_2(num_heads))
    ctx = ws.get("ctx", t * hq, torch.float32)
    _attn_split_kernel[(t, splits)](
        q_buf, kv_pool, req_to_token, req_pool_indices, pos_source,
        ws.get("attn_part", t * splits * hq if splits > 1 else 1, torch.float32),
        ws.get("attn_lse", t * splits * num_heads if splits > 1 else 1, torch.float32),
        ws.get("attn_count", t, torch.int32, zero=True), ctx,
        kv_pool.stride(0), req_to_token.stride(0), int(window or 0), float(scale),
        H=num_heads, D=d, BLOCK_H=block_h, BLOCK_N=block_n_attn, SPLITS=splits,
        DOT16=_dot16(w_qkv.dtype, kv_pool.dtype),
        POS_OFFSET=pos_offset, num_warps=4, num_stages=3 if t * splits < 16 * num_sms(dev, off_gpu=4) else 2, **chain,
    )

    # 4. tail
    block_o = min(32, hq)
    _tail_kernel[(t, hq // block_o)](
        q_buf, ctx, wo, norm_w, wc, bc, ws.get("h", t * hq, torch.float32),
        ws.get("tail_count", t, torch.int32, zero=True), out_scores, float(eps),
        HD=hq, L=num_labels, BLOCK_L=triton.next_power_of_2(num_labels), BLOCK_O=block_o, **chain,
    )
    return out_scores


def probe_decode_step_ref(features, w_qkv, kv_pool, out_cache_loc, req_to_token, req_pool_indices, row_pos,
                          window, scale, wo, norm_w, wc, bc, out_scores, num_heads, eps: float = RMS_EPS):
    """Same contract in plain torch: the served maths of ``ProbeRuntime.score`` for decode rows."""
    t = features.shape[0]
    hq = wo.shape[0]
    qkv = torch.nn.functional.linear(features.to(w_qkv.dtype), w_qkv)
    q = qkv[:, :hq].unflatten(-1, (num_heads, -1))
    valid = row_pos >= 0
    loc = out_cache_loc.long()[valid]
    kv_pool[loc] = qkv[:, hq:][valid].to(kv_pool.dtype)
    ctx = probe_attention_ref(q, kv_pool, req_to_token, req_pool_indices, row_pos, window, scale)
    out_scores[:t] = probe_tail_ref(q, ctx, wo, norm_w, wc, bc, eps)
    return out_scores
