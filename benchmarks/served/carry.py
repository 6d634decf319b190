"""The carry that lets the GPU test machine run the real `python -m sglang.launch_server` with this plugin.

That machine (see the README's GPU section) has Python 3.12, torch 2.11, Triton 3.6 and no SGLang, reaches no
registry, and takes 64 MiB of files a call. This script, run here where PyPI is reachable, builds `.carry/`
(git-ignored; `run(carry=[".carry"])` takes it along):

  .carry/site.tar.gz      cp312 wheels unpacked into one site folder: SGLang 0.5.23 without its Rust
                          extensions and multimodal_gen (not imported by the launch path: 39 -> ~16 MB),
                          the packages SGLang needs that the image lacks (WHEELS), the `sgl_kernel` stand-in
                          (benchmarks/served/sgl_kernel_stub: imports succeed, each call raises naming itself
                          and is logged), and stand-ins for two modules SGLang imports but never uses there
  .carry/vocab/           o200k_base.tiktoken (openai-harmony's vocabulary; nothing can be downloaded there)
  .carry/manifest.json    what went in, with versions and sizes

On the GPU machine `benchmarks/served/gpu_env.py` unpacks it and links this checkout in as the installed
`sglang-ext` (its plugin entry point included). None of this is part of what users install: they get the real
`sglang` and `sglang-kernel` from PyPI.

    .venv/bin/python benchmarks/served/carry.py [--out .carry]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 55 * 2**20  # the call's 64 MiB carry less room for the working tree
SGLANG = ("sglang", "0.5.23")
# The distributions SGLang's launch path and its benchmark tools import that the GPU image lacks. Their versions
# are this checkout's venv's (what `pip install sglang==0.5.23` resolved), so both machines run the same code.
WHEELS = (
    "orjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "fastapi", "starlette",
    "annotated-doc", "uvicorn", "python-multipart", "opentelemetry-api", "pyzmq", "msgspec", "pybase64",
    "setproctitle", "openai", "jiter", "distro", "sniffio", "openai-harmony", "partial-json-parser",
    "interegular", "xgrammar", "apache-tvm-ffi", "compressed-tensors", "loguru", "gguf", "dill", "jsonschema",
    "jsonschema-specifications", "referencing", "rpds-py", "anthropic", "docstring-parser",
    "ninja",  # the build tool of SGLang's JIT kernels (tvm-ffi), which the upstream peer compiles on first use
)
# Paths of the SGLang wheel the launch path never imports (Rust HTTP/gRPC servers, the diffusion runtime).
SGLANG_DROP = ("sglang/srt/rust_extensions/", "sglang/multimodal_gen/")
PLATFORMS = ("manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
             "any")
# Imported at module level by SGLang modules on the server's path, never called for a text model there.
_RAISES = ('\n\ndef __getattr__(name):\n    if name.startswith("__"):\n        raise AttributeError(name)\n\n'
           '    def stub(*args, **kwargs):\n        raise RuntimeError(f"{__name__}.{name} is a stand-in on this machine")\n\n'
           '    return stub\n')
UNUSED_MODULES = {
    "soundfile/__init__.py": '"""Stand-in: SGLang imports soundfile for audio inputs, which gpt-oss never takes."""' + _RAISES,
    "IPython/__init__.py": '"""Stand-in: sglang.utils imports IPython for notebook helpers, unused by a server."""' + _RAISES,
    "IPython/display.py": '"""Stand-in for IPython.display (HTML, display)."""' + _RAISES,
    "datasets/__init__.py": '"""Stand-in: sglang.benchmark.datasets imports load_dataset for MMMU, which the random dataset never uses."""' + _RAISES,
}
STUB_SRC = Path(__file__).resolve().parent / "sgl_kernel_stub" / "sgl_kernel"
# sglang-kernel's triton_kernels is written for Triton 3.8; the GPU machine has Triton 3.6. Two edits of the copy
# (file, text, replacement; each text must occur once) make it import and compile there: 3.6's target_info lacks
# is_hip_gfx1250 (defined here as 3.8 does: an AMD arch, never true on CUDA), and 3.6's JITFunction lacks
# def_file_line_number / def_file_col_number, which specialize.py copies onto the matmul kernels it specializes
# (source locations for tracebacks only). Both are no-ops under Triton 3.8. With them SGLang 0.5.23's MXFP4 MoE
# kernels (topk, ragged metadata, _matmul with and without the swiglu epilogue) compile for sm_90 under 3.6.
TRITON36_EDITS = (
    ("target_info.py", "    is_hip_gfx1250,\n)\n",
     ")\ntry:\n    from triton.language.target_info import is_hip_gfx1250\nexcept ImportError:  # Triton < 3.7\n\n"
     "    @triton.constexpr_function\n    def is_hip_gfx1250():\n        target = tl.target_info.current_target()\n"
     "        return target is not None and target.arch == \"gfx1250\"\n"),
    ("specialize.py",
     "    ret.def_file_line_number = adjust_line_number(fn.def_file_line_number)\n"
     "    ret.def_file_col_number = fn.def_file_col_number\n",
     "    if hasattr(fn, \"def_file_line_number\"):  # Triton >= 3.7\n"
     "        ret.def_file_line_number = adjust_line_number(fn.def_file_line_number)\n"
     "        ret.def_file_col_number = fn.def_file_col_number\n"),
)


def copy_triton_kernels(dest: Path) -> None:
    """This venv's triton_kernels (from the pinned sglang-kernel wheel) into dest, with TRITON36_EDITS applied."""
    import triton_kernels

    shutil.copytree(Path(triton_kernels.__file__).parent, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for name, text, replacement in TRITON36_EDITS:
        src = (dest / name).read_text()
        if src.count(text) != 1:
            raise SystemExit(f"carry: triton_kernels/{name} changed; re-check TRITON36_EDITS against Triton 3.6")
        (dest / name).write_text(src.replace(text, replacement))


def pinned_version(dist: str) -> str:
    from importlib import metadata

    return metadata.version(dist)


def download(specs: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + specs, check=True)


def unpack_wheel(wheel: Path, site: Path, drop: tuple[str, ...] = ()) -> int:
    """Unpack one wheel as pip would for a plain install: purelib/platlib into `site`, scripts (executables such
    as ninja) into `site/bin` (gpu_env puts it on PATH), headers dropped; returns the bytes written."""
    written = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if info.is_dir() or any(name.startswith(d) for d in drop):
                continue
            parts = name.split("/")
            if len(parts) > 2 and parts[0].endswith(".data") and parts[1] in ("purelib", "platlib"):
                name = "/".join(parts[2:])
            elif len(parts) > 2 and parts[0].endswith(".data") and parts[1] == "scripts":
                name = "/".join(["bin", *parts[2:]])
            elif parts[0].endswith(".data"):
                continue  # headers, data: nothing the server needs
            target = site / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            if (info.external_attr >> 16) & 0o111:
                target.chmod(0o755)
            written += info.file_size
    return written


def build(out: Path, cache: Path) -> dict:
    from sglang_ext.launch.tokenizer import O200K_FILE, ensure_o200k_vocab

    cache.mkdir(parents=True, exist_ok=True)
    specs = [f"{SGLANG[0]}=={SGLANG[1]}"] + [f"{d}=={pinned_version(d)}" for d in WHEELS]
    download(specs, cache)
    wheels = {}
    for spec in specs:
        dist, version = spec.split("==")
        norm = dist.replace("-", "_").lower()
        found = [w for w in cache.glob("*.whl") if w.name.lower().startswith(f"{norm}-{version}-")]
        if len(found) != 1:
            raise SystemExit(f"carry: expected one wheel of {spec} in {cache}, found {[w.name for w in found]}")
        wheels[spec] = found[0]
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"wheels": {}, "stubs": ["sgl_kernel", *sorted({m.split("/")[0] for m in UNUSED_MODULES})]}
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        for spec, wheel in wheels.items():
            drop = SGLANG_DROP if spec.startswith("sglang==") else ()
            manifest["wheels"][spec] = {"wheel": wheel.name, "unpacked_bytes": unpack_wheel(wheel, site, drop)}
        shutil.copytree(STUB_SRC, site / "sgl_kernel", ignore=shutil.ignore_patterns("__pycache__"))
        # The upstream peer's MXFP4 MoE: OpenAI's triton_kernels, pure Python + Triton, shipped inside the
        # sglang-kernel wheel (which cannot travel); copied from this venv's install of that pinned wheel and
        # edited for the machine's Triton 3.6 (TRITON36_EDITS).
        copy_triton_kernels(site / "triton_kernels")
        manifest["copied"] = {"triton_kernels": f"from sglang-kernel {pinned_version('sglang-kernel')}, "
                                                f"edited for Triton 3.6: {[e[0] for e in TRITON36_EDITS]}"}
        for name, text in UNUSED_MODULES.items():
            (site / name).parent.mkdir(parents=True, exist_ok=True)
            (site / name).write_text(text)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=9) as tar:
            tar.add(site, arcname="site")
        (out / "site.tar.gz").write_bytes(buf.getvalue())
    vocab = out / "vocab"
    vocab.mkdir(exist_ok=True)
    shutil.copy(Path(ensure_o200k_vocab()) / O200K_FILE, vocab / O200K_FILE)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    manifest.update(site_tar_bytes=(out / "site.tar.gz").stat().st_size, total_bytes=total,
                    sglang=SGLANG[1], dropped=list(SGLANG_DROP))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if total > LIMIT_BYTES:
        raise SystemExit(f"carry: {total / 2**20:.1f} MiB is over the {LIMIT_BYTES / 2**20:.0f} MiB budget")
    return manifest


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".carry")
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "carry-wheels")
    args = ap.parse_args(argv)
    m = build(args.out, args.cache)
    print(f"carry: {args.out} {m['total_bytes'] / 2**20:.1f} MiB ({len(m['wheels'])} wheels, "
          f"site.tar.gz {m['site_tar_bytes'] / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
