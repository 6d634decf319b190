"""Block-scaled FP8 GEMM building blocks in Gluon (Triton's explicit-layout language, sm_90 wgmma), whose tensor
cores keep working while each K block's scales are applied. Compiled CUDA only: Gluon has no interpreter, so on
a CPU the Triton kernels (`fp8_gemm`, `moe`) compute the same sums.

Why: the prefill's FP8 GEMMs (the dense layers and the MoE's mlp1 / mlp2) apply each 128-wide K block's scales to
the block's product before adding it (`acc += dot(a, w) * a_s * w_s`: the per-block promotion to fp32). Triton's
language waits for a dot's result at once (`wgmma.wait_group 0`, benchmarks/results/diag_wgmma_wait.md), so the
warpgroup's MMAs stop while it scales: our kernels run at ~600-750 TFLOP/s, DeepGEMM's grouped GEMM 1.24-1.63x
that on the MoE's shapes (diag_moe_deepgemm_padded.md) but on 128-row expert blocks. Gluon exposes the
asynchronous wgmma: `scaled_k_loop` issues block kb's MMA, then scales and adds block kb - 1's finished product
while kb's runs (one wgmma group in flight, `DEPBAR.LE gsb0, 0x1` in the machine code:
diag_gluon_fp8_gemm_compile.md).

Status (session 21): compiled for sm_90a here with Triton 3.6 (the device image's) and 3.8; never run on a GPU.
`fp8_gemm_gluon` (the dense GEMM: `Fp8GemmConfig.gluon`, benchmarks/diag_gluon_fp8_gemm.py) and the MoE kernels
built on the loop (kernels/moe_gluon.py, `MoeConfig.mlp1_gluon` / `mlp2_gluon` / `gluon_persistent`) are measured
by stages gluon22, gluon22ab and gluon22t of benchmarks/run_h200.sh; nothing served takes them.

    y [M, N] = sum_kb (A_kb W_kb^T) * a_s[:, kb] * w_s[n // 128, kb]   (fp32 sums, block sums in K order)
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from sglang_ext.kernels.fp8_gemm import num_sms
from sglang_ext.kernels.tma import tma_2d_layout_ok

BLOCK_K = gl.constexpr(128)  # = the quantisation block: one scale per row (A) and per 128 rows (W) a K step
K_TILE = 128  # the same, as the host's int


@gluon.jit
def _issue_block(a_bufs, w_bufs, ready, g, zero, STAGES: gl.constexpr):
    """The MMA of the ring's block g (asynchronous), once its tiles have landed (its slot's mbarrier, phase by
    reuse)."""
    slot = g % STAGES
    mbarrier.wait(ready.index(slot), phase=(g // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _request_block(a_desc, w_desc, a_bufs, w_bufs, ready, g0, kb, num_kb, off_a, off_w, STAGES: gl.constexpr):
    """TMA of K block kb's A tile (rows off_a..) and W tile (rows off_w..) into the ring's slot (g0 + kb) % STAGES
    (nothing past the last block)."""
    if kb < num_kb:
        slot = (g0 + kb) % STAGES
        mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_a, kb * BLOCK_K], ready.index(slot), a_bufs.index(slot))
        tma.async_copy_global_to_shared(w_desc, [off_w, kb * BLOCK_K], ready.index(slot), w_bufs.index(slot))


@gluon.jit
def allocate_ring(a_desc, w_desc, STAGES: gl.constexpr):
    """The TMA ring: STAGES slots of one A and one W tile, an mbarrier each."""
    # one slot would issue block 1's MMA before its tiles were requested: a wait that never ends
    gl.static_assert(STAGES >= 2, "scaled_k_loop needs 2+ ring slots")
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    return a_bufs, w_bufs, ready


@gluon.jit
def release_ring(ready, STAGES: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


@gluon.jit
def _row_scale(a_s_ptrs, a_s_step, row_ok, w_s_ptr, kb, PER_COLUMN: gl.constexpr):
    """Block kb's scale by row: a_s * w_s (one W scale block a tile), or a_s alone where w_s goes by column."""
    a_s = gl.load(a_s_ptrs + kb * a_s_step, mask=row_ok, other=0.0)
    if PER_COLUMN:
        return a_s
    else:
        return a_s * gl.load(w_s_ptr + kb)


@gluon.jit
def _add_scaled(acc, p, s, w_s_ptr, w_s_hi, kb, PER_COLUMN: gl.constexpr):
    """acc + p * scale, the scale as the Triton kernels form it (a_s * w_s, then one fma per element). 256-wide
    tiles (PER_COLUMN): columns 0..127 take scale block w_s_ptr, the others w_s_ptr + w_s_hi (two scalar loads: a
    pointer per column cost 64 registers a thread and spilled)."""
    if PER_COLUMN:
        BLOCK_N: gl.constexpr = acc.shape[1]
        hi = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout)) >= 128
        w_s = gl.where(hi, gl.load(w_s_ptr + w_s_hi + kb), gl.load(w_s_ptr + kb))
        return acc + p * (s[:, None] * w_s[None, :])
    else:
        return acc + p * s[:, None]


@gluon.jit
def request_first_blocks(a_desc, w_desc, a_bufs, w_bufs, ready, g0, off_a, off_w, num_kb, STAGES: gl.constexpr):
    """The TMA requests a K loop starts with: its first STAGES blocks into the ring from block g0 on. A persistent
    program makes them for its next tile before the current tile's epilogue (the ring is free once the loop has
    waited for its last MMA), so the copies run while it stores."""
    for i in gl.static_range(STAGES):
        _request_block(a_desc, w_desc, a_bufs, w_bufs, ready, g0, i, num_kb, off_a, off_w, STAGES)


@gluon.jit
def scaled_k_loop(acc, a_desc, w_desc, a_bufs, w_bufs, ready, g0, off_a, off_w, a_s_ptrs, a_s_step, row_ok, w_s_ptr,
                  w_s_hi, num_kb, requested, STAGES: gl.constexpr):
    """acc + sum_kb (A_kb W_kb^T) * a_s[:, kb] * w_s[kb] over the K blocks kb < num_kb, acc fp32 [BLOCK_M, BLOCK_N]
    in the wgmma's layout (zeros, or the bias), the block sums added in K order: A's rows off_a.. from a_desc, W's
    rows off_w.. from w_desc, a_s_ptrs + kb * a_s_step the A rows' scales (masked by row_ok), w_s_ptr + kb the W
    scale of tiles of <= 128 rows (one scale block) and of a 256-row tile's first 128 rows, w_s_ptr + w_s_hi + kb
    that of its last 128 (the caller keeps it inside the tensor where those rows lie past the weight's edge: their
    columns are dropped; w_s_hi unused for narrower tiles). The ring's blocks are numbered on from
    g0 (a kernel calling this again passes g0 + the blocks used), so its slots' mbarrier phases carry over; the
    ring holds no request when it returns. requested != 0: the caller made the first requests already
    (`request_first_blocks`).

    Block kb's MMA is issued, then block kb - 1's product (finished: `warpgroup_mma_wait(num_outstanding=1)`)
    is scaled and added while kb's runs, and block kb + STAGES - 1's tiles are requested into the slot kb - 1
    freed. The two products in flight live in two loop-carried register sets (the loop runs over pairs of K
    blocks): one variable swapped each iteration made ptxas serialise every wgmma (its C7514 warning; in the
    machine code a wait after each one)."""
    PER_COLUMN: gl.constexpr = w_desc.block_type.shape[0] > 128
    if requested == 0:
        request_first_blocks(a_desc, w_desc, a_bufs, w_bufs, ready, g0, off_a, off_w, num_kb, STAGES)
    zero = gl.zeros_like(acc)
    p0 = _issue_block(a_bufs, w_bufs, ready, g0, zero, STAGES)
    s0 = _row_scale(a_s_ptrs, a_s_step, row_ok, w_s_ptr, 0, PER_COLUMN)
    for pair in range((num_kb - 1) // 2):
        kb = 1 + 2 * pair
        p1 = _issue_block(a_bufs, w_bufs, ready, g0 + kb, zero, STAGES)
        p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0, ))  # block kb - 1 done, kb running
        acc = _add_scaled(acc, p0, s0, w_s_ptr, w_s_hi, kb - 1, PER_COLUMN)
        _request_block(a_desc, w_desc, a_bufs, w_bufs, ready, g0, kb + STAGES - 1, num_kb, off_a, off_w, STAGES)
        s1 = _row_scale(a_s_ptrs, a_s_step, row_ok, w_s_ptr, kb, PER_COLUMN)
        p0 = _issue_block(a_bufs, w_bufs, ready, g0 + kb + 1, zero, STAGES)
        p1 = warpgroup_mma_wait(num_outstanding=1, deps=(p1, ))  # block kb done, kb + 1 running
        acc = _add_scaled(acc, p1, s1, w_s_ptr, w_s_hi, kb, PER_COLUMN)
        _request_block(a_desc, w_desc, a_bufs, w_bufs, ready, g0, kb + STAGES, num_kb, off_a, off_w, STAGES)
        s0 = _row_scale(a_s_ptrs, a_s_step, row_ok, w_s_ptr, kb + 1, PER_COLUMN)
    last = 1 + 2 * ((num_kb - 1) // 2)  # num_kb when num_kb is odd: one block left over otherwise
    if last < num_kb:
        q1 = _issue_block(a_bufs, w_bufs, ready, g0 + last, zero, STAGES)
        d0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0, ))
        acc = _add_scaled(acc, d0, s0, w_s_ptr, w_s_hi, last - 1, PER_COLUMN)
        s1 = _row_scale(a_s_ptrs, a_s_step, row_ok, w_s_ptr, last, PER_COLUMN)
        d1 = warpgroup_mma_wait(num_outstanding=0, deps=(q1, ))
        acc = _add_scaled(acc, d1, s1, w_s_ptr, w_s_hi, last, PER_COLUMN)
    else:
        d0 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, ))
        acc = _add_scaled(acc, d0, s0, w_s_ptr, w_s_hi, last - 1, PER_COLUMN)
    return acc


@gluon.jit
def grouped_tile(pid, num_tiles_m, num_tiles_n, GROUP_M: gl.constexpr):
    """(row tile, column tile) of tile pid in grouped order: GROUP_M row tiles visit each column tile back to
    back, while its weights are in L2 (the Triton kernels' order, `fp8_gemm._grouped_tile`)."""
    width = GROUP_M * num_tiles_n
    first_m = pid // width * GROUP_M
    group_rows = gl.minimum(num_tiles_m - first_m, GROUP_M)
    return first_m + (pid % width) % group_rows, (pid % width) // group_rows


def gluon_tile_error(block_m: int, block_n: int, num_warps: int, stages: int) -> str | None:
    """Why the Gluon kernels cannot run this tile (None: they can): warpgroups of 4 warps stacked along M while
    BLOCK_M has 64 rows for each, the rest splitting N; a warpgroup's MMA at most n128 (its accumulator and two
    products in flight stay in registers); block_n dividing 128 (one W scale block) or 256 (a scale per column);
    2+ ring slots."""
    along_m = min(num_warps, block_m // 16)
    along_n = num_warps // max(along_m, 1)
    if along_m < 4 or along_m % 4 or block_n % along_n or along_m * along_n != num_warps:
        return f"tile m{block_m} n{block_n} on {num_warps} warps: no warpgroup layout (block_m >= 64, 4 or 8 warps)"
    if block_n // along_n > 128:
        return f"tile n{block_n} on {num_warps} warps: n{block_n // along_n} a warpgroup, at most 128"
    if 128 % block_n and block_n != 256:
        return f"block_n {block_n}: a divisor of 128 (one W scale block a tile) or 256"
    if stages < 2:
        return f"{stages} stages: the ring needs 2+"
    return None


def mma_layout_for(block_m: int, block_n: int, num_warps: int):
    """The wgmma accumulator layout: warpgroups stacked along M while BLOCK_M has 64 rows for each, else the
    second warpgroup takes the other half of N (m64 on 8 warps: two m64 x n/2 MMAs)."""
    error = gluon_tile_error(block_m, block_n, num_warps, 2)
    if error:
        raise ValueError(error)
    along_m = min(num_warps, block_m // 16)
    along_n = num_warps // along_m
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[along_m, along_n],
                                     instr_shape=[16, block_n // along_n, 32])


def fp8_descriptor(t: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    """Gluon's TMA descriptor of a 2-D e4m3 tensor (kernels/tma.py's rules: `tma_2d_ok`) for tiles of
    block_shape, in the wgmma's swizzled shared layout."""
    layout = gl.NVMMASharedLayout.get_default_for(block_shape, gl.float8e4nv)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block_shape, layout)


@gluon.jit
def _fp8_gemm_gluon_kernel(a_desc, w_desc, AS, WS, BIAS, OUT, M, N, K, stride_as_m, stride_as_k, stride_ws_n,
                           stride_out, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr, mma_layout: gl.constexpr,
                           STAGES: gl.constexpr):
    """`fp8_gemm._fp8_gemm_tma_kernel`'s tile: the accumulator starts at the bias, one rounding to OUT's dtype.
    A program runs tiles pid, pid + grid, ... (one each with a grid of every tile; fewer programs: persistent,
    each next tile's first copies requested before the current tile's stores)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(128 % BLOCK_N == 0, "a tile inside one 128-row W scale block")
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    num_kb = gl.cdiv(K, BLOCK_K)
    a_bufs, w_bufs, ready = allocate_ring(a_desc, w_desc, STAGES)
    g = gl.to_tensor(0)
    requested = gl.to_tensor(0)
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        row_ok = rows < M
        col_ok = cols < N
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)
        if HAS_BIAS:
            acc += gl.load(BIAS + cols, mask=col_ok, other=0.0).to(gl.float32)[None, :]
        acc = scaled_k_loop(acc, a_desc, w_desc, a_bufs, w_bufs, ready, g, off_m, off_n,
                            AS + rows.to(gl.int64) * stride_as_m, stride_as_k, row_ok,
                            WS + (off_n // 128) * stride_ws_n, 0, num_kb, requested, STAGES)
        g += num_kb
        requested = 0
        if tile + gl.num_programs(0) < tiles_m * tiles_n:
            next_m, next_n = grouped_tile(tile + gl.num_programs(0), tiles_m, tiles_n, GROUP_M)
            request_first_blocks(a_desc, w_desc, a_bufs, w_bufs, ready, g, next_m * BLOCK_M, next_n * BLOCK_N,
                                 num_kb, STAGES)
            requested = 1
        out_ptrs = OUT + rows.to(gl.int64)[:, None] * stride_out + cols[None, :]
        gl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    release_ring(ready, STAGES)


def persistent_grid(tiles: int, num_warps: int, device) -> int:
    """Programs of a persistent launch: as many as fit on the SMs at once (4 warps: two a SM, their registers
    and rings fit; 8 warps: one), at most one a tile."""
    per_sm = 2 if num_warps == 4 else 1
    return max(1, min(tiles, per_sm * num_sms(device)))


def fp8_gemm_gluon(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, out: torch.Tensor | None = None, block_m: int = 128,
                   block_n: int = 128, stages: int = 4, num_warps: int = 8, group_m: int = 8,
                   persistent: bool = False) -> torch.Tensor:
    """out [M, N] (bf16 unless given) = the block-scaled product (module docstring) + bias: a [M, K] e4m3 with
    a_scale [M, cdiv(K, 128)] fp32 (any strides: fp8_gemm's quantiser writes them MN-major), w [N, K] e4m3 with
    w_scale [cdiv(N, 128), cdiv(K, 128)] (unit last stride), bias [N] (any float) or None. Both operands must
    suit the copy engine (kernels/tma.py, `tma_2d_ok`). persistent: a program per SM slot, not per tile."""
    m, k = a.shape
    n = w.shape[0]
    kb = triton.cdiv(k, K_TILE)
    error = gluon_tile_error(block_m, block_n, num_warps, stages) or (
        block_n > 128 and f"block_n {block_n} > 128: the dense kernel keeps one W scale block a tile")
    if error:
        raise ValueError(f"fp8_gemm_gluon: {error}")
    layout = mma_layout_for(block_m, block_n, num_warps)
    if tuple(a_scale.shape) != (m, kb) or tuple(w_scale.shape) != (triton.cdiv(n, 128), kb) or w_scale.stride(1) != 1:
        raise ValueError(f"fp8_gemm_gluon: a_scale [{m}, {kb}] and w_scale [{triton.cdiv(n, 128)}, {kb}] (unit last "
                         f"stride), got {tuple(a_scale.shape)} / {tuple(w_scale.shape)}")
    if not (tma_2d_layout_ok(a) and tma_2d_layout_ok(w)):
        raise ValueError("fp8_gemm_gluon: a and w must suit the copy engine (16-byte aligned base and rows, unit "
                         f"last stride; kernels/tma.py), got strides {a.stride()} / {w.stride()}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if out.shape != (m, n) or out.stride(1) != 1:
        raise ValueError(f"fp8_gemm_gluon: out [{m}, {n}] with unit column stride")
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    grid = (persistent_grid(tiles, num_warps, a.device) if persistent else tiles,)
    _fp8_gemm_gluon_kernel[grid](fp8_descriptor(a, [block_m, K_TILE]), fp8_descriptor(w, [block_n, K_TILE]),
                                 a_scale, w_scale, bias if bias is not None else w_scale, out, m, n, k,
                                 a_scale.stride(0), a_scale.stride(1), w_scale.stride(0), out.stride(0),
                                 GROUP_M=group_m, HAS_BIAS=bias is not None, mma_layout=layout, STAGES=stages,
                                 num_warps=num_warps)
    return out


def fp8_gemm_gluon_ref(a, a_scale, w, w_scale) -> torch.Tensor:
    """The same product in float64 from the dequantised operands."""
    m, k = a.shape
    n = w.shape[0]
    kb = torch.arange(k, device=a.device) // K_TILE
    a64 = a.double() * a_scale.double()[:, kb]
    w64 = w.double() * w_scale.double()[torch.arange(n, device=a.device) // 128][:, kb]
    return a64 @ w64.t()
