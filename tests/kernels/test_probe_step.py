"""The fused probe decode step (taps + 3 launches) vs the reference head of probe/model.py.

Each decode row's expected scores come from ``SingProbeHead.forward`` over the request's whole feature
sequence (its K/V history is what the head's own projection wrote into the pool), so the paged pool,
the window, the last-arriver merges and the tail are all checked against the model definition, and
tightly against ``probe_decode_step_ref`` (the same served maths in torch). Kernels run under
TRITON_INTERPRET=1 in a subprocess (this file as a script), as in test_probe_kernel.py; the ``gpu``
test runs them compiled at the 120b probe's dims and inside a CUDA graph.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from sglang_ext.probe.config import ProbeConfig
from sglang_ext.probe.model import SingProbeHead, rms_normalize

SMALL = dict(hidden=96, taps=3, heads=4, head_dim=16, labels=10)
FULL = dict(hidden=2880, taps=3, heads=8, head_dim=64, labels=10)


def _kernels():
    from sglang_ext.kernels import probe_step

    return probe_step


def make_head(dims, window, dtype, seed, device):
    cfg = ProbeConfig.from_dict({
        "architectures": ["SingProbeAttnModel"], "model_type": "sing_probe_attn", "hidden_size": dims["hidden"],
        "base_model_layer_ids": list(range(dims["taps"])), "num_attention_heads": dims["heads"],
        "head_dim": dims["head_dim"], "sliding_window": window, "num_labels": dims["labels"],
        "base_model_name": "x", "torch_dtype": "float32"})
    torch.manual_seed(seed)
    head = SingProbeHead(cfg)
    for p in head.parameters():
        p.data.normal_(0, 1.5 / cfg.input_size ** 0.5)
    head.o_proj.weight.data.normal_(0, 1.0 / cfg.q_size ** 0.5)
    head.norm.weight.data.uniform_(0.5, 1.5)
    head.classifier.weight.data.normal_(0, 0.3)
    head.classifier.bias.data.normal_(0, 0.5)
    return head.to(device=device, dtype=dtype).requires_grad_(False)


def make_batch(head, dims, lengths, n_pad, dtype, seed, device):
    """Requests with histories in a scattered pool; returns the step's inputs and the expected results."""
    g = torch.Generator().manual_seed(seed)
    n_req, max_ctx = len(lengths), max(lengths) + 4
    slots = n_req * max_ctx + 8
    # Slot 0 is the padding slot (SGLang pads out_cache_loc with 0); no request owns it.
    perm = (torch.randperm(slots - 1, generator=g)[: n_req * max_ctx] + 1).reshape(n_req, max_ctx)
    pool_rows = torch.randperm(n_req + 2, generator=g)[:n_req]  # requests sit at arbitrary pool rows
    req_to_token = torch.zeros(n_req + 2, max_ctx, dtype=torch.int32)
    req_to_token[pool_rows] = perm.to(torch.int32)
    kv_pool = torch.randn(slots, 2 * dims["head_dim"], generator=g).to(dtype)  # garbage where unwritten
    feats, want = [], []
    hdev = head.proj_q.weight.device
    for r, length in enumerate(lengths):
        # Tapped residual rows of very different scales, normalised per tap like the runtime does.
        hid = [torch.randn(length + 1, dims["hidden"], generator=g) * 10.0 ** (i - 1) for i in range(dims["taps"])]
        x = torch.cat([rms_normalize(h).to(dtype) for h in hid], dim=-1)
        _, kv = head.project(x.to(hdev))
        kv_pool[perm[r, :length].long()] = kv[:length].cpu().to(dtype)
        feats.append(x[length])
        want.append(head.probs(head(x[None].to(hdev)))[0, -1].cpu())
    t = len(lengths) + n_pad
    features = torch.zeros(t, dims["hidden"] * dims["taps"], dtype=dtype)
    features[: len(lengths)] = torch.stack(feats)
    features[len(lengths):] = torch.randn(n_pad, features.shape[1], generator=g).to(dtype)
    idx = torch.arange(len(lengths))
    row_pos = torch.full((t,), -1, dtype=torch.int64)
    row_pos[: len(lengths)] = torch.tensor(lengths)
    out_loc = torch.zeros(t, dtype=torch.int64)
    out_loc[: len(lengths)] = perm[idx, torch.tensor(lengths)]
    req_idx = torch.zeros(t, dtype=torch.int64)
    req_idx[: len(lengths)] = pool_rows
    # Shuffle rows so padding is not only at the end.
    order = torch.randperm(t, generator=g)
    inputs = [features[order], kv_pool, out_loc[order], req_to_token, req_idx[order], row_pos[order]]
    inputs = [v.to(device) for v in inputs]
    valid = row_pos[order] >= 0
    expected = torch.zeros(t, dims["labels"])
    expected[valid] = torch.stack(want)[order[valid]]
    return inputs, expected, valid


def weights(head):
    w_qkv = torch.cat([head.proj_q.weight, head.proj_k.weight, head.proj_v.weight])
    return w_qkv, head.o_proj.weight, head.norm.weight, head.classifier.weight, head.classifier.bias


def run_step(mod, head, dims, inputs, window, fn, **kw):
    features, kv_pool, out_loc, r2t, req_idx, row_pos = inputs
    w_qkv, wo, nw, wc, bc = weights(head)
    out = torch.full((features.shape[0] + 2, dims["labels"]), float("nan"), device=features.device)
    fn(features, w_qkv, kv_pool, out_loc, r2t, req_idx, row_pos, window, dims["head_dim"] ** -0.5,
       wo, nw, wc, bc, out, dims["heads"], **kw)
    return out


def by_seq_lens(mod, seq_lens_of=lambda row_pos: row_pos + 1):
    """probe_decode_step in the runtime's form, for run_step: row_pos None, seq_lens_of(row_pos) given instead."""
    return lambda *a, **k: mod.probe_decode_step(*a[:6], None, *a[7:], seq_lens=seq_lens_of(a[6]), **k)


def check_taps(dtype_name, device="cpu"):
    mod = _kernels()
    dtype = getattr(torch, dtype_name)
    worst_ulps = 0
    for t, c in ((1, 96), (5, 96), (3, 2880)):
        feats = torch.full((t + 2, 3 * c), float("nan"), dtype=dtype, device=device)
        want = feats.clone()
        for tap in range(3):
            h = (torch.randn(t, c) * 10.0 ** (2 * tap - 2)).to(dtype if dtype != torch.float32 else torch.float32)
            h = h.to(device)
            mod.probe_tap_normalize(h, feats, tap * c)
            want[:t, tap * c : (tap + 1) * c] = rms_normalize(h).to(dtype)
        assert torch.isnan(feats[t:]).all(), "rows past T were written"
        got, ref = feats[:t].float(), want[:t].float()
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=2e-6, atol=0)
        else:
            # At most one ulp of the 16-bit type where the fp32 scale's last bit flips a rounding.
            ulp = torch.finfo(dtype).eps * ref.abs().clamp(min=torch.finfo(dtype).tiny)
            ulps = ((got - ref).abs() / ulp).max().item()
            assert ulps <= 1.0 + 1e-6, ulps
            worst_ulps = max(worst_ulps, ulps)
    return worst_ulps


def check_step(dtype_name, dims=SMALL, device="cpu", cases=None):
    mod = _kernels()
    dtype = getattr(torch, dtype_name)
    tol_model = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}[dtype_name]
    tol_ref = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype_name]
    worst = {"vs_head": 0.0, "vs_ref": 0.0}
    cases = cases or [
        # (window, lengths, padding rows, kwargs)
        (16, [37], 0, {}),
        (64, [5, 40, 0], 1, {"attn_num_splits": 3, "block_n_attn": 16}),
        (4, [9, 1, 33], 0, {"qkv_splits": 1}),
        (None, [3, 17, 30, 8, 2, 25, 11, 6], 2, {"attn_num_splits": 2, "block_n_attn": 16, "qkv_block_n": 32}),
        # past 16 rows: the launcher's own wide-batch tile (32-row T tiles, ragged; 3 K splits here)
        (8, [4, 9, 1, 6, 12, 3, 7, 2, 10, 5, 8, 1, 3, 11, 2, 6, 4, 9, 1, 5], 1, {}),
    ]
    for i, (window, lengths, n_pad, kw) in enumerate(cases):
        head = make_head(dims, window, dtype, seed=i, device=device)
        inputs, expected, valid = make_batch(head, dims, lengths, n_pad, dtype, seed=10 + i, device="cpu")
        inputs = [v.to(device) for v in inputs]
        ref_inputs = [v.clone() for v in inputs]
        pool0 = inputs[1].clone()
        got = run_step(mod, head, dims, inputs, window, mod.probe_decode_step, **kw)
        ref = run_step(mod, head, dims, ref_inputs, window, mod.probe_decode_step_ref)
        t = len(lengths) + n_pad
        assert torch.isnan(got[t:]).all() and torch.isfinite(got[:t]).all(), got
        err_model = (got[:t].cpu()[valid] - expected[valid]).abs().max().item()
        err_ref = (got - ref).abs().nan_to_num(0.0).max().item()
        assert err_model <= tol_model, (dtype_name, i, "vs head", err_model)
        assert err_ref <= tol_ref, (dtype_name, i, "vs ref", err_ref)
        # K|V: written at the valid rows' slots only (within one ulp of the reference), nowhere else.
        written = inputs[1] != pool0
        loc = inputs[2][valid.to(device)]
        assert not written[inputs[2][~valid.to(device)]].any(), "padding row wrote K|V"
        others = torch.ones(written.shape[0], dtype=torch.bool, device=device)
        others[loc] = False
        assert not written[others].any(), "K|V written outside out_cache_loc"
        d_kv = (inputs[1][loc].float() - ref_inputs[1][loc].float()).abs()
        # fp32: summation order only; 16-bit: one ulp where that order flips a rounding.
        ref_kv = ref_inputs[1][loc].float()
        ulp = torch.finfo(dtype).eps * ref_kv.abs() + 1e-5 * ref_kv.abs().max()
        assert (d_kv <= ulp).all(), d_kv.max()
        # Counters reset: a second identical step gives bit-identical scores (and is deterministic).
        again = run_step(mod, head, dims, inputs, window, mod.probe_decode_step, **kw)
        assert torch.equal(again[:t], got[:t])
        # The runtime's form: seq_lens (row_pos + 1), the kernels taking the positions themselves, in int64
        # and in int32 (SGLang's), each on the pool as it was before the step: the same scores and the same
        # pool afterwards (K|V at the valid rows' slots, nothing for padding rows, seq_lens 0).
        for len_dtype in (torch.int64, torch.int32):
            len_inputs = [v.clone() for v in inputs]
            len_inputs[1] = pool0.clone()
            by_len = run_step(mod, head, dims, len_inputs, window,
                              by_seq_lens(mod, lambda row_pos: (row_pos + 1).to(len_dtype)), **kw)
            assert torch.equal(by_len[:t], got[:t]), len_dtype
            assert torch.equal(len_inputs[1], inputs[1]), f"{len_dtype}: another K|V pool than row_pos's"
        worst["vs_head"] = max(worst["vs_head"], err_model)
        worst["vs_ref"] = max(worst["vs_ref"], err_ref)
    return worst


def graph_check(dims=FULL, device="cuda"):
    """Full dims, compiled, captured once, replayed on new requests written into the same buffers."""
    mod = _kernels()
    dtype, window = torch.bfloat16, 2048
    head = make_head(dims, window, dtype, seed=3, device=device)
    lengths = [3000, 17, 2048, 2049]
    inputs, expected, valid = make_batch(head, dims, lengths, 1, dtype, seed=4, device="cpu")
    inputs = [v.to(device) for v in inputs]
    w_qkv, wo, nw, wc, bc = weights(head)
    out = torch.zeros(len(lengths) + 1, dims["labels"], device=device)
    args = lambda: (*inputs[:1], w_qkv, *inputs[1:], window, 0.125, wo, nw, wc, bc, out, dims["heads"])  # noqa: E731
    mod.probe_decode_step(*args())
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mod.probe_decode_step(*args())
    worst = 0.0
    for seed in (5, 6):
        new_inputs, expected, valid = make_batch(head, dims, lengths, 1, dtype, seed, "cpu")
        for dst, src in zip(inputs, new_inputs):
            if dst.shape == src.shape:
                dst.copy_(src)
            else:
                raise AssertionError("graph check needs equal shapes")
        g.replay()
        torch.cuda.synchronize()
        err = (out.cpu()[valid] - expected[valid]).abs().max().item()
        assert torch.isfinite(out).all() and err <= 2e-2, err
        worst = max(worst, err)
    return worst


def test_probe_step_interpreted():
    from interpreted import run_interpreted

    results = run_interpreted(__file__, ["--cpu"], timeout=300)
    assert [r["dtype"] for r in results] == ["float32", "float16", "bfloat16"]


def test_qkv_tile_rule(monkeypatch):
    """The launcher's q|k|v tile at the H200's 132 SMs is the one its sweep picked: 32 x 128 at every
    batch, ~4 programs an SM up to 16 rows (23 splits) and ~2 past that (14 at 32 / 64 rows, 7 at 128)."""
    mod = _kernels()
    monkeypatch.setattr(mod, "num_sms", lambda device, off_gpu: 132)
    n, k = 640, 8640  # the 120b probe's q|k|v rows and features
    got = {}
    for t in (1, 8, 16, 17, 32, 64, 128):
        cfg = mod.qkv_launch_config(t, n, k, torch.device("cuda"))  # what probe_decode_step launches
        got[t] = (cfg["BLOCK_T"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLITS"])
    assert got == {1: (16, 32, 128, 23), 8: (16, 32, 128, 23), 16: (16, 32, 128, 23), 17: (32, 32, 128, 14),
                   32: (32, 32, 128, 14), 64: (64, 32, 128, 14), 128: (64, 32, 128, 7)}, got
    # a caller's own split count or block size wins over the rule
    assert mod.qkv_launch_config(64, n, k, torch.device("cuda"), splits=4)["SPLITS"] == 4
    assert mod.qkv_launch_config(64, n, k, torch.device("cuda"), block_n=64)["BLOCK_N"] == 64


def test_step_takes_row_pos_or_seq_lens():
    """One of the two position arguments, named when the other is wrong."""
    mod = _kernels()
    head = make_head(SMALL, 8, torch.float32, seed=0, device="cpu")
    inputs, _, _ = make_batch(head, SMALL, [5, 3], 0, torch.float32, seed=0, device="cpu")
    with pytest.raises(ValueError, match="row_pos or seq_lens"):  # both
        run_step(mod, head, SMALL, inputs, 8, mod.probe_decode_step, seq_lens=inputs[5] + 1)
    with pytest.raises(ValueError, match="row_pos or seq_lens"):  # neither
        run_step(mod, head, SMALL, inputs, 8, by_seq_lens(mod, lambda row_pos: None))
    with pytest.raises(ValueError, match=r"seq_lens must be \[2\]"):
        run_step(mod, head, SMALL, inputs, 8, by_seq_lens(mod, lambda row_pos: row_pos[:1] + 1))


def test_reference_step_matches_head():
    """The torch reference alone (no Triton) against the head, fp32: the oracle is itself right."""
    mod = _kernels()
    for i, (window, lengths) in enumerate(((8, [20, 3]), (None, [0, 12]))):
        head = make_head(SMALL, window, torch.float32, seed=i, device="cpu")
        inputs, expected, valid = make_batch(head, SMALL, lengths, 1, torch.float32, seed=i, device="cpu")
        got = run_step(mod, head, SMALL, inputs, window, mod.probe_decode_step_ref)
        torch.testing.assert_close(got[: len(valid)][valid], expected[valid], atol=2e-6, rtol=1e-5)


@pytest.mark.gpu
def test_probe_step_compiled_full_dims():
    assert check_taps("bfloat16", device="cuda") <= 1.0
    check_taps("float32", device="cuda")
    full_cases = [(2048, [1], 0, {}), (2048, [4000, 2047, 10], 1, {}), (2048, [2500] * 8, 0, {}),
                  (None, [300] * 32, 3, {})]
    check_step("bfloat16", dims=FULL, device="cuda", cases=full_cases)
    check_step("float32", dims=FULL, device="cuda", cases=full_cases[:2])
    assert graph_check() <= 2e-2


if __name__ == "__main__":
    dev = "cuda" if "--cuda" in sys.argv else "cpu"
    for name in ("float32", "float16", "bfloat16"):
        res = {"dtype": name, "tap_max_ulps": check_taps(name, dev), **check_step(name, device=dev)}
        print(json.dumps(res), flush=True)
