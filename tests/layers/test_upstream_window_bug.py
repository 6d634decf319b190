"""A witness for an upstream SGLang 0.5.23 bug: the triton backend's decode window is one key short.

gpt-oss's sliding window is 128 keys including the current one (key j visible to query i
iff i-128 < j <= i; transformers and SGLang's own prefill agree). SGLang passes
`sliding_window_size = config.sliding_window - 1 = 127` ("earlier keys") to the backends,
and the triton backend's decode path then gathers `min(seq_len, 127)` keys, with
seq_len counting the current token: 127 keys, not 128. Once a sequence is longer than the
window, upstream decode diverges from transformers (cpu_recipes.md: the 8th token of a
200-token prompt). Our `ext_sinks` backend reads 128 (tests/layers/test_attention_backend.py).

This test calls the upstream function itself and pins the buggy count; when upstream
fixes it, this test fails and the workaround notes can go.
"""

import types

import torch


def test_upstream_triton_decode_window_gathers_127_keys_for_a_128_window():
    from sglang.srt.layers.attention.triton_backend import update_sliding_window_buffer
    from sglang.srt.models.gpt_oss import get_attention_sliding_window_size

    window_left = get_attention_sliding_window_size(types.SimpleNamespace(sliding_window=128))
    assert window_left == 127
    translator = types.SimpleNamespace(pack_read_stream=lambda *a, **k: True, window_kv_kind=None)
    seq_lens = torch.tensor([200])  # includes the token being decoded
    indptr = torch.zeros(2, dtype=torch.int64)
    _, _, window_kv_lens, start = update_sliding_window_buffer(
        indptr, translator, None, torch.tensor([0]), window_left, seq_lens, 1,
        device="cpu", token_to_kv_pool=None)
    keys_seen = int(window_kv_lens[0])
    assert keys_seen == 127, "upstream now gathers 128 keys: the bug is fixed"
    assert int(start[0]) == 73  # keys 73..199; key 72 (= 199 - 127) is visible in prefill and in HF
