"""SingProbe scores inside decode CUDA graphs: the serving runtime's step captured, replayed on new
batches, and its scores read through the same path SGLang's decode graph runner takes.

CPU: the lazy score rows, the captured-scores hand-over (copied out, so a later replay cannot change
rows already handed over; unreadable if the replay hook did not run), and the launch rule that turns
prefill graphs off with the probe. GPU (`gpu`): `ProbeRuntime` at gpt-oss-120b probe dims captured
in a CUDA graph for a padded decode batch (its step on the side stream from the last tap), replayed
over fresh batches; every replay's rows equal the same runtime run eagerly (in order, one stream) on
that batch, and the float64 reference head within 2e-2; and a step's rows read without waiting for GPU
work queued after them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sglang_ext.probe import SCORES_KEY
from sglang_ext.probe.config import ProbeConfig
from sglang_ext.probe.model import SingProbeHead, rms_normalize
from sglang_ext.probe_runtime import (
    CapturedProbeScores,
    ProbeRuntime,
    ProbeScoreRows,
    materialize_captured_scores,
)

LABELS = [f"label_{i}" for i in range(10)]


def test_score_rows_are_dicts_read_once():
    probs = torch.rand(3, 10)
    rows = ProbeScoreRows(probs, LABELS)
    assert len(rows) == 3
    want = [dict(zip(LABELS, r)) for r in probs.tolist()]
    probs.zero_()  # read on first use: the tensor the step wrote, not a snapshot at creation
    assert list(rows) == [dict(zip(LABELS, [0.0] * 10))] * 3
    probs.copy_(torch.tensor([list(d.values()) for d in want]))
    assert rows[0] == dict(zip(LABELS, [0.0] * 10))  # ...and only once


@pytest.mark.gpu
def test_score_rows_read_waits_only_for_their_step():
    """Reading a step's rows must not wait for work queued after it (the next forward, under SGLang's overlap
    scheduler): the rows leave for the host at creation, in stream order."""
    import time

    probs = torch.rand(3, 10, device="cuda")
    want = [dict(zip(LABELS, r)) for r in probs.tolist()]
    captured = CapturedProbeScores(torch.cat([probs, torch.zeros(5, 10, device="cuda")]), LABELS)
    for rows in (ProbeScoreRows(probs, LABELS), captured.rows_after_replay(3)):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued behind the rows' copy
        probs.zero_()  # ...and a later write to the step's tensor
        start = time.perf_counter()
        got = list(rows)
        waited = time.perf_counter() - start
        torch.cuda.synchronize()
        probs.copy_(torch.tensor([list(d.values()) for d in want]))
        assert got == want
        assert waited < 0.2, f"the read waited {waited:.3f} s for later work"


def test_captured_scores_become_rows_of_the_replayed_batch():
    static = torch.rand(8, 10)  # a graph captured at padded batch 8
    info = {SCORES_KEY: CapturedProbeScores(static, LABELS), "other": [1, 2, 3]}
    fresh = materialize_captured_scores(info, 3)  # this replay served 3 requests
    rows = fresh[SCORES_KEY]
    assert fresh["other"] == [1, 2, 3] and len(rows) == 3
    expected = [dict(zip(LABELS, r)) for r in static[:3].tolist()]
    static.fill_(0.5)  # the next replay rewrites the static tensor before SGLang reads the rows
    assert list(rows) == expected
    assert info[SCORES_KEY].probs is static  # the captured output keeps its static tensor
    with pytest.raises(RuntimeError, match="replay hook"):
        len(info[SCORES_KEY])
    plain = {SCORES_KEY: rows}
    assert materialize_captured_scores(plain, 3) is plain
    assert materialize_captured_scores(None, 3) is None


def test_decode_runner_hook_replaces_only_captured_scores():
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    from sglang_ext.patches.probe_cuda_graph import _scores_of_this_replay

    static = torch.rand(4, 10)
    out = LogitsProcessorOutput(next_token_logits=torch.zeros(4, 7),
                                customized_info={SCORES_KEY: CapturedProbeScores(static, LABELS)})
    replayed = _scores_of_this_replay(out, None, SimpleNamespace(batch_size=2))
    assert replayed is not out and isinstance(out.customized_info[SCORES_KEY], CapturedProbeScores)
    assert list(replayed.customized_info[SCORES_KEY]) == [dict(zip(LABELS, r)) for r in static[:2].tolist()]
    no_probe = dataclasses.replace(out, customized_info=None)
    assert _scores_of_this_replay(no_probe, None, SimpleNamespace(batch_size=2)) is no_probe


def test_probe_turns_prefill_graphs_off_and_refuses_an_explicit_prefill_graph():
    from sglang_ext.patches.probe_cuda_graph import ProbePrefillGraphConflict, _no_prefill_graphs_with_probe

    args = argparse.Namespace(probe_ckpt="/p", cuda_graph_backend_prefill=None, disable_prefill_cuda_graph=False)
    _no_prefill_graphs_with_probe(None, args)
    assert args.disable_prefill_cuda_graph is True
    untouched = argparse.Namespace(probe_ckpt=None, cuda_graph_backend_prefill=None, disable_prefill_cuda_graph=False)
    _no_prefill_graphs_with_probe(None, untouched)
    assert untouched.disable_prefill_cuda_graph is False
    conflict = argparse.Namespace(probe_ckpt="/p", cuda_graph_backend_prefill="breakable",
                                  disable_prefill_cuda_graph=False)
    with pytest.raises(ProbePrefillGraphConflict, match="--cuda-graph-backend-prefill asks for prefill backend .breakable."):
        _no_prefill_graphs_with_probe(None, conflict)


# -- GPU --------------------------------------------------------------------------------------


def _runtime(hidden, taps, window, num_slots, req_to_token, device, dtype):
    cfg = ProbeConfig.from_dict({
        "architectures": ["SingProbeAttnModel"], "model_type": "sing_probe_attn", "hidden_size": hidden,
        "base_model_layer_ids": list(taps), "num_attention_heads": 8, "head_dim": 64,
        "sliding_window": window, "num_labels": 10, "torch_dtype": "bfloat16"})
    torch.manual_seed(0)
    head = SingProbeHead(cfg)
    for name, p in head.named_parameters():
        p.data.normal_(0, 1.0 / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.5)
    head.norm.weight.data.fill_(1.0)
    runtime = ProbeRuntime.from_weights(cfg, head.state_dict(), dtype, device)
    runtime.bind(req_to_token, num_slots)
    return runtime, cfg, head


def _reference_scores(head64, window, kv_feats, req_to_token, reqs, seq_lens, feats_now):
    """float64 head on each request's last `window` positions (earlier K/V from their features,
    the newest row from this step's taps)."""
    out = []
    for r, (req, n) in enumerate(zip(reqs.tolist(), seq_lens.tolist())):
        slots = req_to_token[req, max(0, n - window):n].long()
        x = kv_feats[slots].double()
        x[-1] = feats_now[r].double()
        out.append(torch.sigmoid(head64(x[None])[0, -1]))
    return torch.stack(out).float().cpu()


@pytest.mark.gpu
def test_runtime_step_captured_in_a_cuda_graph_replays_fresh_batches():
    device, dtype = torch.device("cuda"), torch.bfloat16
    hidden, taps, window, padded, ctx = 2880, (9, 18, 27), 2048, 8, 3000
    num_reqs = 16
    num_slots = 1 + num_reqs * ctx
    req_to_token = (1 + torch.arange(num_reqs, device=device, dtype=torch.int32)[:, None] * ctx
                    + torch.arange(ctx, device=device, dtype=torch.int32)[None, :])
    runtime, cfg, _ = _runtime(hidden, taps, window, num_slots, req_to_token, device, dtype)
    head64 = copy.deepcopy(runtime.head).double()  # the served (bf16-rounded) weights, in float64
    # Every earlier position's probe K|V, from random unit-RMS features.
    width = hidden * len(taps)
    kv_feats = torch.randn(num_slots, width, device=device).to(dtype)
    with torch.no_grad():
        runtime.kv_pool.copy_(torch.nn.functional.linear(kv_feats, runtime.w_qkv[8 * 64:]).to(dtype))

    static = SimpleNamespace(
        hidden=[torch.zeros(padded, hidden, device=device, dtype=dtype) for _ in taps],
        out_cache_loc=torch.zeros(padded, dtype=torch.int64, device=device),
        req_pool_indices=torch.zeros(padded, dtype=torch.int64, device=device),
        seq_lens=torch.ones(padded, dtype=torch.int64, device=device))

    def step():
        # As the model runs it: the batch is announced first, so the step starts on the side
        # stream once the layers are done (a fork/join inside the captured graph) and joins at finish().
        batch = (static.out_cache_loc, static.req_pool_indices, static.seq_lens, None)
        runtime.expect_batch(*batch)
        runtime.begin(padded, device)
        for layer, h in zip(taps, static.hidden):
            runtime.capture(layer, h)
        runtime.layers_done()
        assert runtime._early is not None
        return runtime.as_customized_info(runtime.finish(*batch))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            step()  # eager warm-up, as SGLang's capture does
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        captured = step()
    assert isinstance(captured[SCORES_KEY], CapturedProbeScores)

    gen = torch.Generator(device="cpu").manual_seed(1)
    worst = worst_ref = 0.0
    for batch in (3, 8, 1, 5):
        reqs = torch.randperm(num_reqs, generator=gen)[:batch]
        lens = torch.randint(1, ctx, (batch,), generator=gen)
        hiddens = [torch.randn(batch, hidden, generator=gen).to(device, dtype) * 3 for _ in taps]
        for buf, h in zip(static.hidden, hiddens):
            buf.zero_()
            buf[:batch] = h
        static.req_pool_indices.zero_()
        static.req_pool_indices[:batch] = reqs.to(device)
        static.seq_lens.fill_(1)
        static.seq_lens[:batch] = lens.to(device)
        static.out_cache_loc.zero_()  # padded rows write slot 0, SGLang's padding slot
        static.out_cache_loc[:batch] = req_to_token[reqs.to(device), (lens - 1).to(device)].long()
        graph.replay()
        rows = materialize_captured_scores(captured, batch)[SCORES_KEY]
        got = torch.tensor([[row[label] for label in runtime.labels] for row in rows])

        with torch.no_grad():
            runtime.begin(batch, device)
            for layer, h in zip(taps, hiddens):
                runtime.capture(layer, h)
            eager = runtime.step(static.out_cache_loc[:batch], static.req_pool_indices[:batch],
                                 static.seq_lens[:batch], None).float().cpu()
        feats_now = torch.cat([rms_normalize(h).to(dtype) for h in hiddens], dim=-1)
        with torch.no_grad():
            want = _reference_scores(head64, window, kv_feats, req_to_token, reqs, lens, feats_now)
        assert len(rows) == batch
        worst = max(worst, (got - eager).abs().max().item())
        worst_ref = max(worst_ref, (got - want).abs().max().item())
    print(f"graph vs eager max |dp| {worst:.2e}; vs float64 reference {worst_ref:.2e}")
    assert worst == 0.0
    assert worst_ref < 2e-2


def test_a_forward_whose_taps_did_not_run_is_refused_not_scored_with_stale_features():
    cfg = ProbeConfig.from_dict({
        "architectures": ["SingProbeAttnModel"], "model_type": "sing_probe_attn", "hidden_size": 16,
        "base_model_layer_ids": [0, 1, 2], "num_attention_heads": 2, "head_dim": 8,
        "sliding_window": 4, "num_labels": 10, "torch_dtype": "float32"})
    runtime = ProbeRuntime.from_weights(cfg, SingProbeHead(cfg).state_dict(), torch.float32)
    req_to_token = torch.arange(1, 9, dtype=torch.int32)[None, :]
    runtime.bind(req_to_token, 16)
    batch = (torch.tensor([3]), torch.tensor([0]), torch.tensor([3]), None)
    runtime.begin(1, "cpu")
    for layer in range(3):
        runtime.capture(layer, torch.randn(1, 16))
    assert runtime.finish(*batch).shape == (1, 10)
    with pytest.raises(RuntimeError, match="taps did not run in this forward"):
        runtime.finish(*batch)  # e.g. a replayed prefill graph body: no begin()/capture()


def test_prefill_graph_replay_is_declined_for_a_model_with_a_probe():
    from sglang_ext.patches.probe_cuda_graph import _no_prefill_replay_with_probe

    with_probe = SimpleNamespace(model_runner=SimpleNamespace(model=SimpleNamespace(probe=object())))
    without = SimpleNamespace(model_runner=SimpleNamespace(model=SimpleNamespace(probe=None)))
    assert _no_prefill_replay_with_probe(True, with_probe, None) is False
    assert _no_prefill_replay_with_probe(True, without, None) is None  # None: SGLang's answer stands
    assert _no_prefill_replay_with_probe(False, with_probe, None) is None


def test_prefill_backend_asked_in_the_json_config_is_refused_with_the_probe():
    from sglang_ext.patches.probe_cuda_graph import ProbePrefillGraphConflict, _no_prefill_graphs_with_probe

    args = argparse.Namespace(probe_ckpt="/p", cuda_graph_backend_prefill=None, disable_prefill_cuda_graph=False,
                              cuda_graph_config='{"prefill": {"backend": "breakable"}}')
    with pytest.raises(ProbePrefillGraphConflict, match="--cuda-graph-config"):
        _no_prefill_graphs_with_probe(None, args)
    ok = argparse.Namespace(probe_ckpt="/p", cuda_graph_backend_prefill=None, disable_prefill_cuda_graph=False,
                            cuda_graph_config='{"decode": {"max_bs": 8}}')
    _no_prefill_graphs_with_probe(None, ok)
    assert ok.disable_prefill_cuda_graph is True


def test_step_starts_after_the_last_layer_not_at_the_tap():
    cfg = ProbeConfig.from_dict({
        "architectures": ["SingProbeAttnModel"], "model_type": "sing_probe_attn", "hidden_size": 16,
        "base_model_layer_ids": [1, 3], "num_attention_heads": 2, "head_dim": 8,
        "sliding_window": 4, "num_labels": 10, "torch_dtype": "float32"})
    head = SingProbeHead(cfg)
    events = []
    runtime = ProbeRuntime.from_weights(cfg, head.state_dict(), torch.float32)
    runtime._launch_early = lambda: events.append("launch")
    runtime.begin(2, "cpu")
    for layer in range(5):
        target = runtime.tap_target(layer)
        if target is not None:  # as the fused residual-norm kernel writes it
            features, col0, _ = target
            features[:2, col0:col0 + 16] = torch.randn(2, 16)
            if layer == 3:
                events.append("tap 3")
    events.append("layers done")
    runtime.layers_done()
    assert events == ["tap 3", "layers done", "launch"], events


@pytest.mark.gpu
def test_side_stream_priority_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = ProbeConfig.from_dict({
        "architectures": ["SingProbeAttnModel"], "model_type": "sing_probe_attn", "hidden_size": 16,
        "base_model_layer_ids": [1, 3], "num_attention_heads": 2, "head_dim": 8,
        "sliding_window": 4, "num_labels": 10, "torch_dtype": "float32"})
    head = SingProbeHead(cfg)
    runtime = ProbeRuntime.from_weights(cfg, head.state_dict(), torch.float32, "cuda")
    runtime.bind(torch.zeros(2, 16, dtype=torch.int32, device="cuda"), 40)
    assert runtime._side_stream.priority == torch.cuda.Stream.priority_range()[1]  # the highest
