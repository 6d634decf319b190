"""The ext_sinks backend's torch path against a float64 per-query reference.

Runs the real backend class over SGLang's real paged KV pools (plain MHA and the
hybrid SWA pool gpt-oss gets by default), with scattered page layouts, cached
prefixes of several lengths and batches mixing them, in fp32 and bf16.
"""

import math
import types

import pytest
import torch

WINDOW_LEFT = 127  # gpt-oss: sliding_window 128 inclusive -> SGLang's sliding_window_size


def reference_attention(q, keys, values, sinks, q_pos, window_left, scale):
    """float64, one query at a time: key j visible iff q_pos - window_left <= j <= q_pos."""
    q, keys, values, sinks = (t.double() for t in (q, keys, values, sinks))
    num_heads, group = q.shape[0], q.shape[0] // keys.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lo = 0 if window_left < 0 else max(0, q_pos - window_left)
    for h in range(num_heads):
        kh = keys[lo : q_pos + 1, h // group]
        vh = values[lo : q_pos + 1, h // group]
        logits = kh @ q[h] * scale
        all_logits = torch.cat([logits, sinks[h : h + 1]])
        w = torch.softmax(all_logits, dim=0)[:-1]
        out[h] = w @ vh
    return out


class _Pools:
    def __init__(self, *, swa: bool, dtype, num_kv_heads, head_dim, num_layers, size):
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        common = dict(page_size=1, dtype=dtype, head_num=num_kv_heads, head_dim=head_dim,
                      device="cpu", enable_memory_saver=False)
        if not swa:
            self.kv = MHATokenToKVPool(size=size, layer_num=num_layers, **common)
        else:
            from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

            swa_ids = [i for i in range(num_layers) if i % 2 == 0]
            full_ids = [i for i in range(num_layers) if i % 2 == 1]
            self.kv = SWAKVPool(
                size=size, size_swa=size, swa_attention_layer_ids=swa_ids,
                full_attention_layer_ids=full_ids,
                token_to_kv_pool_class=MHATokenToKVPool, **common,
            )
            # A scrambled full->swa slot map, as the SWA allocator would produce.
            mapping = torch.randperm(size + 1).to(torch.int64)
            self.kv.register_mapping(torch.cat([mapping, torch.tensor([-1])]))


def _make_backend(pools, req_to_token):
    from sglang_ext.attention_backend import SinkAttnBackend

    runner = types.SimpleNamespace(
        device=torch.device("cpu"),
        req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool=pools.kv,
    )
    return SinkAttnBackend(runner)


def _layer(layer_id, num_heads, num_kv_heads, head_dim, window_left):
    return types.SimpleNamespace(
        layer_id=layer_id, tp_q_head_num=num_heads, tp_k_head_num=num_kv_heads,
        tp_v_head_num=num_kv_heads, qk_head_dim=head_dim, v_head_dim=head_dim,
        sliding_window_size=window_left, scaling=1 / math.sqrt(head_dim),
        is_cross_attention=False, k_scale=None, v_scale=None,
    )


def _forward_batch(mode, req_pool_indices, seq_lens, extend_lens, out_cache_loc, prefix_lens=None):
    """prefix_lens (extend): SGLang's extend_prefix_lens_cpu, which the backend reads for a prefill with
    no cached prefix; None leaves it out (the backend then takes every extend as one with a prefix)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(
        extend_prefix_lens_cpu=None if prefix_lens is None else list(prefix_lens),
        forward_mode=ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND,
        req_pool_indices=torch.tensor(req_pool_indices),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens),
        extend_seq_lens=torch.tensor(extend_lens),
        extend_seq_lens_cpu=list(extend_lens),
        out_cache_loc=out_cache_loc,
    )


CASES = [
    # (seq lens, cached-prefix lens): one-shot prefill, radix hits, a chunk past the window
    ([300], [0]),
    ([5, 129, 260], [0, 128, 100]),
    ([1, 140, 200, 64], [0, 0, 199, 63]),
]


@pytest.mark.parametrize("swa_pool", [False, True], ids=["mha_pool", "swa_pool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_extend_then_decode_matches_float64(swa_pool, dtype, case):
    torch.manual_seed(case)
    seq_lens, prefix_lens = CASES[case]
    num_heads, num_kv_heads, head_dim, num_layers = 8, 2, 16, 2
    size = 2048
    pools = _Pools(swa=swa_pool, dtype=dtype, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   num_layers=num_layers, size=size)
    # Scattered page layout: each request's tokens sit in random, non-contiguous slots.
    slots = torch.randperm(size - 1)[: sum(seq_lens) + len(seq_lens)] + 1
    req_to_token = torch.zeros((8, 512), dtype=torch.int32)
    keys = {}
    values = {}
    offset = 0
    rpis = [3, 1, 6, 0][: len(seq_lens)]
    for rpi, n in zip(rpis, seq_lens):
        req_to_token[rpi, : n + 1] = slots[offset : offset + n + 1].int()
        offset += n + 1
    sinks = torch.randn(num_heads) * 2
    backend = _make_backend(pools, req_to_token)

    for layer_id, window_left in ((0, WINDOW_LEFT), (1, -1)):
        layer = _layer(layer_id, num_heads, num_kv_heads, head_dim, window_left)
        # Prefix K/V already cached (a radix hit or an earlier chunk).
        for rpi, n, p in zip(rpis, seq_lens, prefix_lens):
            keys[rpi] = torch.randn(n + 1, num_kv_heads, head_dim).to(dtype)
            values[rpi] = torch.randn(n + 1, num_kv_heads, head_dim).to(dtype)
            if p:
                fb = _forward_batch("extend", [rpi], [p], [p], req_to_token[rpi, :p].long())
                backend.init_forward_metadata(fb)
                backend.forward_extend(torch.zeros(p, num_heads * head_dim, dtype=dtype),
                                       keys[rpi][:p], values[rpi][:p], layer, fb, sinks=sinks)
        # Extend the rest of every request in one mixed batch.
        ext = [n - p for n, p in zip(seq_lens, prefix_lens)]
        loc = torch.cat([req_to_token[r, p:n].long() for r, n, p in zip(rpis, seq_lens, prefix_lens)])
        q = torch.randn(sum(ext), num_heads, head_dim).to(dtype)
        fb = _forward_batch("extend", rpis, seq_lens, ext, loc)
        backend.init_forward_metadata(fb)
        out = backend.forward_extend(
            q.view(sum(ext), -1),
            torch.cat([keys[r][p:n] for r, n, p in zip(rpis, seq_lens, prefix_lens)]),
            torch.cat([values[r][p:n] for r, n, p in zip(rpis, seq_lens, prefix_lens)]),
            layer, fb, sinks=sinks,
        ).view(-1, num_heads, head_dim)
        row = 0
        tol = 2e-5 if dtype == torch.float32 else 1e-2
        for r, n, p in zip(rpis, seq_lens, prefix_lens):
            for pos in range(p, n):
                want = reference_attention(q[row], keys[r], values[r], sinks, pos, window_left, layer.scaling)
                torch.testing.assert_close(out[row].double(), want, atol=tol, rtol=tol)
                row += 1
        # One decode step for every request.
        qd = torch.randn(len(rpis), num_heads, head_dim).to(dtype)
        loc = torch.stack([req_to_token[r, n].long() for r, n in zip(rpis, seq_lens)])
        fb = _forward_batch("decode", rpis, [n + 1 for n in seq_lens], [1] * len(rpis), loc)
        backend.init_forward_metadata(fb)
        out = backend.forward_decode(
            qd.view(len(rpis), -1),
            torch.stack([keys[r][n] for r, n in zip(rpis, seq_lens)]),
            torch.stack([values[r][n] for r, n in zip(rpis, seq_lens)]),
            layer, fb, sinks=sinks,
        ).view(-1, num_heads, head_dim)
        for i, (r, n) in enumerate(zip(rpis, seq_lens)):
            want = reference_attention(qd[i], keys[r], values[r], sinks, n, window_left, layer.scaling)
            torch.testing.assert_close(out[i].double(), want, atol=tol, rtol=tol)


def test_decode_window_is_128_keys_inclusive():
    """Key 128 positions back is out, 127 back is in (upstream's triton decode sees 127)."""
    from sglang_ext.layers.sink_attention import sink_attention_torch

    n = 200
    q = torch.ones(1, 1, 4)
    k = torch.zeros(n, 1, 4)
    v = torch.zeros(n, 1, 4)
    v[n - 1 - WINDOW_LEFT] = 1.0  # oldest visible key
    v[n - 2 - WINDOW_LEFT] = 100.0  # just outside
    out = sink_attention_torch(q, k, v, None, torch.tensor([n - 1]), 0, WINDOW_LEFT, 1.0)
    assert out[0, 0, 0].item() == pytest.approx(1.0 / 128)


@pytest.mark.parametrize("platform", ["cuda", "cpu_without_amx", "cpu_with_amx"])
def test_gpt_oss_defaults_to_ext_sinks_and_its_own_moe(monkeypatch, platform):
    """Upstream's gpt-oss override picks fa3 on Hopper (and the triton_kernels MoE runner, whose MXFP4
    layout this model class does not load); with the plugin, a launch that names no backend gets ext_sinks
    on CUDA and on a CPU without AMX, and what the user names is kept."""
    from sglang_ext.patches import sink_attention_backend as sab

    monkeypatch.setattr(sab, "_cpu_with_amx", lambda: platform == "cpu_with_amx")
    unset = types.SimpleNamespace(attention_backend=None, prefill_attention_backend=None,
                                  decode_attention_backend=None, moe_runner_backend="auto")
    got = sab.gpt_oss_overrides(unset, None)
    if platform == "cpu_with_amx":
        assert got == {}
    else:
        assert got == {"attention_backend": "ext_sinks", "moe_runner_backend": "triton"}
        named = types.SimpleNamespace(attention_backend="triton", prefill_attention_backend=None,
                                      decode_attention_backend=None, moe_runner_backend="triton_kernel")
        assert sab.gpt_oss_overrides(named, None) == {}


def test_gpt_oss_override_runs_after_upstreams():
    """Overrides apply in registration order: ours must come after upstream's gpt-oss provider to win."""
    from sglang.srt.arg_groups import model_override_base as mob

    from sglang_ext.patches import sink_attention_backend as sab

    sab._register_override()
    providers = mob._MODEL_OVERRIDE_FNS["GptOssForCausalLM"]
    assert providers[-1] is sab.gpt_oss_overrides
    assert any(p.__module__.endswith("model_overrides.gpt_oss") for p in providers[:-1])
