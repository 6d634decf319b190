"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's chain of kernels.

At batch 1 a gpt-oss decode step is ~390 kernels in a row, most of them a few microseconds long,
and each one's ramp (launch, first loads in flight) follows its predecessor's tail: the fixed
~3.6 us a call of the FP8 GEMV (benchmarks/results/diag_decode_b1.md) is mostly that. A kernel
launched with `launch_pdl=True` may start while its predecessor still runs, once every program of
the predecessor has executed `griddepcontrol.launch_dependents`; its `griddepcontrol.wait` then
blocks until the predecessor has finished and its writes are visible.

The rule every kernel here keeps (the correctness argument rests on it):
  1. before `pdl_wait_then_release` a kernel only LOADS, and only what no kernel of the step
     writes (weights, scales, biases) or what a kernel at least two launches back wrote (see 3);
  2. it releases its dependents only AFTER its own wait (`pdl_wait_then_release` does both);
  3. so when kernel n+1 starts, kernel n has passed its wait, i.e. kernel n-1 has completed:
     everything two or more launches back is complete and visible. The MoE's mlp2 uses this to
     read the routing's expert ids (written by the routing kernel, two launches back) before its
     wait, and then its experts' weight slab.
All stores follow the wait, so no kernel writes while its predecessor may still read.

`gdc_*` are inline PTX, which the interpreter cannot run: under TRITON_INTERPRET, or on a GPU
older than sm90, or with SGLANG_EXT_PDL=0, `pdl_enabled` is False and the kernels compile without
them (USE_PDL is a constexpr).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: USE_PDL stays False
    gdc_launch_dependents = gdc_wait = None

_override: bool | None = None  # set_pdl(): benchmarks compare both in one process


def set_pdl(enabled: bool | None) -> None:
    """Force PDL on or off for launches from now on (None: back to the environment's choice).
    CUDA graphs keep what they captured."""
    global _override
    _override = enabled


def pdl_enabled(device: torch.device) -> bool:
    if device.type != "cuda" or gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    if _override is not None:
        return _override
    return os.environ.get("SGLANG_EXT_PDL", "1") != "0"


# Up to this many token rows a launch is a programmatic dependent: the one-shot decode kernels'
# range, where the step is a chain of short kernels. H200, paired graphs: batch 1 120b 2773 ->
# 2600 us, batch 4 -1.4 % (benchmarks/results/diag_pdl.md); at batch 8, where the GEMVs and the
# MoE are split-K and grouped kernels without PDL, the few PDL launches left cost +0.2 %
# (results/history/diag_pdl_session6_every_row_count.md), -0.06 % (noise) with this limit.
PDL_MAX_ROWS = 4


def pdl_launch_kwargs(device: torch.device, rows: int) -> dict:
    """The launch keywords of a kernel that calls `pdl_wait_then_release(USE_PDL)`, for a launch
    over `rows` token rows (requests at decode)."""
    use = rows <= PDL_MAX_ROWS and pdl_enabled(device)
    return {"USE_PDL": use, "launch_pdl": use}


@triton.jit
def pdl_wait_then_release(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
