"""SingProbe at serving time: taps, the probe's own K/V pool, one score row per sampled token.

The probe keeps 128 values per token (K|V of its single shared head) in a pool indexed
by the base model's KV-cache slot ids, so a radix-cache hit on a prefix reuses the
prefix's probe K/V exactly as it reuses the base model's. Every forward writes K/V for
all its new tokens (every chunk of a chunked prefill too); only the rows that sample a
token (each request's last row) attend over the last `sliding_window` positions of
their request and run the tail. The score that arrives with output token k is the row
of the forward that produced it (position k-1).

Nothing here allocates per request or syncs with the host inside the step except the
final `.tolist()` that hands scores to SGLang's `customized_info` (the CUDA-graph path
moves that copy out of the step).
"""

from __future__ import annotations

import logging

import torch

from sglang_ext.kernels.probe_attention import probe_attention, probe_attention_ref
from sglang_ext.kernels.probe_tail import probe_tail
from sglang_ext.probe import SCORES_KEY
from sglang_ext.probe.checkpoint import load_probe_checkpoint, validate_against_base
from sglang_ext.probe.model import SingProbeHead, rms_normalize

logger = logging.getLogger(__name__)



class ProbeRuntime:
    def __init__(self, folder: str, base_config, model_dtype: torch.dtype, device="cpu"):
        cfg, tensors = load_probe_checkpoint(folder)
        validate_against_base(cfg, base_config, model_dtype)
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
        logger.info("sglang-ext: SingProbe %s loaded: taps %s, window %s, labels %s",
                    folder, cfg.base_model_layer_ids, cfg.sliding_window, self.labels)

    def bind_kv_pools(self, req_to_token_pool, token_to_kv_pool) -> None:
        """Allocate the probe's K/V beside the base model's slots (once, before any graph capture)."""
        slots = int(token_to_kv_pool.size) + 2 * int(getattr(token_to_kv_pool, "page_size", 1)) + 1
        device = req_to_token_pool.req_to_token.device
        self.head.to(device)
        # One q|k|v GEMM instead of three (+ a concat) per step: the step is launch-bound. The
        # head's three weights become views of the fused one, so nothing is stored twice.
        h = self.head
        self.w_qkv = torch.cat([h.proj_q.weight, h.proj_k.weight, h.proj_v.weight])
        q_rows, k_rows = h.proj_q.weight.shape[0], h.proj_k.weight.shape[0]
        h.proj_q.weight.data = self.w_qkv[:q_rows]
        h.proj_k.weight.data = self.w_qkv[q_rows : q_rows + k_rows]
        h.proj_v.weight.data = self.w_qkv[q_rows + k_rows :]
        self.kv_pool = torch.zeros(slots, 2 * self.config.head_dim, dtype=self.model_dtype, device=device)
        self.req_to_token = req_to_token_pool.req_to_token
        logger.info("sglang-ext: probe K/V pool of %d slots x %d values", slots, 2 * self.config.head_dim)

    # -- taps ---------------------------------------------------------------------
    def begin(self, num_tokens: int, device) -> None:
        width = self.hidden_size * len(self.tap_slot)
        if self._features is None or self._features.shape[0] < num_tokens or self._features.device != device:
            self._features = torch.empty(max(num_tokens, 1), width, dtype=self.model_dtype, device=device)
        self._num_tokens = num_tokens

    def capture(self, layer_id: int, hidden: torch.Tensor) -> None:
        """`hidden`: the input residual stream of base layer `layer_id`."""
        slot = self.tap_slot.get(layer_id)
        if slot is None:
            return
        # The probe's own feature transform, so serving taps equal the reference's.
        lo = slot * self.hidden_size
        self._features[: hidden.shape[0], lo : lo + self.hidden_size] = rms_normalize(hidden).to(self.model_dtype)

    # -- the step -------------------------------------------------------------------
    def score(self, forward_batch) -> torch.Tensor:
        """Probabilities [num requests, num_labels] (fp32) for the rows that sample."""
        if self.kv_pool is None:
            raise RuntimeError("probe K/V pool not bound: bind_kv_pools() runs at attention-backend init")
        features = self._features[: self._num_tokens]
        cfg = self.config
        qkv = torch.nn.functional.linear(features, self.w_qkv)
        q = qkv[:, : cfg.num_attention_heads * cfg.head_dim].unflatten(-1, (cfg.num_attention_heads, cfg.head_dim))
        kv = qkv[:, cfg.num_attention_heads * cfg.head_dim :]
        self.kv_pool[forward_batch.out_cache_loc.long()] = kv.to(self.kv_pool.dtype)
        mode = forward_batch.forward_mode
        if mode.is_decode():
            rows = torch.arange(q.shape[0], device=q.device)
        else:
            rows = torch.cumsum(forward_batch.extend_seq_lens, dim=0) - 1
        q_rows = q[rows]
        row_pos = (forward_batch.seq_lens - 1).to(torch.int64)
        # CUDA: the Triton kernel (graph-safe, no host reads); CPU: its torch reference.
        attend = probe_attention if q_rows.is_cuda else probe_attention_ref
        ctx = attend(q_rows, self.kv_pool, self.req_to_token,
                     forward_batch.req_pool_indices, row_pos, self.window, self.scale)
        if q_rows.is_cuda:
            h = self.head
            return probe_tail(q_rows, ctx, h.o_proj.weight, h.norm.weight, h.classifier.weight, h.classifier.bias)
        return torch.sigmoid(self.head.tail(q_rows, ctx).float())

    def as_customized_info(self, probs: torch.Tensor) -> dict:
        return {SCORES_KEY: [dict(zip(self.labels, row)) for row in probs.tolist()]}
