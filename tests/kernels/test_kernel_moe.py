"""The fused FP8 MoE (kernels/moe/): Triton kernels == `moe_ref` == gpt-oss maths of the layers.

Oracles: `route` (routing, bit for bit), `quantize_activation_group128` (x's e4m3 groups, bit
for bit), a plain-Python sort (the pair layout, exactly), `moe_ref` (the kernel's maths in
torch: fp32 GEMMs on dequantised weights) and `experts_torch` on dequantised weights (the
layer's maths without activation quantisation). `moe_ref` itself is checked against
`experts_torch` with activation quantisation switched off. The decode front (T <= 16: router
logits in Triton) against fp64 and torch's GEMM (one ulp, rarely: another fp32 summation
order) and, on its own logits, `route`'s top-k + softmax bit for bit; the MoE cases then check
the experts' maths on the kernel's routing and that routing against `route`.

The kernel checks run under ``TRITON_INTERPRET=1`` in a subprocess (this file run as a script):
triton decides interpretation when ``@triton.jit`` runs, so the variable must be set before the
kernel module is first imported, and setting it here would change other tests' kernels. Small
dims with every ragged edge of the real model: hidden 320 = 2.5 blocks of 128, intermediate
160 (h groups 1.25, W1 rows 2.5 blocks), 8 experts, top-4. On a CUDA machine the `gpu` tests
run the real shapes (hidden 2880, 32 experts) compiled and inside a CUDA graph. The decode GEMV
path (`MoeConfig.gemv`): its knobs on the small dims here (`gemv_cases`), every variant the H200
sweep times (`decode_gemv_variants`) at full size on the GPU, with graph replays. mlp1's one-dot
variant (`MoeConfig.mlp1_one_dot`) on other ragged dims (`one_dot_cases`, hidden 160/288/320,
intermediate 160/288, 4-8 experts, biases on and off, fused requant on and off, split-K, two
passes (`mlp1_passes`, the prefill table's row) including a pass past 2I) against
`moe_ref` and the default two-dot mlp1: interpreted, the same bits (both sum the same exact e4m3
products in K order; bias and activation are the same elementwise fp32 operations); compiled
(120b prefill, 8192 tokens), within the compiled bounds of each other.

Tolerances vs `moe_ref`: the kernel's sums run in another order, so h can differ in its last
bits and, rarely, round to the neighbouring e4m3 value (a 6-12% step of that one element).
Interpreted (exact e4m3 products, fp32 sums): max |out - ref| <= 2^-6 * max|ref| and >= 99% of
elements within one bf16 ulp (+1e-6) of ref. Compiled, Hopper's FP8 tensor cores accumulate
each 128-deep K step with ~2^-14 relative error, which flips ~0.1% of h's e4m3 roundings:
max <= 2^-6 * max|ref| and relative Frobenius error <= 1e-2. Vs `experts_torch` (no activation
quantisation) the e4m3 rounding of x and h is the whole difference: relative Frobenius <= 6%.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:  # run as a script on a machine without the package installed
    sys.path.insert(0, ROOT)

from sglang_ext.layers.fp8 import (  # noqa: E402
    dequantize_weight_block128,
    quantize_activation_group128,
    quantize_weight_block128,
)
from sglang_ext.layers.moe import add_down_bias, experts_torch, route  # noqa: E402

HIDDEN, INTER, NUM_EXPERTS, TOP_K, LIMIT = 320, 160, 8, 4, 7.0
REF_MAX_REL = 2.0 ** -6
REF_WITHIN_ULP_FRACTION = 0.99  # interpreted
REF_REL_FRO_COMPILED = 1e-2
TORCH_REL_FRO = 0.06


def _kernel_module():
    """The kernel module, installed (``sglang_ext.kernels``) or from the checkout (device machines)."""
    try:
        from sglang_ext.kernels import moe as mod

        return mod
    except ImportError:
        path = os.path.join(ROOT, "kernels", "moe", "__init__.py")
        spec = importlib.util.spec_from_file_location("_moe_checkout", path,
                                                      submodule_search_locations=[os.path.dirname(path)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # the package's relative imports find their parent here
        spec.loader.exec_module(mod)
        return mod


def make_experts(num_local, hidden, inter, seed, device="cpu", with_b2=True, bias_dtype=torch.bfloat16):
    """FP8 block-128 experts from random fp32 weights; scales so the clamp at 7 bites sometimes.
    Made on `device`. On a GPU, 8 experts at a time and the cache emptied after: a whole 120b stack's fp32 draw
    and the quantiser's scratch (~26 GB) would otherwise stay reserved in each test process, and pytest -n runs
    several processes on one card."""
    g = torch.Generator(device=device).manual_seed(seed)
    on_gpu = torch.device(device).type == "cuda"
    chunk = 8 if on_gpu else num_local

    def stack(rows, cols, std):
        q = torch.empty(num_local, rows, cols, dtype=torch.float8_e4m3fn, device=device)
        s = torch.empty(num_local, -(-rows // 128), -(-cols // 128), dtype=torch.float32, device=device)
        for lo in range(0, num_local, chunk):
            n = min(chunk, num_local - lo)
            q[lo:lo + n], s[lo:lo + n] = quantize_weight_block128(
                torch.randn(n, rows, cols, generator=g, device=device) * std)
        return q, s

    q1, s1 = stack(2 * inter, hidden, 2.5 / hidden ** 0.5)
    q2, s2 = stack(hidden, inter, 1.0 / inter ** 0.5)
    b1 = (torch.randn(num_local, 2 * inter, generator=g, device=device) * 0.5).to(bias_dtype)
    b2 = (torch.randn(num_local, hidden, generator=g, device=device) * 0.5).to(bias_dtype) if with_b2 else None
    if on_gpu:
        torch.cuda.empty_cache()
    return [q1, s1, b1, q2, s2, b2]


def make_router(num_experts, hidden, seed, device="cpu", dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(seed)
    weight = (torch.randn(num_experts, hidden, generator=g, device=device) * (2.0 / hidden ** 0.5)).to(dtype)
    bias = (torch.randn(num_experts, generator=g, device=device) * 0.5).to(dtype)
    return weight, bias


def make_x(num_tokens, hidden, seed, device="cpu", dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(num_tokens, hidden, generator=g, device=device).to(dtype)


def dequantised(q1, s1, b1, q2, s2, b2):
    """The experts as fp32 [E, out, in] tensors for `experts_torch`."""
    return (dequantize_weight_block128(q1, s1), b1.float(), dequantize_weight_block128(q2, s2),
            b2.float() if b2 is not None else None)


def compare_to_ref(out, ref, what):
    """The stated bounds vs `moe_ref` (module docstring); returns the measured errors."""
    diff = (out.float() - ref.float()).abs()
    scale = ref.float().abs().max().item()
    ulp = torch.finfo(ref.dtype).eps * ref.float().abs() if ref.dtype != torch.float32 else 0
    errors = {"max_rel_err_vs_ref": diff.max().item() / max(scale, 1e-30),
              "rel_fro_vs_ref": (diff.norm() / ref.float().norm()).item(),
              "within_ulp": (diff <= ulp + 1e-6).float().mean().item()}
    ok = errors["max_rel_err_vs_ref"] <= REF_MAX_REL
    if out.device.type == "cpu":
        ok = ok and errors["within_ulp"] >= REF_WITHIN_ULP_FRACTION
    else:
        ok = ok and errors["rel_fro_vs_ref"] <= REF_REL_FRO_COMPILED
    if not ok:
        raise AssertionError(f"{what}: vs moe_ref {errors} (bounds: max rel {REF_MAX_REL}; interpreted "
                             f"within-ulp {REF_WITHIN_ULP_FRACTION}, compiled rel Frobenius {REF_REL_FRO_COMPILED})")
    return errors


def compare_to_torch(out, want, what):
    rel = ((out.float() - want.float()).norm() / want.float().norm()).item()
    if not rel <= TORCH_REL_FRO:
        raise AssertionError(f"{what}: vs experts_torch relative Frobenius error {rel:.3g} > {TORCH_REL_FRO}")
    return rel


def align_oracle(topk_ids, num_local, expert_offset, block_m):
    """The pair layout in plain Python: per local expert, its pairs in pair order, padded to block_m."""
    flat = [int(e) - expert_offset for e in topk_ids.reshape(-1).tolist()]
    num_pairs = len(flat)
    slots, block_expert = [], []
    for expert in range(num_local):
        mine = [p for p, e in enumerate(flat) if e == expert]
        if not mine:
            continue
        padded = -(-len(mine) // block_m) * block_m
        slots += mine + [num_pairs] * (padded - len(mine))
        block_expert += [expert] * (padded // block_m)
    return slots, block_expert


# ---------------------------------------------------------------------------------------------
# in-process: the reference, the config table, launcher checks (no kernel runs)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [5, 64])  # experts_torch's gathered-bmm and per-expert paths
@pytest.mark.parametrize("expert_offset,num_local,with_b2", [(0, 8, True), (2, 4, False)])
def test_ref_without_activation_quant_is_experts_torch(num_tokens, expert_offset, num_local, with_b2):
    mod = _kernel_module()
    experts = make_experts(num_local, HIDDEN, INTER, seed=1, with_b2=with_b2)
    router = make_router(NUM_EXPERTS, HIDDEN, seed=2, dtype=torch.float32)
    x = make_x(num_tokens, HIDDEN, seed=3, dtype=torch.float32)
    got = mod.moe_ref(x, *router, *experts, top_k=TOP_K, limit=LIMIT, expert_offset=expert_offset,
                      quantize_activations=False)
    weights, ids = route(x, *router, TOP_K)
    w1, b1, w2, b2 = dequantised(*experts)
    want = experts_torch(x, weights, ids, w1, b1, w2, b2, LIMIT, expert_offset)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


# token counts of the full-shape GPU test: at least one in every bucket of the config table
GPU_TABLE_TOKENS = (1, 4, 6, 8, 12, 32, 37, 512, 1100)  # on 20b's 32 experts 6 keeps GEMV, 8 takes many pairs


def test_config_table_covers_every_token_count():
    mod = _kernel_module()
    bounds = [b for b, _ in mod.H200_HIDDEN_2880_CONFIGS]
    assert bounds == sorted(bounds) and bounds[-1] >= 1 << 40
    for t in (1, 2, 4, 8, 16, 32, 64, 128, 129, 1024, 8192, 1 << 20):
        cfg = mod.select_config(t)
        mod._check_config(cfg)
        assert cfg is next(c for b, c in mod.H200_HIDDEN_2880_CONFIGS if t <= b)
    # h is requantised once, in mlp1's epilogue, in every bucket (see the table's comment)
    assert all(c.fused_requant for _, c in mod.H200_HIDDEN_2880_CONFIGS)
    # the GPU test (compiled, CUDA graph, run-to-run bit equality; 20b's 32-expert router) runs every config the
    # table holds, the many-pairs rows included
    every = {id(c) for _, c in mod.H200_HIDDEN_2880_CONFIGS} | {id(c) for *_, c in mod.H200_MANY_PAIRS_CONFIGS}
    assert {id(mod.select_config(t, 32, TOP_K)) for t in GPU_TABLE_TOKENS} == every
    # the interpreted sweep runs the table's decode rows above one-shot (GEMV, many pairs, 16-row TMA blocks)
    ran = {id(mod.select_config(t, experts, TOP_K)) for _, t, config, *_, experts in moe_cases(mod) if config is None}
    decode = {id(mod.select_config(t, e, TOP_K)) for t, e in ((6, 32), (8, 32), (16, 32))}
    assert len(decode) == 3 and decode <= ran


def test_many_pairs_rule():
    """5..8 tokens whose pairs are at least 7/8 of the router's experts (20b's 32 at 7 and 8 tokens) take
    the 16-row blocks, which read a touched expert once; fewer pairs, or 120b's 128 experts, keep the GEMV
    row (one pair a program); an unknown expert count keeps the table's row; the rule goes by all the
    router's experts, which is what fused_moe_fp8 passes (not this rank's share)."""
    mod = _kernel_module()
    gemv, grouped = mod.select_config(8), mod.TMA_DECODE_ROW_XPTR
    assert gemv.gemv and grouped.tma and not grouped.tma_x and grouped.block_m == 16
    assert mod.select_config(8, 32) is grouped and mod.select_config(7, 32, top_k=4) is grouped
    assert mod.select_config(5, 20) is grouped  # 20 pairs on 20 experts
    assert mod.select_config(5, 22) is grouped and mod.select_config(5, 23) is gemv  # 8 * 20 vs 7 * E
    for tokens, experts in ((8, 128), (6, 32), (5, 32), (8, 0)):
        assert mod.select_config(tokens, experts) is gemv, (tokens, experts)
    assert mod.select_config(8, 64, top_k=8) is grouped and mod.select_config(8, 64, top_k=4) is gemv
    # outside 5..8 the rule leaves the table's row, however many pairs
    for tokens in (1, 4, 12, 16, 64):
        assert mod.select_config(tokens, 4) is mod.select_config(tokens)


def test_fused_moe_passes_the_routers_expert_count(monkeypatch):
    """fused_moe_fp8 asks the table with the router's expert count and top_k; fused_experts_fp8 (routing
    given: the count unknown) without one. No kernel runs: the spy raises once it has the arguments."""
    mod = _kernel_module()
    seen = []

    class Asked(Exception):
        pass

    def spy(num_tokens, num_experts=0, top_k=4):
        seen.append((num_tokens, num_experts, top_k))
        raise Asked

    monkeypatch.setattr(mod.dispatch, "select_config", spy)  # where `_check_call` looks it up
    hidden = inter = 128
    router = make_router(24, hidden, seed=1, device="cpu")
    experts = make_experts(6, hidden, inter, seed=2, device="cpu")
    x = make_x(7, hidden, seed=3, device="cpu")
    with pytest.raises(Asked):
        mod.fused_moe_fp8(x, *router, *experts, top_k=3, expert_offset=6)
    ids = torch.zeros((7, 3), dtype=torch.int32)
    with pytest.raises(Asked):
        mod.fused_experts_fp8(x, torch.ones((7, 3)), ids, *experts)
    assert seen == [(7, 24, 3), (7, 0, 4)]


def test_decode_front_takes_decode_batches_only():
    """The decode front (router in Triton) runs for 1..DECODE_FRONT_MAX_TOKENS tokens whose router
    operands F.linear accepts; other calls keep F.linear + `_front` (prefill, T = 0, mixed dtypes)."""
    mod = _kernel_module()
    rw, rb = make_router(32, HIDDEN, seed=0)
    bound = mod.DECODE_FRONT_MAX_TOKENS
    assert bound >= 16
    for t, want in ((0, False), (1, True), (3, True), (bound, True), (bound + 1, False), (8192, False)):
        assert mod._uses_decode_front(make_x(t, HIDDEN, seed=0), rw, rb) is want, t
    x = make_x(2, HIDDEN, seed=0)
    assert mod._uses_decode_front(x, rw, None)
    assert not mod._uses_decode_front(x.float(), rw, rb)
    assert not mod._uses_decode_front(x, rw, rb.float())
    assert not mod._uses_decode_front(x, rw.t().contiguous().t(), rb)
    with pytest.raises(ValueError, match="decode_front"):
        mod.decode_front(make_x(bound + 1, HIDDEN, seed=0), rw, rb, TOP_K, 32)
    # the launch shapes of both gpt-oss sizes: 96 router programs, 3 partials per logit
    for num_experts, per_program in ((128, 4), (32, 1)):
        for t_pad in (1, 4, 16):
            tiling = mod.router_tiling(num_experts, 2880, t_pad)
            assert (tiling.block_k, tiling.splits, tiling.experts) == (1024, 3, per_program)
            assert tiling.row_loop == (t_pad * per_program * 1024 > 16384)


def test_gemv_variants_are_covered():
    """Every decode GEMV variant is a valid config whose knobs the interpreted cases turn (several
    rows a program, split and unsplit mlp2), and whose splits cover K with no empty split; the
    table's decode rows are one of them."""
    mod = _kernel_module()
    tested = [c for _, _, c, *_ in gemv_cases(mod)]
    for t in (1, 2, 4, 8):
        variants = mod.decode_gemv_variants(t)
        assert len(set(variants)) == len(variants) and all(c.gemv for c in variants)
        for c in variants:
            mod._check_config(c)
            for k_dim, split in ((2880, c.mlp1_split_k), (2880, c.mlp2_split_k), (HIDDEN, c.mlp1_split_k)):
                kbp, splits, ncol = mod.gemv_shape(k_dim, c.block_m, split)
                blocks = -(-k_dim // 128)
                assert (splits - 1) * kbp < blocks <= splits * kbp and ncol >= kbp * c.block_m
    assert {c.block_m > 1 for c in tested} == {True, False}
    assert {c.mlp2_split_k > 1 for c in tested} == {True, False}
    # The table: the one-shot kernels up to 4 tokens (bench_moe_decode.md), the GEMV sweep's winner
    # for 5..8 (unless the pairs are many for the experts: H200_MANY_PAIRS_CONFIGS), the grouped rows above.
    table = mod.H200_HIDDEN_2880_CONFIGS
    assert [c.oneshot for t, c in table] == [t <= 4 for t, _ in table]
    assert [c.gemv for t, c in table] == [4 < t <= 8 for t, _ in table]
    assert mod.select_config(8) in mod.decode_gemv_variants(8)
    # 8 and 16 rows a program are valid configs, not swept (mlp1's last arriver: 128-254 registers)
    assert max(c.block_m for c in mod.decode_gemv_variants(8)) <= 4


def test_launcher_rejects_bad_shapes():
    mod = _kernel_module()
    q1, s1, b1, q2, s2, b2 = make_experts(4, HIDDEN, INTER, seed=0)
    rw, rb = make_router(NUM_EXPERTS, HIDDEN, seed=0)
    x = make_x(3, HIDDEN, seed=0)
    with pytest.raises(ValueError, match="w2 must be"):
        mod.fused_moe_fp8(x, rw, rb, q1, s1, b1, q2[:, :, :64], s2, b2)
    with pytest.raises(ValueError, match="w1_scale_inv must be"):
        mod.fused_moe_fp8(x, rw, rb, q1, s1[:, :1], b1, q2, s2, b2)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mod.fused_moe_fp8(x, rw, rb, q1.float(), s1, b1, q2, s2, b2)
    with pytest.raises(ValueError, match="outside the router"):
        mod.fused_moe_fp8(x, rw, rb, q1, s1, b1, q2, s2, b2, expert_offset=6)
    with pytest.raises(ValueError, match="b2 must be"):
        mod.fused_moe_fp8(x, rw, rb, q1, s1, b1, q2, s2, b2[:, :8])
    with pytest.raises(ValueError, match="power of two"):
        mod.fused_moe_fp8(x, rw, rb, q1, s1, b1, q2, s2, b2, config=mod.MoeConfig(24, 32, 4, 2, 32, 4, 2))
    C = mod.MoeConfig
    with pytest.raises(ValueError, match="one-shot path only"):
        mod.fused_moe_fp8(x, rw, rb, q1, s1, b1, q2, s2, b2, config=C(16, 128, 4, 2, 32, 4, 2, mlp2_per_pair=True))


def test_one_dot_config():
    """`mlp1_one_dot` is its own label (the sweep's rows), the grouped kernel's only (not gemv), and
    leaves the table's configs (and their labels) as they were."""
    mod = _kernel_module()
    from dataclasses import replace

    base = two_dot_prefill_config(mod)
    assert not base.mlp1_one_dot and "1dot" not in base.short()
    one = replace(base, mlp1_one_dot=True)
    mod._check_config(one)
    assert one.short() == base.short().replace(f"/s{base.mlp1_stages} ", f"/s{base.mlp1_stages}/1dot ", 1)
    # the table's one-dot rows are those of 9+ tokens (and the many-pairs rows), in two passes with TMA tiles
    # (the launcher falls back to pointer loads where an operand does not suit the copy engine); below, GEMV
    # and one-shot
    assert all(c.mlp1_passes == 2 and c.tma for _, c in mod.H200_HIDDEN_2880_CONFIGS if c.mlp1_one_dot)
    assert all(c.mlp1_passes == 2 and c.tma for *_, c in mod.H200_MANY_PAIRS_CONFIGS)
    assert all(mod.select_config(t).tma for t in (9, 16, 17, 32, 33, 128, 129, 8192))
    assert not any(mod.select_config(t).mlp1_one_dot or mod.select_config(t).tma for t in (1, 4, 8))
    with pytest.raises(ValueError, match="mlp1_one_dot"):
        mod._check_config(replace(mod.select_config(8), mlp1_one_dot=True))  # gemv
    with pytest.raises(ValueError, match="mlp1_one_dot"):
        mod._check_config(replace(mod.select_config(1), mlp1_one_dot=True))  # oneshot
    two_pass = replace(one, mlp1_passes=2)
    mod._check_config(two_pass)
    assert two_pass.short() == one.short().replace("/1dot ", "/1dot/p2 ", 1)
    for bad, match in ((replace(base, mlp1_passes=2), "mlp1_passes: 1, or 2 with mlp1_one_dot"),
                       (replace(two_pass, mlp1_passes=4), "got 4"),
                       (replace(two_pass, mlp1_passes=0), "got 0"),
                       (replace(two_pass, mlp1_split_k=2), "no mlp1 split-K"),
                       (replace(two_pass, mlp1_block_n=256), "16..128 W1 rows"),
                       (replace(mod.select_config(1), mlp1_passes=2), "oneshot"),
                       (replace(mod.select_config(8), mlp1_passes=2), "not gemv"),
                       (replace(mod.select_config(8), tma=True), "not gemv"),
                       (replace(mod.select_config(1), tma=True), "oneshot"),
                       (replace(one, tma=True), "MoeConfig.tma: two mlp1 passes"),
                       (replace(two_pass, tma=True, mlp2_split_k=2), "MoeConfig.tma"),
                       (replace(two_pass, tma=True, mlp1_block_n=64), "MoeConfig.tma"),
                       (replace(two_pass, tma_x=False), "MoeConfig.tma_x")):
        with pytest.raises(ValueError, match=match):
            mod._check_config(bad)
    q1, s1, b1, q2, s2, b2 = make_experts(4, HIDDEN, INTER, seed=0)
    rw, rb = make_router(NUM_EXPERTS, HIDDEN, seed=0)
    with pytest.raises(ValueError, match="mlp1_one_dot"):
        mod.fused_moe_fp8(make_x(3, HIDDEN, seed=0), rw, rb, q1, s1, b1, q2, s2, b2,
                          config=mod.MoeConfig(1, 32, 4, 3, 64, 4, 3, gemv=True, mlp1_one_dot=True))


def test_empty_batch_launches_nothing():
    """T = 0 returns an empty result without a launch (no driver here: a launch would raise)."""
    mod = _kernel_module()
    experts = make_experts(4, HIDDEN, INTER, seed=0)
    router = make_router(4, HIDDEN, seed=0)
    x = make_x(0, HIDDEN, seed=0)
    assert mod.fused_moe_fp8(x, *router, *experts).shape == (0, HIDDEN)
    ids = torch.zeros((0, TOP_K), dtype=torch.int64)
    assert mod.fused_experts_fp8(x, ids.float(), ids, *experts).shape == (0, HIDDEN)


# ---------------------------------------------------------------------------------------------
# the kernels: interpreted here (subprocess), compiled + CUDA graph on a GPU
# ---------------------------------------------------------------------------------------------


def check_routing(mod, device) -> dict:
    """route_and_quantize vs `route` (weights, ids) and fp8.py (x's e4m3 groups), bit for bit."""
    cases = 0
    for num_experts, num_tokens, dtype in ((8, 64, torch.bfloat16), (128, 200, torch.bfloat16), (32, 37, torch.float32)):
        rw, rb = make_router(num_experts, HIDDEN, seed=num_experts, device=device, dtype=dtype)
        x = make_x(num_tokens, HIDDEN, seed=num_tokens, device=device, dtype=dtype)
        x[0, :8] = torch.tensor([-1e-7, 1e-7, -3e-5, 3e-5, -0.0, 0.0, 2e-3, -2e-3])  # -> -0, +0, subnormals
        x[1, 128:256] = 0  # an all-zero group: scale 1
        logits = torch.nn.functional.linear(x, rw, rb)
        weights, ids, xq, xs = mod.route_and_quantize(logits, x, TOP_K)
        want_w, want_ids = route(x, rw, rb, TOP_K)
        # ties-free rows (the top k+1 logits distinct) must match exactly; all rows pick equal values
        top = torch.topk(logits.float(), TOP_K + 1, dim=-1).values
        distinct = (top[:, :-1] != top[:, 1:]).all(dim=-1)
        assert distinct.float().mean() >= 0.5, "too many tied rows for a meaningful check"
        assert torch.equal(ids[distinct].long(), want_ids[distinct]), f"routing ids differ (E={num_experts})"
        if dtype == torch.bfloat16:  # the model's routing dtype: bit for bit
            assert torch.equal(weights[distinct], want_w[distinct]), f"routing weights differ (E={num_experts})"
        else:  # fp32 keeps exp's last-ulp differences (torch CPU's vectorised exp vs the kernel's)
            torch.testing.assert_close(weights[distinct], want_w[distinct], rtol=2e-6, atol=0)
        picked = torch.gather(logits, 1, ids.long())
        assert torch.equal(picked, torch.gather(logits, 1, want_ids)), "top-k values differ on tied rows"
        want_q, want_s = quantize_activation_group128(x)
        assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(xs, want_s), \
            "x quantisation differs from quantize_activation_group128"
        cases += 1
    return {"routing_cases": cases}


def check_align(mod, device) -> dict:
    """The sorted, padded pair layout equals the Python oracle (single- and multi-program sorts)."""
    cases = 0
    g = torch.Generator().manual_seed(5)
    shapes = ((1, 8, 0, 16, 128), (5, 4, 2, 16, 128), (64, 8, 0, 16, 128), (64, 8, 0, 64, 16),
              (300, 8, 4, 16, 128), (300, 3, 1, 32, 64), (300, 8, 4, 16, 16))  # last: 75 chunks, 2 slabs
    if device != "cpu":  # compiled: one single-chunk, one 2-chunk, one multi-program sort (compile time)
        shapes = (shapes[1], shapes[2], shapes[4])
    for num_tokens, num_local, offset, block_m, chunk in shapes:
        ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K] for _ in range(num_tokens)])
        ids = ids.to(torch.int32).to(device)
        sorted_pairs, block_expert, max_blocks = mod.align_pairs(ids, num_local, offset, block_m, chunk)
        slots, experts = align_oracle(ids.cpu(), num_local, offset, block_m)
        used = len(experts)
        assert used <= max_blocks, (used, max_blocks)
        assert block_expert.cpu().tolist() == experts + [-1] * (max_blocks - used), (num_tokens, chunk)
        assert sorted_pairs[: used * block_m].cpu().tolist() == slots, (num_tokens, chunk)
        cases += 1
    return {"align_cases": cases}


def fused_sort_cases(device):
    """(router experts, tokens, local experts, expert_offset, block_m): the routing launch's own sort
    (17..128 tokens, up to 4 chunks of pairs) on gpt-oss's expert counts, EP subsets, ragged counts
    (forced where the table's rule, FUSED_SORT_MAX_TOKENS / FUSED_SORT_MIN_EXPERTS, picks the chunked sort)."""
    cases = [(128, 17, 128, 0, 16), (128, 32, 128, 0, 16), (128, 100, 32, 64, 16), (32, 128, 32, 0, 64),
             (128, 33, 128, 0, 32), (8, 64, 4, 4, 16)]
    return cases if device == "cpu" else cases[:3]


def check_fused_sort(mod, device) -> dict:
    """route_and_align's fused sort (the routing program sorts every pair) vs the Python oracle, and
    its routing vs torch's top-k + softmax on the same logits."""
    g = torch.Generator().manual_seed(11)
    routing = mod.routing  # the module `_front` looks the kernel and the rule up in
    real = routing._front_kernel

    class Recording:  # the routing launches' ALIGN flag: the fused sort ran, not _align_kernel after it
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                aligns.append(kwargs["ALIGN"])
                return real[grid](*args, **kwargs)
            return launch

    rule = (routing.FUSED_SORT_MAX_TOKENS, routing.FUSED_SORT_MIN_EXPERTS)
    # which sort the rule picks (H200: the fused one only for <= 64 tokens on >= 64 local experts)
    for num_experts, num_tokens, num_local, want in ((128, 64, 128, True), (128, 65, 128, False),
                                                     (32, 17, 32, False), (128, 17, 32, False)):
        logits = torch.randn(num_tokens, num_experts, generator=g).to(torch.bfloat16).to(device)
        aligns = []
        routing._front_kernel = Recording()
        try:
            mod.route_and_align(logits, None, TOP_K, num_local, 0, 16)
        finally:
            routing._front_kernel = real
        assert aligns == [want], f"E={num_experts} T={num_tokens} local {num_local}: fused sort {aligns}, want {want}"
    for num_experts, num_tokens, num_local, offset, block_m in fused_sort_cases(device):
        what = f"fused sort E={num_experts} T={num_tokens} local {offset}..{offset + num_local - 1} block {block_m}"
        logits = torch.randn(num_tokens, num_experts, generator=g).to(torch.bfloat16).to(device)
        if num_tokens >= 64:  # crowd a few experts: segments of several blocks
            logits[: num_tokens // 2, :3] += 8
        aligns: list = []
        routing._front_kernel = Recording()
        routing.FUSED_SORT_MAX_TOKENS, routing.FUSED_SORT_MIN_EXPERTS = 128, 1  # the kernel's whole range
        try:
            got = mod.route_and_align(logits, None, TOP_K, num_local, offset, block_m)
        finally:
            routing._front_kernel = real
            routing.FUSED_SORT_MAX_TOKENS, routing.FUSED_SORT_MIN_EXPERTS = rule
        assert aligns == [True], f"{what}: routing launches {aligns}, not one with the fused sort"
        want_w, want_ids = route_from_logits(logits, TOP_K)
        top = torch.topk(logits.float(), TOP_K + 1, dim=-1).values
        distinct = (top[:, :-1] != top[:, 1:]).all(dim=-1)
        assert torch.equal(got["topk_ids"][distinct].long(), want_ids[distinct]), f"{what}: routing ids"
        assert torch.equal(got["topk_weights"][distinct], want_w[distinct]), f"{what}: routing weights"
        slots, experts = align_oracle(got["topk_ids"].cpu(), num_local, offset, block_m)
        max_blocks = got["max_blocks"]
        assert len(experts) <= max_blocks, what
        assert got["block_expert"].cpu().tolist() == experts + [-1] * (max_blocks - len(experts)), what
        assert got["sorted_pairs"][: block_m * len(experts)].cpu().tolist() == slots, what
    return {"fused_sort_cases": len(fused_sort_cases(device))}


def route_from_logits(logits, top_k):
    """`route`'s last two steps on given logits: top-k, then softmax over those k in their dtype."""
    top_values, top_ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top_values, dim=-1, dtype=top_values.dtype), top_ids


def check_router_logits(got, want, what):
    """Router logits summed in another fp32 order than `want`'s: equal after the rounding to the
    router dtype except where the exact value sits near a rounding boundary, there one ulp apart
    (bf16: ~1e-3 of 2880-term logits flip; allow 1% + 2)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=what)
        return 0
    ulp = torch.finfo(got.dtype).eps * want.float().abs().clamp_min(torch.finfo(got.dtype).tiny)
    diff = (got.float() - want.float()).abs()
    assert (diff <= ulp).all(), f"{what}: router logits more than one ulp from the reference: {diff.max()}"
    flips = (diff > 0).sum().item()
    assert flips <= 0.01 * want.numel() + 2, f"{what}: {flips} of {want.numel()} logits one ulp off"
    return flips


def check_routing_vs_route(weights, ids, x, rw, rb, what):
    """The fused router's (weights, ids) vs `route` (the layer's maths, torch's GEMM). The decode
    front's logits may sit one ulp (<= eps |l|) from torch's, so: ids must agree on every row
    whose top k+1 reference logits are more than two such ulps apart, and weights within what
    one-ulp logit moves allow (softmax: |dw_j| <= w_j (|dl_j| + sum_i w_i |dl_i|) <= 2 w_j eps
    max|l|, x1.25 for second order) plus one rounding of w on each side. Where no logit moved,
    the routing is `route`'s bit for bit (check_decode_front, on the kernel's own logits)."""
    want_w, want_ids = route(x, rw, rb, weights.shape[1])
    logits = torch.nn.functional.linear(x, rw, rb).float()
    top = torch.topk(logits, ids.shape[1] + 1, dim=-1).values
    eps = torch.finfo(rw.dtype).eps
    margin = 2 * eps * torch.maximum(top[:, :-1].abs(), top[:, 1:].abs())
    clear = ((top[:, :-1] - top[:, 1:]) > margin).all(dim=-1)
    assert torch.equal(ids[clear].long(), want_ids[clear]), f"{what}: expert ids differ from route()"
    w = want_w.float()
    tol = w * (2.5 * eps * top[:, :-1].abs().amax(dim=-1, keepdim=True) + 2 * torch.finfo(weights.dtype).eps)
    assert ((weights.float() - w).abs()[clear] <= tol[clear] + 1e-12).all(), \
        f"{what}: routing weights further from route() than one-ulp logit moves allow"


def decode_front_cases(mod):
    """(router experts, tokens, local experts, expert_offset, router dtype, tiling override):
    batch 1 / 3 / 16 of both gpt-oss expert counts, EP subsets, an fp32 router; the last two
    force the GPU's 120b tiling (4 rows per program, and the row loop of T > 4) on small dims."""
    tile = mod.RouterTiling
    return [
        (128, 1, 128, 0, torch.bfloat16, None),
        (128, 3, 32, 64, torch.bfloat16, None),
        (128, 16, 128, 0, torch.bfloat16, None),
        (32, 1, 32, 0, torch.bfloat16, None),
        (32, 3, 8, 8, torch.bfloat16, None),
        (32, 5, 32, 0, torch.float32, None),
        (32, 16, 8, 24, torch.bfloat16, tile(block_k=128, splits=3, experts=4, row_loop=True)),
        (8, 4, 8, 0, torch.bfloat16, tile(block_k=128, splits=3, experts=4, row_loop=False)),
    ]


def check_decode_front(mod, device, hidden=HIDDEN, cases=None) -> dict:
    """Router GEMV + routing + x's e4m3 groups + sort in one launch (T <= 16), each output against
    its oracle: logits vs exact (fp64) and torch's GEMM, rounded to the router dtype (one ulp,
    rarely); routing vs `route`'s top-k + softmax on the kernel's own logits, bit for bit on
    ties-free rows; x's quantisation bit for bit; the sort vs the Python oracle; the arrival
    counter back at zero. Compiled, also the same bits on a second call."""
    from sglang_ext.kernels.arrival_counters import current

    flips = 0
    if cases is None:
        cases = decode_front_cases(mod)
        if device != "cpu":  # compiled small dims: EP subset, fp32 router, forced row loop (compile time);
            cases = [cases[1], cases[5], cases[6]]  # gpu_decode_front runs the H200 tilings at full size
    for num_experts, num_tokens, num_local, offset, dtype, tiling in cases:
        what = f"decode front E={num_experts} T={num_tokens} local {offset}..{offset + num_local - 1} {dtype}"
        rw, rb = make_router(num_experts, hidden, seed=num_experts + num_tokens, device=device, dtype=dtype)
        x = make_x(num_tokens, hidden, seed=7 * num_tokens, device=device, dtype=dtype)
        got = mod.decode_front(x, rw, rb, TOP_K, num_local, offset, block_m=16, tiling=tiling)
        counter = current(mod.ROUTER_COUNTER_OWNER, x.device)
        assert counter is not None and not counter.any(), f"{what}: arrival counter not left at zero"
        logits = got["logits"]
        exact = (x.double() @ rw.double().t() + rb.double()).to(dtype)
        flips += check_router_logits(logits, exact, what + " vs fp64")
        check_router_logits(logits, torch.nn.functional.linear(x, rw, rb), what + " vs F.linear")
        want_w, want_ids = route_from_logits(logits, TOP_K)
        weights, ids = got["topk_weights"], got["topk_ids"]
        top = torch.topk(logits.float(), TOP_K + 1, dim=-1).values
        distinct = (top[:, :-1] != top[:, 1:]).all(dim=-1)
        assert torch.equal(ids[distinct].long(), want_ids[distinct]), f"{what}: routing ids"
        if dtype == torch.float32:  # exp's last ulp differs between torch CPU and the kernel
            torch.testing.assert_close(weights[distinct], want_w[distinct], rtol=2e-6, atol=0)
        else:
            assert torch.equal(weights[distinct], want_w[distinct]), f"{what}: routing weights"
        assert torch.equal(torch.gather(logits, 1, ids.long()), torch.gather(logits, 1, want_ids)), \
            f"{what}: top-k values differ on tied rows"
        want_q, want_s = quantize_activation_group128(x)
        assert torch.equal(got["x_fp8"].view(torch.uint8), want_q.view(torch.uint8)), f"{what}: x_fp8"
        assert torch.equal(got["x_scale"], want_s), f"{what}: x_scale"
        slots, experts = align_oracle(ids.cpu(), num_local, offset, 16)
        max_blocks = got["max_blocks"]
        assert got["block_expert"].cpu().tolist() == experts + [-1] * (max_blocks - len(experts)), what
        assert got["sorted_pairs"][: 16 * len(experts)].cpu().tolist() == slots, what
        if device != "cpu":  # bits independent of which router program arrives last
            again = mod.decode_front(x, rw, rb, TOP_K, num_local, offset, block_m=16, tiling=tiling)
            assert all(torch.equal(again[k], got[k]) for k in ("logits", "topk_weights", "topk_ids")), what
    return {"decode_front_cases": len(cases), "decode_front_logit_flips": flips}


def moe_cases(mod):
    """(name, tokens, config, expert_offset, local experts, mlp2 bias, routing given, router
    experts). T <= mod.DECODE_FRONT_MAX_TOKENS runs the decode front (router in Triton)."""
    C = mod.MoeConfig
    bound = mod.DECODE_FRONT_MAX_TOKENS
    return [
        ("decode table T=1 (one-shot)", 1, None, 0, 8, True, False, NUM_EXPERTS),
        ("decode table T=6 (GEMV: 24 pairs on a 32-expert router), EP rank 0..7", 6, None, 0, 8, True, False, 32),
        ("decode table T=7, many pairs (28 on 8 router experts): 16-row TMA blocks", 7, None, 0, 8, True, False,
         NUM_EXPERTS),
        (f"decode table T={bound}, 32-expert router, EP rank 8..11, no b2", bound, None, 8, 4, False, False, 32),
        ("narrow fp32-h tiles, EP rank 2..5, no b2", 5, C(16, 32, 4, 2, 32, 4, 2), 2, 4, False, False, NUM_EXPERTS),
        ("fused requant, grouped, multi-program sort", 64, C(64, 128, 4, 2, 128, 4, 2, group_m=2, align_chunk=32),
         0, 8, True, False, NUM_EXPERTS),
        ("fp32 h, EP rank 4..7, no b2, routing given", 64, C(16, 64, 4, 2, 128, 4, 2), 4, 4, False, True,
         NUM_EXPERTS),
        # split-K: mlp1's last-arriving split sums the partials, mlp2's slabs meet in the combine;
        # hidden 320 has 3 K groups, intermediate 160 has 2: splits 4 leave empty splits
        ("split-K 4/1 T=1", 1, C(16, 128, 4, 2, 32, 4, 2, mlp1_split_k=4), 0, 8, True, False, NUM_EXPERTS),
        ("split-K 3/2 T=2", 2, C(16, 128, 4, 2, 32, 4, 2, mlp1_split_k=3, mlp2_split_k=2), 0, 8, True, False,
         NUM_EXPERTS),
        ("split-K 2/4 T=3, EP rank 2..5, no b2", 3, C(16, 128, 4, 2, 64, 4, 2, mlp1_split_k=2, mlp2_split_k=4),
         2, 4, False, False, NUM_EXPERTS),
        ("split-K 2/2 T=300, grouped", 300, C(64, 128, 4, 2, 128, 4, 2, group_m=2, mlp1_split_k=2, mlp2_split_k=2),
         0, 8, True, False, NUM_EXPERTS),
        ("decode front, 128-expert router, T=1, EP rank 96..127", 1, None, 96, 32, True, False, 128),
        # decode GEMV path (`gemv_cases`): every knob the variants turn, on the ragged dims
        *gemv_cases(mod),
    ]


def two_dot_prefill_config(mod):
    """mlp1 as two dots over the gate / linear rows on 8 warps, 64-row blocks: the grouped kernel's
    two-dot form, the point of comparison for the one-dot rows the table takes."""
    return mod.MoeConfig(block_m=64, mlp1_block_n=128, mlp1_warps=8, mlp1_stages=3, mlp2_block_n=128,
                         mlp2_warps=4, mlp2_stages=3, group_m=4)


def gemv_cases(mod):
    """The GEMV path's knobs (`decode_gemv_variants`) on small dims: 2I = 320 W1 rows are 1.25 h groups
    (a group of 2 tiles and a ragged one of 1, or of 4 and 1), H = 320 and I = 160 ragged K; rows
    per program 1 and 4; mlp2 split and unsplit; EP tokens that have no local pair (the combine's
    zero rows); routing given (int64 ids)."""
    C = mod.MoeConfig
    return [
        ("GEMV T=1: tensor cores, 2-tile h group + a ragged one, split-K 2/2, EP rank 0..3 with b2", 1,
         C(1, 64, 4, 3, 128, 4, 3, mlp1_split_k=2, mlp2_split_k=2, gemv=True), 0, 4, True, False, NUM_EXPERTS),
        ("GEMV T=2, routing given, EP rank 2..5, no b2, mlp2 unsplit", 2,
         C(1, 64, 4, 1, 128, 4, 1, mlp1_split_k=2, mlp2_split_k=1, gemv=True), 2, 4, False, True, NUM_EXPERTS),
        ("GEMV T=5, 4 rows a program, 32-expert router, EP rank 16..19 (tokens with no local pair), no b2", 5,
         C(4, 32, 4, 3, 64, 4, 3, mlp1_split_k=2, mlp2_split_k=2, gemv=True), 16, 4, False, False, 32),
    ]


def check_moe(mod, device) -> dict:
    routers = {n: make_router(n, HIDDEN, seed=11 + n % NUM_EXPERTS, device=device)
               for n in {c[-1] for c in moe_cases(mod)}}
    results = []
    for name, num_tokens, config, offset, num_local, with_b2, given, router_experts in moe_cases(mod):
        router = routers[router_experts]
        experts = make_experts(num_local, HIDDEN, INTER, seed=num_tokens + offset, device=device, with_b2=with_b2)
        x = make_x(num_tokens, HIDDEN, seed=100 + num_tokens, device=device)
        if given:
            weights, ids = route(x, *router, TOP_K)  # int64 ids from torch
            got = mod.fused_experts_fp8(x, weights, ids, *experts, limit=LIMIT, expert_offset=offset, config=config)
        else:
            got, weights, ids = mod.fused_moe_fp8(x, *router, *experts, top_k=TOP_K, limit=LIMIT,
                                                  expert_offset=offset, config=config, return_routing=True)
            check_routing_vs_route(weights, ids, x, *router, name)
        assert got.dtype == x.dtype and got.shape == x.shape
        from sglang_ext.kernels.arrival_counters import current

        for owner in (mod.COUNTERS_OWNER, mod.ROUTER_COUNTER_OWNER, mod.GEMV_COUNTERS_OWNER):
            counters = current(owner, x.device)
            assert counters is None or not counters.any(), f"{name}: {owner} counters not left at zero"
        # the experts' maths on the kernel's routing (the decode front's logits may sit one ulp
        # from torch's GEMM: check_routing_vs_route bounds that)
        ref = mod.moe_ref(x, None, None, *experts, top_k=TOP_K, limit=LIMIT, expert_offset=offset,
                          routing=(weights, ids))
        errors = compare_to_ref(got, ref, name)
        w1, b1, w2, b2 = dequantised(*experts)
        want = experts_torch(x.float(), weights, ids, w1, b1, w2, b2, LIMIT, offset)
        errors["rel_fro_vs_torch"] = compare_to_torch(got, want, name)
        results.append({"case": name, **errors})
    return {"moe": results, "ep_tp": check_expert_parallel_sum(mod, routers[NUM_EXPERTS], device)}


def check_expert_parallel_sum(mod, router, device) -> float:
    """Two EP ranks without mlp2's bias, summed, plus `add_down_bias` once == the whole layer."""
    experts = make_experts(NUM_EXPERTS, HIDDEN, INTER, seed=21, device=device)
    q1, s1, b1, q2, s2, b2 = experts
    x = make_x(7, HIDDEN, seed=22, device=device)
    config = mod.MoeConfig(16, 128, 4, 2, 128, 4, 2)
    whole, weights, ids = mod.fused_moe_fp8(x, *router, *experts, top_k=TOP_K, limit=LIMIT, config=config,
                                            return_routing=True)
    half = NUM_EXPERTS // 2
    parts = [mod.fused_moe_fp8(x, *router, q1[sl], s1[sl], b1[sl], q2[sl], s2[sl], None, top_k=TOP_K,
                               limit=LIMIT, expert_offset=sl.start, config=config,
                               out=torch.empty(x.shape, dtype=torch.float32, device=device))
             for sl in (slice(0, half), slice(half, NUM_EXPERTS))]
    summed = add_down_bias(parts[0] + parts[1], weights, ids.long(), b2)
    rel = ((summed - whole.float()).abs().max() / whole.float().abs().max()).item()
    # same per-pair results on either rank; the sums differ in fp32 order, `whole` rounds to bf16 once
    assert rel <= torch.finfo(torch.bfloat16).eps, f"EP ranks + bias != whole layer: {rel}"
    return rel


def one_dot_cases(mod):
    """(name, tokens, config (one-dot), hidden, intermediate, local experts, expert_offset, b1, b2,
    routing given): ragged dims other than the sweep's, a W1 tile of 64 / 128 / 256 rows (1 or 2
    scale blocks), last tiles ragged (I = 160: 32 of 128 columns; 288: 32 of 64 / 128), K ragged
    (160, 288, 320 = 1.25, 2.25, 2.5 groups), fused requant on (mlp1_block_n 128) and off (fp32 h),
    split-K 3 (320: one K group per split), the old two-dot prefill row's tile (block_m 64, 8 warps),
    two passes: a pass wholly past 2I (I 160), a partly valid second pass (I 224: rows 384..447 of
    384..511), 32-row passes with fp32 h; two passes with TMA tiles (the table's prefill row), one
    with h rows the copy engine cannot take (mlp2 keeps its pointer loads), two with W1 by TMA and x's
    rows by pointers (MoeConfig.tma_x off: no gather launch)."""
    C = mod.MoeConfig
    return [
        ("fused requant, H 288 I 160, 6 experts, biases", 37,
         C(16, 128, 4, 2, 64, 4, 2, mlp1_one_dot=True), 288, 160, 6, 0, True, True, False),
        ("fp32 h (n64), H 160 I 288, 8 experts, no biases", 29,
         C(32, 64, 4, 2, 32, 4, 2, mlp1_one_dot=True), 160, 288, 8, 0, False, False, False),
        ("old prefill tile m64 n128 w8 g4, H 320 I 288, 4 experts, b1 only", 23,
         C(64, 128, 8, 3, 128, 8, 3, group_m=4, mlp1_one_dot=True), 320, 288, 4, 0, True, False, False),
        ("split-K 3/2, n128, H 320 I 160, EP rank 2..6, routing given", 5,
         C(16, 128, 4, 2, 64, 4, 2, mlp1_split_k=3, mlp2_split_k=2, mlp1_one_dot=True), 320, 160, 5, 2,
         True, True, True),
        ("narrow n16 (32 W1 rows), fp32 h, H 288 I 160, 4 experts, no b1", 9,
         C(16, 16, 4, 2, 64, 4, 2, mlp1_one_dot=True), 288, 160, 4, 0, False, True, False),
        ("2 passes of 128 W1 rows, fused requant, H 288 I 160 (a pass past 2I), 6 experts, biases", 37,
         C(16, 128, 4, 2, 64, 4, 2, mlp1_one_dot=True, mlp1_passes=2), 288, 160, 6, 0, True, True, False),
        ("2 passes, prefill tile m64 w4, H 320 I 288, EP rank 1..5, routing given, b1 only", 23,
         C(64, 128, 4, 3, 128, 4, 3, group_m=4, mlp1_one_dot=True, mlp1_passes=2), 320, 288, 4, 1,
         True, False, True),
        ("2 passes of 32 W1 rows, fp32 h (n32), H 160 I 288, 8 experts", 11,
         C(16, 32, 4, 2, 32, 4, 2, mlp1_one_dot=True, mlp1_passes=2), 160, 288, 8, 0, True, True, False),
        ("2 passes, second one partly past 2I, H 288 I 224, 5 experts, biases", 19,
         C(16, 128, 4, 2, 64, 4, 2, mlp1_one_dot=True, mlp1_passes=2), 288, 224, 5, 0, True, True, False),
        # TMA tiles (the table's prefill row): the pointer kernels' bits
        ("TMA, 2 passes, H 288 I 160 (a pass past 2I: the next expert's rows), 6 experts, biases", 37,
         C(16, 128, 4, 2, 64, 4, 2, mlp1_one_dot=True, mlp1_passes=2, tma=True), 288, 160, 6, 0, True, True, False),
        ("TMA, prefill tile m64 w4, H 320 I 288 (ragged K both), EP rank 1..5, routing given, b1 only", 23,
         C(64, 128, 4, 3, 128, 4, 3, group_m=4, mlp1_one_dot=True, mlp1_passes=2, tma=True), 320, 288, 4, 1,
         True, False, True),
        ("TMA mlp1, mlp2 on pointers (h rows of 200 B: not 16-byte aligned), H 288 I 200, 5 experts", 19,
         C(16, 128, 4, 2, 64, 4, 2, mlp1_one_dot=True, mlp1_passes=2, tma=True), 288, 200, 5, 0, True, True, False),
        ("TMA W1 with x's rows by pointers (no gather), H 288 I 160 (ragged K, a pass past 2I), 6 experts", 7,
         C(16, 128, 4, 2, 64, 4, 2, mlp1_one_dot=True, mlp1_passes=2, tma=True, tma_x=False), 288, 160, 6, 0,
         True, True, False),
        ("TMA W1, x by pointers, EP rank 2..6, routing given", 13,
         C(16, 128, 4, 2, 64, 4, 2, mlp1_one_dot=True, mlp1_passes=2, tma=True, tma_x=False), 320, 288, 5, 2,
         True, True, True),
    ]


def expected_moe_descriptors(config, inter: int, device) -> list:
    """What `_experts` builds for `config`: x and W1 tiles for mlp1, h and W2 tiles for mlp2 where h's
    rows suit the copy engine (16-byte rows); none without TMA (the config's or the hardware's)."""
    from sglang_ext.kernels.tma import tma_supported

    if not config.tma or not tma_supported(torch.device(device)):
        return []
    mlp1 = [[config.block_m, 128]] * config.tma_x + [[config.mlp1_block_n, 128]]
    return mlp1 + ([[config.block_m, 128], [config.mlp2_block_n, 128]] if inter % 16 == 0 else [])


def check_one_dot(mod, device) -> dict:
    """mlp1's one-dot variant vs `moe_ref` (the stated bounds) and vs the same config with the
    default two-dot mlp1 (interpreted: equal bits; compiled: the compiled bounds)."""
    from dataclasses import replace

    from sglang_ext.kernels.tma import recording_descriptors

    results = []
    for name, num_tokens, config, hidden, inter, num_local, offset, with_b1, with_b2, given in one_dot_cases(mod):
        seed = 1000 + hidden + inter + num_tokens
        q1, s1, b1, q2, s2, b2 = make_experts(num_local, hidden, inter, seed=seed, device=device, with_b2=with_b2)
        b1 = b1 if with_b1 else None
        experts = (q1, s1, b1, q2, s2, b2)
        router = make_router(NUM_EXPERTS, hidden, seed=seed + 1, device=device)
        x = make_x(num_tokens, hidden, seed=seed + 2, device=device)
        weights, ids = route(x, *router, TOP_K)
        outs = {}
        two_dot = replace(config, mlp1_one_dot=False, mlp1_passes=1, tma=False, tma_x=True)
        for label, cfg in (("one_dot", config), ("two_dot", two_dot)):
            with recording_descriptors() as built:
                if given:
                    outs[label] = mod.fused_experts_fp8(x, weights, ids, *experts, limit=LIMIT, expert_offset=offset,
                                                        config=cfg)
                else:
                    out, w, i = mod.fused_moe_fp8(x, *router, *experts, top_k=TOP_K, limit=LIMIT,
                                                  expert_offset=offset, config=cfg, return_routing=True)
                    assert torch.equal(i.long(), ids.long()) and torch.equal(w, weights), f"{name}: routing"
                    outs[label] = out
            want = expected_moe_descriptors(cfg, inter, device)
            assert built == want, f"{name} {label}: TMA descriptors {built}, expected {want}"
        from sglang_ext.kernels.arrival_counters import current

        counters = current(mod.COUNTERS_OWNER, x.device)
        assert counters is None or not counters.any(), f"{name}: split-K counters not left at zero"
        ref = mod.moe_ref(x, None, None, *experts, top_k=TOP_K, limit=LIMIT, expert_offset=offset,
                          routing=(weights, ids))
        errors = compare_to_ref(outs["one_dot"], ref, f"one-dot {name}")
        compare_to_ref(outs["two_dot"], ref, f"two-dot {name}")
        one, two = outs["one_dot"].float(), outs["two_dot"].float()
        errors["equal_to_two_dot"] = (one == two).float().mean().item()
        errors["max_rel_vs_two_dot"] = ((one - two).abs().max() / two.abs().max()).item()
        if device == "cpu":
            assert torch.equal(outs["one_dot"], outs["two_dot"]), f"{name}: one-dot {errors} != two-dot bits"
        else:
            compare_to_ref(outs["one_dot"], outs["two_dot"], f"one-dot vs two-dot {name}")
        results.append({"case": name, **errors})
    return {"one_dot": results}


def pair_out_bf16_cases(mod):
    """(name, tokens, config, hidden, intermediate, local experts, expert_offset): MoeConfig.pair_out_bf16 on the
    table's prefill row tile (TMA, two passes, ragged K) and on a 16-row pointer tile of an EP rank."""
    C = mod.MoeConfig
    return [
        ("prefill tile m64 w4 TMA, H 320 I 288, 4 experts, biases", 23,
         C(64, 128, 4, 3, 128, 4, 3, group_m=4, mlp1_one_dot=True, mlp1_passes=2, tma=True, pair_out_bf16=True),
         320, 288, 4, 0),
        ("16-row pointer tile, H 288 I 160, EP rank 1..6", 19,
         C(16, 128, 4, 2, 64, 4, 2, mlp1_one_dot=True, pair_out_bf16=True), 288, 160, 5, 1),
    ]


def check_pair_out_bf16(mod, device) -> dict:
    """Each pair's output y rounded to bf16 before the combine (MoeConfig.pair_out_bf16), against the same config
    with fp32 pair outputs (same mlp1 / mlp2 programs, so the same fp32 y bit for bit):
    - weights one-hot on slot j: both give round(y_j) to bf16, bit for bit (the bf16 rows carry y through);
    - the routing's weights: |difference| <= 2^-8 * sum_j w_j |y_j| (y_j's rounding) + one bf16 ulp of the
      output (its own rounding), elementwise, with |y_j| read off the one-hot outputs; and they differ somewhere
      (the rounding took place);
    - interpreted (y equals moe_ref's up to fp32 summation order, so both round alike): the stated bounds of
      `moe_ref(pair_out_bf16=True)`, nearer to it than the fp32-pair output. Compiled, the tensor cores' FP8
      accumulation moves y by more than that order does and y rounds to the other bf16 neighbour in places,
      amplified where the pairs cancel: the elementwise bound above is the check."""
    from dataclasses import replace

    results = []
    eps = torch.finfo(torch.bfloat16).eps
    for name, num_tokens, config, hidden, inter, num_local, offset in pair_out_bf16_cases(mod):
        seed = 2000 + hidden + inter + num_tokens
        experts = make_experts(num_local, hidden, inter, seed=seed, device=device)
        router = make_router(NUM_EXPERTS, hidden, seed=seed + 1, device=device)
        x = make_x(num_tokens, hidden, seed=seed + 2, device=device)
        weights, ids = route(x, *router, TOP_K)
        fp32_config = replace(config, pair_out_bf16=False)
        run = lambda cfg, w: mod.fused_experts_fp8(x, w, ids, *experts, limit=LIMIT,  # noqa: E731
                                                   expert_offset=offset, config=cfg).float()
        got, fp32_pairs = run(config, weights), run(fp32_config, weights)
        magnitude = torch.zeros_like(got)  # sum_j w_j |y_j|, each |y_j| from its bf16 rounding
        for j in range(TOP_K):
            one_hot = torch.zeros_like(weights)
            one_hot[:, j] = 1.0
            y_j = run(fp32_config, one_hot)
            assert torch.equal(run(config, one_hot), y_j), f"{name}: slot {j} alone is not round(y) to bf16"
            magnitude += weights[:, j:j + 1].float() * y_j.abs() * (1 + 2.0 ** -8)
        diff = (got - fp32_pairs).abs()
        bound = 2.0 ** -8 * magnitude + eps * torch.maximum(got.abs(), fp32_pairs.abs()) + 1e-30
        assert (diff <= bound).all(), f"{name}: {(diff / bound).max().item():.3f} of the rounding bound"
        errors = {"differs_from_fp32_pairs": (got != fp32_pairs).float().mean().item(),
                  "max_diff_over_bound": (diff / bound).max().item()}
        assert errors["differs_from_fp32_pairs"] > 0, f"{name}: no element moved: was y rounded at all?"
        if device == "cpu":
            ref = mod.moe_ref(x, None, None, *experts, top_k=TOP_K, limit=LIMIT, expert_offset=offset,
                              routing=(weights, ids), pair_out_bf16=True)
            errors.update(compare_to_ref(got, ref, f"pair_out_bf16 {name}"))
            errors["rel_fro_fp32_pairs_vs_ref"] = ((fp32_pairs - ref.float()).norm() / ref.float().norm()).item()
            assert errors["rel_fro_vs_ref"] < errors["rel_fro_fp32_pairs_vs_ref"], f"{name}: {errors}"
        results.append({"case": name, **errors})
    return {"pair_out_bf16": results}


def sweep(device: str = "cpu") -> dict:
    mod = _kernel_module()
    t0 = time.time()
    result = {"device": device}
    result.update(check_routing(mod, device))
    result.update(check_align(mod, device))
    result.update(check_fused_sort(mod, device))
    result.update(check_decode_front(mod, device))
    result.update(check_moe(mod, device))
    result["seconds"] = round(time.time() - t0, 1)
    return result


def test_kernels_interpreted():
    """Routing, sort, and the whole MoE on ragged small dims, in one interpreter process."""
    from interpreted import run_interpreted

    results = run_interpreted(__file__, ["--sweep"])
    assert len(results) == 1 and results[0]["routing_cases"] == 3 and results[0]["align_cases"] == 7
    assert results[0]["fused_sort_cases"] == len(fused_sort_cases("cpu"))
    assert results[0]["decode_front_cases"] == len(decode_front_cases(_kernel_module()))
    assert results[0]["decode_front_logit_flips"] <= 2, "fp32 sums one ulp off the exact logits too often"
    assert len(results[0]["moe"]) == len(moe_cases(_kernel_module()))


def test_mlp1_one_dot_interpreted():
    """mlp1's one-dot variant (`one_dot_cases`) vs `moe_ref` and the two-dot default, interpreted."""
    from interpreted import run_interpreted

    results = run_interpreted(__file__, ["--one-dot"])
    assert len(results) == 1 and len(results[0]["one_dot"]) == len(one_dot_cases(_kernel_module()))
    assert all(r["equal_to_two_dot"] == 1.0 for r in results[0]["one_dot"])
    assert len(results[0]["pair_out_bf16"]) == len(pair_out_bf16_cases(_kernel_module()))


# ---------------------------------------------------------------------------------------------
# GPU: real shapes, compiled, CUDA graph
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def gpu_layer(num_experts: int):
    """Full-size experts (all local) and router of one gpt-oss size, made once per session."""
    hidden = inter = 2880
    return (make_router(num_experts, hidden, seed=4, device="cuda"),
            make_experts(num_experts, hidden, inter, seed=3, device="cuda"))


def gpu_full_shapes(num_tokens: int, config=None, num_experts: int = 32) -> dict:
    """hidden 2880, intermediate 2880, 32 experts (gpt-oss-20b) or 128 (120b), top-4, table
    configs (or `config`); then the same launcher captured in a CUDA graph and replayed on new
    tokens written in place (a host sync in the launcher would fail the capture; a host-side
    value would freeze stale results). Two eager calls must agree bit for bit (split-K's and the
    decode router's reduction order must not depend on which program arrives last). The
    experts' maths is checked on the kernel's routing, the routing against `route`
    (`check_routing_vs_route`: T <= 16 computes the router logits in Triton)."""
    mod = _kernel_module()
    router, experts = gpu_layer(num_experts)
    x = make_x(num_tokens, 2880, seed=5, device="cuda")
    first, weights, ids = mod.fused_moe_fp8(x, *router, *experts, config=config, return_routing=True)
    what = f"E={num_experts} T={num_tokens}"
    check_routing_vs_route(weights, ids, x, *router, what)
    ref = mod.moe_ref(x, None, None, *experts, routing=(weights, ids))
    result = {"tokens": num_tokens, "experts": num_experts, "config": config.short() if config else "table",
              "eager": compare_to_ref(first, ref, what)}
    for _ in range(3):
        assert torch.equal(mod.fused_moe_fp8(x, *router, *experts, config=config), first), \
            f"{what}: results differ run to run"
    out = torch.empty_like(x)
    mod.fused_moe_fp8(x, *router, *experts, out=out, config=config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, weights, ids = mod.fused_moe_fp8(x, *router, *experts, out=out, config=config, return_routing=True)
    for seed in (6, 7):
        x.copy_(make_x(num_tokens, 2880, seed=seed, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        check_routing_vs_route(weights, ids, x, *router, f"graph replay {what}")
        ref = mod.moe_ref(x, None, None, *experts, routing=(weights, ids))
        result[f"replay_{seed}"] = compare_to_ref(out, ref, f"graph replay {what}")
    return result


def gpu_decode_front() -> dict:
    """The decode front at full size (hidden 2880, both gpt-oss router sizes, T = 1, 3, 16, the
    H200 tilings: 4 rows per program and the row loop at T = 16 for 128 experts): logits within
    one ulp of fp64 and of cuBLAS's F.linear, routing bit for bit from its own logits (torch's
    CUDA top-k + softmax), x's groups and the sort exact, same bits on a second call."""
    bf16 = torch.bfloat16
    cases = [(128, 1, 128, 0, bf16, None), (128, 3, 32, 64, bf16, None), (128, 16, 128, 0, bf16, None),
             (32, 1, 32, 0, bf16, None), (32, 16, 8, 24, bf16, None)]
    return check_decode_front(_kernel_module(), "cuda", hidden=2880, cases=cases)


def gpu_routing() -> dict:
    """torch's CUDA softmax order (expf, butterfly sum, IEEE division) at the real expert counts:
    the kernel's routing equals `route` bit for bit on every ties-free token."""
    mod = _kernel_module()
    result = {}
    for num_experts in (128, 32):
        rw, rb = make_router(num_experts, 2880, seed=num_experts, device="cuda")
        x = make_x(4096, 2880, seed=1, device="cuda")
        logits = torch.nn.functional.linear(x, rw, rb)
        weights, ids, _, _ = mod.route_and_quantize(logits, None, TOP_K)
        want_w, want_ids = route(x, rw, rb, TOP_K)
        top = torch.topk(logits.float(), TOP_K + 1, dim=-1).values
        distinct = (top[:, :-1] != top[:, 1:]).all(dim=-1)
        id_rows = (ids[distinct].long() != want_ids[distinct]).any(dim=-1).sum().item()
        weight_rows = (weights[distinct] != want_w[distinct]).any(dim=-1).sum().item()
        assert id_rows == 0 and weight_rows == 0, \
            f"E={num_experts}: {id_rows} rows with other ids, {weight_rows} with other weights, of {distinct.sum().item()}"
        result[f"E{num_experts}_ties_free_rows"] = distinct.sum().item()
    return result


@pytest.mark.gpu
def test_small_dims_compiled():
    """The interpreted sweep, compiled (the same assertions on a GPU)."""
    sweep("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", GPU_TABLE_TOKENS)
def test_full_shapes_and_cuda_graph(num_tokens):
    gpu_full_shapes(num_tokens)


# gpt-oss-120b's 128 experts: decode batch 1 and the decode front's bound (router in Triton)
GPU_120B_TOKENS = (1, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", GPU_120B_TOKENS)
def test_full_shapes_120b_and_cuda_graph(num_tokens):
    gpu_full_shapes(num_tokens, num_experts=128)


@pytest.mark.gpu
def test_decode_front_full_shapes():
    gpu_decode_front()


def gpu_split_k_configs():
    """Decode split-K configs at full shapes (mlp1 4 ways, mlp2 2 ways; and 2/4)."""
    C = _kernel_module().MoeConfig
    return (C(16, 128, 4, 3, 32, 4, 4, mlp1_split_k=4, mlp2_split_k=2),
            C(16, 128, 4, 2, 64, 4, 3, mlp1_split_k=2, mlp2_split_k=4))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 3, 37])
@pytest.mark.parametrize("which", [0, 1])
def test_full_shapes_split_k(num_tokens, which):
    gpu_full_shapes(num_tokens, gpu_split_k_configs()[which])


GPU_PREFILL_TOKENS = 8192


def gpu_one_dot_configs():
    """mlp1's one-dot variant at 120b prefill: the two-dot row's tiles, block_m 128, 64-column
    tiles (fp32 h, quantised by mlp2), two passes of 128 W1 rows on one warpgroup (the table's
    prefill row)."""
    from dataclasses import replace

    mod = _kernel_module()
    base = replace(two_dot_prefill_config(mod), mlp1_one_dot=True)
    return (base, replace(base, block_m=128), replace(base, mlp1_block_n=64, mlp1_warps=4),
            replace(base, mlp1_warps=4, mlp1_passes=2))


def gpu_one_dot_vs_default(config, num_tokens=GPU_PREFILL_TOKENS, num_experts=128) -> dict:
    """`gpu_full_shapes` for the one-dot config (eager vs `moe_ref`, bits run to run, CUDA graph),
    then the same tokens through the two-dot prefill row: both vs `moe_ref`, and each other
    within the compiled bounds (wgmma's fp32 sums may run in another order per N width, which can
    flip a rare e4m3 rounding of h)."""
    mod = _kernel_module()
    result = gpu_full_shapes(num_tokens, config, num_experts=num_experts)
    router, experts = gpu_layer(num_experts)
    x = make_x(num_tokens, 2880, seed=8, device="cuda")
    one, weights, ids = mod.fused_moe_fp8(x, *router, *experts, config=config, return_routing=True)
    two = mod.fused_moe_fp8(x, *router, *experts, config=two_dot_prefill_config(mod))
    ref = mod.moe_ref(x, None, None, *experts, routing=(weights, ids))
    what = f"E={num_experts} T={num_tokens} {config.short()}"
    result["one_dot_vs_ref"] = compare_to_ref(one, ref, what)
    result["two_dot_vs_ref"] = compare_to_ref(two, ref, what + " (two-dot row)")
    result["one_dot_vs_two_dot"] = compare_to_ref(one, two, what + " vs the two-dot row")
    result["one_dot_vs_two_dot"]["equal"] = (one == two).float().mean().item()
    return result


@pytest.mark.gpu
def test_one_dot_small_dims_compiled():
    """The interpreted one-dot and bf16-pair-output cases, compiled (vs the two-dot mlp1: the compiled bounds)."""
    check_one_dot(_kernel_module(), "cuda")
    check_pair_out_bf16(_kernel_module(), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("which", range(4))
def test_full_shapes_one_dot_120b_prefill(which):
    gpu_one_dot_vs_default(gpu_one_dot_configs()[which])


@pytest.mark.gpu
@pytest.mark.parametrize("inter", (720, 1440))
def test_full_shapes_tp_shard_prefill(inter):
    """Prefill on a tensor-parallel shard's experts (intermediate 720: TP4; 1440: TP2, the two-pass
    row's second pass past 2I in the last tile), 120b's 128 experts, the table's TMA row and the
    pointer kernels on the same tiles: compiled, vs `moe_ref`, the same bits, bits run to run."""
    from dataclasses import replace

    from sglang_ext.kernels.tma import recording_descriptors

    mod = _kernel_module()
    router = make_router(128, 2880, seed=6, device="cuda")
    experts = make_experts(128, 2880, inter, seed=5, device="cuda")
    for num_tokens in (600, 1100):
        config = mod.select_config(num_tokens)
        assert config.tma
        x = make_x(num_tokens, 2880, seed=7, device="cuda")
        with recording_descriptors() as built:
            out, weights, ids = mod.fused_moe_fp8(x, *router, *experts, return_routing=True)
        assert built == expected_moe_descriptors(config, inter, "cuda"), built
        assert torch.equal(out, mod.fused_moe_fp8(x, *router, *experts)), "not bit-reproducible"
        pointer = mod.fused_moe_fp8(x, *router, *experts, config=replace(config, tma=False))
        assert torch.equal(out, pointer), "TMA tiles change the result"
        ref = mod.moe_ref(x, None, None, *experts, routing=(weights, ids))
        compare_to_ref(out, ref, f"E=128 I={inter} T={num_tokens}")


@pytest.mark.gpu
def test_routing_bit_exact_on_cuda():
    gpu_routing()


def gpu_gemv_cases():
    """(tokens, experts, config): every decode GEMV variant at batch 8 on 20b's 32 experts (the batch
    that lists them all) and at batch 1 on 120b's 128."""
    mod = _kernel_module()
    return ([(8, 32, c) for c in mod.decode_gemv_variants(8)]
            + [(1, 128, c) for c in mod.decode_gemv_variants(1)])


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(gpu_gemv_cases())),
                         ids=[f"T{t}-E{e}-{c.short().replace(' ', '_').replace('/', '-')}"
                              for t, e, c in gpu_gemv_cases()])
def test_full_shapes_gemv_and_cuda_graph(case):
    num_tokens, num_experts, config = gpu_gemv_cases()[case]
    gpu_full_shapes(num_tokens, config, num_experts=num_experts)


if __name__ == "__main__":
    # python tests/kernels/test_kernel_moe.py --sweep [--device cuda]   (interpreter: TRITON_INTERPRET=1)
    # python tests/kernels/test_kernel_moe.py --gpu                     (small dims compiled, full shapes + graph, routing)
    args = sys.argv[1:]
    if "--gpu" in args:
        print(json.dumps(sweep("cuda")), flush=True)
        print(json.dumps(gpu_routing()), flush=True)
        print(json.dumps(gpu_decode_front()), flush=True)
        for t in GPU_TABLE_TOKENS:
            print(json.dumps(gpu_full_shapes(t)), flush=True)
        for t in GPU_120B_TOKENS:
            print(json.dumps(gpu_full_shapes(t, num_experts=128)), flush=True)
        for config in gpu_split_k_configs():
            for t in (1, 3, 37):
                print(json.dumps(gpu_full_shapes(t, config)), flush=True)
        for t, e, config in gpu_gemv_cases():
            print(json.dumps(gpu_full_shapes(t, config, num_experts=e)), flush=True)
        print(json.dumps(check_one_dot(_kernel_module(), "cuda")), flush=True)
        for config in gpu_one_dot_configs():
            print(json.dumps(gpu_one_dot_vs_default(config)), flush=True)
    elif "--one-dot" in args:  # python tests/kernels/test_kernel_moe.py --one-dot [--device cuda]
        dev = args[args.index("--device") + 1] if "--device" in args else "cpu"
        t0 = time.time()
        print(json.dumps({**check_one_dot(_kernel_module(), dev), **check_pair_out_bf16(_kernel_module(), dev),
                          "seconds": round(time.time() - t0, 1)}), flush=True)
    else:
        dev = args[args.index("--device") + 1] if "--device" in args else "cpu"
        print(json.dumps(sweep(dev)), flush=True)
