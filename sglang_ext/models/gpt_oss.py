"""gpt-oss (20b/120b) for SGLang: the whole forward in one file.

The maths lives in SGLang-free modules (`sglang_ext.layers`: RMSNorm, YaRN RoPE,
linear-with-bias, MoE, MXFP4); this class wires them to SGLang's batch metadata
(RadixAttention -> the attention backend, `ForwardBatch`), its vocab-parallel
embedding / LM head / logits processor and its tensor-parallel group.

Parameter names equal the Hugging Face checkpoint keys, so loading is one loop. Two
layouts differ from the bf16 checkpoint and say so: experts are stored [E, out, in]
(`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]), the MXFP4 layout, which makes
each expert one `F.linear`; the bf16 checkpoint's [E, in, out] tensors are transposed
on load. Sinks are kept in fp32 (exact for bf16 checkpoints).

Checkpoints: FP8 block-128 ones (launch/convert.py's) load as they are. The official MXFP4 ones serve
on the same FP8 path: `CheckpointLoader` converts their experts and their bf16 q/k/v/o to e4m3 with
128x128 block scales at load, with the converter's own function (experts exactly wherever a block's
values fit e4m3 under a power-of-two scale), so serving an MXFP4 checkpoint is serving its converted
copy, and logs the converter's report. bf16 checkpoints serve in bf16 (on CUDA with decode graphs up
to batch 8: patches/gpt_oss_model.py), or in FP8 with SGLang's own `--quantization fp8`, converted the
same way at load (lossy, logged).

Parallelism (SGLang's --tp/--ep; sglang_ext.layers.parallel holds the maths and its
tests): attention heads split over the TP ranks (KV heads replicated when fewer than
ranks); experts split into --ep-size contiguous ranges, each expert's intermediate
dimension I over tp/ep ranks (interleaved gate/up rows stay in pairs; FP8 shards cut on
the 128-block grid, so every local block keeps its checkpoint scale); o_proj's and mlp2's
biases are added once, after the all-reduce. Data-parallel attention (--enable-dp-attention,
--dp D): attention heads split over the attention-TP group (tp / D ranks) and each DP group runs
attention on its own requests' tokens; every rank's MoE shard runs over all DP groups' tokens,
gathered before it (SGLang's dp_gather) and scattered back after its all-reduce (dp_scatter); the
embedding shards over the attention-TP group, the LM head as SGLang's own gpt-oss does.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Iterable, Optional, Tuple

import torch
from torch import nn

from sglang.srt.distributed.communication_op import tensor_model_parallel_all_reduce
from sglang.srt.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context

from sglang_ext.kernel_select import use_triton
from sglang_ext.layers.fp8 import (BLOCK, Block128Report, convert_block128, dequantize_weight_block128,
                                   summarize_block128_report)
from sglang_ext.layers.linear import FusedLinear, Linear
from sglang_ext.layers.lm_head import fp8_lm_head_enabled, quantize_lm_head, restore_bf16_lm_head
from sglang_ext.layers.moe import add_down_bias, experts_torch, moe_forward, route
from sglang_ext.layers.parallel import BlockShard, ParallelLayout, attention_head_shard, moe_shard
from sglang_ext.layers.mxfp4 import CONVERT_CHUNK_ELEMENTS, DenseExperts, Mxfp4Experts, experts_to_fp8_block128
from sglang_ext.layers.norm import residual_rms_norm, rms_norm
from sglang_ext.layers.rope import YarnRope, apply_rope

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def checkpoint_format(config) -> str:
    """"fp8" (e4m3 with 128x128 block scales: sglang_ext.launch.convert's output), "mxfp4" (the
    official files: MXFP4 experts, bf16 elsewhere) or "dense" (bf16/fp32, as transformers saves it)."""
    qc = getattr(config, "quantization_config", None) or {}
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method is None:
        return "dense"
    if method == "mxfp4":
        return "mxfp4"
    if method != "fp8":
        raise ValueError(f"gpt-oss checkpoints are served from bf16, MXFP4 or FP8 block-128 weights; "
                         f"quantization_config quant_method {method!r} is none of them")
    if list(qc.get("weight_block_size") or []) != [BLOCK, BLOCK] or qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"gpt-oss FP8 checkpoints must be e4m3 with weight_block_size [128, 128], got {qc}")
    return "fp8"


def is_fp8_checkpoint(config) -> bool:
    return checkpoint_format(config) == "fp8"


def serves_fp8(config, quant_config=None) -> bool:
    """Whether the experts and the attention projections are e4m3 block-128 parameters: always for FP8
    and MXFP4 checkpoints (MXFP4 converted at load, exactly where a 128x128 block's values fit e4m3
    under a power-of-two scale: launch/convert.py's conversion), and for a bf16 checkpoint launched
    with SGLang's `--quantization fp8` (its online FP8, here block-128 converted at load, lossy).
    A bf16 checkpoint otherwise stays bf16: its numbers are transformers' (tests/test_served_parity.py,
    tests/test_probe_serving_bf16.py, and on a GPU tests/test_served_gpu.py)."""
    if checkpoint_format(config) != "dense":
        return True
    name = quant_config.get_name() if quant_config is not None else None
    if name not in (None, "fp8"):
        raise ValueError(f"gpt-oss bf16 checkpoints serve in bf16 or, with --quantization fp8, in FP8 block-128; "
                         f"--quantization {name} is not served")
    return name == "fp8"


class _TP:
    """This rank's place in SGLang's TP/EP groups, as a `ParallelLayout`. `attn_size` / `attn_rank`:
    its attention-TP group (the whole TP group without DP attention)."""

    def __init__(self, layout: Optional[ParallelLayout] = None):
        if layout is None:
            layout = _sglang_layout()
        self.layout = layout
        self.size = layout.tp_size
        self.rank = layout.tp_rank
        self.attn_size = layout.attn_tp_size
        self.attn_rank = layout.attn_tp_rank
        self.dp_attention = layout.attn_dp_size > 1


def _sglang_layout() -> ParallelLayout:
    from sglang.srt.distributed import parallel_state as ps

    tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    try:
        ep_size = ps.get_moe_expert_parallel_world_size()
        attn_tp = ps.get_attn_tensor_model_parallel_world_size()
    except (AssertionError, AttributeError, TypeError):  # groups not initialised: one process
        ep_size, attn_tp = 1, tp_size
    if tp_size % attn_tp:
        raise ValueError(f"attention TP {attn_tp} does not divide TP {tp_size}")
    layout = ParallelLayout(tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size, attn_dp_size=tp_size // attn_tp)
    if layout.attn_dp_size > 1 and layout.attn_tp_rank != ps.get_attn_tensor_model_parallel_rank():
        raise NotImplementedError(f"attention TP rank {ps.get_attn_tensor_model_parallel_rank()} of TP rank "
                                  f"{tp_rank}: sglang-ext expects contiguous attention-TP groups")
    return layout


def _head_block_shards(config, tp: _TP, fp8: bool):
    """(q/o shard, k/v shard) over the q rows (o columns) and k/v rows of this rank."""
    hd = config.head_dim
    heads = attention_head_shard(config.num_attention_heads, config.num_key_value_heads, tp.attn_size, tp.attn_rank)
    all_heads = [attention_head_shard(config.num_attention_heads, config.num_key_value_heads, tp.attn_size, r)
                 for r in range(tp.attn_size)]
    q_ranges = [h.q_rows(hd) for h in all_heads]
    kv_ranges = [h.kv_rows(hd) for h in all_heads]
    q = BlockShard.of(config.num_attention_heads * hd, q_ranges, tp.attn_rank)
    kv = BlockShard.of(config.num_key_value_heads * hd, kv_ranges, tp.attn_rank)
    if not fp8:  # padding only keeps FP8 blocks on their scale grid
        q = BlockShard(q.full, q.lo, q.hi, 0, q.cuts_aligned)
        kv = BlockShard(kv.full, kv.lo, kv.hi, 0, kv.cuts_aligned)
    elif not q.cuts_aligned:
        raise NotImplementedError(
            f"FP8 o_proj shards at attention TP {tp.attn_size} cut a 128-block of {q.full} columns: each rank "
            "would need the others' activation scales (sglang_ext.layers.parallel.fp8_row_parallel_linear); use a TP size whose "
            "head shards are 128-aligned")
    return heads, q, kv


class GptOssAttention(nn.Module):
    def __init__(self, config, layer_id: int, tp: _TP, fp8: Optional[bool] = None):
        super().__init__()
        self.tp = tp
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        fp8 = serves_fp8(config) if fp8 is None else fp8
        self.heads, self.q_shard, self.kv_shard = _head_block_shards(config, tp, fp8)
        self.num_heads = self.heads.q_hi - self.heads.q_lo
        self.num_kv_heads = self.heads.kv_hi - self.heads.kv_lo
        self.q_proj = Linear(hidden, self.q_shard.local_len, fp8=fp8)
        self.k_proj = Linear(hidden, self.kv_shard.local_len, fp8=fp8)
        self.v_proj = Linear(hidden, self.kv_shard.local_len, fp8=fp8)
        self.o_proj = Linear(self.q_shard.local_len, hidden, fp8=fp8)
        self.qkv: Optional[FusedLinear] = None  # built after loading (fuse_qkv)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        sliding = config.layer_types[layer_id] == "sliding_attention"
        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            1.0 / math.sqrt(self.head_dim),
            self.num_kv_heads,
            layer_id=layer_id,
            # SGLang counts the earlier keys a query sees: window 128 inclusive -> 127.
            sliding_window_size=config.sliding_window - 1 if sliding else -1,
        )

    def fuse_qkv(self):
        """q/k/v as one GEMM on the kernel path (their parameters become views of it)."""
        self.qkv = FusedLinear([self.q_proj, self.k_proj, self.v_proj])

    def _project_qkv(self, x, x_quant=None):
        """x_quant: x's FP8 codes and scales from the input norm's launch (kernel path), read by
        the GEMM instead of quantising x again; the torch path ignores it."""
        if self.qkv is not None and use_triton(x.device):
            if not self.qkv.is_current():  # a parameter's storage was replaced since the fusion
                self.fuse_qkv()
            return self.qkv(x, x_quant)
        # The torch path keeps three products: the same numbers as before the fusion, bit for bit.
        return self.q_proj(x, x_quant=x_quant), self.k_proj(x, x_quant=x_quant), self.v_proj(x, x_quant=x_quant)

    def forward(self, x, cos_sin, forward_batch, x_quant=None):
        tokens = x.shape[0]
        q, k, v = self._project_qkv(x, x_quant)
        # reshape, not view: a padded head shard's slice is not contiguous
        q = self.q_shard.drop_padding(q).reshape(tokens, self.num_heads, self.head_dim)
        k = self.kv_shard.drop_padding(k).reshape(tokens, self.num_kv_heads, self.head_dim)
        v = self.kv_shard.drop_padding(v)
        if has_forward_context() and getattr(get_attn_backend(), "applies_rope_kv", False):
            # RoPE in the backend, in the KV write's launch (unrotated q/k, strided views of the GEMM).
            o = self.attn(q, k, v, forward_batch, sinks=self.sinks, rope_cos_sin=cos_sin)
        else:
            q, k = apply_rope(q, cos_sin), apply_rope(k, cos_sin)
            o = self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v.contiguous(), forward_batch,
                          sinks=self.sinks)
        o = self.q_shard.pad_activation(o)
        if self.tp.attn_size == 1:
            return self.o_proj(o)
        if self.tp.dp_attention:
            from sglang.srt.layers.dp_attention import attn_tp_all_reduce

            return attn_tp_all_reduce(self.o_proj(o, with_bias=False)) + self.o_proj.bias
        return tensor_model_parallel_all_reduce(self.o_proj(o, with_bias=False)) + self.o_proj.bias


class GptOssRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_local_experts, config.hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(config.num_local_experts), requires_grad=False)


class GptOssExperts(nn.Module):
    def __init__(self, config, tp: _TP, fp8: Optional[bool] = None):
        super().__init__()
        e, h = config.num_local_experts, config.hidden_size
        # SGLang's CPU loader pads intermediate_size to the FP8 block for its own layers
        # (keeping the true value as original_intermediate_size); ours use ragged blocks.
        intermediate = getattr(config, "original_intermediate_size", None) or config.intermediate_size
        self.fp8 = serves_fp8(config) if fp8 is None else fp8
        self.shard = moe_shard(e, intermediate, tp.layout, self.fp8)
        self.expert_offset = self.shard.expert_lo
        i = self.shard.local_intermediate
        e_local = self.shard.expert_hi - self.shard.expert_lo
        wdt = torch.float8_e4m3fn if self.fp8 else None
        self.gate_up_proj = nn.Parameter(torch.empty(e_local, 2 * i, h, dtype=wdt), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e_local, 2 * i), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e_local, h, i, dtype=wdt), requires_grad=False)
        # Whole (all experts): added once, after the TP all-reduce, weighted by routing.
        self.down_proj_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
        e = e_local
        if self.fp8:
            nb = lambda n: (n + BLOCK - 1) // BLOCK  # noqa: E731
            self.gate_up_proj_scale_inv = nn.Parameter(torch.empty(e, nb(2 * i), nb(h), dtype=torch.float32),
                                                       requires_grad=False)
            self.down_proj_scale_inv = nn.Parameter(torch.empty(e, nb(h), nb(i), dtype=torch.float32),
                                                    requires_grad=False)

    def dense(self, dtype):
        """Expert weights in `dtype` for the torch path. FP8 experts are dequantised once, on
        first use after loading, not on every step (the Triton MoE reads e4m3 directly)."""
        if not self.fp8:
            return self.gate_up_proj, self.down_proj
        cached = getattr(self, "_dense", None)
        if cached is None or cached[0].dtype != dtype:
            cached = self._dense = (
                dequantize_weight_block128(self.gate_up_proj, self.gate_up_proj_scale_inv, dtype),
                dequantize_weight_block128(self.down_proj, self.down_proj_scale_inv, dtype))
        return cached


class GptOssMLP(nn.Module):
    def __init__(self, config, tp: _TP, fp8: Optional[bool] = None):
        super().__init__()
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.limit = config.swiglu_limit
        self.router = GptOssRouter(config)
        self.experts = GptOssExperts(config, tp, fp8)

    def forward(self, x, forward_batch=None):
        if self.tp.dp_attention:
            return self._forward_dp_attention(x, forward_batch)
        return self._forward_tp(x)

    def _forward_dp_attention(self, x, forward_batch):
        """x: this DP group's tokens. Every rank's experts shard sees every DP group's tokens: gathered
        (SGLang's dp_gather_replicate into its global buffer: one attention-TP rank of each group places its
        rows, then a TP all-reduce or all-gather, SGLang's choice by padding mode), this rank's partial MoE over
        them, the TP all-reduce (+ the mlp2 bias once), then this group's rows back (dp_scatter). A group with
        no tokens (an idle batch) still joins each collective."""
        from sglang.srt.layers.dp_attention import dp_gather_replicate, dp_scatter, get_global_dp_buffer
        from sglang.srt.runtime_context import get_parallel

        tokens = get_global_dp_buffer(get_parallel().tp_group)
        dp_gather_replicate(tokens, x.contiguous(), forward_batch)
        out = self._forward_tp(tokens)
        local = torch.empty_like(x)
        dp_scatter(local, out.contiguous(), forward_batch)
        return local

    def _forward_tp(self, x):
        ex = self.experts
        single = self.tp.size == 1
        if ex.fp8 and use_triton(x.device):
            # The Triton MoE reads the e4m3 experts directly (routing inside moe_forward).
            out, weights, ids = moe_forward(
                x, self.router.weight, self.router.bias, ex.gate_up_proj, ex.gate_up_proj_scale_inv,
                ex.gate_up_proj_bias, ex.down_proj, ex.down_proj_scale_inv, ex.down_proj_bias,
                self.top_k, self.limit, ex.expert_offset, with_down_bias=single, return_routing=True)
            if single:
                return out
            return add_down_bias(tensor_model_parallel_all_reduce(out), weights, ids, ex.down_proj_bias)
        weights, ids = route(x, self.router.weight, self.router.bias, self.top_k)
        gate_up, down = ex.dense(x.dtype)
        if single:
            return experts_torch(x, weights, ids, gate_up, ex.gate_up_proj_bias,
                                 down, ex.down_proj_bias, self.limit, quantize_activations=ex.fp8)
        partial = experts_torch(x, weights, ids, gate_up, ex.gate_up_proj_bias,
                                down, None, self.limit, ex.expert_offset, quantize_activations=ex.fp8)
        return add_down_bias(tensor_model_parallel_all_reduce(partial), weights, ids, ex.down_proj_bias)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, tp: _TP, fp8: Optional[bool] = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GptOssAttention(config, layer_id, tp, fp8)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GptOssMLP(config, tp, fp8)

    def forward(self, h, x, cos_sin, forward_batch, x_quant=None):
        """h: the residual stream entering the layer, x: its input norm (x_quant: its FP8 form,
        kernel path). Returns (residual after attention, MLP output): the caller adds the MLP
        output inside the next norm's launch."""
        post = self.post_attention_layernorm
        if x.shape[0] == 0:  # an idle DP group (DP attention): no attention; the MoE's collectives still run
            o = torch.zeros_like(h)
        else:
            o = self.self_attn(x, cos_sin, forward_batch, x_quant)
        h, x = residual_rms_norm(h, o, post.weight, post.eps)
        return h, self.mlp(x, forward_batch)


class GptOssModel(nn.Module):
    def __init__(self, config, tp: _TP, fp8: Optional[bool] = None):
        super().__init__()
        self.config = config
        # DP attention: each DP group embeds its own tokens, the vocabulary split over its attention-TP ranks.
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   use_attn_tp_group=tp.dp_attention)
        self.layers = nn.ModuleList(GptOssDecoderLayer(config, i, tp, fp8) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = YarnRope.from_hf_config(config)
        self._cos_sin: Optional[torch.Tensor] = None

    def cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        # Every position the model accepts, built once (131072 x 64 fp32 = 32 MiB): a lookup,
        # no host read of the positions in the step.
        if self._cos_sin is None or self._cos_sin.device != positions.device:
            self._cos_sin = self.rope.cos_sin_cache(self.config.max_position_embeddings, positions.device)
        return self._cos_sin[positions]

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, probe=None):
        h = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        cos_sin = self.cos_sin(positions)
        if probe is not None:
            probe.begin(h.shape[0], h.device)
        pending = None  # the previous layer's MLP output, added in this layer's first norm launch
        # Kernel path, FP8 projections: the input norm's launch also quantises its output for the
        # qkv GEMM (codes + 1x128 scales), which then reads 1 byte per element and skips its own
        # per-program quantisation (the decode GEMV's one-shot form needs it to pay off).
        quantize = len(self.layers) > 0 and self.layers[0].self_attn.q_proj.fp8 and use_triton(h.device)
        for i, layer in enumerate(self.layers):
            norm = layer.input_layernorm
            # The probe taps the input residual stream of layer i, in the same launch as its norm.
            tap = probe.tap_target(i) if probe is not None else None
            normed = residual_rms_norm(h, pending, norm.weight, norm.eps, tap, quantize=quantize)
            h, x = normed[:2]
            x_quant = normed[2] if quantize else None  # (e4m3 codes, scales) of x
            h, pending = layer(h, x, cos_sin, forward_batch, x_quant)
        if probe is not None:
            probe.layers_done()
        return residual_rms_norm(h, pending, self.norm.weight, self.norm.eps)[1]


class GptOssForCausalLM(nn.Module):
    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.tp = _TP()
        lay = self.tp.layout
        if lay.tp_size > 1:
            logger.info("sglang-ext gpt-oss: TP rank %d of %d, EP %d, attention DP %d (attention TP rank %d of %d)",
                        lay.tp_rank, lay.tp_size, lay.ep_size, lay.attn_dp_size, lay.attn_tp_rank, lay.attn_tp_size)
        # SGLang's quant_config: Mxfp4Config / Fp8Config from config.json (both served on our FP8 path), or
        # Fp8Config from --quantization fp8 on a bf16 checkpoint (online FP8: converted at load here).
        self.fp8 = serves_fp8(config, quant_config)
        self.model = GptOssModel(config, self.tp, self.fp8)
        # As SGLang's gpt-oss: vocab-parallel over the TP group (the logits processor gathers the DP groups'
        # rows), or over the attention-TP group with --enable-dp-lm-head.
        from sglang.srt.runtime_context import get_parallel

        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      use_attn_tp_group=self.tp.dp_attention and get_parallel().enable_dp_lm_head)
        self.logits_processor = LogitsProcessor(config)
        self.probe = self._make_probe(config)

    def _make_probe(self, config):
        from sglang.srt.runtime_context import get_server_args

        from sglang_ext.patches.probe_ckpt_flag import probe_ckpt_of

        folder = probe_ckpt_of(get_server_args())
        # One rank of each attention group emits its requests' scores (the group's attention-TP rank 0: the
        # TP rank 0 without DP attention); the others skip the probe entirely.
        if folder is None or self.tp.attn_rank != 0:
            return None
        from sglang_ext.probe_runtime import ProbeRuntime

        return ProbeRuntime(folder, config, torch.get_default_dtype())

    def bind_kv_pools(self, req_to_token_pool, token_to_kv_pool):
        if self.probe is not None:
            self.probe.bind_kv_pools(req_to_token_pool, token_to_kv_pool)

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch: ForwardBatch, input_embeds=None, **kwargs):
        probe = self.probe if self.probe is not None and not forward_batch.forward_mode.is_idle() else None
        if (probe is not None and input_ids.is_cuda and torch.cuda.is_current_stream_capturing()
                and not forward_batch.forward_mode.is_decode()):
            # Decode graphs carry the scores out through a static tensor (patches/probe_cuda_graph.py);
            # any other captured mode (speculative verify, a whole-model prefill graph) was never
            # checked with the probe. (SGLang's prefill graph runners capture only GptOssModel; the
            # patch keeps them from replaying with the probe, and step() refuses untapped features.)
            raise RuntimeError("sglang-ext: --probe-ckpt runs inside plain decode CUDA graphs only (no "
                               "prefill graphs, no speculative decoding); launch with --disable-prefill-cuda-graph")
        if probe is not None and forward_batch.forward_mode.is_decode():
            probe.expect_batch(forward_batch.out_cache_loc, forward_batch.req_pool_indices,
                               forward_batch.seq_lens, None)
        elif probe is not None:
            probe.forget_batch()
        hidden = self.model(input_ids, positions, forward_batch, input_embeds, probe=probe)
        out = self.logits_processor(input_ids, hidden, self.lm_head, forward_batch)
        if probe is not None:
            out.customized_info = probe.as_customized_info(probe.score(forward_batch))
        return out

    def get_attention_sliding_window_size(self):
        return self.config.sliding_window - 1

    @property
    def start_layer(self):
        return 0

    @property
    def end_layer(self):
        return self.config.num_hidden_layers

    # -- loading ----------------------------------------------------------------
    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        for layer in self.model.layers:  # new weights: drop the torch path's dequantised experts
            layer.mlp.experts._dense = None
        restore_bf16_lm_head(self.lm_head)  # a reload of a model served with the FP8 head: bf16 again first
        layer0 = self.model.layers[0]
        loader = CheckpointLoader(self, checkpoint_format(self.config), self.tp, layer0.self_attn, layer0.mlp.experts)
        start = time.perf_counter()
        loader.load(weights)
        self.fp8_load_report = loader.report
        if loader.report:
            if loader.device.type == "cuda":  # the conversion's scratch, before SGLang sizes the KV pool
                torch.cuda.empty_cache()
            if self.tp.rank == 0:
                self._log_conversion(loader, time.perf_counter() - start)
        self.post_load_weights()

    def post_load_weights(self):
        """After the weights are in: by load_weights, and by SGLang's loaders that fill parameters without
        it (--load-format dummy)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_qkv()
        # opt-in: the head in e4m3 blocks (sglang_ext/layers/lm_head.py); once per load
        if fp8_lm_head_enabled() and self.lm_head.weight.dtype != torch.float8_e4m3fn:
            quantize_lm_head(self.lm_head)

    def _log_conversion(self, loader: "CheckpointLoader", seconds: float):
        experts = summarize_block128_report({k: v for k, v in loader.report.items() if ".experts." in k})
        dense = summarize_block128_report({k: v for k, v in loader.report.items() if ".experts." not in k})
        shard = self.tp.layout.ep_size > 1 and self.model.layers[0].mlp.experts.shard
        whose = (f" (this rank's experts {shard.expert_lo}..{shard.expert_hi - 1} of {self.config.num_local_experts})"
                 if shard else "")
        pct = 100.0 * experts["blocks_exact"] / max(experts["blocks"], 1)
        if loader.format == "mxfp4":
            logger.info("sglang-ext gpt-oss: MXFP4 experts served as FP8 e4m3 block-128, converted at load in %.1f s%s: "
                        "%d/%d 128x128 blocks exact (%.2f%%), max relative error %.3e",
                        seconds, whose, experts["blocks_exact"], experts["blocks"], pct, experts["max_rel_err"])
            logger.info("sglang-ext gpt-oss: attention q/k/v/o (bf16 in the MXFP4 checkpoint) quantised to FP8 e4m3 "
                        "block-128 at load, as launch/convert.py does: max relative error %.3e", dense["max_rel_err"])
        else:
            logger.info("sglang-ext gpt-oss: bf16 checkpoint served in FP8 e4m3 block-128 (--quantization fp8), quantised "
                        "at load in %.1f s%s, lossy: experts max relative error %.3e (%d/%d 128x128 blocks exact), "
                        "attention q/k/v/o %.3e; launch/convert.py writes the same FP8 checkpoint once",
                        seconds, whose, experts["max_rel_err"], experts["blocks_exact"], experts["blocks"],
                        dense["max_rel_err"])


class CheckpointLoader:
    """Checkpoint tensors into this rank's parameters of `root` (named as the checkpoint's keys).

    Each tensor is cut for the rank by `shard_checkpoint_tensor`. Where a parameter is e4m3 and the
    checkpoint's tensor is not (an MXFP4 checkpoint's experts and bf16 attention projections, a bf16
    checkpoint served in FP8), the full tensor is first converted to FP8 block-128 with
    launch/convert.py's functions (`experts_to_fp8_block128`, `convert_block128`) on the parameter's
    device, then cut exactly as an FP8 checkpoint's tensor and its scales are: the same bytes as serving
    the converted checkpoint. Experts convert a few at a time (`chunk_elements`), only this rank's
    (expert parallelism), so no layer is ever dequantised whole. `report`: launch/convert.py's report
    row per converted tensor."""

    def __init__(self, root: nn.Module, fmt: str, tp: _TP, attn: GptOssAttention, experts: GptOssExperts,
                 chunk_elements: int = CONVERT_CHUNK_ELEMENTS):
        self.root, self.format, self.tp, self.attn, self.experts = root, fmt, tp, attn, experts
        self.params = dict(root.named_parameters())
        self.chunk_elements = chunk_elements
        self.device = experts.down_proj_bias.device
        self.loaded: set = set()
        self.report: dict = {}

    def load(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        pending_mxfp4: dict = {}
        for name, tensor in weights:
            if name.endswith("_blocks") or name.endswith("_scales"):
                base, part = name.rsplit("_", 1)
                pending_mxfp4.setdefault(base, {})[part] = tensor
                if len(pending_mxfp4[base]) == 2:
                    pieces = pending_mxfp4.pop(base)
                    self._load_experts(base, Mxfp4Experts(pieces["blocks"], pieces["scales"]))
                continue
            if name not in self.params:
                raise KeyError(f"unexpected tensor in the gpt-oss checkpoint: {name}")
            if self._converts(name, tensor):
                if ".experts." in name:
                    self._load_experts(name, DenseExperts(tensor))
                else:
                    self._load_dense_fp8(name, tensor)
                continue
            self._load_one(name, tensor)
        if pending_mxfp4:
            raise KeyError(f"MXFP4 tensors missing their blocks or scales: {sorted(pending_mxfp4)}")
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            raise KeyError(f"tensors missing from the gpt-oss checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _converts(self, name: str, tensor: torch.Tensor) -> bool:
        if self.params[name].dtype != torch.float8_e4m3fn or tensor.dtype == torch.float8_e4m3fn:
            return False
        if self.format == "fp8":  # an FP8 checkpoint carries its own e4m3 values and scales
            raise TypeError(f"{name}: FP8 checkpoint tensor has dtype {tensor.dtype}, expected float8_e4m3fn")
        if not tensor.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {tensor.dtype}")
        return True

    def _load_dense_fp8(self, name: str, tensor: torch.Tensor) -> None:
        """One attention projection's weight [out, in]: e4m3 with amax/448 block scales, launch/convert.py's
        conversion of the q/k/v/o weights."""
        q, s, (stats,) = convert_block128(tensor.to(self.device), exact_source=False)
        row = Block128Report()
        row.add(stats)
        self.report[name] = row.row
        self._load_one(name, q)
        self._load_one(name[: -len("weight")] + "weight_scale_inv", s)

    def _load_experts(self, base: str, source) -> None:
        """`base`'s experts (gate_up_proj [E, 2I, H] or down_proj [E, H, I], from MXFP4 or bf16), this rank's
        only, converted `chunk_elements` at a time, each chunk cut like an FP8 checkpoint's [E, ...] tensor."""
        leaf = base.rsplit(".", 1)[-1]
        if base not in self.params or leaf not in ("gate_up_proj", "down_proj") or ".mlp.experts." not in base:
            raise KeyError(f"unexpected expert tensor in the gpt-oss checkpoint: {base}")
        weight, scales = self.params[base], self.params.get(base + "_scale_inv")
        if weight.dtype != torch.float8_e4m3fn or scales is None:
            raise ValueError(f"{base}: MXFP4 blocks and scales in a checkpoint whose config.json does not say "
                             "quantization_config quant_method mxfp4")
        shard = self.experts.shard
        lo, hi = shard.expert_lo, shard.expert_hi
        if source.num != self.experts.down_proj_bias.shape[0]:
            raise ValueError(f"{base}: {source.num} experts in the checkpoint, the config says "
                             f"{self.experts.down_proj_bias.shape[0]}")
        row = Block128Report(hi - lo)
        for first, last, q, s, stats in experts_to_fp8_block128(source, lo, hi, self.device, self.chunk_elements):
            for one in stats:
                row.add(one)
            part = dataclasses.replace(shard, expert_lo=0, expert_hi=last - first)
            if leaf == "gate_up_proj":
                q, s = part.gate_up(q), part.gate_up_scales(s)
            else:
                q, s = part.down(q), part.down_scales(s)
            self._copy(base, weight[first - lo : last - lo], q)
            self._copy(base + "_scale_inv", scales[first - lo : last - lo], s)
            del q, s
        self.report[base] = row.row
        self.loaded.update((base, base + "_scale_inv"))

    @staticmethod
    def _copy(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{name}: converted shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
        dst.copy_(src)

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        param = self.params[name]
        self.loaded.add(name)
        loader = getattr(param, "weight_loader", None)
        if loader is not None:  # vocab-parallel embedding / LM head shard themselves
            loader(param, tensor)
            return
        try:
            tensor = shard_checkpoint_tensor(name, tensor, "checkpoint", self.tp, self.attn, self.experts)
        except RuntimeError as e:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} cannot be cut for this rank "
                             f"({self.tp.layout}): {e}") from e
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
        if param.dtype == torch.float8_e4m3fn and tensor.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name}: FP8 checkpoint tensor has dtype {tensor.dtype}, expected float8_e4m3fn")
        param.data.copy_(tensor.to(param.dtype))


def shard_checkpoint_tensor(name: str, tensor: torch.Tensor, layout: str, tp: _TP, attn: GptOssAttention,
                            experts: GptOssExperts) -> torch.Tensor:
    """This rank's part of one checkpoint tensor, in the parameter's layout.

    `attn` / `experts` carry the rank's shards (every layer shards alike). bf16 checkpoints
    store experts [E, in, out]: transposed here to [E, out, in] like MXFP4 and FP8."""
    leaf = name.rsplit(".", 1)[-1]
    if ".experts." in name:
        shard = experts.shard
        if leaf in ("gate_up_proj", "down_proj") and layout == "checkpoint" and tensor.dtype != torch.float8_e4m3fn:
            tensor = tensor.transpose(-1, -2)
        if leaf in ("gate_up_proj", "gate_up_proj_bias"):
            tensor = shard.gate_up(tensor)
        elif leaf == "down_proj":
            tensor = shard.down(tensor)
        elif leaf == "gate_up_proj_scale_inv":
            tensor = shard.gate_up_scales(tensor)
        elif leaf == "down_proj_scale_inv":
            tensor = shard.down_scales(tensor)
    elif ".self_attn." in name and tp.attn_size > 1:
        proj = name.rsplit(".", 2)[-2]
        rows = attn.q_shard if proj == "q_proj" else attn.kv_shard
        if proj in ("q_proj", "k_proj", "v_proj"):
            tensor = rows.take_scales(tensor, 0) if leaf == "weight_scale_inv" else rows.take(tensor, 0)
        elif proj == "o_proj" and leaf == "weight":
            tensor = attn.q_shard.take(tensor, 1)
        elif proj == "o_proj" and leaf == "weight_scale_inv":
            tensor = attn.q_shard.take_scales(tensor, 1)
        elif leaf == "sinks":
            tensor = tensor[attn.heads.q_lo : attn.heads.q_hi]
    return tensor


EntryClass = GptOssForCausalLM
