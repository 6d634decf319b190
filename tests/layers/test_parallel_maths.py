"""gpt-oss's one-node parallelism maths in 2 and 4 processes (torch.distributed, gloo) vs one process.

One decoder layer at tiny dims (8 experts top-4, 8/2 heads, sinks, a sliding window) is built
from the sglang_ext.layers modules twice: whole, in this process (the oracle), and sharded by
sglang_ext.layers.parallel in every rank of a gloo group, for each layout SGLang's --tp/--ep/
--attn-dp-size allow on 2 and 4 ranks, in fp32 and in FP8 block-128. Every rank's attention
branch, MoE branch and layer output must equal the oracle's within 1e-5 relative; the o_proj
and mlp2 biases are larger than the signal, so adding either on every rank would show (and a
deliberately double-adding variant is checked to fail). Each world size is spawned once.
"""

from __future__ import annotations

import ast
import functools
import math
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sglang_ext.layers.fp8 import BLOCK, dequantize_weight_block128, fp8_linear_torch, quantize_weight_block128
from sglang_ext.layers.moe import experts_torch, route
from sglang_ext.layers.norm import rms_norm
from sglang_ext.layers.parallel import (BlockShard, DpAttentionTokens, ParallelLayout, SingleProcess, TorchDistGroup,
                                        attention_head_shard, block_granular_ranges, fp8_column_parallel_linear,
                                        fp8_row_parallel_linear, moe_parallel, moe_shard, row_parallel_linear)
from sglang_ext.layers.rope import YarnRope, apply_rope
from sglang_ext.layers.sink_attention import sink_attention_torch

REL_TOL = 1e-5
EPS = 1e-5
SWIGLU_LIMIT = 7.0


@dataclass(frozen=True)
class Dims:
    hidden: int = 64
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 16
    experts: int = 8
    top_k: int = 4
    intermediate: int = 64
    window_left: int = 7  # a sliding layer: 8 keys including the query's own
    fp8: bool = False


FP32 = Dims()
# FP8: hidden 320 = 2.5 blocks (ragged, like 2880); I = 448 = 3.5 blocks. head_dim 48 makes the
# q/o head shards (384 rows, 192 or 96 per rank) start mid-block and cross a block edge, so the
# zero-padded shards and the amax exchange run; at head_dim 16 every head shard fits one block.
FP8 = Dims(hidden=320, head_dim=48, intermediate=448, fp8=True)

# name -> (dims, tp, ep, attn_dp); SGLang: moe_tp = tp / ep, attn_tp = tp / attn_dp.
CONFIGS = {
    2: {
        "TP2": (FP32, 2, 1, 1),
        "EP2": (FP32, 2, 2, 1),
        "DP2-attention + TP2-MoE": (FP32, 2, 1, 2),
        "DP2-attention + EP2-MoE": (FP32, 2, 2, 2),
        "FP8 TP2": (FP8, 2, 1, 1),
        "FP8 DP2-attention + TP2-MoE": (FP8, 2, 1, 2),
    },
    4: {
        "TP4": (FP32, 4, 1, 1),
        "TP2xEP2": (FP32, 4, 2, 1),
        "EP4": (FP32, 4, 4, 1),
        "DP2-attention(TP2) + TP4-MoE": (FP32, 4, 1, 2),
        "DP4-attention + TP2xEP2-MoE": (FP32, 4, 2, 4),
        "FP8 TP4": (FP8, 4, 1, 1),
        "FP8 TP2xEP2": (FP8, 4, 2, 1),
        "FP8 DP2-attention(TP2) + TP4-MoE": (FP8, 4, 1, 2),
    },
}
DOUBLE_BIAS = "TP2 with both biases added on every rank"
# Two batches per layout: a prefill-sized request per attention-DP group (the MoE's per-expert
# path) and a decode-sized one (its gathered batched-matmul path).
BATCHES = {"prefill": lambda dp: 20 - 3 * dp, "decode": lambda dp: 2 + dp}


# -- weights and inputs, the same in every process --------------------------------------------


@functools.lru_cache(maxsize=None)
def make_weights(d: Dims, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=1.0):
        return torch.randn(*shape, generator=g) * std

    h, q, kv, e, i = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim, d.experts, d.intermediate
    w = {
        "ln1": 1 + 0.1 * rnd(h), "ln2": 1 + 0.1 * rnd(h),
        "q_w": rnd(q, h, std=h ** -0.5), "q_b": 0.5 * rnd(q),
        "k_w": rnd(kv, h, std=h ** -0.5), "k_b": 0.5 * rnd(kv),
        "v_w": rnd(kv, h, std=h ** -0.5), "v_b": 0.5 * rnd(kv),
        "o_w": rnd(h, q, std=q ** -0.5), "o_b": 4 + 4 * rnd(h),  # larger than o(x): a double add shows
        "sinks": rnd(d.heads),
        "router_w": rnd(e, h, std=h ** -0.5), "router_b": 0.5 * rnd(e),
        "gate_up_w": rnd(e, 2 * i, h, std=h ** -0.5), "gate_up_b": 0.5 * rnd(e, 2 * i),
        "down_w": rnd(e, h, i, std=i ** -0.5), "down_b": 4 + 4 * rnd(e, h),
    }
    if d.fp8:
        for name in ("q_w", "k_w", "v_w", "o_w", "gate_up_w", "down_w"):
            w[name], w[name + "_s"] = quantize_weight_block128(w[name])
    return w


def make_input(d: Dims, tokens: int, request: int) -> torch.Tensor:
    return torch.randn(tokens, d.hidden, generator=torch.Generator().manual_seed(1000 + request))


def rope_cache(d: Dims) -> torch.Tensor:
    return YarnRope(head_dim=d.head_dim).cos_sin_cache(64)


def attend(d: Dims, q, k, v, sinks, cos_sin):
    tokens = q.shape[0]
    q = apply_rope(q.view(tokens, -1, d.head_dim), cos_sin[:tokens])
    k = apply_rope(k.view(tokens, -1, d.head_dim), cos_sin[:tokens])
    o = sink_attention_torch(q, k, v.view(tokens, -1, d.head_dim), sinks, torch.arange(tokens), 0,
                             d.window_left, 1 / math.sqrt(d.head_dim))
    return o.reshape(tokens, -1)


# -- the oracle: one process, whole weights --------------------------------------------------------


def single_process_layer(d: Dims, w: dict, h: torch.Tensor) -> dict:
    x = rms_norm(h, w["ln1"], EPS)
    if d.fp8:
        q, k, v = (fp8_linear_torch(x, w[p + "_w"], w[p + "_w_s"], w[p + "_b"]) for p in "qkv")
    else:
        q, k, v = (F.linear(x, w[p + "_w"], w[p + "_b"]) for p in "qkv")
    o = attend(d, q, k, v, w["sinks"], rope_cache(d))
    attn = fp8_linear_torch(o, w["o_w"], w["o_w_s"], w["o_b"]) if d.fp8 else F.linear(o, w["o_w"], w["o_b"])
    h = h + attn
    x = rms_norm(h, w["ln2"], EPS)
    weights, ids = route(x, w["router_w"], w["router_b"], d.top_k)
    gate_up, down = w["gate_up_w"], w["down_w"]
    if d.fp8:  # the model's torch path: experts dequantised, activations not quantised
        gate_up = dequantize_weight_block128(gate_up, w["gate_up_w_s"])
        down = dequantize_weight_block128(down, w["down_w_s"])
    moe = experts_torch(x, weights, ids, gate_up, w["gate_up_b"], down, w["down_b"], SWIGLU_LIMIT)
    return {"attn": attn, "moe": moe, "out": h + moe}


# -- one rank of a parallel layout ------------------------------------------------------------------


def parallel_layer(d: Dims, w: dict, h: torch.Tensor, layout: ParallelLayout, attn_group, tp_group,
                   double_bias: bool = False) -> dict:
    x = rms_norm(h, w["ln1"], EPS)
    heads = [attention_head_shard(d.heads, d.kv_heads, layout.attn_tp_size, r) for r in range(layout.attn_tp_size)]
    mine = heads[layout.attn_tp_rank]
    q_rows = [s.q_rows(d.head_dim) for s in heads]
    kv_rows = [s.kv_rows(d.head_dim) for s in heads]
    if d.fp8:
        def column(p, rows):
            shard = BlockShard.of(w[p + "_w"].shape[0], rows, layout.attn_tp_rank)
            return fp8_column_parallel_linear(x, shard.take(w[p + "_w"], 0), shard.take_scales(w[p + "_w_s"], 0),
                                              shard.take(w[p + "_b"], 0), shard)
    else:
        def column(p, rows):
            lo, hi = rows[layout.attn_tp_rank]
            return F.linear(x, w[p + "_w"][lo:hi], w[p + "_b"][lo:hi])
    q, k, v = column("q", q_rows), column("k", kv_rows), column("v", kv_rows)
    o = attend(d, q, k, v, w["sinks"][mine.q_lo:mine.q_hi], rope_cache(d))
    lo, hi = q_rows[layout.attn_tp_rank]
    if d.fp8:
        shard = BlockShard.of(w["o_w"].shape[1], q_rows, layout.attn_tp_rank)
        attn = fp8_row_parallel_linear(o, shard.take(w["o_w"], 1), shard.take_scales(w["o_w_s"], 1), w["o_b"],
                                       shard, attn_group)
    elif double_bias:
        attn = attn_group.all_reduce(F.linear(o, w["o_w"][:, lo:hi], w["o_b"]))
    else:
        attn = row_parallel_linear(o, w["o_w"][:, lo:hi], w["o_b"], attn_group)
    h = h + attn

    x = rms_norm(h, w["ln2"], EPS)
    tokens = DpAttentionTokens.exchange(x.shape[0], layout, tp_group) if layout.attn_dp_size > 1 else None
    x_all = tokens.gather(x) if tokens else x
    ms = moe_shard(d.experts, d.intermediate, layout, d.fp8)
    gate_up, down = ms.gate_up(w["gate_up_w"]), ms.down(w["down_w"])
    if d.fp8:  # the rank's own e4m3 blocks with their original scales
        gate_up = dequantize_weight_block128(gate_up, ms.gate_up_scales(w["gate_up_w_s"]))
        down = dequantize_weight_block128(down, ms.down_scales(w["down_w_s"]))
    if double_bias:
        weights, ids = route(x_all, w["router_w"], w["router_b"], d.top_k)
        moe_all = tp_group.all_reduce(experts_torch(x_all, weights, ids, gate_up, ms.gate_up(w["gate_up_b"]), down,
                                                    w["down_b"][ms.expert_lo:ms.expert_hi], SWIGLU_LIMIT,
                                                    ms.expert_lo))
    else:
        moe_all = moe_parallel(x_all, w["router_w"], w["router_b"], d.top_k, SWIGLU_LIMIT, gate_up,
                               ms.gate_up(w["gate_up_b"]), down, w["down_b"], ms.expert_lo, tp_group)
    moe = tokens.scatter(moe_all) if tokens else moe_all
    return {"attn": attn, "moe": moe, "out": h + moe}


def _worker(rank: int, world: int, port: int, out_dir: str):
    import torch.distributed as dist

    torch.set_num_threads(1)  # 4 ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    # Every rank must create every group, in the same order.
    groups = {}
    for size in range(2, world):
        if world % size == 0:
            for first in range(0, world, size):
                ranks = tuple(range(first, first + size))
                groups[ranks] = TorchDistGroup(dist.new_group(list(ranks)))
    groups[tuple(range(world))] = TorchDistGroup()

    def group_of(ranks):
        return SingleProcess() if len(ranks) == 1 else groups[tuple(ranks)]

    configs = dict(CONFIGS[world])
    if world == 2:
        configs[DOUBLE_BIAS] = (FP32, 2, 1, 1)
    weights = {dims: make_weights(dims) for dims in {c[0] for c in configs.values()}}
    results = {}
    for name, (dims, tp, ep, attn_dp) in configs.items():
        layout = ParallelLayout(tp_size=tp, tp_rank=rank, ep_size=ep, attn_dp_size=attn_dp)
        attn_group, tp_group = group_of(layout.attn_tp_ranks), group_of(range(world))
        for batch, length in BATCHES.items():
            request = layout.attn_dp_rank if attn_dp > 1 else 0
            h = make_input(dims, length(request), request)
            results[(name, batch)] = parallel_layer(dims, weights[dims], h, layout, attn_group, tp_group,
                                                    double_bias=name == DOUBLE_BIAS)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RUNS: dict = {}


def ranks_results(world: int, tmp_path_factory) -> list[dict]:
    """Every rank's outputs for all layouts of `world` (spawned once per world size)."""
    if world not in _RUNS:
        import multiprocessing

        import torch.multiprocessing as mp

        out_dir = tmp_path_factory.mktemp(f"world{world}")
        start = time.perf_counter()
        # A fork server imports torch once for all six ranks (a spawned rank pays ~4 s of CPU for
        # it); its children start from a process that has run no torch thread pool, unlike a fork
        # of this one.
        multiprocessing.set_forkserver_preload(["torch", "sglang_ext.layers.parallel"])
        mp.start_processes(_worker, args=(world, _free_port(), str(out_dir)), nprocs=world, join=True,
                           start_method="forkserver")
        print(f"\nworld {world}: spawned and ran in {time.perf_counter() - start:.1f} s")
        _RUNS[world] = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world)]
    return _RUNS[world]


@functools.lru_cache(maxsize=None)
def oracle(dims: Dims, tokens: int, request: int) -> dict:
    return single_process_layer(dims, make_weights(dims), make_input(dims, tokens, request))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world,name", [(w, n) for w, configs in CONFIGS.items() for n in configs])
def test_every_rank_equals_the_single_process_layer(world, name, tmp_path_factory):
    dims, tp, ep, attn_dp = CONFIGS[world][name]
    ranks = ranks_results(world, tmp_path_factory)
    worst = 0.0
    for batch, length in BATCHES.items():
        for rank, results in enumerate(ranks):
            layout = ParallelLayout(tp_size=tp, tp_rank=rank, ep_size=ep, attn_dp_size=attn_dp)
            request = layout.attn_dp_rank if attn_dp > 1 else 0
            want = oracle(dims, length(request), request)
            got = results[(name, batch)]
            for part in ("attn", "moe", "out"):
                assert got[part].shape == want[part].shape, (batch, rank, part)
                err = relative_error(got[part], want[part])
                worst = max(worst, err)
                assert err <= REL_TOL, f"{name} {batch} rank {rank} {part}: relative error {err:.2e}"
                max_abs = (got[part] - want[part]).abs().max().item()
                assert max_abs <= REL_TOL * want[part].abs().max().item(), (name, batch, rank, part, max_abs)
    print(f"{name}: worst relative error {worst:.1e}")


@pytest.mark.timeout(180)
def test_a_bias_added_on_every_rank_is_caught(tmp_path_factory):
    """The comparison above is sensitive to the bias rule: the same TP2 layer adding o_proj's and
    mlp2's biases on both ranks before the all-reduce is far from the oracle."""
    ranks = ranks_results(2, tmp_path_factory)
    want = oracle(FP32, BATCHES["prefill"](0), 0)
    for results in ranks:
        got = results[(DOUBLE_BIAS, "prefill")]
        assert relative_error(got["attn"], want["attn"]) > 0.1
        assert relative_error(got["moe"], want["moe"]) > 0.1


# -- layout and shard rules, no processes ------------------------------------------------------------


def _sglang_rank_functions() -> dict:
    """SGLang 0.5.23's own rank derivations, read out of its installed source: importing
    sglang.srt costs ~10 s on this machine, these functions are pure arithmetic."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    source = Path(spec.submodule_search_locations[0]) / "srt" / "runtime_context.py"
    tree = ast.parse(source.read_text())
    wanted = {"derive_attn_tp_size", "derive_attention_ranks", "derive_spawn_ranks", "derive_parallel_widths"}
    module = ast.Module(body=[n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted],
                        type_ignores=[])
    namespace: dict = {}
    exec(compile(module, str(source), "exec"), namespace)
    assert wanted <= namespace.keys()
    return namespace


def test_layout_ranks_equal_sglangs():
    sg = _sglang_rank_functions()
    for tp in (1, 2, 4, 8):
        for ep in (e for e in (1, 2, 4, 8) if tp % e == 0):
            for attn_dp in (a for a in (1, 2, 4, 8) if tp % a == 0):
                widths = sg["derive_parallel_widths"](tp_size=tp, attn_cp_size=1, attn_dp_size=attn_dp,
                                                      moe_ep_size=ep, moe_dp_size=1, dcp_size=1, dcp_enabled=False)
                for rank in range(tp):
                    ours = ParallelLayout(tp_size=tp, tp_rank=rank, ep_size=ep, attn_dp_size=attn_dp)
                    theirs = sg["derive_spawn_ranks"](world_rank=rank, tp_size=tp, ep_join_rank_offset=0,
                                                      attn_cp_size=1, attn_tp_size=widths["attn_tp_size"],
                                                      moe_dp_size=1, moe_ep_size=ep)
                    attn_tp_rank, attn_dp_rank = sg["derive_attention_ranks"](
                        tp_rank=rank, attn_tp_size=widths["attn_tp_size"], attn_cp_size=1)
                    assert (ours.attn_tp_size, ours.moe_tp_size) == (widths["attn_tp_size"], widths["moe_tp_size"])
                    assert (ours.moe_ep_rank, ours.moe_tp_rank) == (theirs["moe_ep_rank"], theirs["moe_tp_rank"])
                    assert (ours.attn_tp_rank, ours.attn_dp_rank) == (attn_tp_rank, attn_dp_rank)


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    shards = [attention_head_shard(64, 8, 16, r) for r in range(16)]
    assert [(s.q_lo, s.q_hi) for s in shards] == [(4 * r, 4 * r + 4) for r in range(16)]
    assert [(s.kv_lo, s.kv_hi) for s in shards] == [(r // 2, r // 2 + 1) for r in range(16)]


@pytest.mark.parametrize("full,parts", [(2880, 2), (2880, 4), (2880, 8), (448, 4), (448, 8), (4096, 8)])
def test_block_granular_ranges_cover_the_dimension_on_the_grid(full, parts):
    ranges = block_granular_ranges(full, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == full
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(lo % BLOCK == 0 for lo, hi in ranges if hi > lo)
    # the busiest part holds as few blocks as any split on the grid can give it
    assert max(hi - lo for lo, hi in ranges) == BLOCK * math.ceil(math.ceil(full / BLOCK) / parts)


@pytest.mark.parametrize("full,cuts", [
    (384, [0, 192, 384]), (384, [0, 96, 192, 288, 384]),  # the FP8 layer's q/o head shards
    (2880, [0, 1440, 2880]), (2880, [0, 720, 1440, 2160, 2880]), (2880, [0, 360, 720, 1080, 1440, 1800, 2160, 2520, 2880]),
    (512, [0, 64, 128, 192, 256, 320, 384, 448, 512]),  # 120b k/v at TP8: inside one block, no padding
    (300, [0, 100, 250, 300]),
])
def test_fp8_block_shards_dequantise_to_exactly_the_slice(full, cuts):
    """Rows and columns: a shard's e4m3 values and original scales dequantise bit-exactly to the
    slice of the whole dequantised weight, after its front padding (zeros) is dropped."""
    torch.manual_seed(0)
    other = 130  # ragged too
    w = torch.randn(full, other) * torch.logspace(-2, 1, full)[:, None]  # scales differ block to block
    q, s = quantize_weight_block128(w)
    whole = dequantize_weight_block128(q, s)
    ranges = list(zip(cuts, cuts[1:]))
    for index, (lo, hi) in enumerate(ranges):
        shard = BlockShard.of(full, ranges, index)
        assert shard.pad_front < BLOCK
        rows = dequantize_weight_block128(shard.take(q, 0), shard.take_scales(s, 0))
        assert torch.equal(rows[:shard.pad_front], torch.zeros(shard.pad_front, other))
        assert torch.equal(shard.drop_padding(rows, 0), whole[lo:hi])
        qt, st = q.t().contiguous(), s.t().contiguous()
        cols = dequantize_weight_block128(shard.take(qt, 1), shard.take_scales(st, 1))
        assert torch.equal(shard.drop_padding(cols, 1), whole.t()[:, lo:hi])
