"""SingProbe at serving time: taps, the probe's own K/V pool, one score row per sampled token.

The probe keeps 128 values per token (K|V of its single shared head) in a pool indexed
by the base model's KV-cache slot ids, so a radix-cache hit on a prefix reuses the
prefix's probe K/V exactly as it reuses the base model's. Every forward writes K/V for
all its new tokens (every chunk of a chunked prefill too); only the rows that sample a
token (each request's last row) attend over the last `sliding_window` positions of
their request and run the tail. The score that arrives with output token k is the row
of the forward that produced it (position k-1).

The step reads nothing back to the host: scores leave the forward as a `ProbeScoreRows`
(a lazy sequence of `{label: prob}` dicts over a device tensor, read on first use, after
an event recorded behind the step). Inside a decode CUDA graph the captured output holds
a `CapturedProbeScores` over the graph's static score tensor instead; the decode graph
runner's hook (`patches/probe_cuda_graph.py`) turns it into rows of the replayed batch
after every replay. Buffers a captured graph writes (features, scores) are never freed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from sglang_ext.kernels.probe_attention import probe_attention, probe_attention_ref
from sglang_ext.kernels.probe_step import ProbeStepWorkspace, probe_decode_step, probe_tap_normalize
from sglang_ext.kernels.probe_tail import probe_tail
from sglang_ext.probe import SCORES_KEY
from sglang_ext.probe.checkpoint import load_probe_checkpoint, validate_against_base
from sglang_ext.probe.config import ProbeConfig
from sglang_ext.probe.model import RMS_EPS, SingProbeHead, rms_normalize

logger = logging.getLogger(__name__)


def _capturing(device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


class ProbeScoreRows(Sequence):
    """One forward's score rows, `{label: prob}` per sampling request, read once, on first use.

    On CUDA the rows are copied to pinned host memory at creation, in stream order behind the kernels that
    wrote them, with an event behind the copy: the first read waits on that event only, from whichever thread
    (SGLang's overlap scheduler reads them while the next forward runs). A read of the device tensor instead
    would launch a copy and wait for the reading thread's stream, on the scheduler's host path every step."""

    def __init__(self, probs: torch.Tensor, labels: Sequence[str]):
        self._labels = list(labels)
        self._rows: list[dict] | None = None
        self._ready = None
        if probs.is_cuda:
            host = torch.empty(probs.shape, dtype=probs.dtype, pin_memory=True)
            host.copy_(probs, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
            probs = host
        self._probs = probs

    def _materialize(self) -> list[dict]:
        if self._rows is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._rows = [dict(zip(self._labels, row)) for row in self._probs.tolist()]
            self._probs = self._ready = None
        return self._rows

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else int(self._probs.shape[0])

    def __getitem__(self, i):
        return self._materialize()[i]

    def __repr__(self) -> str:
        return f"ProbeScoreRows({self._materialize()!r})"


class CapturedProbeScores:
    """Stands in the captured output of a decode CUDA graph for its scores: `probs` is the graph's
    static output tensor (rewritten by every replay, padded rows included). `rows_after_replay`
    copies the first `num_rows` rows out (to the host, in stream order) before the next replay can
    overwrite them."""

    def __init__(self, probs: torch.Tensor, labels: Sequence[str]):
        self.probs = probs
        self.labels = list(labels)

    def rows_after_replay(self, num_rows: int) -> ProbeScoreRows:
        rows = self.probs[:num_rows]
        return ProbeScoreRows(rows if rows.is_cuda else rows.clone(), self.labels)

    def __len__(self) -> int:  # never read as rows: a replay hook that did not run must not pass
        raise RuntimeError("sglang-ext: probe scores of a CUDA graph were read without the replay "
                           "hook (patches/probe_cuda_graph.py); launch with --disable-cuda-graph")

    __getitem__ = __len__


def materialize_captured_scores(customized_info, num_rows: int):
    """customized_info of a replayed graph -> the same with rows of this batch, or unchanged."""
    if not customized_info:
        return customized_info
    captured = customized_info.get(SCORES_KEY)
    if not isinstance(captured, CapturedProbeScores):
        return customized_info
    return {**customized_info, SCORES_KEY: captured.rows_after_replay(num_rows)}


class ProbeRuntime:
    def __init__(self, folder: str, base_config, model_dtype: torch.dtype, device="cpu"):
        cfg, tensors = load_probe_checkpoint(folder)
        validate_against_base(cfg, base_config, model_dtype)
        self._setup(cfg, tensors, model_dtype, device)
        logger.info("sglang-ext: SingProbe %s loaded: taps %s, window %s, labels %s",
                    folder, cfg.base_model_layer_ids, cfg.sliding_window, self.labels)

    @classmethod
    def from_weights(cls, cfg: ProbeConfig, tensors: dict, model_dtype: torch.dtype, device="cpu") -> "ProbeRuntime":
        """The same runtime on given weights (the benchmarks' random probe at full size)."""
        runtime = cls.__new__(cls)
        runtime._setup(cfg, tensors, model_dtype, device)
        return runtime

    def _setup(self, cfg: ProbeConfig, tensors: dict, model_dtype: torch.dtype, device) -> None:
        self.config = cfg
        self.labels = list(cfg.labels)
        self.model_dtype = model_dtype
        self.head = SingProbeHead(cfg).to(device=device, dtype=model_dtype)
        self.head.load_state_dict({k: v.to(model_dtype) for k, v in tensors.items()})
        self.head.requires_grad_(False)
        self.window = cfg.sliding_window or 0
        self.scale = cfg.head_dim ** -0.5
        self.tap_slot = {layer_id: i for i, layer_id in enumerate(cfg.base_model_layer_ids)}
        self.hidden_size = cfg.hidden_size
        self.kv_pool: torch.Tensor | None = None
        self.req_to_token: torch.Tensor | None = None
        self._features: torch.Tensor | None = None
        self._graph_buffers: list[torch.Tensor] = []  # written by captured graphs: kept alive
        self._num_tokens = 0
        self._tapped = False  # begin() ran since the last finish()
        self._workspace = None
        self._side_stream = None
        self._batch = None  # (out_cache_loc, req_pool_indices, seq_lens, sample_rows) of this forward
        self._early: torch.Tensor | None = None
        self._early_inputs = None

    def bind_kv_pools(self, req_to_token_pool, token_to_kv_pool) -> None:
        """Allocate the probe's K/V beside the base model's slots (once, before any graph capture)."""
        slots = int(token_to_kv_pool.size) + 2 * int(getattr(token_to_kv_pool, "page_size", 1)) + 1
        self.bind(req_to_token_pool.req_to_token, slots)

    def bind(self, req_to_token: torch.Tensor, num_slots: int) -> None:
        """K|V pool of `num_slots` slots (the base model's slot ids index it) on req_to_token's device."""
        device = req_to_token.device
        self.head.to(device)
        # One q|k|v GEMM instead of three (+ a concat) per step: the step is launch-bound. The
        # head's three weights become views of the fused one, so nothing is stored twice.
        h = self.head
        self.w_qkv = torch.cat([h.proj_q.weight, h.proj_k.weight, h.proj_v.weight])
        q_rows, k_rows = h.proj_q.weight.shape[0], h.proj_k.weight.shape[0]
        h.proj_q.weight.data = self.w_qkv[:q_rows]
        h.proj_k.weight.data = self.w_qkv[q_rows : q_rows + k_rows]
        h.proj_v.weight.data = self.w_qkv[q_rows + k_rows :]
        self.kv_pool = torch.zeros(num_slots, 2 * self.config.head_dim, dtype=self.model_dtype, device=device)
        self.req_to_token = req_to_token
        # The fused decode step's scratch and counters: grown, never freed (graphs hold pointers).
        self._workspace = ProbeStepWorkspace(device) if device.type == "cuda" else None
        self._side_stream = None
        if device.type == "cuda":
            # Decode on CUDA: the step runs on this side stream beside the LM head (one long bandwidth-bound
            # GEMM, where the probe's bytes are all it takes from the step), joined before the scores are read.
            # Highest priority: PyTorch instantiates CUDA graphs with per-node priorities (the capturing
            # stream's), so the probe's few small launches take SM slots ahead of the base model's queued
            # programs and finish inside the step instead of trailing it. Starting after the deepest tap
            # instead, or at normal priority, measured slower (benchmarks/results/diag_decode_b1.md).
            highest = torch.cuda.Stream.priority_range()[1]  # (least, greatest): lower numbers run first
            self._side_stream = torch.cuda.Stream(device, priority=highest)
        logger.info("sglang-ext: probe K/V pool of %d slots x %d values", num_slots, 2 * self.config.head_dim)

    # -- taps ---------------------------------------------------------------------
    def expect_batch(self, out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     sample_rows: torch.Tensor | None) -> None:
        """This forward's batch, known before the layers run (see `step` for the arguments): lets
        a decode step start on the side stream beside the LM head instead of after it."""
        self._drop_unjoined()
        self._batch = (out_cache_loc, req_pool_indices, seq_lens, sample_rows)

    def forget_batch(self) -> None:
        """A forward whose batch is not announced (prefill): the step runs in order at the end, and
        a batch left by a forward that raised before its last tap is not used."""
        self._drop_unjoined()
        self._batch = None

    def _drop_unjoined(self) -> None:
        # A forward that raised after its early launch never joined: join before its inputs go.
        if self._early is not None:
            torch.cuda.current_stream().wait_stream(self._side_stream)
        self._early = self._early_inputs = None

    def begin(self, num_tokens: int, device) -> None:
        width = self.hidden_size * len(self.tap_slot)
        features = self._features
        if features is None or features.shape[0] < num_tokens or features.device != torch.device(device):
            self._features = torch.empty(max(num_tokens, 1), width, dtype=self.model_dtype, device=device)
        if _capturing(device) and not any(b is self._features for b in self._graph_buffers):
            # A graph replays its writes into this buffer forever: a later, larger eager forward
            # must not free it (the allocator would hand the memory to someone else).
            self._graph_buffers.append(self._features)
        self._num_tokens = num_tokens
        self._tapped = True

    def capture(self, layer_id: int, hidden: torch.Tensor) -> None:
        """Write layer `layer_id`'s tap from `hidden`, its input residual stream, for a caller
        whose norm does not write it (the model's fused residual-norm launch uses tap_target)."""
        target = self.tap_target(layer_id)
        if target is None:
            return
        # The probe's own feature transform, so taps equal the reference's (CUDA: one launch
        # instead of torch's five; within 1 ulp of the model dtype, see probe_step.py).
        features, lo, eps = target
        if hidden.is_cuda:
            probe_tap_normalize(hidden, features, lo, eps)
        else:
            features[: hidden.shape[0], lo : lo + self.hidden_size] = rms_normalize(hidden, eps).to(features.dtype)

    def tap_target(self, layer_id: int):
        """(features, column, eps) where a fused residual-norm kernel writes layer `layer_id`'s tap
        itself (`sglang_ext.layers.norm.residual_rms_norm`), or None if the layer is not tapped."""
        slot = self.tap_slot.get(layer_id)
        if slot is None or self._features is None:
            return None
        return self._features, slot * self.hidden_size, RMS_EPS

    def layers_done(self) -> None:
        """The base model's last layer ran (the LM head is next): a decode step starts on the side stream."""
        self._launch_early()

    def _launch_early(self) -> None:
        batch, self._batch = self._batch, None
        if (batch is None or self._side_stream is None or batch[3] is not None
                or not self._features.is_cuda):
            return
        main, side = torch.cuda.current_stream(), self._side_stream
        side.wait_stream(main)  # the taps, and the batch tensors, are ready on `main`
        try:
            with torch.cuda.stream(side):
                probs = self.step(*batch)
        except Exception:  # score() runs the step again on `main`, where failures are isolated
            logger.exception("sglang-ext: probe step on the side stream failed; retrying in order")
            main.wait_stream(side)
            return
        self._early = probs
        # The batch tensors were made on `main` (a caller may hold them only for this call): kept
        # referenced until the join, or the allocator could hand their memory to a `main` kernel
        # while the side stream still reads them (seen on the H200 as an illegal address, in and
        # out of CUDA graphs).
        self._early_inputs = batch

    def _take_early(self) -> torch.Tensor | None:
        probs, self._early = self._early, None
        if probs is not None:
            main = torch.cuda.current_stream()
            main.wait_stream(self._side_stream)  # join: the scores (and K|V) are written
            probs.record_stream(main)  # allocated on the side stream, used on `main` from here
            self._early_inputs = None  # freed after the join: reuse is ordered behind the side work
        return probs

    # -- the step -------------------------------------------------------------------
    def score(self, forward_batch) -> torch.Tensor:
        """Probabilities [num requests, num_labels] (fp32) for the rows that sample."""
        if forward_batch.forward_mode.is_decode():
            sample_rows = None
        else:
            sample_rows = torch.cumsum(forward_batch.extend_seq_lens, dim=0) - 1
        return self.finish(forward_batch.out_cache_loc, forward_batch.req_pool_indices,
                           forward_batch.seq_lens, sample_rows)

    def finish(self, out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               sample_rows: torch.Tensor | None) -> torch.Tensor:
        """The scores of this forward: the side stream's (joined) if the step started beside the LM
        head, else the step run now."""
        early = self._take_early()
        probs = early if early is not None else self.step(out_cache_loc, req_pool_indices, seq_lens, sample_rows)
        self._tapped = False  # the next forward must tap again before it is scored
        return probs

    def step(self, out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
             sample_rows: torch.Tensor | None) -> torch.Tensor:
        """The step on the features `begin`/`capture` collected for this forward's tokens.

        out_cache_loc [T]: each token's KV slot (its probe K|V goes there); req_pool_indices and
        seq_lens [R]: each sampling request's req_to_token row and length after this forward;
        sample_rows [R]: the token row that samples for each request (None: every row, decode).
        Graph-safe: no host reads, no allocation that outlives the step."""
        if self.kv_pool is None:
            raise RuntimeError("probe K/V pool not bound: bind_kv_pools() runs at attention-backend init")
        if not self._tapped:
            # Stale features would score this forward with another's taps (e.g. a replayed
            # prefill graph body, which runs without them): refuse instead.
            raise RuntimeError("sglang-ext: the probe's taps did not run in this forward (a prefill CUDA "
                               "graph replays the model without them); launch with --disable-prefill-cuda-graph")
        features = self._features[: self._num_tokens]
        cfg = self.config
        h = self.head
        if features.is_cuda and sample_rows is None:
            # Decode: q|k|v GEMV + K|V write, windowed attention, tail: three launches, the positions
            # (seq_lens - 1) taken inside them (two more launches in the chain otherwise, each a gap
            # in which the LM head's programs take the SMs the probe's next launch needs).
            probs = torch.empty(features.shape[0], len(self.labels), dtype=torch.float32, device=features.device)
            return probe_decode_step(features, self.w_qkv, self.kv_pool, out_cache_loc, self.req_to_token,
                                     req_pool_indices, None, self.window, self.scale,
                                     h.o_proj.weight, h.norm.weight, h.classifier.weight, h.classifier.bias,
                                     probs, cfg.num_attention_heads, workspace=self._workspace, seq_lens=seq_lens)
        row_pos = (seq_lens - 1).to(torch.int64)
        qkv = torch.nn.functional.linear(features, self.w_qkv)
        q = qkv[:, : cfg.num_attention_heads * cfg.head_dim].unflatten(-1, (cfg.num_attention_heads, cfg.head_dim))
        kv = qkv[:, cfg.num_attention_heads * cfg.head_dim :]
        self.kv_pool[out_cache_loc.long()] = kv.to(self.kv_pool.dtype)
        q_rows = q if sample_rows is None else q[sample_rows.long()]
        # CUDA: the Triton kernel (graph-safe, no host reads); CPU: its torch reference.
        attend = probe_attention if q_rows.is_cuda else probe_attention_ref
        ctx = attend(q_rows, self.kv_pool, self.req_to_token, req_pool_indices, row_pos, self.window, self.scale)
        if q_rows.is_cuda:
            return probe_tail(q_rows, ctx, h.o_proj.weight, h.norm.weight, h.classifier.weight, h.classifier.bias)
        return torch.sigmoid(self.head.tail(q_rows, ctx).float())

    def as_customized_info(self, probs: torch.Tensor) -> dict:
        """SGLang's per-forward `customized_info`: lazy rows, or, while a CUDA graph is being
        captured, the static score tensor the replay hook reads after each replay."""
        if _capturing(probs.device):  # the captured output keeps `probs` alive with the graph
            return {SCORES_KEY: CapturedProbeScores(probs, self.labels)}
        return {SCORES_KEY: ProbeScoreRows(probs, self.labels)}
