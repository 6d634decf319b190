"""gpt-oss's one-node parallelism maths: TP, EP and DP attention, in bf16/fp32 and FP8 block-128.

SGLang-free (torch only): the SGLang model class and the GPU benchmark harness shard and
combine with the same functions. Collectives come in through a small `Collective` object,
so the model can hand in SGLang's group coordinators and the harness/tests torch.distributed.

The layout follows SGLang 0.5.23 (`sglang.srt.runtime_context.derive_spawn_ranks` and
`derive_parallel_widths`, moe_dp_size = attn_cp_size = 1):
  - attention: attn_tp_size = tp / attn_dp; tp_rank = attn_dp_rank * attn_tp_size + attn_tp_rank
    (tp changes fastest). Heads split over attn_tp; KV heads are replicated when there are
    fewer KV heads than attn_tp ranks (SGLang's QKVParallelLinear: kv head = rank // replicas).
  - MoE: moe_tp_size = tp / ep; moe_ep_rank = tp_rank // moe_tp_size, moe_tp_rank = tp_rank %
    moe_tp_size. Each EP rank owns the contiguous experts [ep_rank * E/ep, (ep_rank+1) * E/ep)
    (`expert_offset`); within them, moe_tp slices the intermediate dimension I (mlp1's
    interleaved gate/up rows 2i, 2i+1 stay together; mlp2's columns i). The MoE output is
    summed over the whole TP group (every rank holds a partial: other experts and/or other
    slices of I), then mlp2's bias is added once, weighted by routing.
  - DP attention: each attention-DP group runs attention for its own requests; the MoE runs
    over the tokens of all groups (gather), each rank keeps its own rows of the result (scatter).

FP8 block-128 under TP ("block-aligned sharding", one exact scheme):
  - MoE: shards of I are cut on the 128-grid of the original scales (whole blocks, the last
    rank's shard ends with the ragged half block of 2880 = 22.5 x 128), so every local block is
    an original block with its original scale, mlp1's rows 2i..2i+1 cut on a 256-row (two
    block) grid, and no activation group of mlp2 straddles two ranks: a fused FP8 MoE that
    quantises its intermediate activation per 128-group stays exact with no exchange between
    mlp1 and mlp2. Shards are uneven by at most one block (120b at TP 2/4/8: 1536+1344,
    768x3+576, 384x7+192 of 2880 channels): the busiest rank holds +6.7% over 1/TP and no
    padding. Even shards padded to the grid would store 1.1/7.8/16.7% zeros with the busiest
    rank at +2.2/+15.6/+31.1%, and need that exchange (benchmarks/results/fp8_tp_sharding.md).
  - Attention heads cannot be cut on the grid (they are the unit), so a head shard that starts
    mid-block and crosses a block edge is padded with zero rows (columns for a row-parallel
    weight) at its front, back to the previous 128 edge: each local block is then an original
    block with its original scale; a shard that lies inside one block needs no padding, and no
    shard needs padding at its back (its last local block may be ragged, as 2880's is).
    The activation side gets the same zero padding (row-parallel); where any cut of the
    partition is mid-block, an activation group straddles ranks, and the ranks take the max of
    their group amaxes (one all-reduce of [T, K/128]) so every rank quantises with the scale
    the single process uses. gpt-oss-120b at TP 2/4/8 has no such cut and no padding (q/o
    shards 512-aligned, k/v shards of 64 rows lie inside one block).
  Both are exact: the local e4m3 values and scales dequantise to exactly the slice of the full
  dequantised weight, so the parallel result equals the single-process one up to the order of
  the fp32 sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sglang_ext.layers.fp8 import BLOCK, E4M3_MAX, _div_448, dequantize_weight_block128, fp8_linear_torch
from sglang_ext.layers.moe import add_down_bias, experts_torch, route


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- layout -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelLayout:
    """One process's place in SGLang's one-node layout (`--tp`, `--ep`, `--attn-dp-size`)."""

    tp_size: int
    tp_rank: int
    ep_size: int = 1
    attn_dp_size: int = 1

    def __post_init__(self):
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not a rank of tp_size {self.tp_size}")
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size {self.ep_size} must divide tp_size {self.tp_size} (moe_tp = tp / ep)")
        if self.tp_size % self.attn_dp_size:
            raise ValueError(f"attn_dp_size {self.attn_dp_size} must divide tp_size {self.tp_size}")

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.attn_dp_size

    @property
    def attn_tp_rank(self) -> int:
        return self.tp_rank % self.attn_tp_size

    @property
    def attn_dp_rank(self) -> int:
        return self.tp_rank // self.attn_tp_size

    @property
    def attn_tp_ranks(self) -> tuple[int, ...]:
        """The TP ranks of this process's attention group (contiguous)."""
        first = self.attn_dp_rank * self.attn_tp_size
        return tuple(range(first, first + self.attn_tp_size))

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp_size

    @property
    def moe_ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp_size


# -- collectives --------------------------------------------------------------------------


class Collective(Protocol):
    """The collectives the parallel maths needs over one process group."""

    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...  # sum, returned (input untouched)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]: ...  # equal shapes, in rank order


class SingleProcess:
    """`Collective` of a group of one: nothing to exchange."""

    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    all_reduce_max = all_reduce

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]


class TorchDistGroup:
    """`Collective` over a torch.distributed process group (gloo on CPU, NCCL on GPUs)."""

    def __init__(self, group=None):
        self._dist, self.group = dist, group
        self.size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        out = x.clone().contiguous()
        self._dist.all_reduce(out, group=self.group)
        return out

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        out = x.clone().contiguous()
        self._dist.all_reduce(out, op=self._dist.ReduceOp.MAX, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.size == 1:
            return [x]
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(self.size)]
        self._dist.all_gather(out, x, group=self.group)
        return out


# -- ranges -------------------------------------------------------------------------------


def even_range(n: int, parts: int, index: int, what: str = "dimension") -> tuple[int, int]:
    if n % parts:
        raise ValueError(f"{what}={n} is not divisible by {parts}")
    per = n // parts
    return index * per, (index + 1) * per


def block_granular_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """Split n on the 128-grid: whole blocks per part (the ragged last block goes with the last
    non-empty part), the first parts taking one block more where they do not divide evenly.
    Parts beyond the number of blocks are empty."""
    blocks = _ceil_div(n, BLOCK)
    per, extra = divmod(blocks, parts)
    ranges, start = [], 0
    for part in range(parts):
        count = per + (part < extra)
        lo = min(start * BLOCK, n)
        ranges.append((lo, min(n, (start + count) * BLOCK) if count else lo))
        start += count
    return ranges


# -- attention heads ----------------------------------------------------------------------


@dataclass(frozen=True)
class HeadShard:
    """This attention-TP rank's query heads [q_lo, q_hi) and KV heads [kv_lo, kv_hi)."""

    q_lo: int
    q_hi: int
    kv_lo: int
    kv_hi: int

    def q_rows(self, head_dim: int) -> tuple[int, int]:
        return self.q_lo * head_dim, self.q_hi * head_dim

    def kv_rows(self, head_dim: int) -> tuple[int, int]:
        return self.kv_lo * head_dim, self.kv_hi * head_dim


def attention_head_shard(num_heads: int, num_kv_heads: int, attn_tp_size: int, attn_tp_rank: int) -> HeadShard:
    """Query heads split evenly; KV heads split evenly, or replicated over attn_tp/num_kv_heads
    ranks when there are fewer KV heads than ranks. A rank's query heads always use its KV heads
    (GQA groups are contiguous: head h reads KV head h // (num_heads / num_kv_heads))."""
    q_lo, q_hi = even_range(num_heads, attn_tp_size, attn_tp_rank, "num_attention_heads")
    if num_kv_heads >= attn_tp_size:
        kv_lo, kv_hi = even_range(num_kv_heads, attn_tp_size, attn_tp_rank, "num_key_value_heads")
    else:
        if attn_tp_size % num_kv_heads:
            raise ValueError(f"attention TP {attn_tp_size} is not a multiple of num_key_value_heads {num_kv_heads}")
        kv_lo = attn_tp_rank // (attn_tp_size // num_kv_heads)
        kv_hi = kv_lo + 1
    group = num_heads // num_kv_heads
    assert kv_lo == q_lo // group and kv_hi == _ceil_div(q_hi, group), "a rank's query heads must use its KV heads"
    return HeadShard(q_lo, q_hi, kv_lo, kv_hi)


# -- FP8 block shards ---------------------------------------------------------------------


@dataclass(frozen=True)
class BlockShard:
    """One rank's slice [lo, hi) of a dimension of length `full` of an FP8 block-128 weight,
    with `pad_front` zeros in front so that local block b is original block `block_lo + b`
    (see the module notes). `cuts_aligned`: every cut of the whole partition lies on the
    128-grid, so no block (and no activation group) is shared between ranks."""

    full: int
    lo: int
    hi: int
    pad_front: int
    cuts_aligned: bool

    @classmethod
    def of(cls, full: int, ranges: Sequence[tuple[int, int]], index: int) -> "BlockShard":
        lo, hi = ranges[index]
        inside_one_block = hi > lo and lo // BLOCK == (hi - 1) // BLOCK
        pad_front = 0 if inside_one_block or hi == lo else lo % BLOCK
        cuts = {c for r in ranges for c in r} - {0, full}
        return cls(full, lo, hi, pad_front, all(c % BLOCK == 0 for c in cuts))

    @property
    def local_len(self) -> int:
        return self.pad_front + self.hi - self.lo

    @property
    def block_lo(self) -> int:
        return self.lo // BLOCK

    @property
    def block_hi(self) -> int:
        return _ceil_div(self.hi, BLOCK) if self.hi > self.lo else self.block_lo

    def take(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The slice of a weight or bias along `dim`, zero-padded at the front."""
        part = t.narrow(dim, self.lo, self.hi - self.lo)
        if not self.pad_front:
            return part
        shape = list(t.shape)
        shape[dim] = self.pad_front
        return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), part], dim=dim)

    def take_scales(self, scale_inv: torch.Tensor, dim: int) -> torch.Tensor:
        """The original scales of the blocks this shard touches (no new scale is made)."""
        return scale_inv.narrow(dim, self.block_lo, self.block_hi - self.block_lo)

    def drop_padding(self, y: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return y.narrow(dim, self.pad_front, self.hi - self.lo)

    def pad_activation(self, x: torch.Tensor) -> torch.Tensor:
        """The same zeros in front of the activation's last dimension (row-parallel side)."""
        return F.pad(x, (self.pad_front, 0)) if self.pad_front else x


def _quantise_dequantise_groups(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """fp8.quantize/dequantize_activation_group128 with a given per-group amax: the same ops,
    so the same values when amax is the single process's."""
    t, k = x.shape
    kb = _ceil_div(k, BLOCK)
    padded = torch.zeros(t, kb * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    scale = torch.where(amax > 0, _div_448(amax), torch.ones_like(amax))
    q = (padded.view(t, kb, BLOCK) / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).view(t, kb * BLOCK)[:, :k]
    return q.to(torch.float8_e4m3fn).float() * scale.repeat_interleave(BLOCK, dim=-1)[..., :k]


def _group_amax(x: torch.Tensor) -> torch.Tensor:
    t, k = x.shape
    kb = _ceil_div(k, BLOCK)
    padded = torch.zeros(t, kb * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    return padded.view(t, kb, BLOCK).abs().amax(dim=-1)


# -- linear layers --------------------------------------------------------------------------


def row_parallel_linear(x_local: torch.Tensor, weight_local: torch.Tensor, bias: torch.Tensor | None,
                        group: Collective) -> torch.Tensor:
    """y = sum over ranks of x_r W_r^T, then the bias once (o_proj under TP)."""
    y = group.all_reduce(F.linear(x_local, weight_local))
    return y + bias if bias is not None else y


def fp8_column_parallel_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                               bias_local: torch.Tensor | None, shard: BlockShard) -> torch.Tensor:
    """This rank's output columns of an FP8 linear whose rows were cut by `shard`
    (`bias_local` = shard.take(bias, 0)); the padded rows' outputs are dropped."""
    return shard.drop_padding(fp8_linear_torch(x, w_fp8, w_scale_inv, bias_local))


def fp8_row_parallel_linear(x_local: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                            bias: torch.Tensor | None, shard: BlockShard, group: Collective) -> torch.Tensor:
    """y = x W^T + b for an FP8 weight whose columns were cut by `shard`, x_local = this rank's
    columns of x; activations quantised per 1x128 group with the single process's scales."""
    lead = x_local.shape[:-1]
    x = shard.pad_activation(x_local.reshape(-1, x_local.shape[-1]).float())
    amax = _group_amax(x)
    if not shard.cuts_aligned:  # a group shared with a neighbour: the max of both ranks' amaxes
        full = torch.zeros(x.shape[0], _ceil_div(shard.full, BLOCK), dtype=torch.float32, device=x.device)
        full[:, shard.block_lo:shard.block_hi] = amax
        amax = group.all_reduce_max(full)[:, shard.block_lo:shard.block_hi]
    y = group.all_reduce(_quantise_dequantise_groups(x, amax) @ dequantize_weight_block128(w_fp8, w_scale_inv).t())
    if bias is not None:
        y = y + bias.float()
    return y.to(x_local.dtype).reshape(*lead, -1)


# -- MoE --------------------------------------------------------------------------------------


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    return even_range(num_experts, ep_size, ep_rank, "num_local_experts")


@dataclass(frozen=True)
class MoeShard:
    """This rank's experts [expert_lo, expert_hi) and intermediate channels [inter_lo, inter_hi).

    Takes the rank's part of each checkpoint tensor in the [E, out, in] layout:
    gate_up_proj [E, 2I, H] (rows 2i, 2i+1 of channel i), gate_up_proj_bias [E, 2I],
    down_proj [E, H, I]; the FP8 scales by their blocks. down_proj_bias is not sharded: it is
    added once, for all experts, after the sum (`moe_parallel`)."""

    expert_lo: int
    expert_hi: int
    inter_lo: int
    inter_hi: int
    fp8: bool

    def __post_init__(self):
        if self.fp8 and self.inter_hi > self.inter_lo and self.inter_lo % BLOCK:
            raise ValueError(f"FP8 expert shards must start on the 128-grid, got channel {self.inter_lo}")

    @property
    def local_intermediate(self) -> int:
        return self.inter_hi - self.inter_lo

    def _experts(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.expert_lo:self.expert_hi]

    def gate_up(self, t: torch.Tensor) -> torch.Tensor:
        """gate_up_proj [E, 2I, H] or gate_up_proj_bias [E, 2I]."""
        return self._experts(t).narrow(1, 2 * self.inter_lo, 2 * self.local_intermediate)

    def down(self, t: torch.Tensor) -> torch.Tensor:
        """down_proj [E, H, I]."""
        return self._experts(t).narrow(2, self.inter_lo, self.local_intermediate)

    def gate_up_scales(self, s: torch.Tensor) -> torch.Tensor:
        if not self.local_intermediate:  # a rank past the last block (I smaller than moe_tp blocks)
            return self._experts(s).narrow(1, 0, 0)
        lo, hi = 2 * self.inter_lo // BLOCK, _ceil_div(2 * self.inter_hi, BLOCK)
        return self._experts(s).narrow(1, lo, hi - lo)

    def down_scales(self, s: torch.Tensor) -> torch.Tensor:
        if not self.local_intermediate:
            return self._experts(s).narrow(2, 0, 0)
        lo, hi = self.inter_lo // BLOCK, _ceil_div(self.inter_hi, BLOCK)
        return self._experts(s).narrow(2, lo, hi - lo)


def moe_shard(num_experts: int, intermediate: int, layout: ParallelLayout, fp8: bool) -> MoeShard:
    """EP picks the experts, moe_tp the channels: even slices (SGLang's split) for bf16/fp32;
    whole 128-blocks for FP8 (module notes), so no block or activation group is cut."""
    e_lo, e_hi = expert_range(num_experts, layout.ep_size, layout.moe_ep_rank)
    if fp8:
        i_lo, i_hi = block_granular_ranges(intermediate, layout.moe_tp_size)[layout.moe_tp_rank]
    else:
        i_lo, i_hi = even_range(intermediate, layout.moe_tp_size, layout.moe_tp_rank, "intermediate_size")
    return MoeShard(e_lo, e_hi, i_lo, i_hi, fp8)


def moe_parallel(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, top_k: int, limit: float,
                 gate_up_proj: torch.Tensor, gate_up_proj_bias: torch.Tensor, down_proj: torch.Tensor,
                 down_proj_bias: torch.Tensor, expert_offset: int, group: Collective) -> torch.Tensor:
    """TP-only dispatch and combine: x replicated on every rank of `group` (the whole TP group),
    each rank runs its experts (`expert_offset`, weights [E_local, ...]) on its slice of I,
    one all-reduce sums the partials, mlp2's bias (`down_proj_bias` for ALL experts, [E, H])
    is added once. Weights are dense here (FP8 shards dequantised by the caller)."""
    weights, ids = route(x, router_weight, router_bias, top_k)
    if gate_up_proj.shape[1] == 0:  # no channels on this rank (I smaller than moe_tp blocks)
        partial = torch.zeros_like(x)
    else:
        partial = experts_torch(x, weights, ids, gate_up_proj, gate_up_proj_bias, down_proj, None, limit,
                                expert_offset)
    return add_down_bias(group.all_reduce(partial), weights, ids, down_proj_bias)


# -- DP attention -------------------------------------------------------------------------------


class DpAttentionTokens:
    """Tokens of every attention-DP group gathered for the MoE, and each rank's rows back.

    `counts[d]`: the tokens of attention-DP group d in this forward (SGLang's forward batch
    carries them; `exchange` gathers them). Ranks of one group hold the same tokens; the gather
    keeps its first rank's copy (a padded all-gather over the TP group: simple, not the fewest
    bytes when attn_tp > 1).
    """

    def __init__(self, counts: Sequence[int], layout: ParallelLayout, tp_group: Collective):
        assert len(counts) == layout.attn_dp_size, (counts, layout)
        self.counts, self.layout, self.group = [int(c) for c in counts], layout, tp_group
        self.leaders = [dp * layout.attn_tp_size for dp in range(layout.attn_dp_size)]
        self.offset = sum(self.counts[: layout.attn_dp_rank])
        self.num_local = self.counts[layout.attn_dp_rank]

    @classmethod
    def exchange(cls, num_local_tokens: int, layout: ParallelLayout, tp_group: Collective,
                 device=None) -> "DpAttentionTokens":
        """Counts from every rank (one collective and a host read)."""
        counts = tp_group.all_gather(torch.tensor([num_local_tokens], dtype=torch.int64, device=device))
        return cls([int(counts[r].item()) for r in range(0, layout.tp_size, layout.attn_tp_size)], layout, tp_group)

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        assert x_local.shape[0] == self.num_local, (x_local.shape, self.num_local)
        padded = x_local.new_zeros(max(self.counts), *x_local.shape[1:])
        padded[: self.num_local] = x_local
        pieces = self.group.all_gather(padded)
        return torch.cat([pieces[r][:n] for r, n in zip(self.leaders, self.counts)])

    def scatter(self, y_all: torch.Tensor) -> torch.Tensor:
        return y_all[self.offset: self.offset + self.num_local]
