"""The SGLang model's own sharding (loader + forward) at TP 2/4, EP 2, TP 2 x EP 2, FP8 and bf16.

tests/layers/test_parallel_maths.py proves the maths of sglang_ext.layers.parallel in real gloo
processes; this proves the model file uses it right: each rank's parameters are cut from
the full checkpoint tensors by the model's loader (`shard_checkpoint_tensor`), its modules
run their forward with the all-reduce replaced by the sum over the ranks' partials, and
every rank's output equals the single-process module's. Oracle: the same model class at
TP 1 on the full tensors.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang")

from transformers import GptOssConfig  # noqa: E402

import sglang_ext.models.gpt_oss as gpt_oss  # noqa: E402
import sglang_ext.models.gpt_oss_core as core  # noqa: E402
from sglang_ext.layers.fp8 import quantize_weight_block128  # noqa: E402
from sglang_ext.layers.parallel import ParallelLayout  # noqa: E402

HIDDEN, INTER, EXPERTS, HEADS, KV_HEADS, HEAD_DIM = 320, 320, 8, 8, 2, 64


def make_config(fp8: bool):
    cfg = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=4,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_hidden_layers=2,
                       vocab_size=512, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    if fp8:
        cfg.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    return cfg


def checkpoint_tensors(fp8: bool, seed: int = 0) -> dict:
    """Layer-0 MLP and projection tensors in the checkpoint layout (FP8: [E, out, in] + scales)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t = {
        "mlp.router.weight": r(EXPERTS, HIDDEN), "mlp.router.bias": r(EXPERTS),
        "mlp.experts.gate_up_proj_bias": r(EXPERTS, 2 * INTER) * 5,  # large: a double add would show
        "mlp.experts.down_proj_bias": r(EXPERTS, HIDDEN) * 5,
        "self_attn.q_proj.weight": r(HEADS * HEAD_DIM, HIDDEN) * 0.1, "self_attn.q_proj.bias": r(HEADS * HEAD_DIM),
        "self_attn.k_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN) * 0.1, "self_attn.k_proj.bias": r(KV_HEADS * HEAD_DIM),
        "self_attn.v_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN) * 0.1, "self_attn.v_proj.bias": r(KV_HEADS * HEAD_DIM),
        "self_attn.o_proj.weight": r(HIDDEN, HEADS * HEAD_DIM) * 0.1, "self_attn.o_proj.bias": r(HIDDEN) * 5,
        "self_attn.sinks": r(HEADS),
    }
    gate_up, down = r(EXPERTS, 2 * INTER, HIDDEN) * 0.1, r(EXPERTS, HIDDEN, INTER) * 0.1
    if fp8:
        for name, w in (("mlp.experts.gate_up_proj", gate_up), ("mlp.experts.down_proj", down)):
            t[name], t[name + "_scale_inv"] = quantize_weight_block128(w)
        for proj in "qkvo":
            name = f"self_attn.{proj}_proj.weight"
            t[name], t[f"self_attn.{proj}_proj.weight_scale_inv"] = quantize_weight_block128(t[name])
    else:  # bf16 checkpoints store experts [E, in, out]
        t["mlp.experts.gate_up_proj"], t["mlp.experts.down_proj"] = gate_up.transpose(1, 2), down.transpose(1, 2)
    return t


def build_rank(cfg, layout: ParallelLayout, tensors: dict):
    tp = core.RankGroups(layout)
    attn = core.GptOssAttention(cfg, 0, tp)
    mlp = core.GptOssMLP(cfg, tp)
    modules = {"self_attn": attn, "mlp": mlp}
    for name, full in tensors.items():
        top, rest = name.split(".", 1)
        param = dict(modules[top].named_parameters())[rest]
        part = gpt_oss.shard_checkpoint_tensor("model.layers.0." + name, full, "checkpoint", tp, attn, mlp.experts)
        assert tuple(part.shape) == tuple(param.shape), (name, tuple(part.shape), tuple(param.shape))
        param.data.copy_(part.to(param.dtype))
    return attn, mlp


class SummingCollectives(core.Collectives):
    """The TP all-reduce of ranks run one after another in this process: a first pass records every rank's
    partial (returning zeros), a second returns their sum."""

    def __init__(self):
        self.partials, self.total = [], None

    def all_reduce(self, x):
        if self.total is None:
            self.partials.append(x.clone())
            return x * 0
        return self.total.to(x.dtype)


def run_ranks(layouts, fn):
    """fn(rank_modules) -> output, with the TP all-reduce = the sum of every rank's partial."""
    comm = SummingCollectives()
    for mods in layouts:
        mods.tp.comm = comm
        fn(mods)
    comm.total = torch.stack(comm.partials).sum(0)
    return [fn(mods) for mods in layouts]


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("tp,ep", [(2, 1), (4, 1), (2, 2), (4, 2)], ids=["TP2", "TP4", "EP2", "TP4xEP2"])
def test_rank_outputs_equal_single_process(fp8, tp, ep):
    torch.manual_seed(1)
    cfg = make_config(fp8)
    tensors = checkpoint_tensors(fp8)
    single_attn, single_mlp = build_rank(cfg, ParallelLayout(1, 0), tensors)
    ranks = [build_rank(cfg, ParallelLayout(tp, r, ep_size=ep), tensors) for r in range(tp)]
    x = torch.randn(7, HIDDEN)

    want = single_mlp(x)
    for got in run_ranks([m for _, m in ranks], lambda mlp: mlp(x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())

    # Attention projections: each rank's q/k/v rows are its heads' rows of the full projection
    # (padding dropped); the o_proj partials sum, with the bias once, to the full o_proj.
    q_full = single_attn.q_proj(x)
    o_in = torch.randn(7, HEADS * HEAD_DIM)
    o_want = single_attn.o_proj(o_in)
    partials = []
    for attn, _ in ranks:
        q = attn.q_shard.drop_padding(attn.q_proj(x))
        lo, hi = attn.heads.q_rows(HEAD_DIM)
        torch.testing.assert_close(q, q_full[:, lo:hi], rtol=1e-5, atol=1e-5)
        k = attn.kv_shard.drop_padding(attn.k_proj(x))
        klo, khi = attn.heads.kv_rows(HEAD_DIM)
        torch.testing.assert_close(k, single_attn.k_proj(x)[:, klo:khi], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attn.sinks, single_attn.sinks[attn.heads.q_lo:attn.heads.q_hi])
        partials.append(attn.o_proj(attn.q_shard.pad_activation(o_in[:, lo:hi]), with_bias=False))
    o_got = torch.stack(partials).sum(0) + ranks[0][0].o_proj.bias
    # FP8: each rank quantises its own activation slice (128-aligned cuts: the same groups).
    torch.testing.assert_close(o_got, o_want, rtol=1e-4, atol=1e-4 * o_want.abs().max().item())


@pytest.mark.parametrize("tp_rank,attn_tp", [(0, 1), (3, 1), (2, 2), (3, 2)])
def test_data_parallel_attention_layout_from_sglang_groups(monkeypatch, tp_rank, attn_tp):
    """TP 4 with DP attention: the attention group of TP rank r is r // attn_tp, its rank in it r % attn_tp
    (SGLang's contiguous groups), and a mismatch with SGLang's own attention rank is refused."""
    import sglang.srt.distributed.parallel_state as ps

    monkeypatch.setattr(gpt_oss, "get_tensor_model_parallel_world_size", lambda: 4)
    monkeypatch.setattr(gpt_oss, "get_tensor_model_parallel_rank", lambda: tp_rank)
    monkeypatch.setattr(ps, "get_moe_expert_parallel_world_size", lambda: 2)
    monkeypatch.setattr(ps, "get_attn_tensor_model_parallel_world_size", lambda: attn_tp)
    monkeypatch.setattr(ps, "get_attn_tensor_model_parallel_rank", lambda: tp_rank % attn_tp)
    layout = gpt_oss._sglang_layout()
    assert (layout.tp_size, layout.tp_rank, layout.ep_size) == (4, tp_rank, 2)
    assert (layout.attn_dp_size, layout.attn_tp_size, layout.attn_tp_rank) == (4 // attn_tp, attn_tp, tp_rank % attn_tp)
    if attn_tp > 1:
        monkeypatch.setattr(ps, "get_attn_tensor_model_parallel_rank", lambda: (tp_rank + 1) % attn_tp)
        with pytest.raises(NotImplementedError, match="contiguous attention-TP groups"):
            gpt_oss._sglang_layout()
