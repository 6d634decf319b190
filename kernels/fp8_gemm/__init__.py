"""FP8 e4m3 block-128 GEMM with the bias fused, for gpt-oss's dense layers (qkv, o, lm_head).

y = x W^T + b with the conventions of kernels/reference.py: W [N, K] e4m3 with
`weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)] (a *ragged* last block over 2880 = 22.5 x 128,
no padding), x quantised per token in 1x128 groups along K (scale = amax/448, ragged last
group), products summed in fp32, the bias added to the fp32 accumulator, one rounding to the
output dtype.

Kernels:
  - `_quantize_group128_kernel`: x (any float) -> e4m3 codes + fp32 scales, one [rows, 128]
    tile per program. Scales are written MN-major (`[M, KB]` with strides (1, M)): the GEMM's
    per-K-block scale load is then contiguous, and it is the layout cuBLAS's block-scaled GEMM
    asks for;
  - `_fp8_gemm_kernel`: one [BLOCK_M, BLOCK_N] output tile per program, BLOCK_K = 128 = one
    scale group, so each K step is `acc += dot(a_q, w_q) * a_scale * w_scale` (the per-block
    promotion to fp32 that also bounds the error of Hopper's fp8 tensor-core accumulator).
    The accumulator starts at the bias. With `QUANTIZE_A` it reads x itself and quantises each
    1x128 group inside the K loop (decode: one launch for the whole linear). With split-K the
    K blocks are shared by `grid[1]` programs that write fp32 partials (the bias in split 0's);
    the last split of each tile to finish adds them in split order (deterministic; an arrival
    counter per tile, reset by that split), or `_splitk_sum_kernel` does in a second launch;
  - `_fp8_gemm_tma_kernel` (`Fp8GemmConfig.tma`, M > 16 without split-K): the same tile and maths on
    pre-quantised A, with A and W tiles loaded by TMA descriptors (kernels/tma.py), zero-filled
    past K's ragged edge; no split-K. Same bits as `_fp8_gemm_kernel`, 1.3x faster at M = 8192
    on an H200 (benchmarks/results/diag_tma.md);
  - `_fp8_gemv_kernel`, decode (M <= 16, `Fp8GemvConfig`): a grid of N tiles x K splits sized
    to keep every SM streaming weight slabs, all token rows in each program, each x group
    quantised once per N tile for the real rows only, tensor-core (swap-AB) or FMA blocks,
    the same split-K reductions (the last arriver loads one split or, `vector_reduce`, many
    splits per load: `_gemv_epilogue`);
  - `_fp8_gemv_kernel_xonce`, decode with `Fp8GemvConfig.x_once`: each program loads x and the
    scales for all its K blocks and quantises them in one pass, so only the weight stream is
    left between it and its MMAs (the K loop above waits a memory latency per block, the bulk
    of the GEMV's ~6 us fixed cost at decode sizes); `fixed_cost_variants` lists the configs
    the decode sweep and the GPU test compare;
  - `_fp8_gemv_oneshot_kernel`, decode M <= 4 with `Fp8GemvConfig.oneshot`: each program owns a
    few weight rows and all of K (two slab loads, no K loop, no split-K, so no partials and no
    last-arriver tail), x-side loads first, FMA blocks; x quantised in every program or, faster,
    pre-quantised by its producer (`fp8_linear(x_quant=...)`, the residual norm's `quantize`);
  - launch parameters come from `gemm_config(M, N, K)`, a heuristic by M bucket (no runtime
    autotune, so the interpreter stays fast and a CUDA graph sees one fixed kernel).

Exactness: the quantisation is bit-equal to the torch quantiser (`tl.math.div_rn` where torch
divides; rounding to the e4m3 grid done in fp32 arithmetic before the cast, because the Triton
interpreter's fp32 -> fp8 cast rounds wrongly, while casting a value already on the grid is
exact everywhere). The launchers read no tensor values on the host: CUDA-graph safe.

`fp8_gemm_ref` / `fp8_linear_ref` are the same contract in plain torch (the test oracle's
building blocks are the project's torch quantiser and dequantiser).

Layout (one module per size regime; this package's names are the public API, re-exported here):
  - ``quantize``: the e4m3 / bf16 grid roundings, `_quantize_tile`, the activation quantiser (every regime);
  - ``gemv``: decode, M <= 16: the split-K GEMV, its x-once form and the one-shot GEMV, and their launchers;
  - ``gemm``: M > 16 on pointer tiles (split-K where N gives too few tiles) and the launcher of every tile;
  - ``gemm_tma``: the same tiles with both operands by TMA (prefill, and mid rows without split-K);
  - ``config``: the launch configurations and their tables (`gemm_config`, `gemv_config`,
    `split_k_gemv_config`, `gemv_splits`, the sweeps' variants);
  - ``common``: the split-K sum kernel and counters, the grouped tile order, the operand checks;
  - ``reference``: `fp8_gemm_ref`, `fp8_linear_ref`, `quantize_activation_group128_ref`;
  - here: `fp8_gemm` and `fp8_linear`, the dispatch between them.
Kernels and the names they and their launchers use are looked up in the module that defines or imports them:
patch them there (e.g. ``gemv.interpreted``, ``gemv._fp8_gemv_kernel``), not on this package.
"""

from __future__ import annotations

from typing import Optional

import torch

import triton

from sglang_ext.kernels._util import H200_SMS, num_sms  # noqa: F401  (read through this package by tests, benchmarks)

from .common import COUNTERS_OWNER, MAX_SPLIT_TILES, _check_weight, _out_buffer  # noqa: F401
from .config import (GEMV_MAX_ROWS, ONESHOT_MAX_K_BLOCKS, ONESHOT_MAX_N, ONESHOT_MAX_ROWS,  # noqa: F401
                     ONESHOT_QUANT_MAX_WEIGHT_BYTES, ONESHOT_SWEEP, WIDE_TILE_MIN_PROGRAMS,
                     X_ONCE_MIN_K_BLOCKS_AT_8_ROWS, XONCE_MAX_SLAB, Fp8GemmConfig, Fp8GemvConfig, _auto_split,
                     _auto_split_gemv, dot_tile_decode_config, fixed_cost_variants, gemm_config, gemv_config,
                     gemv_splits, oneshot_applies, oneshot_config, oneshot_variants, split_k_gemv_config)
from .gemm import _launch_gemm
from .gemv import INTERPRETED_ONESHOT_BLOCK_N, VECTOR_REDUCE_MAX_REGS, _launch_gemv, pow2_chunks  # noqa: F401
# the device helpers other kernel modules call from their own @triton.jit functions (imported there by name)
from .quantize import (E4M3_MAX, GROUP, _quantize_tile, _round_to_bf16_grid, _round_to_e4m3_grid,  # noqa: F401
                       quantize_activation_group128)
from .reference import fp8_gemm_ref, fp8_linear_ref, quantize_activation_group128_ref  # noqa: F401


def fp8_gemm(a_fp8: torch.Tensor, a_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
             bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
             out: Optional[torch.Tensor] = None,
             config: Optional[Fp8GemmConfig | Fp8GemvConfig] = None) -> torch.Tensor:
    """y [M, N] = dequant(a) dequant(w)^T + bias from pre-quantised operands.

    a_fp8 e4m3 [M, K], a_scale fp32 [M, ceil(K/128)] (any strides), w_fp8 e4m3 [N, K],
    w_scale_inv fp32 [ceil(N/128), ceil(K/128)], bias [N] (any float) or None."""
    if a_fp8.dim() != 2 or a_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemm: a must be e4m3 [M, K], got {a_fp8.dtype} {tuple(a_fp8.shape)}")
    m, k = a_fp8.shape
    n = _check_weight(w_fp8, w_scale_inv, k)
    if tuple(a_scale.shape) != (m, triton.cdiv(k, GROUP)) or a_scale.dtype != torch.float32:
        raise ValueError(f"fp8_gemm: a_scale must be fp32 [{m}, {triton.cdiv(k, GROUP)}], got "
                         f"{a_scale.dtype} {tuple(a_scale.shape)}")
    out = _out_buffer(out, m, n, out_dtype, a_fp8.device, "fp8_gemm")
    if m == 0:
        return out
    cfg = config or gemm_config(m, n, k, a_fp8.device, x_prequantized=True)
    if isinstance(cfg, Fp8GemvConfig):
        return _launch_gemv(a_fp8, a_scale, w_fp8, w_scale_inv, bias, out, cfg, quantize_x=False)
    return _launch_gemm(a_fp8, a_scale, w_fp8, w_scale_inv, bias, out, cfg, quantize_a=False)


def _check_x_quant(x_quant, x: torch.Tensor, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_linear`'s x_quant -> (codes [M, K], scales [M, ceil(K/128)]), or a ValueError."""
    if not isinstance(x_quant, (tuple, list)) or len(x_quant) != 2:
        raise ValueError("fp8_linear: x_quant must be (codes, scales)")
    codes, scales = x_quant
    kb = triton.cdiv(k, GROUP)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.float8_e4m3fn or \
            tuple(codes.shape) not in ((m, k), tuple(x.shape)):
        raise ValueError(f"fp8_linear: x_quant codes must be e4m3 [{m}, {k}] (x's rows), got "
                         f"{getattr(codes, 'dtype', type(codes))} {tuple(getattr(codes, 'shape', ()))}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or tuple(scales.shape) != (m, kb):
        raise ValueError(f"fp8_linear: x_quant scales must be fp32 [{m}, {kb}], got "
                         f"{getattr(scales, 'dtype', type(scales))} {tuple(getattr(scales, 'shape', ()))}")
    if codes.device != x.device or scales.device != x.device:
        raise ValueError(f"fp8_linear: x_quant must be on x's device {x.device}")
    return codes.reshape(m, k), scales


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
               bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
               out: Optional[torch.Tensor] = None,
               config: Optional[Fp8GemmConfig | Fp8GemvConfig] = None,
               x_quant: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """y [..., N] = x W^T + b: x [..., K] (any float dtype) quantised per 1x128 group, W e4m3
    block-128. Output dtype defaults to x.dtype (as `fp8_linear_torch`). A `Fp8GemvConfig`
    (decode, the default at M <= 16) and `config.fuse_quant` quantise x inside the GEMM (one
    launch), else `quantize_activation_group128` runs first. No host reads: CUDA-graph safe.

    `x_quant` = (e4m3 codes [M, K], fp32 scales [M, ceil(K/128)], any strides): x already
    quantised by its producer, exactly `quantize_activation_group128(x)` (e.g. the residual norm's
    `quantize=True`); every path then reads it instead of quantising x (x still gives the shape and
    the output dtype; its values are not read). The caller vouches that the codes are x's."""
    lead = x.shape[:-1]
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    n = _check_weight(w_fp8, w_scale_inv, k)
    if x_quant is not None:
        x_quant = _check_x_quant(x_quant, x, m, k)
    out_dtype = out_dtype or x.dtype
    y = _out_buffer(out.view(m, n) if out is not None else None, m, n, out_dtype, x.device, "fp8_linear")
    if m > 0:
        cfg = config or gemm_config(m, n, k, x.device, x_prequantized=x_quant is not None)
        if x_quant is not None:
            if isinstance(cfg, Fp8GemvConfig):
                _launch_gemv(*x_quant, w_fp8, w_scale_inv, bias, y, cfg, quantize_x=False)
            else:
                _launch_gemm(*x_quant, w_fp8, w_scale_inv, bias, y, cfg, quantize_a=False)
        elif isinstance(cfg, Fp8GemvConfig):
            _launch_gemv(x2, None, w_fp8, w_scale_inv, bias, y, cfg, quantize_x=True)
        elif cfg.fuse_quant:
            _launch_gemm(x2, None, w_fp8, w_scale_inv, bias, y, cfg, quantize_a=True)
        else:
            a_fp8, a_scale = quantize_activation_group128(x2)
            _launch_gemm(a_fp8, a_scale, w_fp8, w_scale_inv, bias, y, cfg, quantize_a=False)
    return y.view(*lead, n)
