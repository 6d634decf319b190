#!/usr/bin/env bash
# Make DeepGEMM (the benchmark peer of kernels/fp8_gemm/) usable on the GPU machine: no network,
# nothing installed. DeepGEMM 03d0be3 is pure Python + headers (.peers/deepgemm, carried from the
# checkout; see its SOURCE.txt); its kernels are JIT-compiled by nvcc at first use. This script
# checks the tree and the tools, then JIT-compiles and checks a few gpt-oss shapes against the
# project's torch reference. Run from anywhere, on the GPU machine:
#
#   bash benchmarks/build_deepgemm_peer.sh            # ~30 s; last line "deepgemm peer OK: ..."
#
# then, in the same shell (or set the same variables in the benchmark's process):
#   export DG_JIT_CACHE_DIR=$PWD/.peers/deepgemm/jit_cache CUDA_HOME=/usr/local/cuda
#   python -c 'import sys; sys.path.insert(0, "benchmarks"); import deepgemm_peer as d; print(d.deepgemm_version())'
#
# Env: DEEPGEMM_PEER_ROOT (default .peers/deepgemm), CUDA_HOME (default /usr/local/cuda),
#      DG_JIT_CACHE_DIR (default <root>/jit_cache), PYTHON (default python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DG="${DEEPGEMM_PEER_ROOT:-$ROOT/.peers/deepgemm}"
export DEEPGEMM_PEER_ROOT="$DG"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export DG_JIT_CACHE_DIR="${DG_JIT_CACHE_DIR:-$DG/jit_cache}"
PY="${PYTHON:-python3}"
die() { echo "build_deepgemm_peer: FAIL: $*" >&2; exit 1; }

[ -f "$DG/deep_gemm/include/deep_gemm/fp8_gemm.cuh" ] || die "no DeepGEMM tree at $DG (carry .peers/deepgemm)"
[ -f "$DG/deep_gemm/include/cute/arch/copy_sm90_tma.hpp" ] || die "CuTe headers missing under $DG/deep_gemm/include"
[ -f "$DG/deep_gemm/include/cutlass/arch/barrier.h" ] || die "CUTLASS headers missing under $DG/deep_gemm/include"
[ -x "$CUDA_HOME/bin/nvcc" ] || die "no nvcc at $CUDA_HOME/bin/nvcc (set CUDA_HOME)"
[ -x "$CUDA_HOME/bin/cuobjdump" ] || die "no cuobjdump at $CUDA_HOME/bin (DeepGEMM's loader runs it)"
mkdir -p "$DG_JIT_CACHE_DIR" || die "cannot create DG_JIT_CACHE_DIR=$DG_JIT_CACHE_DIR"
"$PY" -c 'import cuda.bindings.driver' 2>/dev/null || die "python package cuda-bindings missing (carry its wheel)"
echo "deepgemm peer: $("$CUDA_HOME/bin/nvcc" --version | grep -o 'release [0-9.]*'), cache $DG_JIT_CACHE_DIR"

"$PY" - <<'EOF' || die "smoke test failed (above)"
import sys, time
sys.path.insert(0, "benchmarks")
import torch
import deepgemm_peer as d
import bench_common

print(d.deepgemm_version())
bench_common.import_project()
from sglang_ext.kernels.fp8_gemm import fp8_linear_ref
from sglang_ext.layers import fp8 as fp8_torch

assert torch.cuda.is_available(), "no GPU"
torch.manual_seed(0)
dev = "cuda"
bad = []
# gpt-oss-120b shapes: qkv (N 5120, K 2880), o (N 2880, K 4096); M: decode, ragged, prefill
for m, n, k in [(1, 5120, 2880), (37, 2880, 4096), (1000, 5120, 2880), (4096, 2880, 4096)]:
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev) * 0.05
    w_fp8, w_s = fp8_torch.quantize_weight_block128(w)  # our layout: [N, K] e4m3, fp32 [N/128, K/128]
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    t0 = time.time()
    y = d.deepgemm_linear(x, w_fp8, w_s, bias)
    torch.cuda.synchronize()
    first = time.time() - t0
    ref = fp8_linear_ref(x, w_fp8, w_s, bias).float()
    err = ((y.float() - ref).norm() / ref.norm()).item()
    ok = torch.isfinite(y).all().item() and err < 5e-3
    print(f"  M={m} N={n} K={k}: rel err {err:.2e} vs fp8_linear_ref, first call {first:.1f} s {'ok' if ok else 'BAD'}")
    if not ok:
        bad.append((m, n, k))
assert not bad, f"mismatch at {bad}"
print("deepgemm peer OK: call benchmarks/deepgemm_peer.py deepgemm_linear(x, w_fp8, w_scale_inv, bias)")
EOF
