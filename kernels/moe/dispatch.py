"""The MoE layer's entry points, `fused_moe_fp8` (router included) and `fused_experts_fp8` (routing
given): host checks, the front (routing.py), then by the config's regime the one-shot kernels
(1..4 tokens, oneshot.py), the GEMV path (5..8, gemv.py) or the grouped GEMMs (9+ and prefill,
grouped.py, launched by `_experts` here), and the combine (combine.py).

Invariant: every host-side check runs before anything is launched and no call reads a device
value back (CUDA-graph capturable); without a config the table's row (`select_config`) is taken
here, for x's token count and the router's expert count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_ext.kernels.pdl import pdl_launch_kwargs
from sglang_ext.kernels.reference import BLOCK as QUANT_GROUP, SWIGLU_ALPHA
from sglang_ext.kernels.tma import descriptor, tma_2d_ok

from .combine import COMBINE_BLOCK_T, _combine_kernel
from .common import FP8, _cdiv, _check_routing, _check_weights, _check_x, _next_pow2, _out_buffer
from .config import MoeConfig, _check_config, select_config
from .gemv import _experts_gemv
from .grouped import GATHER_BLOCK_R, _gather_rows_kernel, _mlp1_kernel, _mlp2_kernel, _split_counters
from .oneshot import ONESHOT_MAX_SLAB_BYTES, OneshotConfig, fused_moe_decode_oneshot
from .routing import _decode_front, _front, _uses_decode_front


def _check_call(x, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2, config, out, num_experts=0, top_k=4):
    """Every host-side check, before anything is launched: (num_local, inter, config, out). Without a
    `config`, the table's row for x's tokens over `num_experts` router experts (select_config)."""
    _check_x("fused_moe_fp8", x)
    num_local, inter = _check_weights(x.shape[1], w1, w1_scale_inv, b1, w2, w2_scale_inv, b2)
    config = config or select_config(x.shape[0], num_experts, top_k)
    _check_config(config)
    return num_local, inter, config, _out_buffer("fused_moe_fp8", x, out)


def _experts(x, front, topk_weights, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2,
             limit, expert_offset, num_local, inter, config, out):
    """mlp1, mlp2 and the combine over the front's routing, x quantisation and sort."""
    _, topk_ids, xq, xs, sorted_pairs, block_expert, max_blocks = front
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return out
    if config.oneshot:
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
    _check_routing("fused_experts_fp8", x, topk_weights, topk_ids)
    front = _front(x, None, topk_ids, topk_ids.shape[1], (num_local, expert_offset, config.block_m, config.align_chunk))
    return _experts(x, front, topk_weights, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2,
                    limit, expert_offset, num_local, inter, config, out)
