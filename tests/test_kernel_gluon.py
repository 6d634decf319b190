"""The Gluon FP8 GEMMs (kernels/fp8_gluon.py, kernels/moe_gluon.py): one wgmma in flight while the previous K
block's scales are applied.

Gluon has no interpreter, so on a CPU the kernels are compiled for sm_90a and launch nothing
(benchmarks/compile_only.py, in a subprocess: it fakes torch's CUDA and Triton's driver): their machine code must
keep one wgmma group in flight through the scaling (`DEPBAR.LE gsb0, 0x1`) and wait for all of them only at the
end of each K loop; ptxas serialising the MMAs (what an earlier form did, its warning C7514) fails it, and so do
more than a few spilled registers, and a TMA copy not behind a CTA barrier since the last wgmma (on 8 warps each
warpgroup waits only for its own MMAs; the barrier is the compiler's, the source has none).

On an H200 (`gpu`): the dense GEMM against float64 of the dequantised operands and bit for bit against
`fp8_gemm.fp8_gemm` on the same tile (the same block products, summed in the same order); the MoE's table
prefill row with `mlp1_gluon` / `mlp2_gluon` (its tiles, and the 8-warp ones: mlp1's 256 W1 rows in one pass,
256-wide mlp2) bit for bit against the same row on the Triton kernels, on ragged small dims (a second mlp1 pass
wholly past 2I, one partly past it, ragged K, an EP rank's experts) and at 120b's full shapes, against `moe_ref`,
run to run and inside a CUDA graph.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from test_kernel_moe import _kernel_module, compare_to_ref, make_experts, make_router, make_x

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compile(script: str, tmp_path, *args) -> list:
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--compile-only", "--out",
                    str(tmp_path), "--stem", "compiled", *args], check=True, capture_output=True, text=True,
                   timeout=600, env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")})
    with open(tmp_path / "compiled.json") as f:
        return json.load(f)["rows"]


def _waits(text: str) -> dict:
    """'DEPBAR.LE gsb0, 0x0 x4, DEPBAR.LE gsb0, 0x1 x6' -> {0: 4, 1: 6}"""
    out = {}
    for part in filter(None, text.split(", DEPBAR")):
        level, count = part.rsplit(" x", 1)
        out[int(level.rsplit("0x", 1)[1])] = int(count)
    return out


def test_gluon_kernels_keep_one_mma_in_flight(tmp_path):
    """Compiled for sm_90a: every wgmma of the PTX is in the machine code, and each K loop (mlp1 runs two)
    waits for all MMAs only at its end (two full waits: the leftover block's and the last), with waits that
    leave one in flight in between."""
    dense = _compile("diag_gluon_fp8_gemm.py", tmp_path / "dense")
    # gluon: mlp1 in two passes (two K loops) on 4 warps; gluon_w8: one pass of 256 W1 rows and 256-wide mlp2
    # tiles on 8 warps, a scale block per warpgroup; gluon_w8p: those persistent
    moe = _compile("diag_gluon_moe.py", tmp_path / "moe", "--variants", "gluon,gluon_w8,gluon_w8p")
    loops = lambda r: 2 if r["kernel"] == "_mlp1_gluon_kernel" and r["variant"] == "gluon" else 1  # noqa: E731
    kernels = [(r["tile"], r, 1) for r in dense] + [(f"{r['variant']} {r['kernel']}", r, loops(r)) for r in moe]
    assert len(moe) == 6, moe
    for name, row, loops in kernels:
        assert row["wgmma"] > 0 and row["sass_qgmma"] == row["wgmma"], (name, row)
        waits = _waits(row["sass_depbar"])
        assert waits.get(0) == 2 * loops, f"{name}: full waits {waits} (serialised MMAs?)"
        assert waits.get(1, 0) >= 2 * loops, f"{name}: no wait that leaves one MMA in flight: {waits}"
        # a few spilled bytes stay in L1 (the table's two-pass mlp1: 4 with Triton 3.8); the persistent two-pass
        # mlp1's 100 are not compiled here
        assert row["regs"] <= 255 and max(map(int, row["spills"].split(" / "))) <= 16, (name, row)
        fenced, copies = map(int, row["copies_fenced"].split(" / "))
        assert copies > 0 and fenced == copies, f"{name}: a TMA copy not behind a CTA barrier ({row['copies_fenced']})"


def test_gluon_config_rules():
    """`MoeConfig.mlp1_gluon` / `mlp2_gluon` belong to the TMA rows with the tiles the Gluon kernels have."""
    mod = _kernel_module()
    table = mod.select_config(8192)
    mod._check_config(replace(table, mlp1_gluon=True, mlp2_gluon=True))
    mod._check_config(replace(table, mlp1_gluon=True, mlp2_gluon=True, mlp1_warps=8, mlp2_warps=8, mlp2_block_n=256))
    bad = [replace(table, mlp1_gluon=True, tma_x=False), replace(table, mlp1_gluon=True, mlp1_block_n=64),
           replace(table, mlp2_gluon=True, mlp2_block_n=256), replace(table, mlp1_gluon=True, tma=False, tma_x=True),
           replace(mod.select_config(1), mlp2_gluon=True), replace(mod.select_config(8), mlp1_gluon=True),
           replace(mod.select_config(32), mlp2_gluon=True),  # 16-row blocks: no warpgroup tile
           replace(table, mlp1_gluon=True, mlp1_stages=1),  # one ring slot would wait forever
           replace(table, mlp2_gluon=True, mlp2_block_n=256),  # n256 on one warpgroup: no registers for it
           replace(table, gluon_persistent=True)]  # an option of the Gluon kernels only
    for config in bad:
        with pytest.raises(ValueError, match="gluon"):
            mod._check_config(config)


DISPATCH = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {tests!r})
from dataclasses import replace
from sglang_ext.kernels import moe, moe_gluon
from sglang_ext.kernels.tma import recording_descriptors
from test_kernel_moe import make_experts, make_router, make_x

calls = []
moe.gluon_supported = lambda device: True  # as on an H200; the Gluon launchers below record their calls instead
moe_gluon.mlp1_gluon = lambda *args, persistent=False: calls.append(["mlp1", persistent])
moe_gluon.mlp2_gluon = lambda *args, persistent=False: calls.append(["mlp2", persistent])
experts = make_experts(4, 320, 288, seed=1)
router, x = make_router(8, 320, seed=2), make_x(23, 320, seed=3)
table = moe.select_config(8192)
out = {{}}
for name, flags in [("mlp1", dict(mlp1_gluon=True)), ("mlp2", dict(mlp2_gluon=True)),
                    ("both_persistent", dict(mlp1_gluon=True, mlp2_gluon=True, gluon_persistent=True))]:
    calls.clear()
    with recording_descriptors() as built:
        moe.fused_moe_fp8(x, *router, *experts, expert_offset=1, config=replace(table, **flags))
    out[name] = {{"calls": list(calls), "descriptors": built}}
print("RESULT " + json.dumps(out))
"""


def test_moe_gluon_dispatch():
    """`_experts` with the Gluon flags on a GPU that runs them (told so here, interpreted, the Gluon launchers
    replaced by recorders): each flagged GEMM goes to its Gluon launcher with the persistent option, the other
    to the Triton kernel, and no Triton descriptor is built for an operand the Gluon kernel loads itself."""
    result = subprocess.run([sys.executable, "-c", DISPATCH.format(tests=os.path.join(ROOT, "tests"))],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.split("RESULT ", 1)[1])
    tile_x, tile_w = [64, 128], [128, 128]  # the table's prefill row: 64-row blocks, 128-row weight tiles
    assert got["mlp1"] == {"calls": [["mlp1", False]], "descriptors": [tile_x, tile_w]}, got["mlp1"]  # mlp2's
    assert got["mlp2"] == {"calls": [["mlp2", False]], "descriptors": [tile_x, tile_w]}, got["mlp2"]  # mlp1's
    assert got["both_persistent"] == {"calls": [["mlp1", True], ["mlp2", True]], "descriptors": []}, got


def test_dense_gluon_rejects_bad_arguments():
    """`fp8_gemm_gluon` names what it cannot run before any launch: rows the copy engine cannot take (K = 200:
    200-byte rows), scales of the wrong shape, tiles without a warpgroup layout, one ring slot, n256 tiles (the
    dense kernel keeps one W scale block a tile)."""
    from sglang_ext.kernels.fp8_gluon import fp8_gemm_gluon

    e4m3 = torch.float8_e4m3fn
    a, w = torch.zeros(64, 256, dtype=e4m3), torch.zeros(128, 256, dtype=e4m3)
    a_s, w_s = torch.ones(64, 2), torch.ones(1, 2)
    for args, kwargs, match in [
        ((torch.zeros(64, 200, dtype=e4m3), a_s, torch.zeros(128, 200, dtype=e4m3), w_s), {}, "copy engine"),
        ((a, torch.ones(64, 3), w, w_s), {}, "a_scale"),
        ((a, a_s, w, w_s), {"block_m": 16, "num_warps": 4}, "warpgroup"),
        ((a, a_s, w, w_s), {"stages": 1}, "stages"),
        ((a, a_s, w, w_s), {"block_n": 256, "num_warps": 8, "block_m": 64}, "one W scale block"),
    ]:
        with pytest.raises(ValueError, match=match):
            fp8_gemm_gluon(*args, **kwargs)


@contextlib.contextmanager
def _counting(module, *names):
    """Within the block, calls of module.<name> are recorded by name (the launchers import them at call time)."""
    calls, real = [], {name: getattr(module, name) for name in names}

    def counted(name):
        def call(*args, **kwargs):
            calls.append(name)
            return real[name](*args, **kwargs)
        return call

    for name in names:
        setattr(module, name, counted(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(module, name, fn)


def _gluon_here():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU (Gluon's wgmma / TMA)")


@pytest.mark.gpu
# K 208: a ragged last K block (80 of 128) with rows the copy engine takes (16-byte multiples)
@pytest.mark.parametrize("m, n, k", [(8192, 5120, 2880), (1000, 640, 2880), (333, 256, 4096), (64, 128, 208)])
def test_dense_gemm_gluon_matches_triton(m, n, k):
    """Against float64, and bit for bit against `_fp8_gemm_tma_kernel` on the same tile (the m64 / m128 tiles whose
    warpgroups each run m64 x n128 MMAs, as Triton's), bias in the accumulator, through `fp8_gemm` with
    `Fp8GemmConfig.gluon` as well."""
    _gluon_here()
    from sglang_ext.kernels import fp8_gemm, fp8_gluon
    from sglang_ext.kernels.fp8_gluon import fp8_gemm_gluon, fp8_gemm_gluon_ref

    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = (torch.randn(m, k, device="cuda", generator=g) * 64).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device="cuda", generator=g) * 64).to(torch.float8_e4m3fn)
    kb = -(-k // 128)
    a_s = (torch.rand(m, kb, device="cuda", generator=g) * 1e-3 + 1e-4).t().contiguous().t()  # MN-major
    w_s = torch.rand(-(-n // 128), kb, device="cuda", generator=g) * 1e-3 + 1e-4
    bias = (torch.randn(n, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    want = fp8_gemm_gluon_ref(a, a_s, w, w_s) + bias.double()
    for block_m, warps, stages in ((128, 8, 4), (64, 4, 3), (64, 8, 4)):
        got = fp8_gemm_gluon(a, a_s, w, w_s, bias, block_m=block_m, num_warps=warps, stages=stages)
        rel = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert rel <= 2.0 ** -7, f"m{block_m} w{warps}: {rel} vs float64"  # bf16 output: 2^-9 per element
        if warps == block_m // 16:  # the same wgmma shape (m64 n128 a warpgroup) as Triton's tile of that size
            twin = fp8_gemm.Fp8GemmConfig(block_m=block_m, block_n=128, num_warps=warps, num_stages=stages, tma=True)
            ours = fp8_gemm.fp8_gemm(a, a_s, w, w_s, bias, config=twin)
            assert torch.equal(got, ours), f"m{block_m} w{warps}: bits differ from fp8_gemm's tile ({rel})"
            with _counting(fp8_gluon, "fp8_gemm_gluon") as calls:
                routed = fp8_gemm.fp8_gemm(a, a_s, w, w_s, bias, config=replace(twin, gluon=True))
            # equal bits alone would pass with the Triton kernel too: the launch must have taken the Gluon one
            assert calls == ["fp8_gemm_gluon"], "Fp8GemmConfig.gluon did not launch the Gluon kernel"
            assert torch.equal(routed, got), "fp8_gemm with Fp8GemmConfig.gluon: bits differ"
        persistent = fp8_gemm_gluon(a, a_s, w, w_s, bias, block_m=block_m, num_warps=warps, stages=stages,
                                    persistent=True)
        assert torch.equal(persistent, got), f"m{block_m} w{warps}: persistent programs change the bits"


def gluon_moe_cases():
    """(name, tokens, hidden, intermediate, local experts, expert offset, b2)"""
    return [
        ("H 320 I 288 (ragged K both, mlp1's last second pass wholly past I), EP rank 1..4", 23, 320, 288, 4, 1, True),
        ("H 288 I 224 (the last first pass partly past 2I), 5 experts, no b2", 37, 288, 224, 5, 0, False),
        ("120b shapes, 1100 tokens", 1100, 2880, 2880, 128, 0, True),
        ("120b shapes, 8192 tokens", 8192, 2880, 2880, 128, 0, True),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(gluon_moe_cases())))
def test_moe_gluon_rows_match_triton(case):
    _gluon_here()
    from sglang_ext.kernels import moe_gluon

    mod = _kernel_module()
    name, tokens, hidden, inter, num_local, offset, with_b2 = gluon_moe_cases()[case]
    experts = make_experts(num_local, hidden, inter, seed=40 + case, device="cuda", with_b2=with_b2)
    router = make_router(8 if num_local < 8 else num_local, hidden, seed=41 + case, device="cuda")
    x = make_x(tokens, hidden, seed=42 + case, device="cuda")
    triton_row = mod.select_config(max(tokens, 129))
    assert triton_row.tma and triton_row.block_m == 64
    want, weights, ids = mod.fused_moe_fp8(x, *router, *experts, expert_offset=offset, config=triton_row,
                                           return_routing=True)
    # the table's tiles, then 8 warps: mlp1's 256 W1 rows in one pass, 256-wide mlp2 tiles (a warpgroup each half)
    # and persistent programs (a program per SM slot, the next tile's copies requested before the epilogue)
    for flags in ({"mlp1_gluon": True}, {"mlp2_gluon": True}, {"mlp1_gluon": True, "mlp1_warps": 8},
                  {"mlp2_gluon": True, "mlp2_warps": 8, "mlp2_block_n": 256},
                  {"mlp1_gluon": True, "mlp2_gluon": True, "gluon_persistent": True},
                  {"mlp1_gluon": True, "mlp2_gluon": True, "mlp1_warps": 8, "mlp2_warps": 8, "mlp2_block_n": 256,
                   "gluon_persistent": True},
                  {"mlp1_gluon": True, "mlp2_gluon": True}):
        config = replace(triton_row, **flags)
        with _counting(moe_gluon, "mlp1_gluon", "mlp2_gluon") as calls:
            got = mod.fused_moe_fp8(x, *router, *experts, expert_offset=offset, config=config)
        # equal bits alone would pass with the Triton kernels too: the flagged kernels must have been launched
        wanted = [k for k in ("mlp1_gluon", "mlp2_gluon") if flags.get(k)]
        assert calls == wanted, f"{name} {flags}: launched {calls}, expected {wanted}"
        assert torch.equal(got, want), f"{name} {flags}: bits differ from the Triton row"
    assert torch.equal(got, mod.fused_moe_fp8(x, *router, *experts, expert_offset=offset, config=config))
    ref = mod.moe_ref(x, None, None, *experts, expert_offset=offset, routing=(weights, ids), pair_out_bf16=True)
    compare_to_ref(got, ref, name)
    out = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    mod.fused_moe_fp8(x, *router, *experts, expert_offset=offset, config=config, out=out)  # compiled before capture
    with torch.cuda.graph(graph):
        mod.fused_moe_fp8(x, *router, *experts, expert_offset=offset, config=config, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want), f"{name}: the CUDA graph's replay"
