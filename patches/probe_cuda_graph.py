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
    explicitly together with the probe stops the launch with one line. Why: SGLang's
    default "breakable" prefill graphs capture the transformer body (the probe's taps
    included) for one request slot and replay it with live metadata; the probe's prefill
    rows were never checked under it, and the model refuses to be captured in extend mode
    with the probe rather than return wrong scores. Decode graphs, where the probe's cost
    matters, stay on.

Without `--probe-ckpt` nothing changes.
"""

from __future__ import annotations

import logging

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

logger = logging.getLogger(__name__)


class ProbePrefillGraphConflict(SystemExit):
    """One-line launch failure (SystemExit: no traceback)."""


def _no_prefill_graphs_with_probe(cls, args, *rest, **kwargs):
    if not getattr(args, "probe_ckpt", None):
        return
    backend = getattr(args, "cuda_graph_backend_prefill", None)
    if backend not in (None, "disabled"):
        raise ProbePrefillGraphConflict(
            f"sglang-ext: --probe-ckpt does not run under prefill CUDA graphs "
            f"(--cuda-graph-backend-prefill {backend}); drop that flag (decode graphs stay on)")
    if hasattr(args, "disable_prefill_cuda_graph") and not args.disable_prefill_cuda_graph:
        args.disable_prefill_cuda_graph = True
        logger.info("sglang-ext: --probe-ckpt turns prefill CUDA graphs off (decode graphs stay on)")


def _scores_of_this_replay(output, runner, forward_batch, *args, **kwargs):
    info = getattr(output, "customized_info", None)
    if not info:
        return output
    from sglang_ext.probe_runtime import materialize_captured_scores

    fresh = materialize_captured_scores(info, int(forward_batch.batch_size))
    if fresh is info:
        return output
    import dataclasses

    return dataclasses.replace(output, customized_info=fresh)


def register() -> None:
    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.from_cli_args", _no_prefill_graphs_with_probe, HookType.BEFORE)
    HookRegistry.register(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute",
        _scores_of_this_replay, HookType.AFTER)
