"""The `ext_sinks` attention backend: paged KV, sinks, inclusive sliding window.

One backend, two kernel paths: the torch path (`sink_attention_torch`, CPU in bf16
and fp32, and any device as a fallback) and the Triton path (`sglang_ext.kernels.
sink_attention`, chosen by `sglang_ext.kernel_select.use_triton`: CUDA by default, or a
CPU under TRITON_INTERPRET=1 with SGLANG_EXT_KERNELS=triton).
It accepts both of SGLang's KV pools: the plain MHA pool and the hybrid SWA pool
that gpt-oss gets by default (sliding layers then live in a smaller sub-pool and
their slot ids are translated from the full pool's).

The Triton path reads the batch only through device tensors (no host reads in the
step), so decode can be captured in a CUDA graph: the cuda-graph hooks keep the
runner's static req_pool_indices / seq_lens and refill a static buffer for the
hybrid pool's translated write slots before each replay.
"""

from __future__ import annotations

import logging

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from sglang_ext.kernel_select import use_triton
from sglang_ext.layers.rope import apply_rope
from sglang_ext.layers.sink_attention import sink_attention_torch
from sglang_ext import ATTENTION_BACKEND

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner



@dataclass
class _RequestSpan:
    """One request of the batch: its query rows and its key range."""

    req_pool_idx: int
    q_start: int  # first row of this request in q
    q_len: int
    seq_len: int  # keys 0..seq_len-1 exist after this forward's KV write

    @property
    def first_q_position(self) -> int:
        return self.seq_len - self.q_len


@dataclass
class _DeviceBatch:
    """The batch as the Triton kernels read it: device tensors only, so a CUDA graph
    replays with whatever the runner copied into them."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor  # keys after this forward's KV write
    q_start: Optional[torch.Tensor]  # extend: first q row of each request (None: packed in order)
    q_len: Optional[torch.Tensor]  # extend: q rows of each request; None for decode (one row each)


class SinkAttnBackend(AttentionBackend):
    def __init__(self, model_runner: "ModelRunner"):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.uses_swa_pool = (
            isinstance(self.token_to_kv_pool, SWAKVPool)
            and self.token_to_kv_pool.swa_layer_nums > 0
        )
        self.kernel_path = "triton" if use_triton(self.device) else "torch"
        logging.getLogger(__name__).info("sglang-ext: ext_sinks attention on the %s path", self.kernel_path)
        self.spans: List[_RequestSpan] = []
        self.device_batch: Optional[_DeviceBatch] = None
        self.swa_out_cache_loc: Optional[torch.Tensor] = None
        self.graph_swa_out_cache_loc: Optional[torch.Tensor] = None
        self.no_prefix = False  # this forward is a prefill whose requests have no cached keys
        self.prefill_logged = False

    # -- metadata -------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: "ForwardBatch"):
        mode = forward_batch.forward_mode
        if self.uses_swa_pool and forward_batch.out_cache_loc is not None:
            self.swa_out_cache_loc = self.token_to_kv_pool.translate_loc_from_full_to_swa(
                forward_batch.out_cache_loc
            )
        else:
            self.swa_out_cache_loc = None
        if mode.is_idle():
            self.spans = []
            return
        # a prefill with no cached prefix: every layer's attention reads this forward's rows (kernel path)
        prefix_lens = getattr(forward_batch, "extend_prefix_lens_cpu", None)
        self.no_prefix = (not mode.is_decode_or_idle() and prefix_lens is not None
                          and not any(int(p) for p in prefix_lens))
        if self.kernel_path == "triton":
            self.device_batch = self._device_batch(forward_batch)
            return
        req_pool_indices = forward_batch.req_pool_indices.tolist()
        seq_lens = forward_batch.seq_lens_cpu.tolist() if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens.tolist()
        if mode.is_decode_or_idle():
            q_lens = [1] * len(seq_lens)
        else:
            if forward_batch.extend_seq_lens_cpu is not None:
                q_lens = list(forward_batch.extend_seq_lens_cpu)
            else:
                q_lens = forward_batch.extend_seq_lens.tolist()
        spans, start = [], 0
        for rpi, seq_len, q_len in zip(req_pool_indices, seq_lens, q_lens):
            spans.append(_RequestSpan(int(rpi), start, int(q_len), int(seq_len)))
            start += int(q_len)
        self.spans = spans

    @staticmethod
    def _device_batch(forward_batch: "ForwardBatch") -> _DeviceBatch:
        if forward_batch.forward_mode.is_decode_or_idle():
            return _DeviceBatch(forward_batch.req_pool_indices, forward_batch.seq_lens, None, None)
        return _DeviceBatch(
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            getattr(forward_batch, "extend_start_loc", None),
            forward_batch.extend_seq_lens,
        )

    # -- CUDA graphs (decode; Triton path only) --------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        if self.kernel_path != "triton":
            raise NotImplementedError(
                f"{ATTENTION_BACKEND}: CUDA graphs need the Triton path (SGLANG_EXT_KERNELS=auto or triton); "
                "the torch path reads the batch on the host: use --disable-cuda-graph"
            )
        if self.uses_swa_pool:
            # The captured KV write reads the sliding sub-pool's slots from here.
            self.graph_swa_out_cache_loc = torch.zeros((max_num_tokens,), dtype=torch.int64, device=self.device)

    def init_forward_metadata_out_graph(self, forward_batch: "ForwardBatch", in_capture: bool = False):
        # Called before capture and before every replay with the runner's static buffers
        # (req_pool_indices, seq_lens): the kernels captured here read them by address.
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise NotImplementedError(f"{ATTENTION_BACKEND}: CUDA graphs cover decode only, got {forward_batch.forward_mode}")
        self.device_batch = _DeviceBatch(forward_batch.req_pool_indices, forward_batch.seq_lens, None, None)
        self.swa_out_cache_loc = None
        if self.graph_swa_out_cache_loc is not None and forward_batch.out_cache_loc is not None:
            n = forward_batch.out_cache_loc.shape[0]
            buf = self.graph_swa_out_cache_loc
            buf[n:].zero_()  # padded rows write to the dummy slot 0
            if in_capture:
                buf[:n].zero_()
            else:
                buf[:n].copy_(self.token_to_kv_pool.translate_loc_from_full_to_swa(forward_batch.out_cache_loc))
            self.swa_out_cache_loc = buf[:n]

    def get_cuda_graph_seq_len_fill_value(self):
        # Padded rows attend to one key (slot of position 0 of request row 0): finite, discarded.
        return 1

    # The same on a CPU, where SGLang pads a DP-attention group's batch to the other groups' size.
    get_cpu_graph_seq_len_fill_value = get_cuda_graph_seq_len_fill_value

    # -- forward --------------------------------------------------------------
    # gpt-oss may hand q and k over unrotated with `rope_cos_sin=` rows: RoPE then runs here, in
    # the same launch as the KV write where the pool allows (models/gpt_oss.py checks this flag).
    applies_rope_kv = True

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs.get("sinks"),
                             kwargs.get("rope_cos_sin"))

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs.get("sinks"),
                             kwargs.get("rope_cos_sin"))

    def _rope_and_write(self, q, k, v, layer, forward_batch, cos_sin, in_swa_pool, save_kv_cache, window_left):
        """(q [T, Hq, D], roped k or None, RopeKV or None, rows or None). Roped q and k for set_kv_buffer;
        or roped q and None when k and v are already in the pool (one launch, `kernels/rope_kv.py`), with
        rows = (roped k, v) of this forward where a prefill with no cached prefix reads its keys from them
        (`sink_attention_prefill`); or, at decode on that path, q unrotated, None and the RopeKV that the
        decode launcher rotates and writes (inside the one-shot kernel's launch where it runs,
        `kernels/sink_attention/decode.py`)."""
        q3 = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k3 = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
        if save_kv_cache and self.kernel_path == "triton":
            k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
            v3 = v.view(-1, layer.tp_v_head_num, layer.v_head_dim)
            plain = (k_cache.dtype == k3.dtype and v_cache.dtype == v3.dtype and k_cache.dim() == 3
                     and k_cache.shape[1:] == k3.shape[1:] and v_cache.shape == k_cache.shape
                     and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
                     and getattr(layer, "k_scale", None) is None and getattr(layer, "v_scale", None) is None)
            if plain:
                # @triton.jit reads TRITON_INTERPRET at import
                from sglang_ext.kernels.rope_kv import rope_store_kv
                from sglang_ext.kernels.sink_attention import RopeKV, prefill_applies

                loc = self.swa_out_cache_loc if in_swa_pool else forward_batch.out_cache_loc
                if self.device_batch.q_len is None:  # decode
                    return q3, None, RopeKV(k3, v3, cos_sin, loc), None
                # Not inside a captured graph: whether a batch has a cached prefix is a host fact of this
                # batch, which a replay of another batch would not re-check (SGLang's default breakable
                # prefill graphs run attention eagerly between their segments, so they still get it).
                if (self.no_prefix and prefill_applies(q3, k3, v3)
                        and not (q3.is_cuda and torch.cuda.is_current_stream_capturing())):
                    k_roped = torch.empty(k3.shape, dtype=k3.dtype, device=k3.device)
                    q3 = rope_store_kv(q3, k3, v3, cos_sin, k_cache, v_cache, loc, k_out=k_roped)
                    return q3, None, None, (k_roped, v3)
                return rope_store_kv(q3, k3, v3, cos_sin, k_cache, v_cache, loc), None, None, None
        return apply_rope(q3, cos_sin), apply_rope(k3, cos_sin), None, None

    def _forward(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
        save_kv_cache: bool,
        sinks: Optional[torch.Tensor],
        rope_cos_sin: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if layer.is_cross_attention:
            raise NotImplementedError(f"{ATTENTION_BACKEND} has no cross attention")
        in_swa_pool = self.uses_swa_pool and self.token_to_kv_pool.layers_mapping[layer.layer_id][1]
        window_left = -1 if layer.sliding_window_size is None else int(layer.sliding_window_size)
        rope = rows = None
        if rope_cos_sin is not None:
            # SGLang runs attention on a padded batch's real rows only (q, k, v and the kwargs it knows
            # are narrowed; a DP-attention group's batch is padded to the largest group's): the RoPE rows too.
            rope_cos_sin = rope_cos_sin[: q.shape[0]]
            q, k, rope, rows = self._rope_and_write(q, k, v, layer, forward_batch, rope_cos_sin, in_swa_pool,
                                                    save_kv_cache, window_left)
            if k is not None:  # not written yet: set_kv_buffer below (v: a strided view of the GEMM output)
                v = v.contiguous()
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer,
                KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc),
                k,
                v,
            )
        num_heads, head_dim, v_head_dim = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        q3 = q.reshape(-1, num_heads, head_dim)
        out = q.new_empty((q3.shape[0], num_heads, v_head_dim))

        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token

        if self.kernel_path == "triton":
            self._forward_triton(q3, k_cache, v_cache, out, sinks, window_left, layer.scaling, in_swa_pool, rope, rows)
            return out.view(-1, num_heads * v_head_dim)

        for span in self.spans:
            if span.q_len == 0:
                continue
            k_lo = 0
            if window_left >= 0:
                k_lo = max(0, span.first_q_position - window_left)
            slots = req_to_token[span.req_pool_idx, k_lo : span.seq_len]
            if in_swa_pool:
                slots = self.token_to_kv_pool.translate_loc_from_full_to_swa(slots)
            slots = slots.long()
            q_rows = q3[span.q_start : span.q_start + span.q_len]
            q_positions = torch.arange(span.first_q_position, span.seq_len, device=q.device)
            out[span.q_start : span.q_start + span.q_len] = sink_attention_torch(
                q_rows,
                k_cache[slots],
                v_cache[slots],
                sinks,
                q_positions,
                k_lo,
                window_left,
                layer.scaling,
            )
        return out.view(-1, num_heads * v_head_dim)

    def _forward_triton(self, q3, k_cache, v_cache, out, sinks, window_left, scale, in_swa_pool, rope=None,
                        rows=None):
        # @triton.jit reads TRITON_INTERPRET at import
        from sglang_ext.kernels.sink_attention import (sink_attention_decode, sink_attention_extend,
                                                       sink_attention_prefill)

        batch = self.device_batch
        req_to_token = self.req_to_token_pool.req_to_token
        # The sliding sub-pool is addressed by translated ids: the kernels translate per key.
        slot_map = self.token_to_kv_pool.full_to_swa_index_mapping if in_swa_pool else None
        if q3.stride(-1) != 1:
            q3 = q3.contiguous()
        if rows is not None:  # a no-prefix prefill: keys from this forward's rows (_rope_and_write)
            if not self.prefill_logged:
                self.prefill_logged = True
                logging.getLogger(__name__).info("sglang-ext: prefills without a cached prefix read their keys "
                                                 "from the forward's rows (sink_attention_prefill)")
            sink_attention_prefill(q3, rows[0], rows[1], batch.q_start, batch.q_len, sinks, scale,
                                   window_left=window_left, out=out)
        elif batch.q_len is None:
            sink_attention_decode(q3, k_cache, v_cache, req_to_token, batch.req_pool_indices, batch.seq_lens,
                                  sinks, window_left, scale, slot_map=slot_map, out=out, rope=rope)
        else:
            sink_attention_extend(q3, k_cache, v_cache, req_to_token, batch.req_pool_indices, batch.seq_lens,
                                  batch.q_start, batch.q_len, sinks, window_left, scale, slot_map=slot_map,
                                  out=out)

    def support_triton(self):
        return False
