"""The opt-in FP8 LM head (sglang_ext/layers/lm_head.py): chunked quantisation == the whole-tensor
quantiser bit for bit, SGLang's LogitsProcessor dispatching to it, and its logits against the bf16
head (random weights: the size of the change, not a claim about the real model's tokens)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang_ext.layers.fp8 import dequantize_weight_block128, fp8_linear_torch, quantize_weight_block128
from sglang_ext.layers.lm_head import (FP8_LM_HEAD_ENV, Fp8BlockLMHeadMethod, fp8_lm_head_enabled,
                                       fp8_lm_head_error, quantize_head_weight, quantize_lm_head,
                                       restore_bf16_lm_head)


def _head(vocab=1000, hidden=320, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = nn.Module()
    head.weight = nn.Parameter((torch.randn(vocab, hidden, generator=g) * 0.02).to(torch.bfloat16), requires_grad=False)
    return head


@pytest.mark.parametrize("rows_per_chunk", [128, 300, 1 << 20])
def test_chunked_quantisation_is_the_whole_tensor_quantiser(rows_per_chunk):
    w = _head(vocab=1000).weight.data  # 7.8 row blocks: a ragged last block, in and across chunks
    codes, scales = quantize_head_weight(w, rows_per_chunk=rows_per_chunk)
    want_q, want_s = quantize_weight_block128(w)
    assert torch.equal(codes.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_s)


def test_sglang_logits_processor_runs_the_e4m3_head():
    """LogitsProcessor._compute_lm_head (SGLang 0.5.23) on a head after quantize_lm_head: it takes the
    quant method's apply, whose logits are fp8_linear_torch's on the codes."""
    from sglang.srt.layers.logits_processor import LogitsProcessor, should_apply_lm_head_quant_method

    head = _head()
    bf16 = head.weight.data.clone()
    quantize_lm_head(head)
    assert head.weight.dtype == torch.float8_e4m3fn and isinstance(head.quant_method, Fp8BlockLMHeadMethod)
    assert should_apply_lm_head_quant_method(head, head.quant_method)
    x = torch.randn(5, 320, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    fake_self = SimpleNamespace(use_fp32_lm_head=False, use_fp32_lm_head_output=False)
    logits = LogitsProcessor._compute_lm_head(fake_self, x, head)
    assert torch.equal(logits, fp8_linear_torch(x, head.weight, head.weight_scale_inv, None))
    # the dequantised codes are the bf16 weight within e4m3's half-ulp (2^-4 relative) of each block's scale
    deq = dequantize_weight_block128(head.weight, head.weight_scale_inv)
    assert ((deq - bf16.float()).abs() <= 2 ** -4 * bf16.float().abs() + 1e-6).all()


def test_fp8_head_error_is_small_on_random_weights():
    head = _head(vocab=4096, hidden=640, seed=3)
    x = torch.randn(16, 640, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    err = fp8_lm_head_error(x, head.weight.data)
    assert err["rel_fro"] < 0.05 and err["argmax_agree"] >= 0.75, err


def test_env_switch(ext_env, monkeypatch):
    ext_env(FP8_LM_HEAD_ENV, None)
    assert not fp8_lm_head_enabled()
    ext_env(FP8_LM_HEAD_ENV, "1")
    assert fp8_lm_head_enabled()
    monkeypatch.setenv(FP8_LM_HEAD_ENV, "0")
    assert fp8_lm_head_enabled()  # read once: a change without reload_settings is not seen
    ext_env(FP8_LM_HEAD_ENV, "yes")
    with pytest.raises(ValueError, match=FP8_LM_HEAD_ENV):
        fp8_lm_head_enabled()


def test_a_reload_gets_the_bf16_head_back():
    """load_weights on a live model (SGLang's weight updates) first calls restore_bf16_lm_head: the
    weight is bf16 again with its loader attribute, the scales and the FP8 method are gone, and the
    head quantises again after the new weights are in."""
    head = _head()
    head.quant_method = "the embedding's own method"
    head.weight.weight_loader = lambda param, tensor: param.data.copy_(tensor)
    assert not restore_bf16_lm_head(head)  # never quantised: nothing to undo
    quantize_lm_head(head)
    assert restore_bf16_lm_head(head)
    assert head.weight.dtype == torch.bfloat16 and head.quant_method == "the embedding's own method"
    assert not hasattr(head, "weight_scale_inv") and callable(head.weight.weight_loader)
    new = torch.randn(head.weight.shape).to(torch.bfloat16)
    head.weight.weight_loader(head.weight, new)
    quantize_lm_head(head)
    assert torch.equal(head.weight.view(torch.uint8), quantize_weight_block128(new)[0].view(torch.uint8))


def test_quantize_rejects_an_already_quantised_head():
    head = _head()
    quantize_lm_head(head)
    with pytest.raises(ValueError, match="LM head"):
        quantize_lm_head(head)
