"""Do tensor-memory-accelerator (TMA) loads speed up the prefill's FP8 GEMMs? A prototype on one H200.

Why: the 120b prefill of 8192 tokens spends 131 of its 187 ms in FP8 GEMMs whose operand tiles come
in through pointer loads (cp.async: one 16-byte copy a thread per instruction, address tensors held
in registers); at 255 registers a warpgroup the MoE's mlp1 issues from 2 warps per scheduler and
idles 57 % of cycles (ncu, session 7). A Hopper TMA copy moves a whole tile on one instruction from
a descriptor, frees the address registers and the issue slots, and zero-fills past the tensor's
edge (no K masks). Triton loads through descriptors when a kernel takes a host `TensorDescriptor`.

Three prototypes beside the shipped kernels, on the same operands, same process:
  - dense: `_fp8_gemm_kernel` (block-128 scales, bias in the accumulator) with A and B by TMA;
  - mlp2: `_mlp2_kernel` (h in the sorted, padded pair order is already contiguous) by TMA;
  - mlp1: the two-pass `_mlp1_kernel` with x gathered into the sorted pair order first (one small
    gather kernel, timed with it), so that x too is a TMA tile.
Each prints the shipped time, the TMA time, the ratio and the max difference of the outputs; the
dense rows add cuBLAS block-scaled `scaled_mm` + bias as the peer.

    python benchmarks/diag_tma.py --out benchmarks/results        # H200
    TRITON_INTERPRET=1 python benchmarks/diag_tma.py --smoke      # CPU: the prototypes' outputs only

Its H200 run (results/diag_tma.md) put the TMA tiles into the tables: kernels/fp8_gemm.py's
`_fp8_gemm_tma_kernel` and moe.py's `MoeConfig.tma`. The prototype's m128n256 dense rows are wrong
(one weight scale per 256-column tile, where the shipped kernel loads a vector) and were not adopted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

bc.import_project()
from bench_common import event_time, md_table, run_meta, write_results  # noqa: E402
from sglang_ext.kernels import fp8_gemm as fg  # noqa: E402
from sglang_ext.kernels import moe as mk  # noqa: E402

FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------
# dense
# ------------------------------------------------------------------------------------------------


@triton.jit
def _fp8_gemm_tma_kernel(a_desc, b_desc, A_SCALE, B_SCALE, BIAS, C, M, N, K,
                         stride_asm, stride_ask, stride_bsn, stride_bsk, stride_cm,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                         HAS_BIAS: tl.constexpr):
    BLOCK_K: tl.constexpr = 128
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_in_group = GROUP_M * tiles_n
    first_m = (pid // tiles_in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_in_group) % group_rows
    pid_n = (pid % tiles_in_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_m % M).to(tl.int64)
    a_scale_ptrs = A_SCALE + rows * stride_asm
    b_scale_ptr = B_SCALE + (pid_n * BLOCK_N // 128) * stride_bsn
    if HAS_BIAS:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + \
            tl.load(BIAS + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
        b = b_desc.load([pid_n * BLOCK_N, kb * BLOCK_K])
        a_s = tl.load(a_scale_ptrs + kb * stride_ask)
        b_s = tl.load(b_scale_ptr + kb * stride_bsk)
        acc += tl.dot(a, tl.trans(b)) * (a_s[:, None] * b_s)
    c_ptrs = C + rows[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def fp8_gemm_tma(a, a_scale, w, w_scale_inv, bias, out, block_m=128, block_n=128, group_m=8, warps=8, stages=4):
    m, k = a.shape
    n = w.shape[0]
    a_desc = TensorDescriptor.from_tensor(a, [block_m, 128])
    b_desc = TensorDescriptor.from_tensor(w, [block_n, 128])
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_tma_kernel[grid](a_desc, b_desc, a_scale, w_scale_inv, bias if bias is not None else w_scale_inv, out,
                               m, n, k, a_scale.stride(0), a_scale.stride(1), w_scale_inv.stride(0),
                               w_scale_inv.stride(1), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                               GROUP_M=group_m, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages)
    return out


# ------------------------------------------------------------------------------------------------
# MoE
# ------------------------------------------------------------------------------------------------


@triton.jit
def _tile_ids(num_blocks_m, num_n, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    width = GROUP_M * num_n
    first_m = pid // width * GROUP_M
    group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
    return first_m + (pid % width) % group_size, (pid % width) // group_size


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _mlp2_tma_kernel(h_desc, w_desc, HS, W2S, B2, SORTED_PAIRS, BLOCK_EXPERT, PAIR_OUT,
                     num_pairs, hidden, inter, num_blocks_m, stride_w2s_e, stride_w2s_n, stride_b2_e,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, HAS_B2: tl.constexpr):
    """_mlp2_kernel (SPLIT_K 1, fp8 h, BLOCK_N <= 128) with h and W2 tiles by TMA: W2 as [E * H, I]."""
    BLOCK_K: tl.constexpr = 128
    pid_m, pid_n = _tile_ids(num_blocks_m, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    expert = tl.load(BLOCK_EXPERT + pid_m)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SORTED_PAIRS + rows)
    row_ok = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    num_k_groups = tl.cdiv(inter, BLOCK_K)
    hs_ptrs = HS + rows.to(tl.int64) * num_k_groups
    ws_ptr = W2S + expert * stride_w2s_e + (pid_n * BLOCK_N // 128) * stride_w2s_n
    w_row = (expert * hidden + pid_n * BLOCK_N).to(tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, num_k_groups):
        a = h_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
        w = w_desc.load([w_row, kb * BLOCK_K])
        a_s = tl.load(hs_ptrs + kb, mask=row_ok, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * (a_s[:, None] * tl.load(ws_ptr + kb))
    if HAS_B2:
        acc += tl.load(B2 + expert * stride_b2_e + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = PAIR_OUT + pairs.to(tl.int64)[:, None] * hidden + cols[None, :]
    tl.store(out_ptrs, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gather_rows_kernel(XQ, XG, SORTED_PAIRS, num_pairs, hidden, TOP_K: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    """xg[r] = xq[token of sorted pair r] (padding rows: zeros)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    pairs = tl.load(SORTED_PAIRS + rows)
    ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    for h0 in range(0, hidden, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        m = ok[:, None] & (offs < hidden)[None, :]
        v = tl.load(XQ + tokens[:, None] * hidden + offs[None, :], mask=m, other=0.0)
        tl.store(XG + rows.to(tl.int64)[:, None] * hidden + offs[None, :], v, mask=(offs < hidden)[None, :])


@triton.jit
def _mlp1_tma_pass(x_desc, w_desc, XS, W1S, B1, tokens, row_ok, pid_m, expert, first_row, hidden, inter, limit, alpha,
                   stride_w1s_e, stride_w1s_n, stride_b1_e, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                   HAS_B1: tl.constexpr):
    BLOCK_K: tl.constexpr = 128
    num_k_groups = tl.cdiv(hidden, BLOCK_K)
    w_rows = first_row + tl.arange(0, ROWS)
    w_row_ok = w_rows < 2 * inter
    xs_ptrs = XS + tokens * num_k_groups
    ws_ptr = W1S + expert * stride_w1s_e + (first_row // 128) * stride_w1s_n
    w_coord = (expert * 2 * inter + first_row).to(tl.int32)
    acc = tl.zeros([BLOCK_M, ROWS], dtype=tl.float32)
    for kb in range(0, num_k_groups):
        a = x_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
        w = w_desc.load([w_coord, kb * BLOCK_K])
        a_s = tl.load(xs_ptrs + kb, mask=row_ok, other=0.0)
        w_s = tl.load(ws_ptr + kb, mask=first_row < 2 * inter, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * (a_s[:, None] * w_s)
    if HAS_B1:
        acc += tl.load(B1 + expert * stride_b1_e + w_rows, mask=w_row_ok, other=0.0).to(tl.float32)[None, :]
    acc_g, acc_l = tl.split(tl.reshape(acc, [BLOCK_M, ROWS // 2, 2]))
    return mk._gpt_oss_activation(acc_g, acc_l, limit, alpha)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _mlp1_tma_kernel(x_desc, w_desc, XS, W1S, B1, SORTED_PAIRS, BLOCK_EXPERT, HQ, HS,
                     num_pairs, hidden, inter, num_blocks_m, limit, alpha, stride_w1s_e, stride_w1s_n, stride_b1_e,
                     TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                     HAS_B1: tl.constexpr):
    """The two-pass _mlp1_kernel (FUSED_REQUANT, SPLIT_K 1) on x gathered into sorted order, by TMA."""
    pid_m, pid_n = _tile_ids(num_blocks_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    expert = tl.load(BLOCK_EXPERT + pid_m)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SORTED_PAIRS + rows)
    row_ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    h_lo = _mlp1_tma_pass(x_desc, w_desc, XS, W1S, B1, tokens, row_ok, pid_m, expert, pid_n * (2 * BLOCK_N), hidden,
                          inter, limit, alpha, stride_w1s_e, stride_w1s_n, stride_b1_e, BLOCK_M, BLOCK_N, HAS_B1)
    h_hi = _mlp1_tma_pass(x_desc, w_desc, XS, W1S, B1, tokens, row_ok, pid_m, expert, pid_n * (2 * BLOCK_N) + BLOCK_N,
                          hidden, inter, limit, alpha, stride_w1s_e, stride_w1s_n, stride_b1_e, BLOCK_M, BLOCK_N,
                          HAS_B1)
    h = tl.reshape(tl.permute(tl.join(h_lo, h_hi), (0, 2, 1)), [BLOCK_M, BLOCK_N])
    ok = row_ok[:, None] & col_ok[None, :]
    h = tl.where(ok, h, 0.0)
    GROUPS: tl.constexpr = BLOCK_N // 128
    q3, scale3 = mk._quantize_e4m3(tl.reshape(h, [BLOCK_M, GROUPS, 128]), 2)
    out_offs = rows.to(tl.int64)[:, None] * inter + cols[None, :]
    tl.store(HQ + out_offs, tl.reshape(q3, [BLOCK_M, BLOCK_N]), mask=ok)
    num_i_groups = tl.cdiv(inter, 128)
    groups = pid_n * GROUPS + tl.arange(0, GROUPS)
    tl.store(HS + rows.to(tl.int64)[:, None] * num_i_groups + groups[None, :], scale3,
             mask=row_ok[:, None] & (groups < num_i_groups)[None, :])


class MoeCase:
    """One prefill MoE layer's operands and routing (moe.py's sort), and the shipped kernels' buffers."""

    def __init__(self, tokens, experts, hidden, inter, dev, seed=0, config=None):
        g = torch.Generator(device=dev).manual_seed(seed)
        self.tokens, self.experts, self.hidden, self.inter, self.top_k = tokens, experts, hidden, inter, 4
        # the shipped kernels run the prefill table's row for this width (8192 tokens)
        self.config = config or mk.select_config(8192, inter)
        bm = self.config.block_m
        x = torch.randn(tokens, hidden, device=dev, generator=g)
        self.xq, self.xs = fg.quantize_activation_group128_ref(x)
        logits = torch.randn(tokens, experts, device=dev, generator=g)
        self.topk_ids = logits.topk(4, dim=1).indices.to(torch.int32)
        self.sorted_pairs, self.block_expert, self.max_blocks = mk.align_pairs(self.topk_ids, experts, 0, bm)
        kg_h, kg_i = triton.cdiv(hidden, 128), triton.cdiv(inter, 128)
        self.w1 = (torch.randn(experts, 2 * inter, hidden, device=dev, generator=g) * 0.5).to(FP8)
        self.w1s = torch.rand(experts, triton.cdiv(2 * inter, 128), kg_h, device=dev, generator=g) * 0.01 + 0.001
        self.b1 = (torch.randn(experts, 2 * inter, device=dev, generator=g) * 0.1).to(torch.bfloat16)
        self.w2 = (torch.randn(experts, hidden, inter, device=dev, generator=g) * 0.5).to(FP8)
        self.w2s = torch.rand(experts, kg_h, kg_i, device=dev, generator=g) * 0.01 + 0.001
        self.b2 = (torch.randn(experts, hidden, device=dev, generator=g) * 0.1).to(torch.bfloat16)
        rows = self.max_blocks * bm
        self.hq = torch.zeros(rows, inter, dtype=FP8, device=dev)
        self.hs = torch.zeros(rows, kg_i, dtype=torch.float32, device=dev)
        self.hq2 = torch.zeros_like(self.hq)
        self.hs2 = torch.zeros_like(self.hs)
        self.xg = torch.zeros(rows, hidden, dtype=FP8, device=dev)
        self.pair_out = torch.zeros(tokens * 4, hidden, device=dev)
        self.pair_out2 = torch.zeros_like(self.pair_out)
        self.interpreted = dev.type == "cpu"

    def shipped_mlp1(self):
        c = self.config
        mk._mlp1_kernel[(self.max_blocks * triton.cdiv(self.inter, c.mlp1_block_n),)](
            self.xq, self.xs, self.w1, self.w1s, self.b1, self.sorted_pairs, self.block_expert, self.hq, self.hs,
            self.hs, self.hs, self.hs, self.tokens * 4, self.hidden, self.inter, self.max_blocks, 7.0, 1.702,
            self.w1.stride(0), self.w1.stride(1), self.w1s.stride(0), self.w1s.stride(1), self.b1.stride(0),
            TOP_K=4, BLOCK_M=c.block_m, BLOCK_N=c.mlp1_block_n, GROUP_M=c.group_m, HAS_B1=True, FUSED_REQUANT=True,
            DOT_FP32=self.interpreted, SPLIT_K=1, ONE_DOT=c.mlp1_one_dot, PASSES=c.mlp1_passes,
            num_warps=c.mlp1_warps, num_stages=c.mlp1_stages)

    def shipped_mlp2(self):
        c = self.config
        mk._mlp2_kernel[(self.max_blocks * triton.cdiv(self.hidden, c.mlp2_block_n),)](
            self.hq, self.hs, self.hs, self.w2, self.w2s, self.b2, self.sorted_pairs, self.block_expert, self.pair_out,
            self.tokens * 4, self.hidden, self.inter, self.max_blocks,
            self.w2.stride(0), self.w2.stride(1), self.w2s.stride(0), self.w2s.stride(1), self.b2.stride(0),
            BLOCK_M=c.block_m, BLOCK_N=c.mlp2_block_n, GROUP_M=c.group_m, HAS_B2=True, A_IS_FP8=True,
            DOT_FP32=self.interpreted, SPLIT_K=1, num_warps=c.mlp2_warps, num_stages=c.mlp2_stages)

    def tma_mlp2(self, warps=4, stages=None, block_n=None):
        c = self.config
        bn = block_n or c.mlp2_block_n
        h_desc = TensorDescriptor.from_tensor(self.hq, [c.block_m, 128])
        w_desc = TensorDescriptor.from_tensor(self.w2.view(-1, self.inter), [bn, 128])
        _mlp2_tma_kernel[(self.max_blocks * triton.cdiv(self.hidden, bn),)](
            h_desc, w_desc, self.hs, self.w2s, self.b2, self.sorted_pairs, self.block_expert, self.pair_out2,
            self.tokens * 4, self.hidden, self.inter, self.max_blocks, self.w2s.stride(0), self.w2s.stride(1),
            self.b2.stride(0), BLOCK_M=c.block_m, BLOCK_N=bn, GROUP_M=c.group_m, HAS_B2=True,
            num_warps=warps, num_stages=stages or c.mlp2_stages)

    def tma_mlp1(self, warps=4, stages=None):
        c = self.config
        _gather_rows_kernel[(self.max_blocks * c.block_m // 16,)](
            self.xq, self.xg, self.sorted_pairs, self.tokens * 4, self.hidden, TOP_K=4, BLOCK_R=16, BLOCK_H=512,
            num_warps=4)
        x_desc = TensorDescriptor.from_tensor(self.xg, [c.block_m, 128])
        # two passes of 128 W1 rows (128 h columns) whatever the shipped row, as the table's TP1 row
        w_desc = TensorDescriptor.from_tensor(self.w1.view(-1, self.hidden), [128, 128])
        _mlp1_tma_kernel[(self.max_blocks * triton.cdiv(self.inter, 128),)](
            x_desc, w_desc, self.xs, self.w1s, self.b1, self.sorted_pairs, self.block_expert, self.hq2, self.hs2,
            self.tokens * 4, self.hidden, self.inter, self.max_blocks, 7.0, 1.702,
            self.w1s.stride(0), self.w1s.stride(1), self.b1.stride(0),
            TOP_K=4, BLOCK_M=c.block_m, BLOCK_N=128, GROUP_M=c.group_m, HAS_B1=True,
            num_warps=warps, num_stages=stages or c.mlp1_stages)

    def diffs(self):
        ok = self.sorted_pairs < self.tokens * 4
        return {"h_codes_differ": int((self.hq[ok].float() != self.hq2[ok].float()).sum()),
                "h_scale_max_rel": float(((self.hs[ok] - self.hs2[ok]).abs() / self.hs[ok].abs().clamp_min(1e-30))
                                         .max()),
                "mlp2_max_abs": float((self.pair_out - self.pair_out2).abs().max())}


def dense_rows(dev, m_list, iters):
    rows = []
    for name, n, k in (("qkv", 5120, 2880), ("o", 2880, 4096)):
        for m in m_list:
            g = torch.Generator(device=dev).manual_seed(m + n)
            x = torch.randn(m, k, device=dev, generator=g)
            a, a_s = fg.quantize_activation_group128_ref(x)
            w = (torch.randn(n, k, device=dev, generator=g) * 0.5).to(FP8)
            ws = torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=dev, generator=g) * 0.01 + 0.001
            bias = torch.randn(n, device=dev, generator=g).to(torch.bfloat16)
            out1 = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            out2 = torch.empty_like(out1)
            shipped = lambda: fg.fp8_gemm(a, a_s, w, ws, bias, out=out1)  # noqa: E731
            row = {"shape": name, "M": m, "N": n, "K": k, "flop": 2.0 * m * n * k}
            row["shipped_us"] = event_time(shipped, iters=iters, device=dev) * 1e6
            for bm_, bn_, wp, st in ((128, 128, 8, 4), (128, 128, 8, 3), (128, 256, 8, 3), (64, 128, 4, 4)):
                key = f"tma_m{bm_}n{bn_}w{wp}s{st}"
                try:
                    fn = lambda: fp8_gemm_tma(a, a_s, w, ws, bias, out2, bm_, bn_, 8, wp, st)  # noqa: E731
                    fn()
                    row[key + "_us"] = event_time(fn, iters=iters, device=dev) * 1e6
                    row[key + "_max_abs_diff"] = float((out1.float() - out2.float()).abs().max())
                except Exception as exc:  # noqa: BLE001
                    row[key + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
                if dev.type == "cpu":
                    break
            if dev.type == "cuda":
                try:
                    import bench_fp8_gemm as bfg
                    cub, _ = bfg.cublas_blockwise_fn(a, a_s, w, ws, bias)
                    row["cublas_us"] = event_time(cub, iters=iters, device=dev) * 1e6
                except Exception as exc:  # noqa: BLE001
                    row["cublas_error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def moe_rows(dev, cases, iters):
    rows = []
    for label, tokens, experts, inter in cases:
        c = MoeCase(tokens, experts, 2880 if dev.type == "cuda" else 256, inter, dev)
        c.shipped_mlp1()
        c.shipped_mlp2()
        row = {"case": label, "tokens": tokens, "experts": experts, "inter": inter, "config": c.config.short()
               if hasattr(c.config, "short") else str(c.config)}
        flop1 = 2.0 * tokens * 4 * c.hidden * 2 * inter
        flop2 = 2.0 * tokens * 4 * c.hidden * inter
        row["mlp1_shipped_us"] = event_time(c.shipped_mlp1, iters=iters, device=dev) * 1e6
        row["mlp2_shipped_us"] = event_time(c.shipped_mlp2, iters=iters, device=dev) * 1e6
        variants1 = ((4, 3), (4, 4), (4, 2)) if dev.type == "cuda" else ((4, 3),)
        for warps, stages in variants1:
            key = f"mlp1_tma_w{warps}s{stages}"
            try:
                fn = lambda: c.tma_mlp1(warps, stages)  # noqa: E731
                fn()
                row[key + "_us"] = event_time(fn, iters=iters, device=dev) * 1e6
            except Exception as exc:  # noqa: BLE001
                row[key + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
        variants2 = ((4, 3, None), (4, 4, None), (8, 3, None), (8, 4, None)) if dev.type == "cuda" else ((4, 3, None),)
        for warps, stages, bn in variants2:
            key = f"mlp2_tma_w{warps}s{stages}"
            try:
                fn = lambda: c.tma_mlp2(warps, stages, bn)  # noqa: E731
                fn()
                row[key + "_us"] = event_time(fn, iters=iters, device=dev) * 1e6
            except Exception as exc:  # noqa: BLE001
                row[key + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
        # outputs of the shipped and TMA kernels from the same inputs: run each once more, in order
        c.shipped_mlp1()
        c.tma_mlp1()
        c.shipped_mlp2()
        c.tma_mlp2()
        row.update(c.diffs())
        row["mlp1_TFLOPs_shipped"] = flop1 / row["mlp1_shipped_us"] / 1e6
        row["mlp2_TFLOPs_shipped"] = flop2 / row["mlp2_shipped_us"] / 1e6
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def shipped_dense_rows(dev, m_list, copies: int = 8):
    """The shipped `_fp8_gemm_kernel` tiles of gemm_config at decode-sized M (no split-K) against the
    same tiles with `tma=True`: CUDA graphs of back-to-back calls over `copies` weight copies (> L2,
    so the weights stream from HBM, as in a decode step); bits compared."""
    from dataclasses import replace

    rows = []
    for name, n, k in (("qkv", 5120, 2880), ("o", 2880, 4096)):
        g = torch.Generator(device=dev).manual_seed(n)
        ws = [(torch.randn(n, k, device=dev, generator=g) * 0.5).to(FP8) for _ in range(copies)]
        wsc = torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=dev, generator=g) * 0.01 + 0.001
        bias = torch.randn(n, device=dev, generator=g).to(torch.bfloat16)
        for m in m_list:
            a, a_s = fg.quantize_activation_group128_ref(torch.randn(m, k, device=dev, generator=g))
            cfg = fg.gemm_config(m, n, k, dev, x_prequantized=True)
            if not isinstance(cfg, fg.Fp8GemmConfig) or cfg.split_k != 1:
                continue
            row = {"shape": name, "M": m, "config": cfg.short(), "weight_MB": n * k / 1e6}
            outs = {}
            for label, c in (("pointer", replace(cfg, tma=False)), ("tma", replace(cfg, tma=True))):
                out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                calls = [lambda w=w, c=c, out=out: fg.fp8_gemm(a, a_s, w, wsc, bias, out=out, config=c) for w in ws]
                row[label + "_us"] = bc.graph_time_calls(calls, device=dev) * 1e6
                row[label + "_TBps"] = n * k / (row[label + "_us"] * 1e-6) / 1e12
                fg.fp8_gemm(a, a_s, ws[0], wsc, bias, out=out, config=c)
                outs[label] = out
            row["bits_equal"] = bool(torch.equal(outs["pointer"], outs["tma"]))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def markdown(meta, dense, moe) -> str:
    lines = [f"# TMA loads for the prefill's FP8 GEMMs: prototype vs shipped ({meta.get('gpu', 'CPU')})", "",
             f"`{meta['command']}` — {meta.get('date', '')}", "",
             "Times in us, medians of CUDA-event timed calls on the same operands. `diff`: max abs difference of "
             "the outputs from the shipped kernel's.", "", "## Dense FP8 GEMM + bias (pre-quantised x)", ""]
    for r in dense:
        ks = [k[:-3] for k in r if k.startswith("tma_") and k.endswith("_us")]
        best = min(ks, key=lambda k: r[k + "_us"]) if ks else None
        cub = r.get("cublas_us")
        lines.append(f"- {r['shape']} M={r['M']}: shipped {r['shipped_us']:.1f}"
                     + (f", cuBLAS {cub:.1f}" if cub else "")
                     + "".join(f", {k} {r[k + '_us']:.1f} (diff {r.get(k + '_max_abs_diff', float('nan')):.1e})"
                               for k in ks)
                     + (f"; best TMA vs shipped {r['shipped_us'] / r[best + '_us']:.2f}x" if best else "")
                     + (f", vs cuBLAS {cub / r[best + '_us']:.2f}x" if best and cub else ""))
    lines += ["", "## MoE prefill layer kernels", ""]
    for r in moe:
        ks = [k for k in r if k.endswith("_us")]
        lines.append(f"- {r['case']} ({r['tokens']} tokens, {r['experts']} experts, I {r['inter']}): "
                     + ", ".join(f"{k[:-3]} {r[k]:.1f}" for k in ks)
                     + f"; h codes differing {r['h_codes_differ']}, h scale rel {r['h_scale_max_rel']:.1e}, "
                       f"mlp2 max abs {r['mlp2_max_abs']:.1e}")
        errs = [f"{k}: {v}" for k, v in r.items() if k.endswith("_error")]
        lines += [f"  - {e}" for e in errs]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter: tiny shapes, outputs compared only")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--shipped-dense", default=None, metavar="M,M,...",
                    help="only the shipped dense tiles with / without TMA at these M (decode sizes), "
                         "written to diag_tma_dense_decode.{json,md}")
    args = ap.parse_args(argv)
    if args.shipped_dense:
        dev = torch.device("cpu" if args.smoke else "cuda")
        rows = shipped_dense_rows(dev, [int(m) for m in args.shipped_dense.split(",")], copies=1 if args.smoke else 8)
        meta = run_meta("python benchmarks/diag_tma.py " + " ".join(sys.argv[1:]))
        md = "\n".join([f"# Shipped dense FP8 GEMM tiles with / without TMA at decode sizes ({meta.get('gpu', 'CPU')})",
                        "", f"`{meta['command']}` — {meta.get('date', '')}", "",
                        "CUDA graphs of back-to-back calls over 8 weight copies (beyond L2); us per call.", "",
                        md_table(rows, [("shape", "shape", None), ("M", "M", None), ("config", "config", None),
                                        ("pointer us", "pointer_us", "{:.1f}"), ("TMA us", "tma_us", "{:.1f}"),
                                        ("pointer TB/s", "pointer_TBps", "{:.2f}"), ("TMA TB/s", "tma_TBps", "{:.2f}"),
                                        ("bits equal", "bits_equal", None)])]) + "\n"
        if args.out:
            write_results(args.out, "diag_tma_dense_decode", meta, rows, md)
        print(md)
        return
    dev = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        dense = dense_rows(dev, [160], 1)
        moe = moe_rows(dev, [("tiny", 48, 4, 256)], 1)
    else:
        dense = dense_rows(dev, [2048, 8192], args.iters)
        moe = moe_rows(dev, [("120b TP1", 8192, 128, 2880), ("20b TP1", 8192, 32, 2880),
                             ("120b TP4", 8192, 128, 720)], args.iters)
    meta = run_meta("python benchmarks/diag_tma.py" + (" --smoke" if args.smoke else ""))
    if args.out:
        write_results(args.out, "diag_tma", meta, {"dense": dense, "moe": moe}, markdown(meta, dense, moe))
    else:
        print(markdown(meta, dense, moe))


if __name__ == "__main__":
    main()
