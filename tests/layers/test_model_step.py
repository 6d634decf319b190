"""The benchmark harness computes gpt-oss, not just something of the right size.

benchmarks/model_step.py runs the server's decoder (sglang_ext/models/gpt_oss_core.py) on its
own paged KV cache (the GPU image has no SGLang). Oracles: (1) the same harness without a cache: a decode step after
a prefill of n tokens must give the logits of a prefill of n + 1 tokens; (2) the SGLang-free
layers it calls, recomposed here in plain torch on dequantised weights, over a dense
(unpaged) causal window mask.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # `pytest` without `python -m`: benchmarks/ is a package of the checkout
    sys.path.insert(0, ROOT)

from benchmarks.model_step import GPT_OSS_TINY, ModelStep, parallel_layout, decode_step_bytes, GPT_OSS_120B  # noqa: E402

from sglang_ext.layers.fp8 import dequantize_weight_block128, fp8_linear_torch  # noqa: E402
from sglang_ext.layers.moe import experts_torch, route  # noqa: E402
from sglang_ext.layers.norm import rms_norm  # noqa: E402
from sglang_ext.layers.rope import apply_rope  # noqa: E402
from sglang_ext.layers.sink_attention import sink_attention_torch  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ModelStep(GPT_OSS_TINY, parallel_layout(), batch=3, context=48, swa_slots=48, device="cpu", dtype=torch.float32)


def dense_reference(m: ModelStep, token_ids: torch.Tensor) -> torch.Tensor:
    """The whole tiny model on one sequence, from the layer functions, no paging."""
    d = m.dims
    n, hd = token_ids.shape[0], d.head_dim
    positions = torch.arange(n)
    cos_sin = m.decoder.cos_sin(positions)
    h = m.embed[token_ids]
    lin = lambda x, p: fp8_linear_torch(x, p.weight, p.weight_scale_inv, p.bias)  # noqa: E731
    for i, layer in enumerate(m.layers):
        attn, ex = layer.self_attn, layer.mlp.experts
        x = rms_norm(h, layer.input_layernorm.weight, d.rms_eps)
        q = lin(x, attn.q_proj).view(n, m.num_heads, hd)
        k = lin(x, attn.k_proj).view(n, m.num_kv_heads, hd)
        v = lin(x, attn.v_proj).view(n, m.num_kv_heads, hd)
        q, k = apply_rope(q, cos_sin), apply_rope(k, cos_sin)
        window = d.sliding_window - 1 if d.is_sliding(i) else -1
        o = sink_attention_torch(q, k, v, attn.sinks, positions, 0, window, hd ** -0.5)
        h = h + lin(o.reshape(n, -1), attn.o_proj)
        x = rms_norm(h, layer.post_attention_layernorm.weight, d.rms_eps)
        w, ids = route(x, layer.mlp.router.weight, layer.mlp.router.bias, d.top_k)
        h = h + experts_torch(x, w, ids, dequantize_weight_block128(ex.gate_up_proj, ex.gate_up_proj_scale_inv),
                              ex.gate_up_proj_bias, dequantize_weight_block128(ex.down_proj, ex.down_proj_scale_inv),
                              ex.down_proj_bias, d.swiglu_limit, quantize_activations=True)
    return torch.nn.functional.linear(rms_norm(h[-1:], m.decoder.norm.weight, d.rms_eps), m.lm_head)


def test_prefill_equals_dense_reference(model):
    inputs = model.prefill_inputs(30)  # longer than the window (8): sliding layers are exercised
    got = model.forward(**inputs)
    want = dense_reference(model, inputs["token_ids"])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class _QShapedOutput(torch.nn.Module):
    """The attention op with its output in a buffer shaped as q ([T, H, D]), as SGLang's RadixAttention
    returns it from the eager attention of a breakable prefill CUDA graph (graph_utils.allocate_attention_outputs)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.tp_q_head_num, self.qk_head_dim, self.v_head_dim = inner.num_heads, inner.head_dim, inner.head_dim

    @property
    def applies_rope_kv(self):
        return self.inner.applies_rope_kv

    def forward(self, q, k, v, batch, **kwargs):
        from sglang.srt.layers.attention.graph_utils import allocate_attention_outputs

        out, _ = allocate_attention_outputs(self, q.view(q.shape[0], self.tp_q_head_num, -1), v, None)
        out.view(-1).copy_(self.inner(q, k, v, batch, **kwargs).reshape(-1))
        return out


def test_attention_output_shaped_as_q(model):
    inputs = model.prefill_inputs(30)
    want = model.forward(**inputs)
    attns = [layer.self_attn for layer in model.layers]
    inner = [a.attn for a in attns]
    try:
        for a in attns:
            a.attn = _QShapedOutput(a.attn)
        got = model.forward(**inputs)
    finally:
        for a, op in zip(attns, inner):
            a.attn = op
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_decode_after_prefill_equals_longer_prefill(model):
    inputs = model.prefill_inputs(21)
    want = model.forward(**inputs)[0]
    short = {k: v[:20] if isinstance(v, torch.Tensor) and v.shape[0] == 21 else v for k, v in inputs.items()}
    short["seq_lens"] = torch.tensor([20], dtype=torch.int32)
    short["q_len"] = torch.tensor([20], dtype=torch.int32)
    model.forward(**short)
    step = model.decode_inputs(21)  # requests 1, 2 decode over random cache contents beside it
    step["token_ids"][0] = inputs["token_ids"][20]
    got = model.forward(**step)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_decode_bytes_match_the_issue_budget():
    # Issue 7: 6.03 GB per token for 120b at batch 1, context 8192 (FP8 experts, bf16 LM head).
    assert abs(decode_step_bytes(GPT_OSS_120B, parallel_layout(), 1, 8192) / 1e9 - 6.03) < 0.01


def test_harness_probe_makes_its_request_rows_once(model):
    """The probe-on step's request rows come from one tensor made once (a server passes its batch's
    req_pool_indices): an arange at each step's start and end was harness time charged to the probe."""
    from benchmarks.model_step import HarnessProbe

    probe = HarnessProbe(model)
    inputs = model.decode_inputs(40)
    last = inputs["q_start"] + inputs["q_len"] - 1
    first = probe._batch(inputs["out_full"], inputs["seq_lens"], last)
    again = probe._batch(inputs["out_full"], inputs["seq_lens"], last)
    assert again[1] is first[1]
    assert torch.equal(first[1], torch.arange(model.batch_local))
    assert first[3] is None  # one row per request: a decode batch, every row samples


def test_head_carveout_sets_and_restores_the_matmul_settings():
    """The harness's carveout experiment (head_carveout) sets torch's SM carveout, and
    with `lt` cuBLASLt, only inside its block, and leaves both as it found them; 0 SMs changes nothing."""
    from benchmarks.model_step import head_carveout

    library = torch.backends.cuda.preferred_blas_library()
    seen = []
    for sms, lt in ((16, True), (8, False), (0, True)):
        with head_carveout(sms, lt):
            seen.append((torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()))
        assert torch._C._get_sm_carveout_experimental() is None
        assert torch.backends.cuda.preferred_blas_library() == library
    assert seen == [(16, torch._C._BlasBackend.Cublaslt), (8, library), (None, library)]
