"""The one-shot decode MoE (kernels/moe/oneshot.py) == `moe_ref` == the shipped `fused_moe_fp8` path.

Oracles: `moe_ref` (the maths in torch, on the kernel's own routing), the shipped decode path
(`fused_moe_fp8` / `fused_experts_fp8` with the table's config: the split-K GEMV path), fp64 h
from the same e4m3 operands, `quantize_activation_group128` (h's e4m3 groups, bit for bit), and
combine.py's `_combine_kernel` run on the one-shot kernel's own per-pair outputs (`pair_out`): the
one-shot combine must give the same bits.

Interpreted checks (``TRITON_INTERPRET=1``, this file run as a script in two subprocesses at
once, as tests/kernels/test_kernel_moe.py does it: the variable must be set before the kernels are
imported) on fresh random small shapes whose every edge is ragged: hidden / intermediate 160 or
288 (1.25 / 2.25 groups of 128; 2I = 320 / 576 W1 rows), 4-8 experts, T = 1..4, biases on and
off, expert parallelism (experts 2..6 of 8 local, b2 left to the caller), routing given or from
the decode front, h quantised by its own launch or inside mlp2, mlp2 per token or per pair (last
arriver combines), wide and narrow tiles. The
interpreter's per-op cost makes narrow tiles slow, so most cases use the widest tiles the config
allows; the GPU tests run the H200 variants.

Bounds: vs `moe_ref` the stated bounds of tests/kernels/test_kernel_moe.py (`compare_to_ref`). Vs the
shipped path only the fp32 summation order of the GEMVs can differ, which can flip a rare e4m3
rounding of h (asserted: max relative <= REF_MAX_REL). Measured, interpreted: equal bits, fp32
and bf16 (at <= 3 K blocks the shipped split-K GEMV, 3 splits of one block each, sums in the
one-shot's order: (b0 + b1) + b2); at 2880 (23 blocks) the orders differ: the GPU test reports
`vs_shipped_fp32`. h vs fp64: <= 1e-5 of max |h| (fp32 sums of exact products; measured ~2e-7).
h's codes and scales equal
`quantize_activation_group128`'s bit for bit; quantising h inside mlp2 gives the same output bits
(interpreted); `_combine_kernel` on `pair_out` gives `out`'s bits (interpreted and compiled).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (ROOT, HERE):  # as a script on a machine without the package installed
    if path not in sys.path:
        sys.path.insert(0, path)

from test_kernel_moe import REF_MAX_REL, compare_to_ref, make_experts, make_router, make_x  # noqa: E402

from sglang_ext.layers.fp8 import (  # noqa: E402
    dequantize_activation_group128,
    dequantize_weight_block128,
    quantize_activation_group128,
)
from sglang_ext.layers.moe import route, swiglu_oai  # noqa: E402

TOP_K, LIMIT = 4, 7.0
H_VS_FP64_REL = 1e-5


def _modules():
    """(moe, moe.oneshot): installed (``sglang_ext.kernels``) or from the checkout (device machines)."""
    try:
        from sglang_ext.kernels import moe
        from sglang_ext.kernels.moe import oneshot

        return moe, oneshot
    except ImportError:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        import bench_common

        bench_common.import_project()
        from sglang_ext.kernels import moe
        from sglang_ext.kernels.moe import oneshot

        return moe, oneshot


# ---------------------------------------------------------------------------------------------
# the checks (device-agnostic)
# ---------------------------------------------------------------------------------------------


def interpreted_cases(md):
    """(name, part, tokens, hidden, inter, local experts, router experts, expert_offset, b1, b2,
    entry, config, vs_shipped, vs_quant_in_mlp2). entry "layer": `fused_moe_fp8_oneshot` (decode
    front); "experts": routing from `route`, x quantised by the launcher. part: which of the two
    interpreter processes runs it (balanced by measured time)."""
    C = md.OneshotConfig
    wide = C(64, 4, 128, 16)  # 128 W1 rows, 128 W2 rows x 4 pairs: few programs
    return [
        ("T1 H288 I160 4 experts, biases", 0, 1, 288, 160, 4, 4, 0, True, True, "layer", wide, True, False),
        ("T2 EP experts 2..6 of 8, no b2, H160 I160, hq in mlp2", 0, 2, 160, 160, 5, 8, 2, True, False, "experts",
         C(64, 4, 128, 16, quant_in_mlp2=True), True, False),
        ("T2 H160 I288 6 experts, no biases", 1, 2, 160, 288, 6, 6, 0, False, False, "layer",
         C(64, 8, 64, 8), False, True),
        ("T3 H288 I288 8 experts, b1 only, routing given", 1, 3, 288, 288, 8, 8, 0, True, False, "experts",
         wide, False, False),
        ("T4 H160 I160 5 experts, biases", 1, 4, 160, 160, 5, 5, 0, True, True, "layer", wide, False, False),
        ("T1 narrow tiles mlp1 n16 mlp2 n32, H160 I160 4 experts", 1, 1, 160, 160, 4, 4, 0, True, True, "layer",
         C(16, 4, 32, 4), False, False),
        ("T2 EP experts 2..6 of 8, per-pair mlp2, no b2, H160 I288", 0, 2, 160, 288, 5, 8, 2, True, False, "experts",
         C(64, 4, 128, 16, mlp2_per_pair=True), True, False),
        ("T4 H288 I160 6 experts, biases, per-pair mlp2 n32", 1, 4, 288, 160, 6, 6, 0, True, True, "layer",
         C(64, 4, 32, 4, mlp2_per_pair=True), False, False),
    ]


def run_oneshot(md, x, router, experts, entry, config, offset, out=None, **debug):
    """(out, topk_weights, topk_ids) through the chosen entry point."""
    if entry == "layer":
        return md.fused_moe_fp8_oneshot(x, *router, *experts, top_k=TOP_K, limit=LIMIT, expert_offset=offset,
                                        config=config, out=out, return_routing=True, **debug)
    weights, ids = route(x, *router, TOP_K)
    out = md.fused_moe_decode_oneshot(x, weights, ids, *experts, limit=LIMIT, expert_offset=offset, config=config,
                                      out=out, **debug)
    return out, weights, ids


def h_fp64(x, ids, experts, offset, limit=LIMIT):
    """h per pair [P, I] in fp64 from the same e4m3 operands (x's groups, W1's blocks); NaN rows
    for pairs off this rank."""
    q1, s1, b1 = experts[:3]
    xf = dequantize_activation_group128(*quantize_activation_group128(x)).double()
    flat = ids.reshape(-1).long() - offset
    inter = q1.shape[1] // 2
    h = torch.full((flat.numel(), inter), float("nan"), dtype=torch.float64, device=x.device)
    for p, e in enumerate(flat.tolist()):
        if 0 <= e < q1.shape[0]:
            w = dequantize_weight_block128(q1[e], s1[e]).double()
            g = xf[p // ids.shape[1]] @ w.t() + (b1[e].double() if b1 is not None else 0)
            h[p] = swiglu_oai(g, limit)
    return h


def combine_of(mod, pair_out, weights, ids, offset, num_local, out_like):
    """combine.py's `_combine_kernel` on given per-pair outputs (the shipped path's last launch)."""
    num_tokens, hidden = out_like.shape
    out = torch.empty_like(out_like)
    block_h = min(1024, 1 << (hidden - 1).bit_length())
    mod._combine_kernel[(-(-num_tokens // mod.COMBINE_BLOCK_T), -(-hidden // block_h))](
        pair_out, weights.contiguous(), ids.contiguous(), out, num_tokens, hidden, out.stride(0), offset, num_local,
        TOP_K=ids.shape[1], BLOCK_T=mod.COMBINE_BLOCK_T, BLOCK_H=block_h, SPLIT_K=1, num_warps=4)
    return out


def check_case(mod, md, device, name, num_tokens, hidden, inter, num_local, router_experts, offset, with_b1,
               with_b2, entry, config, vs_shipped, vs_quant_in_mlp2, seed) -> dict:
    q1, s1, b1, q2, s2, b2 = make_experts(num_local, hidden, inter, seed=seed, device=device, with_b2=with_b2)
    experts = (q1, s1, b1 if with_b1 else None, q2, s2, b2)
    router = make_router(router_experts, hidden, seed=seed + 1, device=device)
    x = make_x(num_tokens, hidden, seed=seed + 2, device=device)
    num_pairs = num_tokens * TOP_K
    pair_out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=device)
    h_out = torch.full((num_pairs, inter), float("nan"), dtype=torch.float32, device=device)
    out, weights, ids = run_oneshot(md, x, router, experts, entry, config, offset, pair_out=pair_out, h_out=h_out)
    assert out.dtype == x.dtype and out.shape == x.shape
    result = {"case": name}
    ref = mod.moe_ref(x, None, None, *experts, top_k=TOP_K, limit=LIMIT, expert_offset=offset, routing=(weights, ids))
    result.update(compare_to_ref(out, ref, name))
    if device != "cpu":  # a second call: the same bits (no atomics; the interpreter is sequential)
        again, _, _ = run_oneshot(md, x, router, experts, entry, config, offset)
        assert torch.equal(again, out), f"{name}: results differ call to call"

    # h: fp32 sums of exact products vs fp64, and its e4m3 groups vs the torch quantiser
    local = ((ids.reshape(-1).long() - offset >= 0) & (ids.reshape(-1).long() - offset < num_local))
    exact = h_fp64(x, ids, experts, offset)[local]
    h = h_out[local]
    h_rel = ((h.double() - exact).abs().max() / exact.abs().max()).item()
    assert h_rel <= H_VS_FP64_REL, f"{name}: h vs fp64 {h_rel:.3g} > {H_VS_FP64_REL}"
    result["h_max_rel_vs_fp64"] = h_rel
    hq, hs = md.quantize_h(h_out, ids, offset, num_local)
    want_q, want_s = quantize_activation_group128(h)
    assert torch.equal(hq[local].view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(hs[local], want_s), \
        f"{name}: h's e4m3 groups differ from quantize_activation_group128"

    # the combine: `_combine_kernel` on this kernel's per-pair outputs gives the same bits
    combined = combine_of(mod, pair_out, weights, ids, offset, num_local, out)
    result["combine_equal"] = (combined == out).float().mean().item()
    assert torch.equal(combined, out), f"{name}: _combine_kernel of pair_out != out ({result['combine_equal']})"

    if vs_quant_in_mlp2:
        from dataclasses import replace

        flipped = replace(config, quant_in_mlp2=not config.quant_in_mlp2)
        other, _, _ = run_oneshot(md, x, router, experts, entry, flipped, offset)
        result["quant_in_mlp2_equal"] = (other == out).float().mean().item()
        if device == "cpu":
            assert torch.equal(other, out), f"{name}: h quantised in mlp2 gives other bits"
    if vs_shipped:
        # the shipped decode path (table config) on the same routing, fp32 outputs (both combines
        # round the same fp32 sum once, so bf16 outputs are these rounded)
        fp32 = lambda: torch.empty(x.shape, dtype=torch.float32, device=device)  # noqa: E731
        ship = mod.fused_experts_fp8(x, weights, ids, *experts, limit=LIMIT, expert_offset=offset, out=fp32())
        mine, _, _ = run_oneshot(md, x, router, experts, entry, config, offset, out=fp32())
        assert torch.equal(mine.to(out.dtype), out), f"{name}: fp32 out rounded != the {out.dtype} out"
        scale = ship.abs().max().item()
        result["max_rel_vs_shipped_fp32"] = (mine - ship).abs().max().item() / scale
        result["equal_vs_shipped_fp32"] = (mine == ship).float().mean().item()
        result["equal_vs_shipped_bf16"] = (ship.to(out.dtype) == out).float().mean().item()
        assert result["max_rel_vs_shipped_fp32"] <= REF_MAX_REL, f"{name}: vs the shipped path {result}"
    return result


def check_h_quant(md, device) -> dict:
    """`quantize_h` on planted edges == `quantize_activation_group128`, codes and scales bit for bit:
    an all-zero group (scale 1), -0 results, e4m3 ties (to even), roundings that carry into the
    next power of two, subnormals, clamping at 448, a ragged last group (288 = 2.25 x 128)."""
    g = torch.Generator(device=device).manual_seed(7)
    pairs, inter = 8, 288
    h = torch.randn(pairs, inter, generator=g, device=device) * torch.logspace(-6, 3, pairs, device=device)[:, None]
    h[0, :128] = 0.0
    h[1, :128] = torch.tensor([448.0, -448.0] + [1e-9, -1e-9] * 63, device=device)  # tiny: -0 / +0 codes
    ties = torch.tensor([1.0625, 1.1875, 17.0, 19.0, -1.0625, 0.0009765625 * 1.5, 15.75, 15.9], device=device)
    h[2, :128] = ties.repeat(16)
    h[2, 0] = 448.0  # scale exactly 1: the ties stay ties
    h[3, 130:140] = torch.tensor([240.0, 247.9, 248.0, 255.9, -250.0, 0.001, -0.002, 3.0, 2.9999, 448.0],
                                 device=device)
    h[3, 140:256] = 0.0
    h[4, 256:] = torch.randn(32, generator=g, device=device) * 1e-3  # the ragged group alone
    ids = torch.zeros(pairs // TOP_K, TOP_K, dtype=torch.int32, device=device)
    hq, hs = md.quantize_h(h.contiguous(), ids)
    want_q, want_s = quantize_activation_group128(h)
    assert torch.equal(hq.view(torch.uint8), want_q.view(torch.uint8)), "quantize_h codes != torch's"
    assert torch.equal(hs, want_s), "quantize_h scales != torch's"
    return {"h_quant_groups": hs.numel(), "negative_zero_codes": int((hq.view(torch.uint8) == 0x80).sum())}


def check_interpreter_tiles(mod, md, device) -> dict:
    """`fused_moe_fp8` on the table's one-shot row runs wide tiles under the interpreter (fewer
    programs, see `_experts`): the same bits as that row's own tiles given explicitly."""
    q1, s1, b1, q2, s2, b2 = make_experts(8, 288, 160, seed=91, device=device)
    rw, rb = make_router(8, 288, seed=92, device=device)
    x = make_x(1, 288, seed=93, device=device)
    row = mod.select_config(1)
    assert row.oneshot
    got, weights, ids = mod.fused_moe_fp8(x, rw, rb, q1, s1, b1, q2, s2, b2, top_k=TOP_K, limit=LIMIT,
                                          return_routing=True)
    narrow = md.OneshotConfig(row.mlp1_block_n, row.mlp1_warps, row.mlp2_block_n, row.mlp2_warps,
                              mlp2_per_pair=row.mlp2_per_pair)
    want = md.fused_moe_decode_oneshot(x, weights, ids, q1, s1, b1, q2, s2, b2, LIMIT, 0, narrow)
    assert torch.equal(got, want), "the interpreter's wide one-shot tiles changed the bits"
    return {"interpreter_tiles_equal": True}


def run_part(part: int, device: str = "cpu") -> dict:
    mod, md = _modules()
    t0 = time.time()
    result = {"part": part, "device": device, "cases": []}
    if part == 0:
        result.update(check_h_quant(md, device))
    if part == 1 and device == "cpu":
        result.update(check_interpreter_tiles(mod, md, device))
    for i, (name, p, *case) in enumerate(interpreted_cases(md)):
        if p == part:
            result["cases"].append(check_case(mod, md, device, name, *case, seed=300 + 17 * i))
    result["seconds"] = round(time.time() - t0, 1)
    return result


# ---------------------------------------------------------------------------------------------
# in-process: configs and launcher checks (no kernel runs)
# ---------------------------------------------------------------------------------------------


def test_configs_and_chunks():
    _, md = _modules()
    assert md.pow2_chunks(23) == (16, 8) and md.pow2_chunks(3) == (2, 1) and md.pow2_chunks(2) == (2, 0)
    assert md.pow2_chunks(1) == (1, 0) and md.pow2_chunks(16) == (16, 0) and md.pow2_chunks(17) == (16, 1)
    variants = md.oneshot_variants()
    assert len(set(variants)) == len(variants) and md.DEFAULT_ONESHOT in variants
    assert {v.quant_in_mlp2 for v in variants} == {False, True} and {v.mlp2_per_pair for v in variants} == {False, True}
    for v in variants:  # every variant the sweep times is valid at the real shapes
        md._check_config(v, 2880, 2880, TOP_K)
    labels = [v.short() for v in variants]
    assert len(set(labels)) == len(labels)


def test_launcher_rejects_bad_calls():
    _, md = _modules()
    experts = make_experts(4, 160, 160, seed=1)
    x = make_x(2, 160, seed=2)
    weights, ids = route(x, *make_router(4, 160, seed=3), TOP_K)
    C = md.OneshotConfig
    for bad, match in ((C(mlp1_block_n=3), "power of two"), (C(mlp1_block_n=128), "mlp1_block_n <= 64"),
                       (C(mlp2_block_n=256), "mlp2_block_n <= 128"), (C(mlp2_block_n=128, mlp2_warps=1), "bytes per"),
                       (C(mlp2_per_pair=True, quant_in_mlp2=True), "does not apply")):
        with pytest.raises(ValueError, match=match):
            md.fused_moe_decode_oneshot(x, weights, ids, *experts, config=bad)
    with pytest.raises(ValueError, match="both be"):
        md.fused_moe_decode_oneshot(x, weights[:1], ids, *experts)
    with pytest.raises(ValueError, match="x_fp8 and x_scale"):
        md.fused_moe_decode_oneshot(x, weights, ids, *experts, x_fp8=torch.empty(2, 160, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="pair_out"):
        md.fused_moe_decode_oneshot(x, weights, ids, *experts, pair_out=torch.empty(8, 160, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="w1 must be"):
        md.fused_moe_decode_oneshot(x, weights, ids, experts[0][:, :, :128], *experts[1:])
    empty = make_x(0, 160, seed=2)
    out = md.fused_moe_decode_oneshot(empty, weights[:0], ids[:0], *experts)  # nothing to launch
    assert out.shape == (0, 160)


# ---------------------------------------------------------------------------------------------
# interpreted kernels (subprocesses)
# ---------------------------------------------------------------------------------------------


def test_oneshot_interpreted():
    """Every interpreted case (`interpreted_cases`) and the h quantisation edges, in two
    interpreter processes at once."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--part", str(part)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for part in (0, 1)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, f"interpreted part failed:\n{stdout[-3000:]}\n{stderr[-5000:]}"
        results += [json.loads(line) for line in stdout.strip().splitlines() if line.startswith("{")]
    assert len(results) == 2 and results[0]["h_quant_groups"] == 8 * 3 and results[0]["negative_zero_codes"] > 0
    assert results[1]["interpreter_tiles_equal"]
    _, md = _modules()
    assert sum(len(r["cases"]) for r in results) == len(interpreted_cases(md))
    print(json.dumps(results))


# ---------------------------------------------------------------------------------------------
# GPU: gpt-oss-120b shapes (128 experts, H = I = 2880), compiled, CUDA graph
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def gpu_layer_120b():
    from test_kernel_moe import gpu_layer

    return gpu_layer(128)


def gpu_configs():
    """The default, the extremes of the sweep's tiles, h quantised in mlp2."""
    _, md = _modules()
    C = md.OneshotConfig
    return [md.DEFAULT_ONESHOT, C(2, 2, 1, 2), C(16, 8, 8, 8), C(8, 4, 4, 4, quant_in_mlp2=True),
            C(4, 4, 8, 4, mlp2_per_pair=True)]


def gpu_oneshot(num_tokens: int, config) -> dict:
    """Full 120b shapes: vs `moe_ref` (compiled bounds) on the kernel's own routing, vs the shipped
    `fused_moe_fp8` (same routing: the same decode front), `_combine_kernel` on pair_out == out bit
    for bit, h's groups == `quantize_activation_group128`, bits call to call, and the layer captured
    in a CUDA graph, replayed on new tokens written in place."""
    mod, md = _modules()
    router, experts = gpu_layer_120b()
    x = make_x(num_tokens, 2880, seed=50 + num_tokens, device="cuda")
    what = f"120b T={num_tokens} {config.short()}"
    out, weights, ids = md.fused_moe_fp8_oneshot(x, *router, *experts, config=config, return_routing=True)
    ref = mod.moe_ref(x, None, None, *experts, routing=(weights, ids))
    result = {"tokens": num_tokens, "config": config.short(), "eager": compare_to_ref(out, ref, what)}
    shipped, w_s, i_s = mod.fused_moe_fp8(x, *router, *experts, return_routing=True)
    assert torch.equal(w_s, weights) and torch.equal(i_s, ids), f"{what}: routing differs from fused_moe_fp8"
    diff = (out.float() - shipped.float()).abs()
    result["vs_shipped"] = {"max_rel": (diff.max() / shipped.float().abs().max()).item(),
                            "equal": (out == shipped).float().mean().item()}
    assert result["vs_shipped"]["max_rel"] <= REF_MAX_REL, f"{what}: vs shipped {result['vs_shipped']}"
    # fp32 outputs: the GEMVs' summation orders are the whole difference (split-K vs one pass)
    mine32 = md.fused_moe_fp8_oneshot(x, *router, *experts, config=config, out=torch.empty_like(x, dtype=torch.float32))
    ship32 = mod.fused_moe_fp8(x, *router, *experts, out=torch.empty_like(x, dtype=torch.float32))
    assert torch.equal(mine32.to(out.dtype), out), f"{what}: fp32 out rounded != the bf16 out"
    result["vs_shipped_fp32"] = {"max_rel": ((mine32 - ship32).abs().max() / ship32.abs().max()).item(),
                                 "rel_fro": ((mine32 - ship32).norm() / ship32.norm()).item(),
                                 "equal": (mine32 == ship32).float().mean().item()}
    for _ in range(2):
        assert torch.equal(md.fused_moe_fp8_oneshot(x, *router, *experts, config=config), out), \
            f"{what}: results differ call to call"
    pair_out = torch.zeros(num_tokens * TOP_K, 2880, dtype=torch.float32, device="cuda")
    h_out = torch.zeros(num_tokens * TOP_K, 2880, dtype=torch.float32, device="cuda")
    again = md.fused_moe_decode_oneshot(x, weights, ids, *experts, config=config, pair_out=pair_out, h_out=h_out)
    assert torch.equal(again, out), f"{what}: the experts' entry point differs from the layer's"
    combined = combine_of(mod, pair_out, weights, ids, 0, 128, out)
    result["combine_equal"] = (combined == out).float().mean().item()
    assert torch.equal(combined, out), f"{what}: _combine_kernel of pair_out != out ({result['combine_equal']})"
    hq, hs = md.quantize_h(h_out, ids)
    want_q, want_s = quantize_activation_group128(h_out)
    assert torch.equal(hq.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(hs, want_s), \
        f"{what}: h's e4m3 groups differ from quantize_activation_group128"
    exact = h_fp64(x, ids, experts, 0)
    result["h_max_rel_vs_fp64"] = ((h_out.double() - exact).abs().max() / exact.abs().max()).item()

    buf = torch.empty_like(x)
    md.fused_moe_fp8_oneshot(x, *router, *experts, config=config, out=buf)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, weights, ids = md.fused_moe_fp8_oneshot(x, *router, *experts, config=config, out=buf, return_routing=True)
    for seed in (60, 61):
        x.copy_(make_x(num_tokens, 2880, seed=seed, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        ref = mod.moe_ref(x, None, None, *experts, routing=(weights, ids))
        result[f"replay_{seed}"] = compare_to_ref(buf, ref, f"graph replay {what}")
    return result


GPU_CASES = [(t, 0) for t in (1, 2, 4)] + [(1, i) for i in range(1, len(gpu_configs()))] + [(4, len(gpu_configs()) - 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,which", GPU_CASES)
def test_oneshot_120b_and_cuda_graph(num_tokens, which):
    print(json.dumps(gpu_oneshot(num_tokens, gpu_configs()[which])))


if __name__ == "__main__":
    # TRITON_INTERPRET=1 python tests/kernels/test_kernel_moe_decode.py --part 0|1 [--device cuda]
    # python tests/kernels/test_kernel_moe_decode.py --gpu      (full 120b shapes, every GPU case)
    args = sys.argv[1:]
    if "--gpu" in args:
        for t, which in GPU_CASES:
            print(json.dumps(gpu_oneshot(t, gpu_configs()[which])), flush=True)
    else:
        dev = args[args.index("--device") + 1] if "--device" in args else "cpu"
        print(json.dumps(run_part(int(args[args.index("--part") + 1]), dev)), flush=True)
