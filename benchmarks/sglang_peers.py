"""SGLang 0.5.23's own Triton kernels as benchmark peers, on a machine without SGLang.

`benchmarks/fetch_sglang_peers.sh` extracts the kernel modules (and the few modules they import
that really run) from the sglang==0.5.23 wheel into `.peers/sglang_src/`. `load_sglang_kernels`
puts that folder on `sys.path`, installs stub modules for everything else the kernel modules
import at load time, imports them, and returns name -> callable (or name -> reason string when a
group can't be loaded). The stubs are import-time plumbing only (platform probes copied from
`sglang.srt.utils.common`, config defaults, no-op decorators/contexts, and placeholders that
raise `PeerUnavailable` for CUDA-only non-Triton ops that are not carried); none does maths.

Kernels (SGLang's own functions, signatures as in 0.5.23):
  decode_attention_fwd        sglang.kernels.ops.attention.decode_attention
  extend_attention_fwd        sglang.kernels.ops.attention.extend_attention
  get_num_kv_splits_triton    sglang.kernels.ops.attention.metadata (triton_backend's split count)
  w8a8_block_fp8_matmul_triton sglang.kernels.ops.gemm.fp8_kernel
  per_token_group_quant_fp8_triton sglang.kernels.ops.quantization.fp8_kernel._per_token_group_quant_8bit_raw
  fused_experts / fused_moe_kernel_sequence   sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe

Adapters (`make_*`: setup on the plain tensors our benchmarks use, returning a zero-argument
callable that launches only what SGLang launches per layer call; `.api` says what it runs):
  make_paged_decode, make_paged_extend   paged sink attention, as triton_backend.py calls them
  make_fp8_gemm, make_fp8_linear         block-128 FP8 GEMM (+ SGLang's Triton quant) + bias
  make_fused_experts                     gpt-oss FP8 experts: silu + gemm1_alpha/clamp, biases

Substitutions on CUDA (SGLang's CUDA path calls non-Triton ops that are not carried; each is
replaced by SGLang's own Triton equivalent, listed in `SUBSTITUTIONS`):
  - activation quant of the MoE (JIT CUDA `per_token_group_quant`) -> SGLang's Triton
    `_per_token_group_quant_8bit_raw` (what SGLang runs on non-CUDA platforms; same layout);
  - MoE top-k combine above 32 tokens (`sgl_kernel.moe_sum_reduce`) -> SGLang's
    `moe_sum_reduce_triton` (what SGLang itself uses at <= 32 tokens on Hopper);
  - `moe_align_block_size` (sgl_kernel / JIT CUDA) runs in the adapter's setup, untimed: SGLang's
    Triton `moe_align_small_numel` where SGLang uses it, else `_moe_align_torch` (same buffer
    contract). SGLang's Triton runner does the same split (pre_permute aligns, run() launches);
  - make_fp8_linear quantises x with that Triton quant too (SGLang's CUDA linear: JIT CUDA).

On the GPU machine: carry `.peers/sglang_src` (about 1 MB); `load_sglang_kernels()` finds it there
or at $SGLANG_PEERS_SRC. Checked by tests/benchmarks/test_sglang_peers.py (CPU interpreter; sm_90 compile).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import platform
import sys
import types
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

SGLANG_VERSION = "0.5.23"
DEFAULT_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".peers", "sglang_src")
BLOCK = 128
MAX_KV_SPLITS = 8  # ServerArgs.triton_attention_num_kv_splits default in 0.5.23
SUBSTITUTIONS: list[str] = []
_STUB_FLAG = "__sglang_peers_stub__"
_CACHE: dict[str, dict] = {}


class PeerUnavailable(RuntimeError):
    """A CUDA-only, non-Triton SGLang op that was not carried to this machine."""


def _unavailable(name: str, why: str) -> Callable:
    def placeholder(*args, **kwargs):
        raise PeerUnavailable(f"{name}: {why}; not carried (benchmarks/sglang_peers.py)")

    placeholder.__name__ = name.rsplit(".", 1)[-1]
    placeholder.__qualname__ = placeholder.__name__
    return placeholder


# ---------------------------------------------------------------------------------------------
# platform probes: the semantics of sglang.srt.utils.common 0.5.23, without its imports
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def is_hip() -> bool:
    return torch.version.hip is not None


@functools.lru_cache(maxsize=1)
def is_cuda() -> bool:
    return torch.cuda.is_available() and torch.version.cuda is not None


@functools.lru_cache(maxsize=1)
def is_xpu() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


@functools.lru_cache(maxsize=1)
def is_musa() -> bool:
    return False  # needs torch.version.musa and torchada; neither exists here


@functools.lru_cache(maxsize=1)
def is_cpu() -> bool:
    if os.getenv("SGLANG_USE_CPU_ENGINE", "0") != "1":
        return False
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "aarch64", "arm64")


def cpu_has_amx_support() -> bool:
    return False  # SGLang's needs sgl_kernel's AMX backend, which is not carried


def _gcn_arch_has(tag: str) -> bool:
    return bool(torch.version.hip) and tag in torch.cuda.get_device_properties(0).gcnArchName


is_gfx95_supported = functools.lru_cache(maxsize=1)(functools.partial(_gcn_arch_has, "gfx95"))
is_gfx942_supported = functools.lru_cache(maxsize=1)(functools.partial(_gcn_arch_has, "gfx942"))
is_gfx1250_supported = functools.lru_cache(maxsize=1)(functools.partial(_gcn_arch_has, "gfx1250"))


def _check_cuda_device_version(majors, cuda_version) -> bool:
    if not is_cuda():
        return False
    major, _ = torch.cuda.get_device_capability()
    return major in majors and tuple(map(int, torch.version.cuda.split(".")[:2])) >= cuda_version


is_sm90_supported = functools.lru_cache(maxsize=1)(functools.partial(_check_cuda_device_version, [9], (12, 3)))
is_sm100_supported = functools.lru_cache(maxsize=1)(functools.partial(_check_cuda_device_version, [10], (12, 8)))
is_sm120_supported = functools.lru_cache(maxsize=1)(functools.partial(_check_cuda_device_version, [12], (12, 8)))
is_blackwell_supported = functools.lru_cache(maxsize=1)(
    functools.partial(_check_cuda_device_version, [10, 11, 12], (12, 8)))


def get_device_core_count(device_id: int = 0) -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device_id).multi_processor_count
    return 0


def get_device_name(device_id: int = 0) -> str:
    # SGLang returns None without a device (its config lookups then fail); "" finds no config.
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(device_id)
    return ""


def get_device_capability(device_id: int = 0):
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability(device_id)
    return None, None


def get_bool_env_var(name: str, default: str = "false") -> bool:
    return os.getenv(name, default).lower() in ("true", "1")


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def ceil_align(x: int, y: int) -> int:
    return ceil_div(x, y) * y


def log_info_on_rank0(logger, msg):
    logger.info(msg)


@functools.lru_cache(maxsize=1)
def is_arch_support_pdl() -> bool:
    """sglang.kernels.jit.utils.arch.is_arch_support_pdl: CUDA arch major >= 9."""
    if torch.version.hip is not None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 9


def get_jit_cuda_arch():
    major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    return types.SimpleNamespace(major=major, minor=minor, suffix="a" if major >= 9 else "")


def _identity_decorator(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


@dataclasses.dataclass
class MoeRunnerConfig:
    """The fields (and 0.5.23 defaults) of sglang.srt.layers.moe.moe_runner.base.MoeRunnerConfig
    that the Triton fused_experts reads."""

    num_experts: Optional[int] = None
    num_local_experts: Optional[int] = None
    hidden_size: Optional[int] = None
    intermediate_size_per_partition: Optional[int] = None
    layer_id: Optional[int] = None
    top_k: Optional[int] = None
    num_fused_shared_experts: Optional[int] = None
    params_dtype: Optional[torch.dtype] = None
    activation: str = "silu"
    is_gated: bool = True
    apply_router_weight_on_input: bool = False
    inplace: bool = True
    no_combine: bool = False
    no_combine_keep_router_weight: bool = False
    routed_scaling_factor: Optional[float] = None
    gemm1_alpha: Optional[float] = None
    gemm1_beta: Optional[float] = None
    gemm1_clamp_limit: Optional[float] = None
    swiglu_limit: Optional[float] = None
    gate_up_interleaved: bool = True


def _ns(**kw):
    return types.SimpleNamespace(**kw)


# ServerArgs defaults (0.5.23) of the few config-bag fields the kernel modules read.
_EXEC = _ns(
    moe=_ns(enable_fused_moe_sum_all_reduce=False),
    deterministic=_ns(enable_deterministic_inference=False),
    kernel=_ns(triton_attention_num_kv_splits=MAX_KV_SPLITS, triton_attention_split_tile_size=None,
               enable_lean_attention=None),
)
_PARALLEL = _ns(tp_group=None, tp_rank=0, tp_size=1, attn_tp_size=1, attn_dcp_size=1, attn_dcp_rank=0)


class _Platform:
    """runtime_context.get_platform(): `is_sm90` etc. read the probes above."""

    def __getattr__(self, name):
        probe = globals().get(f"{name}_supported")
        if probe is None:
            raise AttributeError(f"platform fact {name!r} is not stubbed (benchmarks/sglang_peers.py)")
        return probe()


# ---------------------------------------------------------------------------------------------
# stub installation
# ---------------------------------------------------------------------------------------------


def _module(name: str, path: Optional[list] = None, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    setattr(mod, _STUB_FLAG, True)
    if path is not None:
        mod.__path__ = path  # a package whose __init__.py is not run (submodules load from path)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod


def _install_stubs(src: str) -> None:
    def pkg(name, **attrs):
        path = os.path.join(src, *name.split("."))
        return _module(name, [path] if os.path.isdir(path) else [], **attrs)

    utils = dict(
        is_hip=is_hip, is_cuda=is_cuda, is_xpu=is_xpu, is_musa=is_musa, is_cpu=is_cpu,
        cpu_has_amx_support=cpu_has_amx_support, is_gfx95_supported=is_gfx95_supported,
        is_gfx942_supported=is_gfx942_supported, is_gfx1250_supported=is_gfx1250_supported,
        is_sm90_supported=is_sm90_supported, is_sm100_supported=is_sm100_supported,
        is_sm120_supported=is_sm120_supported, is_blackwell_supported=is_blackwell_supported,
        get_device_core_count=get_device_core_count, get_device_name=get_device_name,
        get_device_capability=get_device_capability, get_bool_env_var=get_bool_env_var,
        ceil_div=ceil_div, ceil_align=ceil_align, log_info_on_rank0=log_info_on_rank0,
    )
    pkg("sglang", __version__=SGLANG_VERSION)
    pkg("sglang.kernels")
    pkg("sglang.kernels.jit")
    _module("sglang.kernels.jit.utils",
            is_arch_support_pdl=is_arch_support_pdl, get_jit_cuda_arch=get_jit_cuda_arch,
            is_hip_runtime=is_hip, is_musa_runtime=is_musa, cache_once=functools.cache,
            load_jit=_unavailable("sglang.kernels.jit.utils.load_jit", "JIT CUDA (tvm-ffi + nvcc)"),
            make_cpp_args=_unavailable("sglang.kernels.jit.utils.make_cpp_args", "JIT CUDA (tvm-ffi + nvcc)"))
    pkg("sglang.kernels.ops")
    pkg("sglang.kernels.ops.attention")
    pkg("sglang.kernels.ops.gemm")
    jit_quant = "JIT CUDA kernel (tvm-ffi + nvcc)"
    pkg("sglang.kernels.ops.quantization",
        sgl_per_token_quant_fp8=_unavailable("quantization.sgl_per_token_quant_fp8", jit_quant),
        sgl_per_token_group_quant_8bit=_unavailable("quantization.sgl_per_token_group_quant_8bit", "MUSA AOT"))
    _module("sglang.kernels.ops.quantization.per_token_group_quant",
            per_token_group_quant=_unavailable("quantization.per_token_group_quant", jit_quant))
    _module("sglang.kernels.ops.quantization.per_tensor_quant_fp8",
            per_tensor_quant_fp8=_unavailable("quantization.per_tensor_quant_fp8", jit_quant))
    pkg("sglang.kernels.ops.activation")
    _module("sglang.kernels.ops.activation.activation", **{
        n: _unavailable(f"activation.{n}", "JIT CUDA kernel")
        for n in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul", "silu_and_mul_with_activation_rounding")})
    pkg("sglang.kernels.ops.moe",
        moe_align_block_size=_unavailable("moe.moe_align_block_size", "sgl_kernel AOT / JIT CUDA kernel"))

    pkg("sglang.srt")
    pkg("sglang.srt.utils", **utils)
    _module("sglang.srt.utils.common", **utils)
    _module("sglang.srt.utils.custom_op", register_custom_op=_identity_decorator)  # torch.library op: eager-identical
    _module("sglang.srt.utils.patch_torch", register_fake_if_exists=_identity_decorator)
    _module("sglang.srt.runtime_context", get_platform=_Platform, get_exec=lambda: _EXEC,
            get_parallel=lambda: _PARALLEL)
    _module("sglang.srt.batch_invariant_ops", is_batch_invariant_mode_enabled=lambda: False)
    pkg("sglang.srt.distributed")
    pkg("sglang.srt.distributed.device_communicators")
    _module("sglang.srt.distributed.device_communicators.pynccl_allocator",
            use_symmetric_memory=lambda *a, **k: contextlib.nullcontext())
    pkg("sglang.srt.layers")
    _module("sglang.srt.layers.dp_attention", is_allocation_symmetric=lambda: False)
    _module("sglang.srt.layers.deep_gemm_wrapper", ENABLE_JIT_DEEPGEMM=False,
            gemm_nt_f8f8bf16=_unavailable("deep_gemm_wrapper.gemm_nt_f8f8bf16", "DeepGEMM"),
            gemm_nt_mxfp8_f8f8bf16=_unavailable("deep_gemm_wrapper.gemm_nt_mxfp8_f8f8bf16", "DeepGEMM"))
    pkg("sglang.srt.layers.moe")
    # sglang.srt.layers.moe.utils.get_moe_padding_size, same semantics (AITER/TRITON_PADDING_SIZE = 128)
    _module("sglang.srt.layers.moe.utils",
            get_moe_padding_size=lambda is_aiter_moe: 128 if is_aiter_moe or bool(
                int(os.getenv("SGLANG_MOE_PADDING", "0"))) else 0,
            get_moe_runner_backend=_unavailable("moe.utils.get_moe_runner_backend", "server args"))
    pkg("sglang.srt.layers.moe.moe_runner", MoeRunnerConfig=MoeRunnerConfig)
    if "sgl_kernel" not in sys.modules:
        _module("sgl_kernel", **{n: _unavailable(f"sgl_kernel.{n}", "sgl_kernel AOT CUDA library") for n in (
            "moe_sum_reduce", "silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul", "sgl_per_tensor_quant_fp8",
            "sgl_per_token_quant_fp8", "moe_align_block_size")})


# ---------------------------------------------------------------------------------------------
# loader
# ---------------------------------------------------------------------------------------------

KERNEL_NAMES = ("decode_attention_fwd", "extend_attention_fwd", "get_num_kv_splits_triton",
                "w8a8_block_fp8_matmul_triton", "per_token_group_quant_fp8_triton", "fused_experts",
                "fused_moe_kernel_sequence", "moe_align_block_size")
ADAPTER_NAMES = ("make_paged_decode", "make_paged_extend", "make_fp8_gemm", "make_fp8_linear",
                 "make_fused_experts")
_GROUPS = {
    "attention": ("decode_attention_fwd", "extend_attention_fwd", "get_num_kv_splits_triton",
                  "make_paged_decode", "make_paged_extend"),
    "fp8": ("w8a8_block_fp8_matmul_triton", "per_token_group_quant_fp8_triton", "make_fp8_gemm",
            "make_fp8_linear"),
    "moe": ("fused_experts", "fused_moe_kernel_sequence", "moe_align_block_size", "make_fused_experts"),
}


def load_sglang_kernels(src_dir: Optional[str] = None) -> dict:
    """name -> callable, or name -> reason string for what could not be loaded (see module doc).

    src_dir defaults to $SGLANG_PEERS_SRC, else <repo>/.peers/sglang_src. Installs the stubs once
    per process; a process that already imported a real SGLang gets
    reasons only (the two must not mix)."""
    src = os.path.abspath(src_dir or os.environ.get("SGLANG_PEERS_SRC") or DEFAULT_SRC)
    if src in _CACHE:
        return dict(_CACHE[src])
    names = KERNEL_NAMES + ADAPTER_NAMES
    real = sys.modules.get("sglang")
    if real is not None and not getattr(real, _STUB_FLAG, False):
        return {n: f"a real SGLang ({getattr(real, '__file__', '?')}) is already imported in this process"
                for n in names}
    if not os.path.isdir(os.path.join(src, "sglang")):
        return {n: f"{src} has no sglang/: run benchmarks/fetch_sglang_peers.sh and carry .peers/sglang_src"
                for n in names}
    if src not in sys.path:
        sys.path.insert(0, src)
    if real is None:
        _install_stubs(src)

    result: dict[str, Any] = {}
    for group, loader in (("attention", _load_attention), ("fp8", _load_fp8), ("moe", _load_moe)):
        try:
            result.update(loader())
        except Exception as exc:  # noqa: BLE001  (a group that fails is a result)
            reason = f"{group} peers failed to load: {type(exc).__name__}: {exc}"[:600]
            result.update({n: reason for n in _GROUPS[group]})
    _CACHE[src] = result
    return dict(result)


def _load_attention() -> dict:
    dec = importlib.import_module("sglang.kernels.ops.attention.decode_attention")
    ext = importlib.import_module("sglang.kernels.ops.attention.extend_attention")
    meta = importlib.import_module("sglang.kernels.ops.attention.metadata")
    mods = _ns(decode_attention_fwd=dec.decode_attention_fwd, extend_attention_fwd=ext.extend_attention_fwd,
               get_num_kv_splits_triton=meta.get_num_kv_splits_triton)
    return {
        "decode_attention_fwd": dec.decode_attention_fwd,
        "extend_attention_fwd": ext.extend_attention_fwd,
        "get_num_kv_splits_triton": meta.get_num_kv_splits_triton,
        "make_paged_decode": functools.partial(make_paged_decode, mods),
        "make_paged_extend": functools.partial(make_paged_extend, mods),
    }


def _load_fp8() -> dict:
    gemm = importlib.import_module("sglang.kernels.ops.gemm.fp8_kernel")
    quant = importlib.import_module("sglang.kernels.ops.quantization.fp8_kernel")
    mods = _ns(mm=gemm.w8a8_block_fp8_matmul_triton, quant=quant._per_token_group_quant_8bit_raw)
    return {
        "w8a8_block_fp8_matmul_triton": gemm.w8a8_block_fp8_matmul_triton,
        "per_token_group_quant_fp8_triton": quant._per_token_group_quant_8bit_raw,
        "make_fp8_gemm": functools.partial(make_fp8_gemm, mods),
        "make_fp8_linear": functools.partial(make_fp8_linear, mods),
    }


def _load_moe() -> dict:
    quant = importlib.import_module("sglang.kernels.ops.quantization.fp8_kernel")
    kern = importlib.import_module("sglang.kernels.ops.moe.fused_moe_triton_kernels")
    fm = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe")
    cfg = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config")
    align = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size")
    if kern._is_cuda:
        kern.sglang_per_token_group_quant_fp8 = quant._per_token_group_quant_8bit_raw
        kern.per_token_group_quant_fp8 = quant._per_token_group_quant_8bit_raw
        SUBSTITUTIONS.append("MoE activation quant: JIT CUDA per_token_group_quant -> SGLang's Triton "
                             "_per_token_group_quant_8bit_raw")
    if fm._is_cuda:
        fm.moe_sum_reduce = kern.moe_sum_reduce_triton
        SUBSTITUTIONS.append("MoE combine > 32 tokens: sgl_kernel.moe_sum_reduce -> SGLang's moe_sum_reduce_triton")
    mods = _ns(fm=fm, cfg=cfg, kern=kern, align=align)
    return {
        "fused_experts": fm.fused_experts,
        "fused_moe_kernel_sequence": fm._fused_moe_kernel_sequence,
        "moe_align_block_size": align.moe_align_block_size,
        "make_fused_experts": functools.partial(make_fused_experts, mods),
    }


# ---------------------------------------------------------------------------------------------
# adapters: paged sink attention
# ---------------------------------------------------------------------------------------------


def _paged_indices(req_to_token, req_pool_indices, starts, ends):
    """(kv_indptr int32 [B+1], kv_indices int64): slots of positions starts[b]..ends[b]-1 of each
    request, packed in request order (what triton_backend's pack_read_stream produces)."""
    dev = req_to_token.device
    starts = starts.to(dev, torch.int64)
    lens = (ends.to(dev, torch.int64) - starts).clamp_min(0)
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=dev)
    indptr[1:] = torch.cumsum(lens, 0)
    total = int(indptr[-1])
    row = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), lens, output_size=total)
    pos = torch.arange(total, device=dev) - indptr[:-1].long()[row] + starts[row]
    rows = req_pool_indices.to(dev, torch.int64)[row]
    return indptr, req_to_token[rows, pos].to(torch.int64)


def make_paged_decode(mods, q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sinks,
                      window_left: int, scale: float, *, out=None, max_kv_splits: int = MAX_KV_SPLITS,
                      device_core_count: Optional[int] = None, upstream_window: bool = False,
                      use_pdl: Optional[bool] = None) -> Callable:
    """SGLang's decode_attention_fwd over our paged layout: one query row per request.

    q [B, Hq, D]; k_buffer/v_buffer [slots, Hkv, D]; req_to_token [R, ctx] int32; seq_lens [B]
    counts the token being decoded (its K/V already written); sinks [Hq] or None; window_left:
    earlier keys visible (-1: full). Setup (untimed, as SGLang's init_forward_metadata, once per
    step for all layers): kv_indptr/kv_indices, num_kv_splits by SGLang's get_num_kv_splits_triton
    (SM count, max 8 splits; 0 cores -> static max, as SGLang), attn_logits/attn_lse buffers.
    A sliding layer reads the last window_left + 1 keys (our convention); upstream_window=True
    reproduces 0.5.23's triton backend, which gathers min(seq_len, window_left) keys (one short).
    use_pdl defaults to SGLang's choice (programmatic dependent launch on sm_90+).
    Returns a zero-argument callable (graph-capturable) that writes and returns out [B, Hq, D]."""
    batch, num_heads, head_dim = q.shape
    dev = q.device
    ends = seq_lens.to(dev, torch.int64)
    if window_left >= 0:
        keys = window_left if upstream_window else window_left + 1
        starts = (ends - keys).clamp_min(0)
    else:
        starts = torch.zeros_like(ends)
    kv_indptr, kv_indices = _paged_indices(req_to_token, req_pool_indices, starts, ends)
    num_kv_splits = torch.empty(batch, dtype=torch.int32, device=dev)
    uneven_batch = torch.zeros(1, dtype=torch.int32, device=dev)
    cores = get_device_core_count(dev.index or 0) if device_core_count is None and dev.type == "cuda" else (
        device_core_count or 0)
    if cores <= 0:
        num_kv_splits.fill_(max_kv_splits)
    else:
        mods.get_num_kv_splits_triton[(1,)](
            num_kv_splits, ends, batch, 1, num_heads,
            k_buffer.shape[1], max_kv_splits, cores,
            MAX_NUM_SEQ=256 if batch < 256 else 1 << (batch - 1).bit_length(), uneven_batch_ptr=uneven_batch)
    attn_logits = torch.empty(batch, num_heads, max_kv_splits, v_buffer.shape[-1], dtype=torch.float32, device=dev)
    attn_lse = torch.empty(batch, num_heads, max_kv_splits, dtype=torch.float32, device=dev)
    o = out if out is not None else torch.empty(batch, num_heads, v_buffer.shape[-1], dtype=q.dtype, device=dev)
    if use_pdl is None:  # triton_backend: is_arch_support_pdl() on CUDA
        use_pdl = dev.type == "cuda" and is_arch_support_pdl()
    fn = mods.decode_attention_fwd

    def run():
        fn(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse, num_kv_splits, max_kv_splits,
           scale, 1.0, 1.0, logit_cap=0.0, sinks=sinks, xai_temperature_len=-1, has_mla=False, use_pdl=use_pdl,
           page_size=1, enable_lean=False, uneven_batch=uneven_batch)
        return o

    run.api = (f"sglang {SGLANG_VERSION} decode_attention_fwd (grouped split-KV, max {max_kv_splits} splits; "
               f"indices/splits built untimed{'; upstream 127-key window' if upstream_window else ''})")
    return run


def make_paged_extend(mods, q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, q_start, q_len,
                      sinks, window_left: int, scale: float, *, out=None) -> Callable:
    """SGLang's extend_attention_fwd over our paged layout (prefill / chunked prefill).

    Rows q_start[b] .. q_start[b]+q_len[b]-1 of q [T, Hq, D] are request b's new tokens, at the
    last q_len[b] of its seq_lens[b] positions; all K/V (prefix and new) already in the buffers.
    SGLang reads the prefix through kv_indptr/kv_indices (sliding layer: the last window_left
    prefix keys, update_sliding_window_buffer) and the new tokens' K/V from contiguous
    k_extend/v_extend (the projection's output in a real forward): both built untimed here.
    Rows must be packed in request order (q_start = exclusive cumsum of q_len)."""
    dev = q.device
    q_len64 = q_len.to(dev, torch.int64)
    seq64 = seq_lens.to(dev, torch.int64)
    packed = torch.zeros_like(q_len64)
    packed[1:] = torch.cumsum(q_len64, 0)[:-1]
    if not torch.equal(q_start.to(dev, torch.int64), packed):
        raise ValueError("make_paged_extend: query rows must be packed in request order")
    prefix = seq64 - q_len64
    starts = (prefix - prefix.clamp_max(window_left)) if window_left >= 0 else torch.zeros_like(prefix)
    kv_indptr, kv_indices = _paged_indices(req_to_token, req_pool_indices, starts, prefix)
    _, new_slots = _paged_indices(req_to_token, req_pool_indices, prefix, seq64)
    k_extend = k_buffer[new_slots].contiguous()
    v_extend = v_buffer[new_slots].contiguous()
    qo_indptr = torch.zeros(q_len64.numel() + 1, dtype=torch.int64, device=dev)
    qo_indptr[1:] = torch.cumsum(q_len64, 0)
    q_len_cpu = q_len64.tolist()
    max_len_extend = max(q_len_cpu) if q_len_cpu else 0
    o = out if out is not None else torch.empty(q.shape[0], q.shape[1], v_buffer.shape[-1], dtype=q.dtype, device=dev)
    fn = mods.extend_attention_fwd

    def run():
        fn(q, k_extend, v_extend, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, None, True, None,
           max_len_extend, 1.0, 1.0, sm_scale=scale, logit_cap=0.0,
           sliding_window_size=window_left if window_left >= 0 else -1, sinks=sinks, window_kv_offsets=None,
           xai_temperature_len=-1, page_size=1, extend_seq_lens_cpu=q_len_cpu)
        return o

    run.api = f"sglang {SGLANG_VERSION} extend_attention_fwd (2-stage; prefix indices and k/v_extend built untimed)"
    return run


# ---------------------------------------------------------------------------------------------
# adapters: FP8 block-128 GEMM
# ---------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_fp8_gemm(mods, a_fp8, a_scale, w_fp8, w_scale_inv, bias=None, out_dtype=torch.bfloat16) -> Callable:
    """y = (a_fp8 * a_scale) (w_fp8 * w_scale_inv)^T + bias with SGLang's
    w8a8_block_fp8_matmul_triton(A, B, As, Bs, [128, 128], output_dtype) and `output += bias`
    (triton_w8a8_block_fp8_linear): pre-quantised operands, a_scale [M, cdiv(K, 128)] fp32,
    w_scale_inv [cdiv(N, 128), cdiv(K, 128)]. K needs no padding (the kernel masks K)."""
    a = a_fp8.contiguous()
    a_s = a_scale.float()
    mm = mods.mm

    def run():
        y = mm(a, w_fp8, a_s, w_scale_inv, [BLOCK, BLOCK], output_dtype=out_dtype)
        if bias is not None:
            y += bias
        return y

    run.api = f"sglang {SGLANG_VERSION} w8a8_block_fp8_matmul_triton + bias add"
    return run


def make_fp8_linear(mods, x, w_fp8, w_scale_inv, bias=None) -> Callable:
    """x [M, K] -> SGLang's Triton per-token-group quant (1x128, row-major scales) ->
    w8a8_block_fp8_matmul_triton -> + bias, output in x's dtype (triton_w8a8_block_fp8_linear;
    on CUDA SGLang quantises with a JIT CUDA kernel instead, not carried). SGLang's quant needs
    K % 128 == 0: otherwise x is zero-padded inside the call and w once here (exact: zeros do
    not change a group's amax, and the block scales of w are unchanged)."""
    m, k = x.shape
    kp = _cdiv(k, BLOCK) * BLOCK
    w = w_fp8
    if kp != k:
        w = torch.zeros(w_fp8.shape[0], kp, dtype=w_fp8.dtype, device=w_fp8.device)
        w[:, :k] = w_fp8
    quant, mm = mods.quant, mods.mm

    def run():
        xp = x if kp == k else F.pad(x, (0, kp - k))
        q, s = quant(xp.contiguous(), BLOCK, column_major_scales=False)
        y = mm(q, w, s, w_scale_inv, [BLOCK, BLOCK], output_dtype=x.dtype)
        if bias is not None:
            y += bias
        return y

    run.api = (f"sglang {SGLANG_VERSION} Triton per_token_group_quant + w8a8_block_fp8_matmul_triton + bias"
               + (f"; x zero-padded {k}->{kp} in the call" if kp != k else ""))
    return run


# ---------------------------------------------------------------------------------------------
# adapters: gpt-oss FP8 experts
# ---------------------------------------------------------------------------------------------


def _moe_align_torch(topk_ids, block_size: int, num_experts: int):
    """sgl_kernel.moe_align_block_size's contract in torch (the "+1 offset" convention of
    moe_align_block_size.py): pairs sorted by expert, stable in pair order, each expert's segment
    padded to block_size with the pad id numel; expert_ids per block; num_tokens_post_pad [1]."""
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64)
    numel = ids.numel()
    if numel < num_experts + 1:
        max_padded = numel * block_size
    else:
        max_padded = numel + (num_experts + 1) * (block_size - 1)
    max_padded = (max_padded + 3) // 4 * 4
    max_blocks = _cdiv(max_padded, block_size)
    bucket = ids + 1
    counts = torch.bincount(bucket, minlength=num_experts + 1)
    padded = (counts + block_size - 1) // block_size * block_size
    offsets = torch.cumsum(padded, 0) - padded
    order = torch.argsort(bucket, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(numel, device=dev) - (torch.cumsum(counts, 0) - counts)[bucket[order]]
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=dev)
    sorted_ids[offsets[bucket] + rank] = torch.arange(numel, dtype=torch.int32, device=dev)
    blocks = padded // block_size
    expert_ids = torch.full((max_blocks,), -1, dtype=torch.int32, device=dev)
    used = int(blocks.sum())
    expert_ids[:used] = torch.repeat_interleave(torch.arange(num_experts + 1, device=dev) - 1, blocks).to(torch.int32)
    total = torch.tensor([int(padded.sum())], dtype=torch.int32, device=dev)
    return sorted_ids, expert_ids, total


def _pad_to(t, shape):
    if tuple(t.shape) == tuple(shape):
        return t.contiguous()
    out = torch.zeros(shape, dtype=t.dtype, device=t.device)
    out[tuple(slice(0, s) for s in t.shape)] = t
    return out


def _pad_scale(s, shape):
    if tuple(s.shape) == tuple(shape):
        return s.contiguous()
    out = torch.ones(shape, dtype=s.dtype, device=s.device)  # new blocks hold only zero weights
    out[tuple(slice(0, n) for n in s.shape)] = s
    return out


def make_fused_experts(mods, x, topk_weights, topk_ids, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2,
                       limit: float = 7.0, alpha: float = 1.702) -> Callable:
    """gpt-oss experts with SGLang's Triton MoE (the runner's _fused_moe_kernel_sequence: x quant,
    fused_moe_kernel up with b1, gpt-oss swiglu = activation "silu" + gemm1_alpha + gemm1_limit on
    interleaved gate/up rows, fused_moe_kernel down with b2 and routing weights, top-k sum).

    Our layout: x [T, H]; topk_ids [T, k] (all experts local); w1 [E, 2I, H] e4m3 (gate, linear
    rows interleaved), w1_scale_inv [E, cdiv(2I,128), cdiv(H,128)], b1 [E, 2I]; w2 [E, H, I],
    w2_scale_inv [E, cdiv(H,128), cdiv(I,128)], b2 [E, H] or None. SGLang's activation quant
    needs H and I multiples of 128 (gpt-oss: 2880): H and I are zero-padded once here (exact;
    the layer then runs in SGLang's "pre-padded hidden" mode) and the result is sliced back.
    Setup, untimed: padding, launch config (SGLang's try_get_optimal_moe_config), alignment
    (see module doc). Returns a zero-argument callable -> [T, H] in x's dtype (graph-capturable
    after its first call, which compiles SGLang's torch.compile'd gpt-oss swiglu)."""
    fm, cfg, align = mods.fm, mods.cfg, mods.align
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w1.shape
    inter = two_inter // 2
    hp, ip = _cdiv(hidden, BLOCK) * BLOCK, _cdiv(inter, BLOCK) * BLOCK
    xp = _pad_to(x, (num_tokens, hp))
    w1p = _pad_to(w1, (num_experts, 2 * ip, hp))
    s1p = _pad_scale(w1_scale_inv.float(), (num_experts, _cdiv(2 * ip, BLOCK), _cdiv(hp, BLOCK)))
    b1p = _pad_to(b1, (num_experts, 2 * ip)) if b1 is not None else None
    w2p = _pad_to(w2, (num_experts, hp, ip))
    s2p = _pad_scale(w2_scale_inv.float(), (num_experts, _cdiv(hp, BLOCK), _cdiv(ip, BLOCK)))
    b2p = _pad_to(b2, (num_experts, hp)) if b2 is not None else None
    topk_ids = topk_ids.to(torch.int32).contiguous()
    topk_weights = topk_weights.float().contiguous()
    top_k = topk_ids.shape[1]
    block_shape = [BLOCK, BLOCK]

    # _prepare_fused_moe_run, config half
    config, (down_config, _) = cfg.try_get_optimal_moe_config(
        w1p.shape, w2p.shape, top_k, "fp8_w8a8", num_tokens, block_shape=block_shape,
        per_channel_quant=False, return_down_config=True)
    config = dict(config)
    up_tma = bool(config.pop("USE_TMA", False)) and fm._moe_support_tma()
    down_tma = down_config is not None and bool(down_config.pop("USE_TMA", False)) and fm._moe_support_tma()
    # alignment half (untimed; SGLang's own kernel where it has a Triton one for this case)
    numel = topk_ids.numel()
    small = getattr(align, "SMALL_NUMEL_LIMIT", 0)
    if align._is_cuda and numel <= small and num_experts + 1 > align._CUDA_SMALL_BATCH_MAX_BUCKETS:
        sorted_ids, expert_ids, post_pad = align.moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], num_experts)
        how = "SGLang's Triton moe_align_small_numel"
    else:
        sorted_ids, expert_ids, post_pad = _moe_align_torch(topk_ids, config["BLOCK_SIZE_M"], num_experts)
        how = "torch port of sgl_kernel's moe_align_block_size"
    seq = fm._fused_moe_kernel_sequence

    def run():
        out = seq(xp, w1p, w2p, topk_weights, topk_ids, sorted_ids, expert_ids, post_pad, config, down_config,
                  down_tma, up_tma, b1=b1p, b2=b2p, use_fp8_w8a8=True, use_int8_w8a8=False, use_int8_w8a16=False,
                  use_int4_w4a16=False, per_channel_quant=False, w1_scale=s1p, w2_scale=s2p, w1_zp=None,
                  w2_zp=None, a1_scale=None, a2_scale=None, block_shape=block_shape, activation="silu",
                  is_gated=True, no_combine=False, inplace=False, apply_router_weight_on_input=False,
                  routed_scaling_factor=None, gemm1_alpha=alpha, gemm1_limit=limit, filter_expert=False,
                  hooks=None, swiglu_limit=None, gate_up_interleaved=True)
        return out if hp == hidden else out[:, :hidden]

    padded = f"; H/I padded {hidden}/{inter}->{hp}/{ip}" if (hp, ip) != (hidden, inter) else ""
    run.api = (f"sglang {SGLANG_VERSION} Triton fused MoE (fp8 w8a8 block 128, config "
               f"BLOCK_M={config['BLOCK_SIZE_M']} N={config['BLOCK_SIZE_N']} K={config['BLOCK_SIZE_K']}); "
               f"alignment untimed ({how}){padded}")
    return run
