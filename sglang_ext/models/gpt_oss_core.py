"""gpt-oss's decoder, SGLang-free: the one forward that the server and the GPU harness both run.

Norms, attention projections, the attention call, router and experts, the layer loop with the
probe's taps and the final norm live here, on torch and sglang_ext.layers only. What differs
between a server and the harness comes in from outside, with the same signatures:
  - `attention`: builds each layer's attention op, called as SGLang's RadixAttention is
    (`attn(q, k, v, batch, sinks=..., rope_cos_sin=...)`); the server passes RadixAttention (its
    backend reads SGLang's paged cache), benchmarks/model_step.py a paged attention over its own cache.
    The op's `applies_rope_kv` says whether RoPE and the KV write happen inside it.
  - `RankGroups.comm`: the collectives (`Collectives`: identity in one process; SGLang's group
    coordinators in the server, torch.distributed in the harness).
  - `batch`: passed through untouched to the attention op and the DP gather (SGLang's ForwardBatch
    in the server).
Parameter names equal the checkpoint keys (`input_layernorm.weight`, `self_attn.q_proj.weight`,
`mlp.experts.gate_up_proj`, ...), so the server loads checkpoints into these modules as they are.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from sglang_ext.kernel_select import use_triton
from sglang_ext.layers.fp8 import BLOCK, dequantize_weight_block128
from sglang_ext.layers.linear import FusedLinear, Linear
from sglang_ext.layers.moe import add_down_bias, experts_torch, moe_forward, route
from sglang_ext.layers.norm import residual_rms_norm, rms_norm
from sglang_ext.layers.parallel import BlockShard, ParallelLayout, attention_head_shard, moe_shard
from sglang_ext.layers.rope import YarnRope, apply_rope


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


def serves_fp8(config, quant_config=None) -> bool:
    """Whether the experts and the attention projections are e4m3 block-128 parameters: always for FP8
    and MXFP4 checkpoints (MXFP4 converted at load, exactly where a 128x128 block's values fit e4m3
    under a power-of-two scale: launch/convert.py's conversion), and for a bf16 checkpoint launched
    with SGLang's `--quantization fp8` (its online FP8, here block-128 converted at load, lossy).
    A bf16 checkpoint otherwise stays bf16: its numbers are transformers' (tests/served/test_served_parity.py,
    tests/served/test_probe_serving_bf16.py, and on a GPU tests/benchmarks/test_served_gpu.py)."""
    if checkpoint_format(config) != "dense":
        return True
    name = quant_config.get_name() if quant_config is not None else None
    if name not in (None, "fp8"):
        raise ValueError(f"gpt-oss bf16 checkpoints serve in bf16 or, with --quantization fp8, in FP8 block-128; "
                         f"--quantization {name} is not served")
    return name == "fp8"


class Collectives:
    """The decoder's collectives; this base is one process (every one the identity). `batch` is the
    caller's batch object, for the DP-attention gather that needs its token counts."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # sum over the TP group
        return x

    def attn_all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # sum over the attention-TP group
        return x

    def dp_gather(self, x: torch.Tensor, batch) -> torch.Tensor:  # every DP group's tokens, on every rank
        return x

    def dp_scatter(self, out: torch.Tensor, x: torch.Tensor, batch) -> torch.Tensor:  # this group's rows of `out`
        return out


class RankGroups:
    """This rank's place in the TP/EP/DP-attention layout (`ParallelLayout`) and the collectives over
    its groups. `attn_size` / `attn_rank`: its attention-TP group (the whole TP group without DP
    attention)."""

    def __init__(self, layout: ParallelLayout, comm: Optional[Collectives] = None):
        self.layout = layout
        self.comm = comm if comm is not None else Collectives()
        self.size = layout.tp_size
        self.rank = layout.tp_rank
        self.attn_size = layout.attn_tp_size
        self.attn_rank = layout.attn_tp_rank
        self.dp_attention = layout.attn_dp_size > 1


def _head_block_shards(config, tp: RankGroups, fp8: bool):
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


# attention(num_heads, head_dim, scaling, num_kv_heads, layer_id=, sliding_window_size=) -> the layer's op
AttentionFactory = Callable[..., nn.Module]


class GptOssAttention(nn.Module):
    def __init__(self, config, layer_id: int, tp: RankGroups, fp8: Optional[bool] = None,
                 attention: Optional[AttentionFactory] = None):
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
        # None: the shapes and weights only (loader tests); such a layer has no forward
        self.attn = None if attention is None else attention(
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

    def forward(self, x, cos_sin, batch, x_quant=None):
        tokens = x.shape[0]
        q, k, v = self._project_qkv(x, x_quant)
        # reshape, not view: a padded head shard's slice is not contiguous
        q = self.q_shard.drop_padding(q).reshape(tokens, self.num_heads, self.head_dim)
        k = self.kv_shard.drop_padding(k).reshape(tokens, self.num_kv_heads, self.head_dim)
        v = self.kv_shard.drop_padding(v)
        if self.attn.applies_rope_kv:
            # RoPE in the attention op, in the KV write's launch (unrotated q/k, strided views of the GEMM).
            o = self.attn(q, k, v, batch, sinks=self.sinks, rope_cos_sin=cos_sin)
        else:
            q, k = apply_rope(q, cos_sin), apply_rope(k, cos_sin)
            o = self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v.contiguous(), batch, sinks=self.sinks)
        # [T, H * D]: SGLang's eager attention in a breakable prefill CUDA graph hands back a buffer shaped as q
        o = self.q_shard.pad_activation(o.reshape(tokens, -1))
        if self.tp.attn_size == 1:
            return self.o_proj(o)
        reduce = self.tp.comm.attn_all_reduce if self.tp.dp_attention else self.tp.comm.all_reduce
        return reduce(self.o_proj(o, with_bias=False)) + self.o_proj.bias


class GptOssRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_local_experts, config.hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(config.num_local_experts), requires_grad=False)


def redraw_routing(decoder: nn.Module, seed: int = 0) -> None:
    """Router weights N(0, 1) and zero bias in every layer, the same draw on every rank (seeded on the CPU), and
    the token embedding (`decoder.embed_tokens`, where the decoder holds one) N(0, 1).

    For weightless runs only (patches/dummy_routing.py): SGLang's dummy weights are one seeded
    uniform(-1e-3, 1e-3) draw per shape. The router's bias then outweighs its product with the token, and
    every token picks the same top-k experts: hence the routers. And every layer's biases are the same vector,
    added once per layer to a residual stream whose token part (the embedding) is of their size, so with depth
    the hidden states of all tokens converge and so do their experts (64 tokens through 12 such layers with
    only the routers redrawn: 21 experts of 32 in the first layer, 5 in the last): hence the embedding, which
    keeps each token's own direction dominant in every layer. Each rank draws its own embedding shard from the
    same seed, so rows at the same offset of two shards are equal: harmless for routing."""
    gen = torch.Generator().manual_seed(seed)
    for layer in decoder.layers:
        router = layer.mlp.router
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen, dtype=torch.float32))
        router.bias.zero_()
    embed = getattr(getattr(decoder, "embed_tokens", None), "weight", None)
    if embed is not None:
        embed.normal_(generator=torch.Generator(embed.device).manual_seed(seed + 1))


class GptOssExperts(nn.Module):
    def __init__(self, config, tp: RankGroups, fp8: Optional[bool] = None):
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
    def __init__(self, config, tp: RankGroups, fp8: Optional[bool] = None):
        super().__init__()
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.limit = config.swiglu_limit
        self.router = GptOssRouter(config)
        self.experts = GptOssExperts(config, tp, fp8)

    def forward(self, x, batch=None):
        if self.tp.dp_attention:
            # x: this DP group's tokens. Every rank's experts shard sees every DP group's tokens: gathered,
            # this rank's partial MoE over them, the TP all-reduce (+ the mlp2 bias once), then this group's
            # rows back. A group with no tokens (an idle batch) still joins each collective.
            comm = self.tp.comm
            return comm.dp_scatter(self._forward_tp(comm.dp_gather(x, batch)), x, batch)
        return self._forward_tp(x)

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
            return add_down_bias(self.tp.comm.all_reduce(out), weights, ids, ex.down_proj_bias)
        weights, ids = route(x, self.router.weight, self.router.bias, self.top_k)
        gate_up, down = ex.dense(x.dtype)
        if single:
            return experts_torch(x, weights, ids, gate_up, ex.gate_up_proj_bias,
                                 down, ex.down_proj_bias, self.limit, quantize_activations=ex.fp8)
        partial = experts_torch(x, weights, ids, gate_up, ex.gate_up_proj_bias,
                                down, None, self.limit, ex.expert_offset, quantize_activations=ex.fp8)
        return add_down_bias(self.tp.comm.all_reduce(partial), weights, ids, ex.down_proj_bias)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, tp: RankGroups, fp8: Optional[bool] = None,
                 attention: Optional[AttentionFactory] = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GptOssAttention(config, layer_id, tp, fp8, attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GptOssMLP(config, tp, fp8)

    def forward(self, h, x, cos_sin, batch, x_quant=None):
        """h: the residual stream entering the layer, x: its input norm (x_quant: its FP8 form,
        kernel path). Returns (residual after attention, MLP output): the caller adds the MLP
        output inside the next norm's launch."""
        post = self.post_attention_layernorm
        if x.shape[0] == 0:  # an idle DP group (DP attention): no attention; the MoE's collectives still run
            o = torch.zeros_like(h)
        else:
            o = self.self_attn(x, cos_sin, batch, x_quant)
        h, x = residual_rms_norm(h, o, post.weight, post.eps)
        return h, self.mlp(x, batch)


class GptOssDecoder(nn.Module):
    """The layers and the final norm over embedded tokens: hidden states in, normed hidden states out.
    The server's model (models/gpt_oss.py) is this plus SGLang's embedding, LM head and batch; the
    harness (benchmarks/model_step.py) is this plus its own."""

    def __init__(self, config, tp: RankGroups, fp8: Optional[bool] = None,
                 attention: Optional[AttentionFactory] = None):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(GptOssDecoderLayer(config, i, tp, fp8, attention)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = YarnRope.from_hf_config(config)
        self._cos_sin: Optional[torch.Tensor] = None

    def cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        # Every position the model accepts, built once (131072 x 64 fp32 = 32 MiB): a lookup,
        # no host read of the positions in the step.
        if self._cos_sin is None or self._cos_sin.device != positions.device:
            self._cos_sin = self.rope.cos_sin_cache(self.config.max_position_embeddings, positions.device)
        return self._cos_sin[positions]

    def decode(self, h, positions, batch, probe=None):
        """h: the embedded tokens [T, hidden]; `probe`: the SingProbe runtime (probe_runtime.ProbeRuntime) that
        taps its layers' input residual streams, or None."""
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
            h, pending = layer(h, x, cos_sin, batch, x_quant)
        if probe is not None:
            probe.layers_done()
        return residual_rms_norm(h, pending, self.norm.weight, self.norm.eps)[1]
