#!/usr/bin/env bash
# Fetch SGLang 0.5.23's own Triton kernels as benchmark peers for a GPU machine without SGLang.
#
# Run here (network to PyPI): downloads the cp312 wheel of sglang==0.5.23 (no dependencies) into
# .peers/ and extracts ONLY the Python files that the peer kernels import and really run into
# .peers/sglang_src/ (plus SGLang's tuned-config JSONs for NVIDIA H200 and the licence). Everything
# else those modules import at load time (sglang.srt.utils, runtime_context, sgl_kernel, JIT CUDA
# ops, ...) is stubbed by benchmarks/sglang_peers.py, never carried.
#
#   bash benchmarks/fetch_sglang_peers.sh          # then: carry .peers/sglang_src to the device
#
# .peers/ is ignored through .git/info/exclude (added here, idempotent).
set -euo pipefail

VERSION="0.5.23"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PEERS="$ROOT/.peers"
SRC="$PEERS/sglang_src"
cd "$ROOT"

# --- ignore .peers/ locally -------------------------------------------------------------------
source "$ROOT/benchmarks/ignore_peers.sh"
ignore_peers_folder "$ROOT"

# --- download the wheel -----------------------------------------------------------------------
if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="${PYTHON:-python3}"; fi
mkdir -p "$PEERS"
WHEEL="$(ls "$PEERS"/sglang-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$WHEEL" ]; then
  "$PY" -m pip download "sglang==$VERSION" --no-deps --python-version 3.12 --only-binary=:all: \
      -d "$PEERS" --disable-pip-version-check --quiet \
    || "$PY" -m pip download "sglang==$VERSION" --no-deps --only-binary=:all: \
      --platform any --python-version 3 --implementation py -d "$PEERS" --disable-pip-version-check --quiet
  WHEEL="$(ls "$PEERS"/sglang-"$VERSION"-*.whl | head -n1)"
fi
echo "wheel: $WHEEL"

# --- extract the few files the peers need ------------------------------------------------------
"$PY" - "$WHEEL" "$SRC" "$VERSION" <<'EOF'
import fnmatch
import hashlib
import os
import shutil
import sys
import zipfile

wheel, dest, version = sys.argv[1:4]

# The kernel modules and the modules they import that must really run (import chains traced by
# hand against 0.5.23; everything else is stubbed in benchmarks/sglang_peers.py).
FILES = [
    # paged attention with sinks: decode (split-KV, 2 stages) and extend (prefix + new tokens)
    "sglang/kernels/ops/attention/decode_attention.py",
    "sglang/kernels/ops/attention/extend_attention.py",
    "sglang/kernels/ops/attention/score_mod.py",      # unpack_aux_tensors (imported by both)
    "sglang/kernels/ops/attention/metadata.py",       # get_num_kv_splits_triton (triton_backend's splits)
    # FP8 block GEMM and SGLang's Triton per-token-group quantisation
    "sglang/kernels/ops/gemm/fp8_kernel.py",
    "sglang/kernels/ops/quantization/fp8_kernel.py",
    "sglang/kernels/ops/quantization/fp8_utils.py",   # fp8_dtype_to_triton
    "sglang/kernels/ops/quantization/int8_kernel.py", # imported by fused_moe_triton_kernels
    # Triton fused MoE (runner: triton)
    "sglang/kernels/ops/moe/fused_moe_triton_kernels.py",
    "sglang/kernels/ops/moe/moe_align_small_numel.py",
    "sglang/srt/layers/moe/moe_runner/triton_utils/__init__.py",
    "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe.py",
    "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py",
    "sglang/srt/layers/moe/moe_runner/triton_utils/moe_align_block_size.py",
    # SGLang's environment-variable registry (stdlib only): real defaults, not re-typed ones
    "sglang/srt/environ.py",
]
# Tuned launch configs the kernels look up by device name at run time (H200 only: small).
GLOBS = [
    "sglang/kernels/ops/gemm/configs/*device_name=NVIDIA_H200*",
    "sglang/srt/layers/moe/moe_runner/triton_utils/configs/triton_*/*device_name=NVIDIA_H200*",
]
# fused_moe_triton_config lists configs/triton_* to find a fallback version: keep every dir.
DIRS_GLOB = "sglang/srt/layers/moe/moe_runner/triton_utils/configs/triton_*/"

if os.path.isdir(dest):
    shutil.rmtree(dest)
os.makedirs(dest)
with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    missing = [f for f in FILES if f not in names]
    if missing:
        sys.exit(f"not in {os.path.basename(wheel)}: {missing}")
    chosen = list(FILES)
    for pattern in GLOBS:
        chosen += [n for n in names if fnmatch.fnmatch(n, pattern)]
    chosen += [n for n in names if n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")]
    dirs = sorted({n.rsplit("/", 2)[0] + "/" + n.rsplit("/", 2)[1] for n in names
                   if fnmatch.fnmatch(n, DIRS_GLOB + "*")})
    for d in dirs:
        os.makedirs(os.path.join(dest, d), exist_ok=True)
    total = 0
    for name in sorted(set(chosen)):
        out = os.path.join(dest, name if not name.endswith("LICENSE") else "LICENSE")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        data = z.read(name)
        with open(out, "wb") as f:
            f.write(data)
        total += len(data)

sha = hashlib.sha256(open(wheel, "rb").read()).hexdigest()
with open(os.path.join(dest, "SOURCE.txt"), "w") as f:
    f.write(f"sglang=={version}\nwheel={os.path.basename(wheel)}\nsha256={sha}\n"
            f"files={len(set(chosen))} bytes={total}\n"
            "Extracted by benchmarks/fetch_sglang_peers.sh; loaded by benchmarks/sglang_peers.py.\n")
print(f"extracted {len(set(chosen))} files, {total / 1e6:.2f} MB -> {dest}")
EOF
du -sh "$SRC"
