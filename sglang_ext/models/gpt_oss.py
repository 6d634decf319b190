"""gpt-oss (20b/120b) for SGLang.

The decoder is SGLang-free (`sglang_ext.models.gpt_oss_core`, on `sglang_ext.layers`: RMSNorm,
YaRN RoPE, linear-with-bias, MoE), the same forward the GPU harness runs; this module wires it to
SGLang: RadixAttention (-> the attention backend, `ForwardBatch`), its collectives, its
vocab-parallel embedding / LM head / logits processor, the probe, and checkpoint loading.

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
import time
from typing import Iterable, Tuple

import torch
from torch import nn

from sglang.srt.distributed import parallel_state as ps
from sglang.srt.distributed.communication_op import tensor_model_parallel_all_reduce
from sglang.srt.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from sglang.srt.layers import dp_attention
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context
from sglang.srt.runtime_context import get_parallel, get_server_args

from sglang_ext.layers.fp8 import Block128Report, convert_block128, summarize_block128_report
from sglang_ext.layers.lm_head import fp8_lm_head_enabled, quantize_lm_head, restore_bf16_lm_head
from sglang_ext.layers.mxfp4 import CONVERT_CHUNK_ELEMENTS, DenseExperts, Mxfp4Experts, experts_to_fp8_block128
from sglang_ext.layers.parallel import ParallelLayout
from sglang_ext.models.gpt_oss_core import (Collectives, GptOssAttention, GptOssDecoder, GptOssExperts, RankGroups,
                                            checkpoint_format, serves_fp8)
from sglang_ext.probe.checkpoint import probe_ckpt_of

logger = logging.getLogger(__name__)


class SglangCollectives(Collectives):
    """The decoder's collectives over SGLang's TP group, attention-TP group and DP-attention buffers."""

    def all_reduce(self, x):
        return tensor_model_parallel_all_reduce(x)

    def attn_all_reduce(self, x):
        return dp_attention.attn_tp_all_reduce(x)

    def dp_gather(self, x, batch):
        # SGLang's dp_gather_replicate into its global buffer: one attention-TP rank of each group places its
        # rows, then a TP all-reduce or all-gather, SGLang's choice by padding mode.
        tokens = dp_attention.get_global_dp_buffer(get_parallel().tp_group)
        dp_attention.dp_gather_replicate(tokens, x.contiguous(), batch)
        return tokens

    def dp_scatter(self, out, x, batch):
        local = torch.empty_like(x)
        dp_attention.dp_scatter(local, out.contiguous(), batch)
        return local


def sglang_rank_groups(layout: ParallelLayout | None = None) -> RankGroups:
    """This rank's place in SGLang's TP/EP groups (read from SGLang unless given) with SGLang's collectives."""
    return RankGroups(layout if layout is not None else _sglang_layout(), SglangCollectives())


def _sglang_layout() -> ParallelLayout:
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


class ExtRadixAttention(RadixAttention):
    """SGLang's RadixAttention, saying whether this step's attention backend applies RoPE and the KV write
    itself (sglang_ext's ext_sinks backend: in the write's launch, from unrotated q/k)."""

    @property
    def applies_rope_kv(self) -> bool:
        return has_forward_context() and getattr(get_attn_backend(), "applies_rope_kv", False)


class GptOssModel(GptOssDecoder):
    """The SGLang-free decoder (models/gpt_oss_core.py) behind SGLang's vocab-parallel embedding."""

    def __init__(self, config, tp: RankGroups, fp8: bool | None = None):
        super().__init__(config, tp, fp8, attention=ExtRadixAttention)
        # DP attention: each DP group embeds its own tokens, the vocabulary split over its attention-TP ranks.
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   use_attn_tp_group=tp.dp_attention)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, probe=None):
        h = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        return self.decode(h, positions, forward_batch, probe)


class GptOssForCausalLM(nn.Module):
    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.tp = sglang_rank_groups()
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
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      use_attn_tp_group=self.tp.dp_attention and get_parallel().enable_dp_lm_head)
        self.logits_processor = LogitsProcessor(config)
        self.probe = self._make_probe(config)

    def _make_probe(self, config):
        folder = probe_ckpt_of(get_server_args())
        # One rank of each attention group emits its requests' scores (the group's attention-TP rank 0: the
        # TP rank 0 without DP attention); the others skip the probe entirely.
        if folder is None or self.tp.attn_rank != 0:
            return None
        from sglang_ext.probe_runtime import ProbeRuntime  # Triton kernels: only a served probe needs them

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

    def __init__(self, root: nn.Module, fmt: str, tp: RankGroups, attn: GptOssAttention, experts: GptOssExperts,
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


def shard_checkpoint_tensor(name: str, tensor: torch.Tensor, layout: str, tp: RankGroups, attn: GptOssAttention,
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
