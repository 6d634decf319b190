"""Windowed paged MQA attention of the SingProbe head, reading K/V from the probe's own slot pool.

The probe stores 128 values per token (K then V of its single shared head) at the *base model's* KV-cache
slot of that token, so radix-cache hits reuse probe K/V for free and one kernel serves prefill rows and
decode rows alike: each query row names its request (``row_req``) and absolute position (``row_pos``),
and its keys are that request's positions ``max(0, pos-W+1) .. pos`` looked up through ``req_to_token``.

One program per query row handles all H query heads against the shared K/V (MQA: each K/V block is read
once for 8 heads), with an fp32 online softmax. Decode batches have too few rows to fill a GPU while each
row walks up to W/64 dependent gathers, so the launcher can split a row's key range over several programs
(flash-decoding) and merge them in a second pass; the split count depends only on T, W and the SM count.
The launcher reads no tensor values on the host (grid from T, key ranges computed in-kernel), so it can be
captured in a CUDA graph. Rows with a negative position (graph padding) produce zeros instead of NaN.

Precision: scores, softmax and accumulators are fp32. fp32 inputs are multiplied as fp32 (IEEE dots).
When q and K/V are both bf16 (or fp16), the dots run on tensor cores without losing that: 16-bit
products are exact in the fp32 accumulator, and the fp32 probabilities enter the P.V dot as a hi + lo
pair of 16-bit values (~16 mantissa bits); on an H200 that is 3-10x faster than the fp32 dots.

``probe_attention_ref`` is the same contract in plain torch (the CPU fallback and the test oracle).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

import triton
import triton.language as tl

from ._util import interpreted, num_sms
from .online_softmax import block_weights

DEFAULT_BLOCK_N = 64


@triton.jit
def _attend_key_range(q, KV, REQ_TO_TOKEN, req, pos, split, window, scale, stride_kv, stride_r2t,
                      D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      SPLIT_BF16_DOT: tl.constexpr):
    """q [BLOCK_H, D] of one row (request `req`, position `pos`) against its keys through req_to_token, in an
    fp32 online softmax: (acc [BLOCK_H, D] unnormalised, running max m_i, running sum l_i; l_i == 0 without
    keys). With NUM_SPLITS > 1 only this split's contiguous run of the row's key blocks."""
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    # Key range [lo, hi) of this row; with splits, this program takes a contiguous run of its blocks.
    lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    hi = pos + 1
    if NUM_SPLITS > 1:
        n_blocks = tl.maximum(tl.cdiv(hi - lo, BLOCK_N), 0)
        per_split = tl.cdiv(n_blocks, NUM_SPLITS)
        lo = lo + split * per_split * BLOCK_N
        hi = tl.minimum(lo + per_split * BLOCK_N, hi)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    tok_base = REQ_TO_TOKEN + req * stride_r2t

    for start in range(lo, hi, BLOCK_N):
        key_pos = start + offs_n
        key_ok = key_pos < hi
        slot = tl.load(tok_base + key_pos, mask=key_ok, other=0).to(tl.int64)
        kv_row = KV + slot[:, None] * stride_kv + offs_d[None, :]
        k = tl.load(kv_row, mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(kv_row + D, mask=key_ok[:, None], other=0.0)
        # natural-log units: the split LSEs and their merge are in them
        m_new, alpha, p, l_i = block_weights(m_i, l_i, q, k, start, offs_n, hi, scale, False, SPLIT_BF16_DOT)
        if SPLIT_BF16_DOT:
            # fp32 p as hi + lo 16-bit parts: ~16 mantissa bits on tensor cores instead of an fp32
            # FMA dot that is 3-10x slower at decode sizes.
            p_hi = p.to(v.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
            pv = tl.dot(p_hi, v) + tl.dot(p_lo, v)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _probe_attention_kernel(
    Q,  # [T, H, D]
    KV,  # [num_slots, 2*D]: K in [:D], V in [D:]
    REQ_TO_TOKEN,  # [max_reqs, max_ctx] int32
    ROW_REQ,  # [T]
    ROW_POS,  # [T]
    OUT,  # [T, H, D] fp32; with splits: [T, NUM_SPLITS, H, D] partial outputs
    LSE,  # with splits: [T, NUM_SPLITS, H] fp32 log-sum-exp of each partial (unused otherwise)
    stride_q_t,
    stride_q_h,
    stride_kv,
    stride_r2t,
    stride_o_t,
    stride_o_h,
    window,  # 0 = full causal
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_BF16_DOT: tl.constexpr,  # q and K/V both bf16 (or both fp16): tensor-core dots, see the loop
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    req = tl.load(ROW_REQ + row).to(tl.int64)
    pos = tl.load(ROW_POS + row).to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    head_ok = offs_h < H

    q = tl.load(Q + row * stride_q_t + offs_h[:, None] * stride_q_h + offs_d[None, :],
                mask=head_ok[:, None], other=0.0)
    if not SPLIT_BF16_DOT:
        q = q.to(tl.float32)

    acc, m_i, l_i = _attend_key_range(q, KV, REQ_TO_TOKEN, req, pos, split, window, scale, stride_kv, stride_r2t,
                                      D, BLOCK_H, BLOCK_N, NUM_SPLITS, SPLIT_BF16_DOT)

    # l_i == 0 only without keys (pos < 0: CUDA-graph padding, or an empty split); emit zeros, not NaN.
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    o_ptr = OUT + row * stride_o_t + offs_h[:, None] * stride_o_h + offs_d[None, :]
    if NUM_SPLITS > 1:
        o_ptr += split * (H * D)
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(LSE + (row * NUM_SPLITS + split) * H + offs_h, lse, mask=head_ok)
    tl.store(o_ptr, out, mask=head_ok[:, None])


@triton.jit
def _probe_attention_combine_kernel(
    PART,  # [T, NUM_SPLITS, H, D] fp32
    LSE,  # [T, NUM_SPLITS, H] fp32
    OUT,  # [T, H, D] fp32
    stride_o_t,
    stride_o_h,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    head_ok = offs_h < H
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for sp in tl.static_range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(LSE + (row * NUM_SPLITS + sp) * H + offs_h, mask=head_ok, other=float("-inf")))
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for sp in tl.static_range(NUM_SPLITS):
        lse = tl.load(LSE + (row * NUM_SPLITS + sp) * H + offs_h, mask=head_ok, other=float("-inf"))
        w = tl.exp(lse - m_safe)  # 0 for empty splits
        part = tl.load(PART + ((row * NUM_SPLITS + sp) * H + offs_h[:, None]) * D + offs_d[None, :],
                       mask=head_ok[:, None], other=0.0)
        acc += w[:, None] * part
        den += w
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(OUT + row * stride_o_t + offs_h[:, None] * stride_o_h + offs_d[None, :], out, mask=head_ok[:, None])


def _check_inputs(q, kv_pool, req_to_token, row_req, row_pos):
    if q.dim() != 3:
        raise ValueError(f"probe_attention: q must be [T, H, D], got {tuple(q.shape)}")
    t, _, d = q.shape
    if kv_pool.dim() != 2 or kv_pool.shape[1] != 2 * d:
        raise ValueError(f"probe_attention: kv_pool must be [num_slots, {2 * d}], got {tuple(kv_pool.shape)}")
    if req_to_token.dim() != 2:
        raise ValueError(f"probe_attention: req_to_token must be 2-D, got {tuple(req_to_token.shape)}")
    if tuple(row_req.shape) != (t,) or tuple(row_pos.shape) != (t,):
        raise ValueError(
            f"probe_attention: row_req/row_pos must be [{t}], got {tuple(row_req.shape)}/{tuple(row_pos.shape)}"
        )
    if d & (d - 1):
        raise ValueError(f"probe_attention: head_dim must be a power of two, got {d}")


MAX_SPLITS = 16


def _use_16bit_dots(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Tensor-core dots when q and K/V share a 16-bit type. Not for bf16 under TRITON_INTERPRET: the
    interpreter's bf16 tl.dot returns garbage (triton 3.8), so there bf16 takes the upcast path and the
    16-bit path is covered by fp16 (same code) on CPU and by the gpu test on a GPU."""
    if q_dtype != kv_dtype or q_dtype not in (torch.float16, torch.bfloat16):
        return False
    return not (interpreted() and q_dtype == torch.bfloat16)


def auto_num_splits(num_rows: int, window: Optional[int], device: torch.device, block_n: int = DEFAULT_BLOCK_N) -> int:
    """Key-range splits per row, from host-known values only (rows, window, SM count): a row's keys are
    a serial loop of dependent gathers, so a few rows (decode) leave the GPU idle unless the range is
    split; enough rows fill it without the extra combine pass. Tuned on an H200 (132 SMs), W=2048:
    T=1 146 -> 6.5 us, T=64 46 -> 14 us, T>=264 unsplit."""
    sms = num_sms(device, off_gpu=1)
    if device.type != "cuda" or num_rows >= 2 * sms:
        return 1
    max_blocks = triton.cdiv(window, block_n) if window else MAX_SPLITS  # full causal: length unknown here
    return int(max(1, min(MAX_SPLITS, max_blocks // 2, triton.cdiv(4 * sms, num_rows))))


def probe_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    row_req: torch.Tensor,
    row_pos: torch.Tensor,
    window: Optional[int],
    scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    block_n: int = DEFAULT_BLOCK_N,
    num_splits: Optional[int] = None,
    num_warps: int = 4,
    num_stages: Optional[int] = None,
) -> torch.Tensor:
    """Launch the kernel: ctx [T, H, D] fp32 (written into ``out`` when given, for CUDA-graph buffers).

    ``window`` None/0 means full causal; ``scale`` defaults to 1/sqrt(D). ``num_splits`` 1 is one program
    per row; >1 splits each row's key range over that many programs plus a combine pass (flash-decoding);
    None picks from T and the window (:func:`auto_num_splits`)."""
    _check_inputs(q, kv_pool, req_to_token, row_req, row_pos)
    t, h, d = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if out is None:
        out = torch.empty((t, h, d), dtype=torch.float32, device=q.device)
    elif out.shape != (t, h, d) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"probe_attention: out must be fp32 [{t}, {h}, {d}] with unit last stride")
    if t == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_pool.stride(-1) != 1 or req_to_token.stride(-1) != 1:
        raise ValueError("probe_attention: kv_pool and req_to_token need a unit last stride")
    if num_splits is None:
        num_splits = auto_num_splits(t, window, q.device, block_n)
    if num_stages is None:
        # Deeper K/V prefetch pays while programs are few; with thousands it only costs occupancy.
        num_stages = 3 if t * num_splits < 16 * num_sms(q.device, off_gpu=1) else 2
    block_h = max(16, triton.next_power_of_2(h))
    if num_splits > 1:
        part = torch.empty((t, num_splits, h, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((t, num_splits, h), dtype=torch.float32, device=q.device)
        dst, stride_t, stride_h = part, num_splits * h * d, d
    else:
        part = lse = None
        dst, stride_t, stride_h = out, out.stride(0), out.stride(1)
    _probe_attention_kernel[(t, num_splits)](
        q, kv_pool, req_to_token, row_req, row_pos, dst, lse if lse is not None else dst,
        q.stride(0), q.stride(1), kv_pool.stride(0), req_to_token.stride(0), stride_t, stride_h,
        int(window or 0), float(scale),
        H=h, D=d, BLOCK_H=block_h, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        SPLIT_BF16_DOT=_use_16bit_dots(q.dtype, kv_pool.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _probe_attention_combine_kernel[(t,)](
            part, lse, out, out.stride(0), out.stride(1), H=h, D=d, BLOCK_H=block_h, NUM_SPLITS=num_splits,
        )
    return out


def probe_attention_ref(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    row_req: torch.Tensor,
    row_pos: torch.Tensor,
    window: Optional[int],
    scale: Optional[float] = None,
    max_elems: int = 1 << 24,
) -> torch.Tensor:
    """Same contract as :func:`probe_attention` in plain torch (fp32), vectorised over rows in chunks.

    Gathers each row's key slots through ``req_to_token`` exactly as the kernel does; ``max_elems`` bounds
    the gathered [rows, keys, 2D] block so long full-causal prompts do not exhaust memory."""
    _check_inputs(q, kv_pool, req_to_token, row_req, row_pos)
    t, h, d = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    out = torch.zeros((t, h, d), dtype=torch.float32, device=q.device)
    if t == 0:
        return out
    pos = row_pos.to(torch.int64)
    req = row_req.to(torch.int64)
    lo = (pos - window + 1).clamp(min=0) if window else torch.zeros_like(pos)
    n_keys = (pos - lo + 1).clamp(min=0)
    max_ctx = req_to_token.shape[1]
    nk = n_keys.tolist()  # one host read; this is the reference, not the graph-captured path
    r0 = 0
    while r0 < t:
        # Rows per chunk so that rows * keys * 2D stays under max_elems (at least one row).
        r1 = r0 + 1
        width = nk[r0]
        while r1 < t and (r1 + 1 - r0) * max(width, nk[r1]) * 2 * d <= max_elems:
            width = max(width, nk[r1])
            r1 += 1
        if width > 0:
            offs = lo[r0:r1, None] + torch.arange(width, device=q.device)[None, :]  # [R, N]
            valid = offs <= pos[r0:r1, None]
            slots = req_to_token[req[r0:r1, None], offs.clamp(max=max_ctx - 1)].to(torch.int64)
            kv = kv_pool[slots.clamp(min=0)].float()  # [R, N, 2D]
            k, v = kv[..., :d], kv[..., d:]
            scores = torch.einsum("rhd,rnd->rhn", q[r0:r1].float(), k) * scale
            scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            ctx = torch.einsum("rhn,rnd->rhd", probs, v)
            has_keys = (n_keys[r0:r1] > 0)[:, None, None]
            out[r0:r1] = torch.where(has_keys, ctx, torch.zeros_like(ctx))
        r0 = r1
    return out
