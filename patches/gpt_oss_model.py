"""Patch: serve `GptOssForCausalLM` with sglang-ext's model class (SGLang 0.5.23).

Target: `sglang.srt.models.registry._ModelRegistry.resolve_model_cls` (BEFORE): the
first time a process resolves a model class, our classes from `sglang_ext.models`
enter the registry, overriding upstream's of the same name. Classes are keyed by
`__name__`, so ours keeps the upstream name and every gpt-oss decision keyed on that
string (config overrides, the hybrid SWA pool, the chat serving checks) still applies.
Registering lazily keeps the launcher and the detokenizer from importing the model.

Why: upstream's class runs on CPU only through the Triton interpreter in fp32, its
native MoE path recompiles with torch.compile on every new shape (about 1.4 tok/s on
the tiny model here), and the FP8 block-128 layers, fused biases, probe taps and our
kernels need a model whose forward we own.

Target: the resolution step `handle_gpu_memory_settings` (SGLang's plugin registry for
resolution steps, `register_resolution_hook`; it sets the default decode CUDA-graph batch
sizes): a bf16 gpt-oss checkpoint on CUDA without `--quantization fp8` keeps its bf16
experts, which run the torch MoE, and a CUDA graph captures that only up to batch 8 (above,
it reads expert counts on the host: sglang_ext.layers.moe). Where the user set no decode
graph sizes, they stop at batch 8 (larger batches run eagerly), with one warning saying why;
a default launch then works instead of failing at capture. MXFP4 and FP8 checkpoints, and
bf16 with `--quantization fp8`, run the graph-safe Triton MoE at SGLang's default sizes.
"""

from __future__ import annotations

import logging

from sglang.srt.arg_groups.model_override_base import model_config_of, resolving_view
from sglang.srt.arg_groups.overrides import declare_resolution
from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

logger = logging.getLogger(__name__)

MODEL_PACKAGE = "sglang_ext.models"
GPT_OSS_ARCH = "GptOssForCausalLM"


def _register_ours(registry, *args, **kwargs):
    if not getattr(registry, "_sglang_ext_registered", False):
        from sglang.srt.models.registry import import_model_classes  # heavy: ~4400 modules

        registry.models.update(import_model_classes(MODEL_PACKAGE, strict=True))
        registry._sglang_ext_registered = True


def bf16_decode_graph_limit(server_args) -> int | None:
    """The largest decode batch a CUDA graph may capture for this launch, where sglang-ext must limit it:
    a bf16 gpt-oss checkpoint on CUDA served in bf16 (no quantization_config, no --quantization fp8)
    whose decode graph sizes the user left to SGLang. None otherwise."""
    from sglang_ext.layers.moe import GATHER_MAX_PAIRS  # model code: loads sglang_ext.kernels

    cfg = resolving_view(server_args)
    if cfg.device != "cuda" or cfg.quantization is not None:
        return None
    locked = getattr(server_args, "_cuda_graph_config_locked", set())
    if (Phase.DECODE, "max_bs") in locked or (Phase.DECODE, "bs") in locked:
        return None
    hf_config = model_config_of(server_args).hf_config
    if GPT_OSS_ARCH not in (getattr(hf_config, "architectures", None) or []):
        return None
    if getattr(hf_config, "quantization_config", None):  # MXFP4 / FP8: the Triton MoE
        return None
    return GATHER_MAX_PAIRS // hf_config.num_experts_per_tok


def _limit_bf16_decode_graphs(server_args, previous):
    limit = bf16_decode_graph_limit(server_args)
    graphs = resolving_view(server_args).cuda_graph_config
    if limit is not None and graphs is not None and graphs.decode.backend != Backend.DISABLED:
        declare_resolution(server_args, "sglang_ext.bf16_gpt_oss_decode_graphs",
                           cuda_graph_config=with_phase(graphs, Phase.DECODE, max_bs=limit))
        logger.warning(
            "sglang-ext gpt-oss: bf16 checkpoint: its experts run the torch MoE, which a CUDA graph captures only up "
            "to batch %d (above, it reads expert counts on the host), so decode CUDA graphs stop at batch %d and "
            "larger batches run eagerly; --quantization fp8 serves it in FP8 block-128 (converted at load, lossy) "
            "with graphs at every batch size", limit, limit)
    previous(server_args)


def register() -> None:
    HookRegistry.register(
        "sglang.srt.models.registry._ModelRegistry.resolve_model_cls",
        _register_ours,
        HookType.BEFORE,
    )
    register_resolution_hook("handle_gpu_memory_settings")(_limit_bf16_decode_graphs)
