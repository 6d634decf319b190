#!/usr/bin/env bash
# Fetch DeepGEMM, the FP8 GEMM peer of benchmarks/deepgemm_peer.py, into .peers/deepgemm (ignored), for a GPU
# machine without network: then carry .peers/deepgemm there and run benchmarks/build_deepgemm_peer.sh.
#
#   bash benchmarks/fetch_deepgemm_peer.sh      # needs git and network to github.com
#
# What it holds: deepseek-ai/DeepGEMM at 03d0be3 (2025-07-02), the last release before DeepGEMM became a C++
# torch extension (its kernels are JIT-compiled by nvcc at run time and launched through cuda-bindings, so
# nothing is built against the local torch), with the CUTLASS headers of its submodule pin (NVIDIA/cutlass
# eefa171, v3.8.0-1) placed where DeepGEMM's setup.py would put them (deep_gemm/include/{cute,cutlass}).
# ~25 MiB. The same tree can be built with the library's fetch tool (where only package registries are
# reachable); SOURCE.txt in the folder records the commits.
set -euo pipefail

DEEPGEMM_COMMIT=03d0be3d2d03b6eed3c99d683c0620949a13a826
CUTLASS_COMMIT=eefa171318b79cbe2e78514d4cce5cd0fe919d0c
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.peers/deepgemm"
cd "$ROOT"

source "$ROOT/benchmarks/ignore_peers.sh"
ignore_peers_folder "$ROOT"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
fetch() {  # fetch URL COMMIT DIR: one commit, no history
  git init -q "$3"
  git -C "$3" fetch -q --depth 1 "$1" "$2"
  git -C "$3" checkout -q FETCH_HEAD
}
fetch https://github.com/deepseek-ai/DeepGEMM.git "$DEEPGEMM_COMMIT" "$WORK/dg"
fetch https://github.com/NVIDIA/cutlass.git "$CUTLASS_COMMIT" "$WORK/cutlass"

rm -rf "$DEST"
mkdir -p "$DEST"
cp -r "$WORK/dg/deep_gemm" "$WORK/dg/tests" "$WORK/dg/LICENSE" "$WORK/dg/README.md" "$DEST/"
cp -r "$WORK/cutlass/include/cute" "$WORK/cutlass/include/cutlass" "$DEST/deep_gemm/include/"
cp "$WORK/cutlass/LICENSE.txt" "$DEST/deep_gemm/include/CUTLASS_LICENSE.txt"
cat > "$DEST/SOURCE.txt" <<EOF
DeepGEMM benchmark peer (not part of the project; ignored via .git/info/exclude), made by
benchmarks/fetch_deepgemm_peer.sh.

repo:    https://github.com/deepseek-ai/DeepGEMM
commit:  $DEEPGEMM_COMMIT  (2025-07-02, the last pure-Python JIT release)
kept:    LICENSE, README.md, deep_gemm/, tests/

third-party headers, as setup.py's build_py would place them (deep_gemm/include/cute, deep_gemm/include/cutlass):
  repo:    https://github.com/NVIDIA/cutlass
  commit:  $CUTLASS_COMMIT  (v3.8.0-1, DeepGEMM's third-party/cutlass pin)
  licence: deep_gemm/include/CUTLASS_LICENSE.txt
EOF
echo "fetched DeepGEMM ${DEEPGEMM_COMMIT:0:7} + CUTLASS ${CUTLASS_COMMIT:0:7} into $DEST ($(du -sh "$DEST" | cut -f1))"
