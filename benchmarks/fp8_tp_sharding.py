"""FP8 block-128 weights of gpt-oss-120b under tensor parallelism: bytes and exactness per shard scheme.

2880 = 22.5 x 128, so even TP shards of the expert dimension I (1440/720/360) cut 128-blocks.
For one layer of gpt-oss-120b (q [4096, 2880], k/v [512, 2880], o [2880, 4096], 128 experts of
mlp1 [5760, 2880] and mlp2 [2880, 2880]) at TP 2/4/8 this counts, per tensor and scheme:
  - padding: zero e4m3 bytes stored so that every local block is an original block
    (`sglang_ext.layers.parallel.BlockShard`), over the e4m3 bytes of the shards;
  - duplicated scales: fp32 scales of blocks that two ranks share;
  - the busiest rank's bytes against an even 1/TP share (what a memory-bound decode step waits on);
for the MoE under three schemes: even shards padded to the grid, block-granular shards (whole
128-blocks per rank, the chosen one), and expert parallelism (whole experts) for reference.
Then it checks exactness on the real shapes with random weights (two experts stand in for 128:
every expert is cut the same way): each shard's e4m3 values and scales dequantise bit-exactly
to the slice of the whole dequantised weight, and the TP result of each linear (ranks simulated
by threads around the real `fp8_*_parallel_linear` / all-reduce code) equals the single-process
FP8 GEMM. CPU only:  python benchmarks/fp8_tp_sharding.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time

import torch

from sglang_ext.layers.fp8 import (BLOCK, dequantize_weight_block128, fp8_linear_torch,
                                   quantize_weight_block128)
from sglang_ext.layers.parallel import (BlockShard, ParallelLayout, attention_head_shard,
                                        block_granular_ranges, even_range, fp8_column_parallel_linear,
                                        fp8_row_parallel_linear, moe_shard)

COMMAND = "python benchmarks/fp8_tp_sharding.py --out benchmarks/results"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, INTERMEDIATE = 2880, 64, 8, 64, 128, 2880
TP_DEGREES = (2, 4, 8)
CHECK_EXPERTS = 2
TOKENS = 8


def blocks(n: int) -> int:
    return math.ceil(n / BLOCK)


# -- bytes ------------------------------------------------------------------------------------


def linear_bytes(name: str, n: int, k: int, split_dim: int, ranges, copies: int = 1) -> dict:
    """One [n, k] weight (x `copies` experts) cut along `split_dim` (0: rows, 1: columns)."""
    full_w, full_s = n * k * copies, blocks(n) * blocks(k) * 4 * copies
    other = k if split_dim == 0 else n
    pad, scales, per_rank = 0, 0, []
    for index in range(len(ranges)):
        shard = BlockShard.of(n if split_dim == 0 else k, ranges, index)
        local_scales = (shard.block_hi - shard.block_lo) * blocks(other) * 4 * copies
        rank_pad = shard.pad_front * other * copies
        per_rank.append((shard.hi - shard.lo) * other * copies + rank_pad + local_scales)
        pad += rank_pad
        scales += local_scales
    return {"tensor": name, "full_bytes": full_w + full_s, "full_e4m3_bytes": full_w, "padding_bytes": pad,
            "padding_pct_of_shards": 100 * pad / full_w, "duplicated_scale_bytes": scales - full_s,
            "per_rank_bytes": per_rank, "busiest_rank_bytes": max(per_rank),
            "busiest_rank_vs_even_pct": 100 * (max(per_rank) / ((full_w + full_s) / len(ranges)) - 1)}


def moe_row(scheme: str, tp: int, ranges) -> dict:
    """mlp1 + mlp2 of all experts with the intermediate channels cut by `ranges`. A fused MoE
    needs mlp1 and mlp2 to hold the same local channels, so a shard padded in front by p
    channels (mlp2's columns, `BlockShard`) carries 2p zero rows of mlp1 too."""
    per_rank, pad = [], 0
    for index, (lo, hi) in enumerate(ranges):
        channels = BlockShard.of(INTERMEDIATE, ranges, index).pad_front + hi - lo
        e4m3 = EXPERTS * 3 * channels * HIDDEN
        scales = EXPERTS * (blocks(2 * channels) * blocks(HIDDEN) + blocks(HIDDEN) * blocks(channels)) * 4
        per_rank.append(e4m3 + scales)
        pad += EXPERTS * 3 * (channels - (hi - lo)) * HIDDEN
    full_w = EXPERTS * 3 * INTERMEDIATE * HIDDEN
    full = full_w + EXPERTS * (blocks(2 * INTERMEDIATE) * blocks(HIDDEN) + blocks(HIDDEN) * blocks(INTERMEDIATE)) * 4
    return {"tensor": f"MoE (mlp1+mlp2, {EXPERTS} experts), {scheme}", "tp": tp, "full_bytes": full,
            "full_e4m3_bytes": full_w, "padding_bytes": pad, "padding_pct_of_shards": 100 * pad / full_w,
            "duplicated_scale_bytes": sum(per_rank) - pad - full,
            "per_rank_bytes": per_rank, "busiest_rank_bytes": max(per_rank),
            "busiest_rank_vs_even_pct": 100 * (max(per_rank) / (full / tp) - 1)}


def moe_rows(tp: int) -> list[dict]:
    """Per MoE scheme at TP=tp; expert parallelism (EP=tp, whole experts) for reference."""
    return [moe_row("even shards, zero-padded to the grid", tp, [even_range(INTERMEDIATE, tp, r) for r in range(tp)]),
            moe_row("block-granular shards (chosen)", tp, block_granular_ranges(INTERMEDIATE, tp)),
            expert_parallel_row(tp)]


def expert_parallel_row(tp: int) -> dict:
    whole = moe_row("expert parallel EP=TP (reference)", tp, [(0, INTERMEDIATE)])
    return whole | {"per_rank_bytes": None, "busiest_rank_bytes": whole["full_bytes"] // tp,
                    "busiest_rank_vs_even_pct": 0.0}


# -- exactness ------------------------------------------------------------------------------------


class ThreadGroup:
    """A `Collective` whose ranks are threads of this process (sum/max over the ranks' tensors)."""

    def __init__(self, size: int):
        self.size = size
        self._barrier = threading.Barrier(size)
        self._slots: list = [None] * size
        self._rank = threading.local()

    def run(self, fn):
        results = [None] * self.size

        def target(rank):
            self._rank.value = rank
            results[rank] = fn(rank)

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    def _reduce(self, x, op):
        self._slots[self._rank.value] = x
        self._barrier.wait()
        out = self._slots[0].clone()
        for other in self._slots[1:]:
            out = op(out, other)
        self._barrier.wait()
        return out

    def all_reduce(self, x):
        return self._reduce(x, torch.add)

    def all_reduce_max(self, x):
        return self._reduce(x, torch.maximum)

    def all_gather(self, x):
        raise NotImplementedError


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_linear(name, w, b, ranges, split_dim, gen) -> dict:
    """Shards of one FP8 weight [n, k] cut along rows (column-parallel) or columns (row-parallel)."""
    q, s = quantize_weight_block128(w)
    whole = dequantize_weight_block128(q, s)
    n, k = w.shape
    x = torch.randn(TOKENS, k, generator=gen)
    want = fp8_linear_torch(x, q, s, b)
    weight_diff = 0.0
    shards = [BlockShard.of(n if split_dim == 0 else k, ranges, r) for r in range(len(ranges))]
    for shard in shards:
        local = dequantize_weight_block128(shard.take(q, split_dim), shard.take_scales(s, split_dim))
        weight_diff = max(weight_diff, (shard.drop_padding(local, split_dim)
                                        - whole.narrow(split_dim, shard.lo, shard.hi - shard.lo)).abs().max().item())
    if split_dim == 0:
        got = torch.cat([fp8_column_parallel_linear(x, sh.take(q, 0), sh.take_scales(s, 0), sh.take(b, 0), sh)
                         for sh in shards], dim=-1)
    else:
        group = ThreadGroup(len(shards))
        got = group.run(lambda r: fp8_row_parallel_linear(x[:, shards[r].lo:shards[r].hi], shards[r].take(q, 1),
                                                          shards[r].take_scales(s, 1), b, shards[r], group))[0]
    return {"tensor": name, "max_abs_diff_dequantised_shard_vs_slice": weight_diff,
            "tp_vs_single_process_rel_err": rel(got, want),
            "amax_exchange": split_dim == 1 and not shards[0].cuts_aligned,
            "padded_ranks": sum(sh.pad_front > 0 for sh in shards)}


def check_moe(tp: int, gen) -> list[dict]:
    """Two experts' mlp1 (rows, interleaved pairs) and mlp2 (columns) under each MoE scheme."""
    rows = []
    gate_up = torch.randn(CHECK_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.02
    down = torch.randn(CHECK_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.02
    q1, s1 = quantize_weight_block128(gate_up)
    q2, s2 = quantize_weight_block128(down)
    whole1, whole2 = dequantize_weight_block128(q1, s1), dequantize_weight_block128(q2, s2)
    diff = 0.0
    for rank in range(tp):
        ms = moe_shard(CHECK_EXPERTS, INTERMEDIATE, ParallelLayout(tp_size=tp, tp_rank=rank), fp8=True)
        local1 = dequantize_weight_block128(ms.gate_up(q1), ms.gate_up_scales(s1))
        local2 = dequantize_weight_block128(ms.down(q2), ms.down_scales(s2))
        diff = max(diff, (local1 - ms.gate_up(whole1)).abs().max().item(), (local2 - ms.down(whole2)).abs().max().item())
    rows.append({"tensor": f"mlp1+mlp2 x{CHECK_EXPERTS} experts, block-granular (moe_shard)",
                 "max_abs_diff_dequantised_shard_vs_slice": diff})
    # mlp2 with FP8 activations (a Triton MoE quantises them): block-granular cuts need no exchange,
    # even cuts need the amax exchange; both must equal the single process.
    for scheme, ranges in (("even", [even_range(INTERMEDIATE, tp, r) for r in range(tp)]),
                           ("block-granular", block_granular_ranges(INTERMEDIATE, tp))):
        r = check_linear(f"mlp2 expert 0 with FP8 activations, {scheme} cuts", down[0], torch.randn(HIDDEN, generator=gen),
                         ranges, 1, gen)
        rows.append(r)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    byte_rows, exact_rows = [], []
    for tp in TP_DEGREES:
        heads = [attention_head_shard(HEADS, KV_HEADS, tp, r) for r in range(tp)]
        q_ranges = [h.q_rows(HEAD_DIM) for h in heads]
        kv_ranges = [h.kv_rows(HEAD_DIM) for h in heads]
        attn = [linear_bytes("q_proj", HEADS * HEAD_DIM, HIDDEN, 0, q_ranges),
                linear_bytes("k_proj", KV_HEADS * HEAD_DIM, HIDDEN, 0, kv_ranges),
                linear_bytes("v_proj", KV_HEADS * HEAD_DIM, HIDDEN, 0, kv_ranges),
                linear_bytes("o_proj", HIDDEN, HEADS * HEAD_DIM, 1, q_ranges)]
        for row in attn:
            row["tp"] = tp
        byte_rows += attn + moe_rows(tp)
        checks = [check_linear("q_proj", torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=gen) * 0.02,
                               torch.randn(HEADS * HEAD_DIM, generator=gen), q_ranges, 0, gen),
                  check_linear("k_proj", torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=gen) * 0.02,
                               torch.randn(KV_HEADS * HEAD_DIM, generator=gen), kv_ranges, 0, gen),
                  check_linear("o_proj", torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=gen) * 0.02,
                               torch.randn(HIDDEN, generator=gen), q_ranges, 1, gen)]
        for row in checks + check_moe(tp, gen):
            row["tp"] = tp
            exact_rows.append(row)
        print(f"TP{tp} done ({time.perf_counter() - start:.0f} s)", flush=True)

    os.makedirs(args.out, exist_ok=True)
    lines = ["# FP8 block-128 under tensor parallelism, gpt-oss-120b (one layer; CPU, measured)", "",
             "Scheme (`sglang_ext/layers/parallel.py`): expert shards cut on the 128-grid (whole blocks, "
             "uneven by at most one block); attention head shards zero-padded at the front to the grid "
             "where they start mid-block and cross a block edge. Every local block is an original block "
             "with its original scale: no re-quantisation.", "",
             "## Bytes", "",
             "padding = zero e4m3 bytes over the shards' e4m3 bytes; busiest rank = its e4m3 + padding + "
             "scale bytes against an even 1/TP share of the tensor's bytes.", "",
             "| TP | tensor | e4m3 bytes | padding | padding / shards | duplicated scale bytes | busiest rank bytes | busiest rank vs 1/TP |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in byte_rows:
        lines.append(f"| {r['tp']} | {r['tensor']} | {r['full_e4m3_bytes']:,} | {r['padding_bytes']:,} | "
                     f"{r['padding_pct_of_shards']:.2f}% | {r['duplicated_scale_bytes']:,} | "
                     f"{r['busiest_rank_bytes']:,} | {r['busiest_rank_vs_even_pct']:+.1f}% |")
    lines += ["", "## Exactness (random weights at the real shapes)", "",
              "| TP | tensor | max abs diff, dequantised shard vs slice | TP vs single process (rel.) | amax exchange | padded ranks |",
              "|---:|---|---:|---:|---|---:|"]
    for r in exact_rows:
        tp_err = r.get("tp_vs_single_process_rel_err")
        lines.append(f"| {r['tp']} | {r['tensor']} | {r['max_abs_diff_dequantised_shard_vs_slice']:.1e} | "
                     f"{'' if tp_err is None else f'{tp_err:.1e}'} | {r.get('amax_exchange', '')} | "
                     f"{r.get('padded_ranks', '')} |")
    lines += ["", "Reading: on gpt-oss-120b at TP 2/4/8 the chosen scheme stores no padding at all (q/o shards "
              "are 512-aligned, k/v shards of 64 rows at TP8 lie inside one block, expert shards are whole "
              "blocks). Its cost is the uneven split of 22.5 blocks: the busiest rank holds 6.7% more than "
              "1/TP. Even shards padded to the grid store 1.1/7.8/16.7% zeros at TP 2/4/8 and load the "
              "busiest rank +2.2/+15.6/+31.1%: lighter only at TP2, and where the MoE quantises its "
              "intermediate activation per 128-group (an FP8 fused MoE does), a group cut between two ranks "
              "stays exact only with an amax exchange between mlp1 and mlp2 (the `amax exchange` rows), "
              "which a fused kernel cannot make. Expert parallelism needs neither (its cost is routing "
              "imbalance, not measured here). Dequantised shards equal the slices bit for bit; TP results "
              "differ from the single process only by fp32 summation order.",
              "", f"Command: `{COMMAND}`"]
    with open(os.path.join(args.out, "fp8_tp_sharding.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "fp8_tp_sharding.json"), "w") as f:
        json.dump({"command": COMMAND, "model": "gpt-oss-120b, one layer", "bytes": byte_rows,
                   "exactness": exact_rows, "seconds": time.perf_counter() - start}, f, indent=2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
