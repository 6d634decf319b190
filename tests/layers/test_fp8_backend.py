"""The dense FP8 layers' GEMM backend (`sglang_ext/layers/fp8_backend.py`): our kernel or DeepGEMM.

Off the GPU: the mode switch, the choice per GEMM (row range, shape rules, a missing or broken
`deep_gemm`), and the adapter's contract with both DeepGEMM APIs, checked against stand-ins that
implement each API's documented contract (operand layouts asserted, the GEMM done in float64 and
rounded to bf16) under ``TRITON_INTERPRET=1`` (our quantiser runs in the adapter). On a CUDA
machine with DeepGEMM (`benchmarks/deepgemm_peer.py` loads its 1.x JIT release) the `gpu` test runs
the real DeepGEMM at gpt-oss's dense shapes against a float64 oracle, through the layers and in a
CUDA graph:
    python tests/layers/test_fp8_backend.py --gpu
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KERNEL_TESTS = os.path.join(os.path.dirname(HERE), "kernels")


@pytest.fixture()
def backend(monkeypatch):
    from sglang_ext.layers import fp8_backend

    fp8_backend.reset()
    yield fp8_backend
    fp8_backend.reset()


def _weights(n, k, device="cpu"):
    from sglang_ext.layers.fp8 import quantize_weight_block128

    g = torch.Generator().manual_seed(n * 7 + k)
    return quantize_weight_block128(torch.randn(n, k, generator=g) * 0.05)


def test_mode_parsing(backend, ext_env, monkeypatch):
    ext_env(backend.ENV_VAR, None)
    assert backend.backend_mode() == "triton"
    ext_env(backend.ENV_VAR, " DeepGEMM ")
    assert backend.backend_mode() == "deepgemm"
    monkeypatch.setenv(backend.ENV_VAR, "auto")
    assert backend.backend_mode() == "deepgemm"  # read once: a change without reload_settings is not seen
    ext_env(backend.ENV_VAR, "cublas")
    with pytest.raises(ValueError, match="SGLANG_EXT_FP8_GEMM='cublas'"):
        backend.backend_mode()


def _fake_deep_gemm(api, calls):
    """A stand-in with one DeepGEMM API: checks the documented operand layouts and computes the
    exact float64 GEMM of the dequantised operands, rounded to bf16 once."""
    from sglang_ext.layers.fp8 import dequantize_activation_group128, dequantize_weight_block128

    def gemm(lhs, rhs, out):
        (a, sa), (w, sw) = lhs, rhs
        m, k = a.shape
        n = w.shape[0]
        assert a.dtype == w.dtype == torch.float8_e4m3fn and sa.dtype == sw.dtype == torch.float32
        assert sa.shape == (m, -(-k // 128)) and sw.shape == (-(-n // 128), -(-k // 128))
        assert sa.stride(0) == 1 and sa.stride(1) == -(-m // 4) * 4, ("LHS scales not TMA-aligned MN-major", sa.stride())
        assert sw.is_contiguous() and a.stride(1) == 1 and w.stride(1) == 1
        assert out.dtype == torch.bfloat16 and out.shape == (m, n) and out.stride(1) == 1
        exact = dequantize_activation_group128(a, sa).double() @ dequantize_weight_block128(w, sw).double().t()
        out.copy_(exact.to(torch.bfloat16))
        calls.append((api, m, n, k))

    mod = types.ModuleType("deep_gemm")
    mod.__file__ = f"<stand-in deep_gemm {api}>"
    setattr(mod, "fp8_gemm_nt" if api == "v2" else "gemm_fp8_fp8_bf16_nt", gemm)
    return mod


def test_choice_without_cuda_or_out_of_range_never_imports(backend, ext_env, monkeypatch):
    w, ws = _weights(256, 256)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # an import would raise
    ext_env(backend.ENV_VAR, "triton")
    assert backend.choose(x, w, ws) == ("triton", None)
    ext_env(backend.ENV_VAR, "auto")
    assert backend.choose(x, w, ws) == ("triton", None)  # 4 rows: outside DEEPGEMM_AUTO_ROWS
    assert "result" not in backend._loaded


def _as_h200(backend, monkeypatch):
    """CPU tensors pass for CUDA ones of an sm90 GPU in the backend's checks."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(backend, "_device_capability", lambda device: (9, 0))


def test_missing_deep_gemm_raises_a_fresh_error_each_time(backend, monkeypatch):
    """The outcome is cached as a reason, not as one exception raised again: that one's traceback would grow
    with every call and keep each caller's frame (and its activations) alive."""
    import traceback

    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    errors = []
    for _ in range(5):
        try:
            backend.load_deep_gemm()
        except backend.DeepGemmUnavailable as e:
            errors.append(e)
    assert len({id(e) for e in errors}) == 5
    assert all(len(traceback.extract_tb(e.__traceback__)) <= 2 for e in errors)


def test_missing_deep_gemm(backend, ext_env, monkeypatch, caplog):
    w, ws = _weights(256, 256)
    monkeypatch.setattr(backend, "DEEPGEMM_AUTO_ROWS", {(256, 256): (17, 128)})
    x = torch.randn(32, 256, dtype=torch.bfloat16)  # in auto's range
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    ext_env(backend.ENV_VAR, "auto")
    _as_h200(backend, monkeypatch)
    with caplog.at_level(logging.WARNING, logger=backend.__name__):
        assert backend.choose(x, w, ws) == ("triton", None)
        assert backend.choose(x, w, ws) == ("triton", None)
    assert sum("DeepGEMM unavailable" in r.getMessage() for r in caplog.records) == 1  # logged once
    ext_env(backend.ENV_VAR, "deepgemm")
    with pytest.raises(backend.DeepGemmUnavailable, match="SGLANG_EXT_FP8_GEMM=deepgemm: import deep_gemm failed"):
        backend.choose(x, w, ws)


def test_unknown_deep_gemm_api(backend, monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))
    with pytest.raises(backend.DeepGemmUnavailable, match="neither fp8_gemm_nt"):
        backend.load_deep_gemm()


def test_shape_rules(backend, monkeypatch):
    w, ws = _weights(2880, 2880)
    x = torch.empty(64, 2880, dtype=torch.bfloat16)
    assert backend.deepgemm_unsupported("v1", x, w, ws) == "x is not on a CUDA device"
    _as_h200(backend, monkeypatch)
    assert backend.deepgemm_unsupported("v1", x, w, ws) is None
    assert "K % 128" in backend.deepgemm_unsupported("v2", x, w, ws)  # 2880 = 22.5 x 128: SGLang's rule
    w4, ws4 = _weights(2880, 4096)
    assert backend.deepgemm_unsupported("v2", torch.empty(8, 4096, dtype=torch.bfloat16), w4, ws4) is None
    assert "bf16 only" in backend.deepgemm_unsupported("v1", x.float(), w, ws)
    wk, wsk = _weights(256, 200)
    assert "16 bytes" in backend.deepgemm_unsupported("v1", torch.empty(2, 200, dtype=torch.bfloat16), wk, wsk)
    monkeypatch.setattr(backend, "_device_capability", lambda device: (8, 0))  # an A100: no DeepGEMM kernels
    assert "sm8x" in backend.deepgemm_unsupported("v1", x, w, ws)
    monkeypatch.setattr(backend, "_device_capability", lambda device: (10, 0))
    assert "sm10x" in backend.deepgemm_unsupported("v1", x, w, ws)
    assert backend.deepgemm_unsupported("v2", torch.empty(8, 4096, dtype=torch.bfloat16), w4, ws4) is None


def test_auto_takes_deepgemm_in_range_only(backend, ext_env, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "deep_gemm", _fake_deep_gemm("v1", calls))
    _as_h200(backend, monkeypatch)
    ext_env(backend.ENV_VAR, "auto")
    w, ws = _weights(256, 256)
    monkeypatch.setattr(backend, "DEEPGEMM_AUTO_ROWS", {(256, 256): (17, 128)})
    for rows, want in ((16, "triton"), (17, "deepgemm"), (128, "deepgemm"), (129, "triton")):
        x = torch.empty(rows, 256, dtype=torch.bfloat16)
        assert backend.choose(x, w, ws)[0] == want, rows
    w2, ws2 = _weights(128, 256)  # a shape auto has no measurement of: ours
    assert backend.choose(torch.empty(32, 256, dtype=torch.bfloat16), w2, ws2)[0] == "triton"
    x3 = torch.empty(3, 7, 256, dtype=torch.bfloat16)  # rows = all leading dims: 21
    assert backend.choose(x3, w, ws)[0] == "deepgemm"
    monkeypatch.setattr(backend, "_device_capability", lambda device: (10, 0))  # auto's rows are the H200's
    assert backend.choose(x3, w, ws)[0] == "triton"
    _as_h200(backend, monkeypatch)
    ext_env(backend.ENV_VAR, "deepgemm")
    assert backend.choose(torch.empty(1, 256, dtype=torch.bfloat16), w, ws)[0] == "deepgemm"
    assert backend.choose(torch.empty(1, 256), w, ws)[0] == "triton"  # fp32 x: ours (logged)


def adapter_sweep() -> dict:
    """deepgemm_linear against both stand-ins (run under TRITON_INTERPRET=1): bit-equal to
    bf16(bf16(exact) + b) from our quantiser's codes, with x quantised here or given as x_quant in
    our quantiser's own (unaligned) scale layout."""
    from sglang_ext.kernels.fp8_gemm import quantize_activation_group128
    from sglang_ext.layers import fp8_backend
    from sglang_ext.layers.fp8 import dequantize_activation_group128, dequantize_weight_block128
    from sglang_ext.layers.fp8 import quantize_activation_group128 as quantize_torch

    cases = 0
    for api in ("v1", "v2"):
        calls = []
        mod = _fake_deep_gemm(api, calls)
        for m, n, k in ((1, 256, 256), (3, 384, 320), (6, 128, 208), (17, 256, 384)):
            g = torch.Generator().manual_seed(m * 1000 + n + k)
            w, ws = _weights(n, k)
            x = (torch.randn(2, m, k, generator=g) * 2).to(torch.bfloat16)  # leading dims kept
            for with_bias in (False, True):
                b = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16) if with_bias else None
                codes, scales = quantize_torch(x.reshape(-1, k))
                exact = dequantize_activation_group128(codes, scales).double() @ dequantize_weight_block128(w, ws).double().t()
                want = exact.to(torch.bfloat16)
                if b is not None:
                    want = want + b  # bf16 + bf16: one rounding of the exact sum, as y.add_(b)
                got = fp8_backend.deepgemm_linear(x, w, ws, b, module=mod, api=api)
                assert got.shape == (2, m, n) and got.dtype == torch.bfloat16
                assert torch.equal(got.reshape(-1, n), want), (api, m, n, k, with_bias)
                xq = quantize_activation_group128(x.reshape(-1, k))  # scales strided (1, 2m): unaligned at odd m
                got_q = fp8_backend.deepgemm_linear(x, w, ws, b, x_quant=xq, module=mod, api=api)
                assert torch.equal(got_q, got), (api, m, n, k, "x_quant")
                cases += 2
        assert len(calls) == 16 and {c[0] for c in calls} == {api}
    try:
        fp8_backend.deepgemm_linear(x, w, ws, x_quant=(codes, scales[:, :1]), module=mod, api="v1")
    except ValueError as e:
        assert "x_quant scales" in str(e)
    else:
        raise AssertionError("a malformed x_quant was accepted")
    return {"adapter_cases": cases}


def test_adapter_matches_both_apis_interpreted():
    if KERNEL_TESTS not in sys.path:  # interpreted.py, the kernel tests' helper, sits in tests/kernels
        sys.path.insert(0, KERNEL_TESTS)
    from interpreted import run_interpreted

    result = run_interpreted(__file__, ["--adapter"])[-1]
    assert result["adapter_cases"] == 32, result


# ---------------------------------------------------------------------------------------------
# GPU: the real DeepGEMM at gpt-oss's dense shapes
# ---------------------------------------------------------------------------------------------


def _load_real_deep_gemm():
    """The importable deep_gemm, else DeepGEMM's 1.x JIT release from .peers/deepgemm (the H200
    image cannot load sgl-deep-gemm's extension); None if neither loads."""
    from sglang_ext.layers import fp8_backend

    fp8_backend.reset()
    try:
        return fp8_backend.load_deep_gemm(), None
    except fp8_backend.DeepGemmUnavailable as first:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        import deepgemm_peer

        try:
            deepgemm_peer.load_deepgemm()
        except deepgemm_peer.DeepGemmUnavailable as second:
            return None, f"{first}; peer: {second}"
        fp8_backend.reset()
        return fp8_backend.load_deep_gemm(), None


def gpu_check() -> list[dict]:
    from sglang_ext.kernels.fp8_gemm import fp8_linear
    from sglang_ext import kernel_select
    from sglang_ext.layers import fp8_backend
    from sglang_ext.layers.fp8 import dequantize_activation_group128, dequantize_weight_block128, quantize_weight_block128
    from sglang_ext.layers.fp8 import quantize_activation_group128 as quantize_torch
    from sglang_ext.layers.linear import Linear

    loaded, why = _load_real_deep_gemm()
    if loaded is None:
        pytest.skip(f"DeepGEMM not loadable here: {why}")
    module, api = loaded
    dev = torch.device("cuda")
    rows = []
    for name, n, k in (("qkv", 5120, 2880), ("o", 2880, 4096)):
        g = torch.Generator(device=dev).manual_seed(n + k)
        lin = Linear(k, n, bias=True, dtype=torch.bfloat16, fp8=True).to(dev)
        w, ws = quantize_weight_block128(torch.randn(n, k, device=dev, generator=g) * 0.02)
        lin.weight.data.copy_(w)
        lin.weight_scale_inv.data.copy_(ws)
        lin.bias.data.copy_((torch.randn(n, device=dev, generator=g) * 0.1).to(torch.bfloat16))
        wd = dequantize_weight_block128(w, ws).double()
        for m in (1, 16, 64, 256, 2048):
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            codes, scales = quantize_torch(x)
            xd = dequantize_activation_group128(codes, scales).double()
            exact = xd @ wd.t() + lin.bias.double()
            mag = xd.abs() @ wd.abs().t() + lin.bias.double().abs()
            got = fp8_backend.deepgemm_linear(x, w, ws, lin.bias, module=module, api=api)
            err = (got.double() - exact).abs()
            ulp = torch.finfo(torch.bfloat16).eps * exact.abs()
            # two bf16 roundings (GEMM out, bias add) + the FP8 MMA's accumulation (fp32 promotion
            # every 128 K; inside, wgmma keeps fewer bits: bounded generously by 2^-10 of the magnitude)
            bound = 2 * ulp + mag * 2.0 ** -10 + 1e-30
            over = float((err / bound).max())
            correctly_rounded = float((got == exact.to(torch.bfloat16)).double().mean())
            ours = fp8_linear(x, w, ws, lin.bias)
            lo, hi = fp8_backend.DEEPGEMM_AUTO_ROWS.get((n, k), (1, 0))
            for mode, want in (("deepgemm", got), ("triton", ours), ("auto", got if lo <= m <= hi else ours)):
                os.environ[fp8_backend.ENV_VAR] = mode
                kernel_select.reload_settings()
                try:
                    assert torch.equal(lin(x), want), (name, m, mode, "the layer took the other backend")
                finally:
                    os.environ.pop(fp8_backend.ENV_VAR, None)
                    kernel_select.reload_settings()
            row = {"shape": name, "m": m, "api": api, "err_over_bound": round(over, 4),
                   "correctly_rounded": round(correctly_rounded, 4)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            assert over <= 1, row
        # captured in a CUDA graph: replays give the eager bits
        x = torch.randn(64, k, device=dev, generator=g).to(torch.bfloat16)
        eager = fp8_backend.deepgemm_linear(x, w, ws, lin.bias, module=module, api=api)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp8_backend.deepgemm_linear(x, w, ws, lin.bias, module=module, api=api)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), (name, "graph replay")
    return rows


@pytest.mark.gpu
def test_deepgemm_backend_full_shapes():
    gpu_check()


if __name__ == "__main__":
    # python tests/layers/test_fp8_backend.py --adapter   (under TRITON_INTERPRET=1: both API stand-ins)
    # python tests/layers/test_fp8_backend.py --gpu       (on a CUDA machine with DeepGEMM)
    sys.path.insert(0, ROOT)
    if "--gpu" in sys.argv:
        print(json.dumps({"gpu_rows": gpu_check()}), flush=True)
    else:
        print(json.dumps(adapter_sweep()), flush=True)
