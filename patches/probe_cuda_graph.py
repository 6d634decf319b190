"""Patch: SingProbe scores from decode CUDA graphs (SGLang 0.5.23).

A captured decode step returns the *capture-time* output object at every replay, so scores
handed over as Python values would repeat the capture's numbers. The probe therefore leaves
a `CapturedProbeScores` (the graph's static score tensor) in the captured output, and this
patch turns it into the replayed batch's rows.

Targets
  - `DecodeCudaGraphRunner.execute` (AFTER): after each replay, `customized_info`'s
    captured scores become `ProbeScoreRows` over a copy of the first `batch_size` rows
    (the copy is queued behind the replay, so the next replay cannot overwrite it before
    SGLang reads it, also under the overlap scheduler).
  - `ServerArgs.from_cli_args` (BEFORE): with `--probe-ckpt`, prefill CUDA graphs are turned
    off (`--disable-prefill-cuda-graph`), logged; asking for a prefill graph backend
    explicitly together with the probe (`--cuda-graph-backend-prefill`, or `prefill` in
    `--cuda-graph-config`) stops the launch with one line. Why: SGLang's prefill graph
    runners capture and replay only the transformer body (`GptOssModel.forward`), swapped in
    without its `probe=` argument, so the probe's taps would not run for a replayed prefill.
  - `PrefillCudaGraphRunner.can_run_graph` (AFTER): the same rule where no launcher flag
    was parsed (the offline Engine with `SGLANG_EXT_PROBE_CKPT`): a model with a probe never
    replays a prefill graph (eager prefill instead, logged once). Decode graphs, where the
    probe's cost matters, stay on.

Without `--probe-ckpt` nothing changes.
"""

from __future__ import annotations

import dataclasses
import json
import logging

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

logger = logging.getLogger(__name__)


class ProbePrefillGraphConflict(SystemExit):
    """One-line launch failure (SystemExit: no traceback)."""


def _prefill_backend_in_json(config) -> str | None:
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return None  # SGLang reports a malformed --cuda-graph-config itself
    prefill = config.get("prefill") if isinstance(config, dict) else None
    return prefill.get("backend") if isinstance(prefill, dict) else None


def _no_prefill_graphs_with_probe(cls, args, *rest, **kwargs):
    if not getattr(args, "probe_ckpt", None):
        return
    for flag, backend in (("--cuda-graph-backend-prefill", getattr(args, "cuda_graph_backend_prefill", None)),
                          ("--cuda-graph-config", _prefill_backend_in_json(getattr(args, "cuda_graph_config", None)))):
        if backend not in (None, "disabled"):
            raise ProbePrefillGraphConflict(
                f"sglang-ext: --probe-ckpt does not run under prefill CUDA graphs ({flag} asks for "
                f"prefill backend {backend!r}); drop it (decode graphs stay on)")
    if hasattr(args, "disable_prefill_cuda_graph") and not args.disable_prefill_cuda_graph:
        args.disable_prefill_cuda_graph = True
        logger.info("sglang-ext: --probe-ckpt turns prefill CUDA graphs off (decode graphs stay on)")


def _no_prefill_replay_with_probe(can_run, runner, *args, **kwargs):
    if not can_run:
        return None
    model = getattr(getattr(runner, "model_runner", None), "model", None)
    if getattr(model, "probe", None) is None:
        return None
    if not getattr(runner, "_sglang_ext_probe_logged", False):
        logger.info("sglang-ext: the probe runs prefill eagerly (prefill CUDA graphs replay the model "
                    "body without its taps); pass disable_prefill_cuda_graph=True to skip their capture")
        runner._sglang_ext_probe_logged = True
    return False


def _scores_of_this_replay(output, runner, forward_batch, *args, **kwargs):
    info = getattr(output, "customized_info", None)
    if not info:
        return output
    from sglang_ext.probe_runtime import materialize_captured_scores  # Triton kernels: scheduler only

    fresh = materialize_captured_scores(info, int(forward_batch.batch_size))
    if fresh is info:
        return output
    return dataclasses.replace(output, customized_info=fresh)


def register() -> None:
    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.from_cli_args", _no_prefill_graphs_with_probe, HookType.BEFORE)
    HookRegistry.register(
        "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.can_run_graph",
        _no_prefill_replay_with_probe, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute",
        _scores_of_this_replay, HookType.AFTER)
