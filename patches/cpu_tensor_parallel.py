"""Patch: tensor / expert parallel SGLang servers on a CPU (SGLang 0.5.23).

On a CPU the model-parallel groups use gloo, but `init_model_parallel_group` still asks for a
PyNccl communicator in every group of two or more ranks. On this project's CPU setup (the stub
`libcuda.so.1` that lets the CUDA-only `sgl_kernel` wheel import, launch/cpu_shims.py) the NCCL
library loads, and the communicator's constructor then enters `torch.cuda.device("cpu")`: every
`--tp 2` server on a CPU died at start with "Expected a cuda device, but got: cpu". Nothing on a
CPU can use NCCL, so its groups are built without it.

Targets
  - `sglang.srt.distributed.parallel_state.init_model_parallel_group` (AROUND): a group on the
    gloo backend, with no CUDA device in this process, gets `use_pynccl=False` where the caller left
    the choice to SGLang (None). Groups on CUDA (nccl) are untouched.
  - `sglang.srt.model_executor.model_runner.adjust_config_with_unaligned_cpu_tp` (AROUND): on a CPU,
    SGLang pads the attention heads of a model whose KV heads the TP size does not divide (gpt-oss's 8
    KV heads, or the tiny model's 2, at TP 4: the config then says twice the heads and the checkpoint
    no longer fits) and rounds the MoE intermediate size up, for its own layers, which pad their weights
    as they load. Our gpt-oss shards the real shapes itself (KV heads replicated over attention-TP ranks
    when fewer, as on a GPU; experts on the 128-block grid), so its config is left as the checkpoint's.

Why it matters: our sharded gpt-oss (heads, experts and each expert's intermediate dimension on the
128-block grid, sglang_ext/layers/parallel.py) and the probe under TP can then run inside real
multi-rank SGLang servers on this CPU, not only rank by rank in one process
(tests/served/test_served_parallel.py).
"""

from __future__ import annotations

import torch

from sglang.srt.plugins.hook_registry import HookRegistry, HookType


def _no_nccl_on_cpu(original, group_ranks, local_rank, backend, *args, **kwargs):
    if backend == "gloo" and not torch.cuda.is_available():
        if args:  # use_pynccl passed positionally
            if args[0] is None:
                args = (False, *args[1:])
        elif kwargs.get("use_pynccl") is None:
            kwargs["use_pynccl"] = False
    return original(group_ranks, local_rank, backend, *args, **kwargs)


def _keep_gpt_oss_config(original, model_config, *args, **kwargs):
    if "GptOssForCausalLM" in (getattr(model_config.hf_config, "architectures", None) or []):
        return model_config
    return original(model_config, *args, **kwargs)


def register() -> None:
    HookRegistry.register("sglang.srt.distributed.parallel_state.init_model_parallel_group", _no_nccl_on_cpu,
                          HookType.AROUND)
    HookRegistry.register("sglang.srt.model_executor.model_runner.adjust_config_with_unaligned_cpu_tp",
                          _keep_gpt_oss_config, HookType.AROUND)
