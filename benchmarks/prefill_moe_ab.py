"""bench_prefill with the MoE table's prefill row (T > 128) replaced by a named candidate of
diag_moe_prefill.CANDIDATES: an A/B of one launch configuration on the whole model step, every
other kernel unchanged. Why: the MoE layer alone (diag_moe_prefill, uniform random routing) and
the model step (the routing of its random weights, tensor-parallel shards) can disagree.

    python benchmarks/prefill_moe_ab.py before --models 120b --configs 1:1:1,4:1:1 --lengths 1024,4096 \
        --iters 10 --out /tmp/ab_before --stem bench_prefill_ab_before
    # --dense-gluon: the dense layers' FP8 GEMM tiles of M > 256 on the Gluon kernel as well (kernels/fp8_gluon.py)
    python benchmarks/prefill_moe_ab.py gluon --dense-gluon --models 120b --configs 1:1:1 --lengths 8192 --iters 10
"""

from __future__ import annotations

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import diag_moe_prefill as diag  # noqa: E402
from sglang_ext.kernels import moe as moe_kernels  # noqa: E402


def main():
    row, rest = sys.argv[1], sys.argv[2:]
    if "--dense-gluon" in rest:  # the dense layers' prefill tiles on Gluon too (fp8_gemm.GLUON_PREFILL_TILES)
        from sglang_ext.kernels import fp8_gemm

        rest.remove("--dense-gluon")
        fp8_gemm.GLUON_PREFILL_TILES = True
        print("dense prefill tiles: Gluon", flush=True)
    config = diag.use_prefill_row(row)
    for tokens in (129, 8192):
        assert moe_kernels.select_config(tokens) is config
    print(f"MoE prefill row: {row} = {config.short()}", flush=True)
    sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_prefill.py")] + rest
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
