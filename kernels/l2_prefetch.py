"""L2 prefetch of a later kernel's weights from an earlier kernel of the decode chain.

Why: at batch 1-4 a decode step is a chain of short kernels, and the HBM sits idle through many
of them (the norms, the MoE front, the attention at batch 1, which reads its 16.8 MB of KV at
~35 % of copy bandwidth), while the FP8 GEMVs after them read their weights cold (qkv 14.7 MB in
~6 us, o 11.8 MB in ~4.4 us on the 120b critical path, benchmarks/results/diag_rope_serving_width.md).
A kernel that runs during such an idle stretch can ask the L2 to fetch the next GEMV's weight
bytes then: `prefetch.global.L2` lines, issued before the kernel's PDL wait (weights are never
written by the step, kernels/pdl.py rule 1), which neither block the issuing thread nor change
any value, so the GEMV reads the same bytes from L2 instead of HBM.

`PrefetchL2(tensor)` names the bytes; a launcher that takes `l2_prefetch=` passes
`prefetch_args(...)` and its kernel calls `l2_prefetch_share` once per program: program `part` of
`parts` prefetches lines part, part + parts, ... (one line per thread per round). The eviction
priority is `evict_last` by default, so the lines outlive the MoE's ~100 MB of streamed experts
between the prefetch and the read; `set_l2_prefetch_policy("normal")` for comparison.

Inline PTX, which the interpreter cannot run: under TRITON_INTERPRET (and off CUDA) the kernels
compile without it (PF_ON is a constexpr), and a prefetch never changes a result, so the CPU tests
of every kernel that takes one cover it with the prefetch off; the GPU tests compare bits on and off.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

LINE = 128  # bytes an L2 prefetch covers

_override: Optional[bool] = None  # set_l2_prefetch(): benchmarks compare both in one process
_policy = "evict_last"


def set_l2_prefetch(enabled: Optional[bool]) -> None:
    """Force the prefetch on or off for captures from now on (None: back to the environment's choice)."""
    global _override
    _override = enabled


def set_l2_prefetch_policy(policy: str) -> None:
    """"evict_last" (default) or "normal": the L2 eviction priority of prefetched lines."""
    global _policy
    if policy not in ("evict_last", "normal"):
        raise ValueError(f"set_l2_prefetch_policy: 'evict_last' or 'normal', got {policy!r}")
    _policy = policy


def l2_prefetch_enabled(device: torch.device) -> bool:
    """Whether callers should hand their kernels the next weights to prefetch (SGLANG_EXT_L2_PREFETCH, default
    off until measured on; never under the interpreter or off CUDA)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if _override is not None:
        return _override
    return os.environ.get("SGLANG_EXT_L2_PREFETCH", "0") == "1"


class PrefetchL2(NamedTuple):
    """The bytes of `tensor` (contiguous) to pull into L2."""

    tensor: torch.Tensor


def prefetch_args(prefetch: Optional[PrefetchL2], device: torch.device) -> dict:
    """The launch keywords of a kernel that calls `l2_prefetch_share(PF, pf_lines, ..., PF_ON, PF_EVICT_LAST)`."""
    if prefetch is None or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return {}
    t = prefetch.tensor
    if not t.is_contiguous() or t.device != device:
        raise ValueError(f"l2 prefetch: a contiguous tensor on {device} is needed, got {tuple(t.shape)} on {t.device}")
    lines = triton.cdiv(t.numel() * t.element_size(), LINE)
    return {"PF": t.view(-1).view(torch.uint8), "pf_lines": lines, "PF_ON": True,
            "PF_EVICT_LAST": _policy == "evict_last"}


@triton.jit
def l2_prefetch_share(PF, pf_lines, part, parts, LANES: tl.constexpr, PF_ON: tl.constexpr,
                      PF_EVICT_LAST: tl.constexpr):
    """Program `part` of `parts` prefetches lines part * LANES + i + k * parts * LANES of PF's pf_lines 128-byte
    lines (LANES: the program's threads, one line each per round; past the end, the last line again)."""
    if PF_ON:
        lane = tl.arange(0, LANES)
        for start in range(part * LANES, pf_lines, parts * LANES):
            line = tl.minimum(start + lane, pf_lines - 1).to(tl.int64)
            ptr = PF + line * 128
            if PF_EVICT_LAST:
                tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr],
                                          dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr],
                                          dtype=tl.int32, is_pure=False, pack=1)
