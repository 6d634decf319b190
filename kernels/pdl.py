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
older than sm90 (or after `set_pdl(False)`), `pdl_enabled` is False and the kernels compile without
them (USE_PDL is a constexpr).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import interpreted

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: USE_PDL stays False
    gdc_launch_dependents = gdc_wait = None

_override: bool | None = None  # set_pdl(): benchmarks compare both in one process


def set_pdl(enabled: bool | None) -> None:
    """Force PDL on or off for launches from now on (None: back to the default, on where the GPU has it).
    CUDA graphs keep what they captured."""
    global _override
    _override = enabled


def pdl_enabled(device: torch.device) -> bool:
    if device.type != "cuda" or gdc_wait is None or interpreted():
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    return _override is not False


# Up to this many token rows a launch is a programmatic dependent: every kernel of the 1..16-row decode chain
# waits at its top (before it, nothing but a request's length and row), so the chain runs as dependents, but
# for the families PDL_PLAIN_FROM_ROWS names. H200, paired graphs, batch 1 120b 2773 -> 2600 us
# (benchmarks/results/diag_pdl.md).
PDL_MAX_ROWS = 16


# Kernel families (a launcher's `family`) launched plainly in the PDL range, from this many rows: their
# programs still wait and release (a wait in a kernel that was not launched as a dependent returns at once),
# so their successors start early, but they themselves start only once their predecessor has finished. Why:
# a dependent's programs are placed on the SMs while its predecessor's still hold some of them, and a heavy
# kernel placed unevenly runs longer, its successors too (20b batch 16 with the GEMVs as dependents: the
# full-layer attention after qkv 87.7 -> 101.9 us a call). H200, paired graphs, diff against the plain step
# (benchmarks/results/diag_pdl_families.md), us, 20b / 120b:
#   every kernel a dependent        batch 4 -106.8 / -162.9, batch 8 -43.3 / +142.0, batch 16 +136.5 / +182.7
#   moe plain                       batch 8  -75.0 / -93.4,  batch 16 +153.9 / +231.8
#   moe and both GEMV kernels plain batch 8  -56.2 / -74.7,  batch 16  -68.5 / -100.3
#   both GEMV kernels, attention, moe, moe_combine plain (at batch 4 near a step whose GEMVs and
#   split-loop attention had no wait or release): batch 4 -78.2 / -124.5, batch 8 -24.4 / +1.2, 16 -33.2 / -68.4
# (that run's "gemv" family held the x_once kernel too; "gemv_xonce" is its own family since)
# so the MoE's mlp1 / mlp2 (GEMV and TMA rows) always, and the dense GEMV's K-loop kernel ("gemv": qkv at 5..16
# rows, o at 9..16); its x_once kernel ("gemv_xonce": o at 5..8 rows, both at 2..4) stays a dependent. At 8 rows
# (diag_pdl_families_b8.md): moe plain -82.9 / -107.9, + the K-loop GEMV -99.4 / -127.6, + x_once too -70.2 /
# -101.1. With the GEMVs plain from 9 rows only (qkv a dependent at 2..8) against the plain step
# (diag_pdl_session19.md): batch 2 / 4 / 8 / 16 -98.9 / -105.5 / -81.1 / -68.1 us on 20b, -155.5 / -162.0 /
# -96.9 / -107.8 on 120b, bits equal (2 and 4 run no K-loop GEMV: the same as this table); batch 3, 5..7 and
# 9..15 not measured.
# The probe's decode step ("probe": its q|k|v GEMV, attention and tail, on a side stream beside the LM head)
# launches plainly too. As a chain of dependents its attention and tail run inside the head's span instead
# of waiting ~180 us for SM slots, but the step got slower, not faster (H200, 200 paired rounds against the
# probe-off step, benchmarks/results/diag_probe_variants2.md, us, plain -> chain): 20b batch 1 / 8
# +2.5 -> +6.1 / +5.6 -> +13.6, 120b +3.4 -> +4.2 / +13.8 -> +18.6.
PDL_PLAIN_FROM_ROWS: dict = {"moe": 1, "gemv": 1, "probe": 1}
_plain_override: dict | None = None


def set_pdl_plain(families) -> None:
    """Launch these kernel families plainly at every row count from now on (None: back to
    PDL_PLAIN_FROM_ROWS), to compare sets in one process. CUDA graphs keep what they captured."""
    global _plain_override
    _plain_override = None if families is None else {f: 1 for f in families}


def pdl_launch_kwargs(device: torch.device, rows: int, family: str = "") -> dict:
    """The launch keywords of a kernel that calls `pdl_wait_then_release(USE_PDL)`, for a launch
    over `rows` token rows (requests at decode); `family` names the kernel for PDL_PLAIN_FROM_ROWS."""
    use = rows <= PDL_MAX_ROWS and pdl_enabled(device)
    plain_from = (PDL_PLAIN_FROM_ROWS if _plain_override is None else _plain_override).get(family)
    return {"USE_PDL": use, "launch_pdl": use and (plain_from is None or rows < plain_from)}


@triton.jit
def pdl_wait_then_release(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
