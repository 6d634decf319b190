"""The probe's paged windowed MQA attention: Triton kernel == torch reference == float64 loop.

The kernel checks run under ``TRITON_INTERPRET=1`` in a subprocess (this file run as a script): triton
decides interpretation when ``@triton.jit`` runs, so the variable must be set before the kernel module is
first imported, and setting it in the pytest process would change other tests' kernels too. On a CUDA
machine the same sweep also runs compiled and inside a CUDA graph (the ``gpu`` test), which is what makes
"no host syncs in the launcher" a tested property rather than a claim.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WINDOWS = (None, 1, 16, 64)
ROW_COUNTS = (1, 5, 37)
NUM_REQS, MAX_CTX, NUM_SLOTS, H, D = 3, 200, 1024, 8, 64
# Positions where the window and the key blocks (BLOCK_N 16 / 64) start, end and cross.
EDGE_POSITIONS = [0, 1, 15, 16, 17, 63, 64, 65, 79, 80, 127, 128, 129, 199]


def _kernel_module():
    """The kernel module, installed (``sglang_ext.kernels``) or from the checkout (device machines)."""
    try:
        from sglang_ext.kernels import probe_attention as mod

        return mod
    except ImportError:
        path = os.path.join(HERE, "..", "..", "kernels", "probe_attention.py")
        spec = importlib.util.spec_from_file_location("_probe_attention_checkout", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


def make_case(n_rows: int, dtype: torch.dtype, seed: int, device="cpu"):
    """A pool with scattered slots shared by several requests, and query rows at window/block edges."""
    g = torch.Generator().manual_seed(seed)
    kv_pool = torch.randn(NUM_SLOTS, 2 * D, generator=g).to(dtype)
    # Each request owns a random, non-contiguous set of slots (like a radix cache after evictions).
    req_to_token = torch.randperm(NUM_SLOTS, generator=g)[: NUM_REQS * MAX_CTX].reshape(NUM_REQS, MAX_CTX)
    req_to_token = req_to_token.to(torch.int32)
    row_req = torch.randint(0, NUM_REQS, (n_rows,), generator=g, dtype=torch.int32)
    pos = torch.tensor(EDGE_POSITIONS, dtype=torch.int32)
    if n_rows <= len(EDGE_POSITIONS):
        row_pos = pos[torch.randperm(len(EDGE_POSITIONS), generator=g)[:n_rows]]
        if n_rows == 1:
            row_pos = torch.tensor([129], dtype=torch.int32)  # a decode row past the window and 2 blocks
    else:
        extra = torch.randint(0, MAX_CTX, (n_rows - len(EDGE_POSITIONS),), generator=g, dtype=torch.int32)
        row_pos = torch.cat([pos, extra])
    q = (torch.randn(n_rows, H, D, generator=g) * 2.0).to(dtype)  # peaked softmax: errors in masking show
    return [t.to(device) for t in (q, kv_pool, req_to_token, row_req, row_pos)]


def loop_reference_f64(q, kv_pool, req_to_token, row_req, row_pos, window, scale):
    """Independent oracle: per row and head, the keys listed explicitly, softmax in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        pos, req = int(row_pos[t]), int(row_req[t])
        first = 0 if not window else max(0, pos - window + 1)
        keys = list(range(first, pos + 1))
        if not keys:
            continue
        slots = [int(req_to_token[req, j]) for j in keys]
        k = kv_pool[slots, :D].double()
        v = kv_pool[slots, D:].double()
        for h in range(q.shape[1]):
            s = [float((q[t, h].double() * k[i]).sum()) * scale for i in range(len(keys))]
            m = max(s)
            w = [math.exp(x - m) for x in s]
            z = sum(w)
            out[t, h] = sum((w[i] / z) * v[i] for i in range(len(keys)))
    return out


# ---------------------------------------------------------------------------------------------------------
# in-process: torch reference vs float64 loop, launcher argument checks
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_matches_float64_loop(window, dtype):
    mod = _kernel_module()
    case = make_case(37, dtype, seed=7)
    scale = 1.0 / math.sqrt(D)
    got = mod.probe_attention_ref(*case, window, scale)
    want = loop_reference_f64(*case, window, scale)
    assert got.dtype == torch.float32 and got.shape == (37, H, D)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


def test_reference_row_chunking_is_exact():
    """Tiny max_elems forces one row per chunk; results must not depend on chunking."""
    mod = _kernel_module()
    case = make_case(37, torch.float32, seed=3)
    a = mod.probe_attention_ref(*case, 16)
    b = mod.probe_attention_ref(*case, 16, max_elems=1)
    # Wider chunks pad rows with masked keys, which changes float summation order only.
    torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_reference_window_edge():
    """Key pos-W+1 is visible to row pos, key pos-W is not (checked by poisoning one K/V slot)."""
    mod = _kernel_module()
    q, kv, r2t, _, _ = make_case(1, torch.float32, seed=1)
    w, pos = 16, 100
    row_req, row_pos = torch.tensor([0], dtype=torch.int32), torch.tensor([pos], dtype=torch.int32)
    base = mod.probe_attention_ref(q, kv, r2t, row_req, row_pos, w)
    for key, visible in ((pos - w, False), (pos - w + 1, True), (pos, True), (pos + 1, False)):
        kv2 = kv.clone()
        kv2[int(r2t[0, key])] += 5.0
        changed = not torch.equal(mod.probe_attention_ref(q, kv2, r2t, row_req, row_pos, w), base)
        assert changed == visible, (key, visible)


def test_launcher_rejects_bad_shapes():
    mod = _kernel_module()
    q, kv, r2t, rr, rp = make_case(5, torch.float32, seed=0)
    with pytest.raises(ValueError, match="kv_pool must be"):
        mod.probe_attention(q, kv[:, :D], r2t, rr, rp, 16)
    with pytest.raises(ValueError, match="row_req/row_pos must be"):
        mod.probe_attention(q, kv, r2t, rr[:3], rp, 16)
    with pytest.raises(ValueError, match="q must be"):
        mod.probe_attention(q[0], kv, r2t, rr, rp, 16)


# ---------------------------------------------------------------------------------------------------------
# the kernel itself: interpreted here (subprocess), compiled + CUDA graph on a GPU
# ---------------------------------------------------------------------------------------------------------


def sweep(dtype_name: str, device: str = "cpu", graph: bool = False) -> dict:
    """Kernel vs reference over rows x windows x block sizes; returns the worst errors (raises on a miss)."""
    mod = _kernel_module()
    dtype = getattr(torch, dtype_name)
    worst = 0.0
    n = 0
    # BLOCK_N 16 exercises the multi-block loop/online softmax and splits the split-K path; that logic is
    # dtype independent, so the low-precision sweeps keep only the production block size (interpreter time).
    configs = [(64, 1), (16, 1), (16, 3)] if dtype_name == "float32" else [(64, 1)]
    if device != "cpu":
        configs += [(64, None), (64, 16)]
    for n_rows in ROW_COUNTS:
        for window in WINDOWS:
            for block_n, splits in configs:
                case = make_case(n_rows, dtype, seed=100 * n_rows + (window or 0), device=device)
                want = mod.probe_attention_ref(*case, window)
                got = mod.probe_attention(*case, window, block_n=block_n, num_splits=splits)
                err = (got - want).abs().max().item()
                if not err <= 2e-5 * max(1.0, want.abs().max().item()):
                    raise AssertionError(
                        f"{dtype_name} T={n_rows} W={window} BLOCK_N={block_n} splits={splits}: max err {err}"
                    )
                worst, n = max(worst, err), n + 1
    # Graph padding rows (pos < 0) give zeros; ``out=`` is written in place; also when split.
    q, kv, r2t, rr, rp = make_case(5, dtype, seed=5, device=device)
    rp = rp.clone()
    rp[2] = -1
    for splits in (1, 4):
        out = torch.full((5, H, D), float("nan"), device=device)
        res = mod.probe_attention(q, kv, r2t, rr, rp, 64, out=out, num_splits=splits)
        assert res is out and torch.count_nonzero(out[2]) == 0 and not torch.isnan(out).any()
        torch.testing.assert_close(out, mod.probe_attention_ref(q, kv, r2t, rr, rp, 64), atol=2e-5, rtol=1e-5)
    result = {"dtype": dtype_name, "cases": n, "max_abs_err": worst}
    if graph:
        result["graph_max_abs_err"] = graph_check(mod, dtype, device)
    return result


def graph_check(mod, dtype, device) -> float:
    worst = 0.0
    for splits in (1, None):  # None: auto, split-K on a GPU for 37 rows
        worst = max(worst, _graph_check(mod, dtype, device, splits))
    return worst


def _graph_check(mod, dtype, device, splits) -> float:
    """Capture the launcher in a CUDA graph, then change positions/requests/K-V in place and replay:
    a host sync or a host-side value in the launcher would fail the capture or freeze stale values."""
    q, kv, r2t, rr, rp = make_case(37, dtype, seed=11, device=device)
    out = torch.empty((37, H, D), dtype=torch.float32, device=device)
    mod.probe_attention(q, kv, r2t, rr, rp, 64, out=out, num_splits=splits)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mod.probe_attention(q, kv, r2t, rr, rp, 64, out=out, num_splits=splits)
    worst = 0.0
    for seed in (12, 13):
        q2, kv2, r2t2, rr2, rp2 = make_case(37, dtype, seed=seed, device=device)
        for dst, src in ((q, q2), (kv, kv2), (r2t, r2t2), (rr, rr2), (rp, rp2)):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        err = (out - mod.probe_attention_ref(q, kv, r2t, rr, rp, 64)).abs().max().item()
        assert err <= 2e-5 * 8, f"graph replay err {err}"
        worst = max(worst, err)
    return worst


def test_kernel_matches_reference_interpreted():
    """fp32, fp16 and bf16 inputs (upcast at load) in one interpreter process (imports cost ~3 s)."""
    from interpreted import run_interpreted

    results = run_interpreted(__file__, ["--sweep", "float32,float16,bfloat16"], timeout=300)
    assert [r["dtype"] for r in results] == ["float32", "float16", "bfloat16"]
    n = len(ROW_COUNTS) * len(WINDOWS)
    assert [r["cases"] for r in results] == [3 * n, n, n]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_kernel_compiled_and_graph_captured(dtype_name):
    res = sweep(dtype_name, device="cuda", graph=True)
    assert res["graph_max_abs_err"] <= 2e-5 * 8


if __name__ == "__main__":
    # python tests/kernels/test_probe_kernel.py --sweep DTYPE[,DTYPE...] [--device cuda] [--graph]
    args = sys.argv[1:]
    dev = args[args.index("--device") + 1] if "--device" in args else "cpu"
    for name in args[args.index("--sweep") + 1].split(","):
        print(json.dumps(sweep(name, device=dev, graph="--graph" in args)), flush=True)
