"""SGLang 0.5.23's own Triton kernels as benchmark peers (benchmarks/sglang_peers.py), on a CPU.

Each check runs in a fresh interpreter that refuses the installed SGLang (and sgl_kernel), loads
the kernels from .peers/sglang_src through `load_sglang_kernels`, and, under TRITON_INTERPRET=1,
compares every adapter on tiny shapes with a plain torch reference (fp16/fp32: bf16 arithmetic
is wrong in the interpreter). A second interpreter imports the same files as an H200 would (torch
told it has CUDA sm_90), so the CUDA import branches and the carried H200 configs are checked too.

Skips when .peers/sglang_src is absent: CI does not fetch it (bash benchmarks/fetch_sglang_peers.sh).
Opt-in (SGLANG_PEERS_SM90=1, ~50 s on 2 cores): compile every peer kernel for sm_90 with the
installed Triton, ptxas included, launching nothing; put the GPU image's Triton first on
PYTHONPATH to check that version (3.6.0 compiled all of them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / ".peers" / "sglang_src"

pytestmark = pytest.mark.skipif(
    not (SRC / "sglang").is_dir(),
    reason=".peers/sglang_src absent (run: bash benchmarks/fetch_sglang_peers.sh)",
)

PRELUDE = f"""
import os, sys
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'benchmarks')!r}]

class _RefuseInstalledSGLang:  # only the extracted files may provide `sglang`
    def find_spec(self, name, path=None, target=None):
        if name in ("sglang", "sgl_kernel"):
            raise ImportError(name + ": the installed one is hidden in this check")
        return None

sys.meta_path.insert(0, _RefuseInstalledSGLang())
import torch
SRC = {str(SRC)!r}

def assert_only_extracted_sglang():
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] in ("sglang", "sgl_kernel"):
            f = getattr(mod, "__file__", None)
            assert f is None or f.startswith(SRC), (name, f)
"""

CHECKS = """
import sglang_peers as sp
from sglang_ext.layers import fp8 as f8
from sglang_ext.layers.moe import swiglu_oai
from sglang_ext.layers.sink_attention import sink_attention_torch

k = sp.load_sglang_kernels(SRC)
bad = {n: v for n, v in k.items() if not callable(v)}
assert not bad, bad
assert sp.SUBSTITUTIONS == []  # no CUDA here: SGLang's own non-CUDA path is the Triton one
g = torch.Generator().manual_seed(0)
dt = torch.float16

def ref_paged(q, kb, vb, r2t, rpi, seq_lens, q_len, sinks, window_left, scale):
    outs, row = [], 0
    for b in range(len(seq_lens)):
        s, n = int(seq_lens[b]), int(q_len[b])
        slots = r2t[int(rpi[b]), :s].long()
        outs.append(sink_attention_torch(q[row:row + n].float(), kb[slots].float(), vb[slots].float(), sinks,
                                         torch.arange(s - n, s), 0, window_left, scale))
        row += n
    return torch.cat(outs)

# paged sink attention: 8 q / 2 kv heads, D 64, slots scattered over the pool
HQ, HKV, D = 8, 2, 64
kb = torch.randn(400, HKV, D, generator=g).to(dt)
vb = torch.randn(400, HKV, D, generator=g).to(dt)
r2t = (torch.randperm(399, generator=g)[:360] + 1).view(4, 90).to(torch.int32)
sinks = torch.randn(HQ, generator=g)
scale = D ** -0.5
seq, rpi = torch.tensor([37, 70, 5]), torch.tensor([2, 0, 3])
one = torch.ones(3, dtype=torch.long)
for window_left, cores, upstream in ((-1, None, False), (15, 132, False), (15, None, True)):
    q = torch.randn(3, HQ, D, generator=g).to(dt)
    out = k["make_paged_decode"](q, kb, vb, r2t, rpi, seq, sinks, window_left, scale,
                                 device_core_count=cores, upstream_window=upstream)()
    # upstream_window: 0.5.23's triton backend gathers window_left keys, i.e. one earlier key less
    ref = ref_paged(q, kb, vb, r2t, rpi, seq, one, sinks, window_left - upstream, scale)
    err = (out.float() - ref).abs().max().item()
    assert out.shape == q.shape and err < 5e-3, ("decode", window_left, cores, upstream, err)
seq, q_len, q_start, rpi = torch.tensor([40, 23]), torch.tensor([17, 23]), torch.tensor([0, 17]), torch.tensor([1, 3])
for window_left in (-1, 7):
    q = torch.randn(40, HQ, D, generator=g).to(dt)
    out = k["make_paged_extend"](q, kb, vb, r2t, rpi, seq, q_start, q_len, sinks, window_left, scale)()
    err = (out.float() - ref_paged(q, kb, vb, r2t, rpi, seq, q_len, sinks, window_left, scale)).abs().max().item()
    assert err < 5e-3, ("extend", window_left, err)

# FP8 block-128 GEMM; K = 320 and N = 192 leave ragged blocks
M, N, K = 5, 192, 320
wq, ws = f8.quantize_weight_block128(torch.randn(N, K, generator=g) * 0.05)
wf = f8.dequantize_weight_block128(wq, ws)
bias = torch.randn(N, generator=g).to(dt)
x = torch.randn(M, K, generator=g).to(dt)
xq, xs = f8.quantize_activation_group128(x)
y = k["make_fp8_gemm"](xq, xs, wq, ws, bias.float(), out_dtype=torch.float32)()
ref = f8.dequantize_activation_group128(xq, xs) @ wf.t() + bias.float()
assert (y - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), "fp8 gemm"
# SGLang's quant, on operands whose scaled values lie on the e4m3 grid (exact in any rounding):
# the interpreter's fp32->e4m3 cast drops the carry when rounding bumps the exponent (124.3 -> 64
# instead of 128), so off-grid values would test the interpreter, not SGLang.
quant = k["per_token_group_quant_fp8_triton"]
grid = torch.randn(M, 256, generator=g).to(torch.float8_e4m3fn).float()
grid[:, 0] = grid[:, 128] = 448.0
xg = (grid * torch.tensor([2.0 ** -7, 2.0 ** -3]).repeat_interleave(128)).to(dt)
gq, gs = quant(xg, 128)
rq, rs = f8.quantize_activation_group128(xg)
assert torch.equal(gs, rs) and torch.equal(gq.float(), rq.float()), "per_token_group_quant on the grid"
# the linear path (quant + GEMM + bias; K padded 320 -> 384 inside), against SGLang's own quant
lin = k["make_fp8_linear"](x, wq, ws, bias)
y = lin()
sq, ss = quant(torch.nn.functional.pad(x, (0, 64)).contiguous(), 128)
ref = f8.dequantize_activation_group128(sq, ss)[:, :K] @ wf.t() + bias.float()
assert y.dtype == dt and (y.float() - ref).abs().max().item() <= 2e-3 * ref.abs().max().item(), "fp8 linear"
assert "320->384" in lin.api

# gpt-oss experts: H 200 and I 96 padded to 256 / 128 inside the adapter; biases; top-2 of 4
E, H, I, T, TOPK, LIMIT = 4, 200, 96, 6, 2, 7.0
w1q, s1 = f8.quantize_weight_block128(torch.randn(E, 2 * I, H, generator=g) * 0.05)
w2q, s2 = f8.quantize_weight_block128(torch.randn(E, H, I, generator=g) * 0.05)
b1 = (torch.randn(E, 2 * I, generator=g) * 0.1).to(dt)
b2 = (torch.randn(E, H, generator=g) * 0.1).to(dt)
x = torch.randn(T, H, generator=g).to(dt)
tw, ti = torch.topk(torch.randn(T, E, generator=g), TOPK, dim=-1)
tw = torch.softmax(tw, dim=-1)
run = k["make_fused_experts"](x, tw, ti, w1q, s1, b1, w2q, s2, b2, limit=LIMIT)
y = run()

def sglang_fake_quant(a):  # SGLang's activation quant (same interpreter cast as the kernel's)
    a = torch.nn.functional.pad(a, (0, -a.shape[1] % 128)).to(dt).contiguous()
    return f8.dequantize_activation_group128(*quant(a, 128))

ref = torch.zeros(T, H)
xf = sglang_fake_quant(x)[:, :H]
for e in range(E):
    w1f, w2f = f8.dequantize_weight_block128(w1q[e], s1[e]), f8.dequantize_weight_block128(w2q[e], s2[e])
    for t, j in (ti == e).nonzero().tolist():
        h = (xf[t:t + 1] @ w1f.t() + b1[e].float()).to(dt)  # compute_type fp16, as the kernel stores it
        h = sglang_fake_quant(swiglu_oai(h, LIMIT))[:, :I]
        ref[t] += tw[t, j] * (h @ w2f.t() + b2[e].float())[0]
err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
assert y.shape == (T, H) and err < 5e-3, ("fused experts", err, run.api)
assert "200/96->256/128" in run.api

# the torch port of sgl_kernel's alignment agrees with SGLang's Triton small-numel kernel
import importlib
small = importlib.import_module("sglang.kernels.ops.moe.moe_align_small_numel")
ids = torch.randint(-1, 70, (9, 4), generator=g, dtype=torch.int32)
sid, eid, npad = sp._moe_align_torch(ids, 16, 70)
s2_, e2_, n2_ = torch.full_like(sid, -7), torch.full_like(eid, -7), torch.zeros(1, dtype=torch.int32)
small.moe_align_small_numel(ids, 71, 16, s2_, e2_, n2_)
used = int(n2_)
assert used == int(npad) and torch.equal(sid[:used], s2_[:used]) and torch.equal(eid[:used // 16], e2_[:used // 16])
assert_only_extracted_sglang()
print("ok")
"""

AS_H200 = """
import types
props = types.SimpleNamespace(multi_processor_count=132, shared_memory_per_block_optin=232448, gcnArchName="",
                              name="NVIDIA H200")
torch.cuda.is_available = lambda: True
torch.cuda.is_initialized = lambda: True
torch.cuda.get_device_capability = lambda *a: (9, 0)
torch.cuda.get_device_name = lambda *a: "NVIDIA H200"
torch.cuda.get_device_properties = lambda *a: props
torch.cuda.current_device = lambda: 0
torch.version.cuda = "12.8"
import sglang_peers as sp

k = sp.load_sglang_kernels(SRC)
bad = {n: v for n, v in k.items() if not callable(v)}
assert not bad, bad
assert len(sp.SUBSTITUTIONS) == 2, sp.SUBSTITUTIONS
kern = sys.modules["sglang.kernels.ops.moe.fused_moe_triton_kernels"]
fm = sys.modules["sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"]
quant = sys.modules["sglang.kernels.ops.quantization.fp8_kernel"]
gemm = sys.modules["sglang.kernels.ops.gemm.fp8_kernel"]
cfg = sys.modules["sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config"]
assert kern._is_cuda and fm._is_cuda and sp.is_sm90_supported() and sp.is_arch_support_pdl()
assert kern.sglang_per_token_group_quant_fp8 is quant._per_token_group_quant_8bit_raw
assert fm.moe_sum_reduce is kern.moe_sum_reduce_triton
# the CUDA-only ops SGLang would call are placeholders that say so, never silent stand-ins
try:
    quant.per_token_group_quant(None, None, None, 128)
    raise AssertionError("placeholder ran")
except sp.PeerUnavailable:
    pass
# the carried H200 configs are found by SGLang's own lookups
assert gemm.get_w8a8_block_fp8_configs(7168, 2048, 128, 128), "fp8 gemm H200 config"
assert cfg.get_moe_configs(256, 256, "fp8_w8a8", 128, 128), "moe H200 config (triton-version fallback)"
assert_only_extracted_sglang()
print("ok")
"""


SM90_COMPILE = AS_H200.split("import sglang_peers as sp")[0] + """
import triton
from compile_only import install_compile_only_h200

compiled = {}
install_compile_only_h200(lambda fn, kernel, kwargs: compiled.__setitem__(fn.fn.__name__, len(kernel.asm["cubin"])))
import sglang_peers as sp
from sglang_ext.layers import fp8 as f8

k = sp.load_sglang_kernels(SRC)
bf = torch.bfloat16
HQ, HKV, D = 64, 8, 64  # gpt-oss attention
kb, vb = torch.randn(4096, HKV, D).to(bf), torch.randn(4096, HKV, D).to(bf)
r2t = (torch.arange(4000) + 1).view(4, 1000).to(torch.int32)
sinks = torch.randn(HQ)
for wl in (-1, 127):
    k["make_paged_decode"](torch.randn(4, HQ, D).to(bf), kb, vb, r2t, torch.arange(4), torch.full((4,), 900), sinks,
                           wl, 0.125, device_core_count=132, use_pdl=True)()
    k["make_paged_extend"](torch.randn(700, HQ, D).to(bf), kb, vb, r2t, torch.tensor([0, 1]), torch.tensor([500, 400]),
                           torch.tensor([0, 300]), torch.tensor([300, 400]), sinks, wl, 0.125)()
wq, ws = f8.quantize_weight_block128(torch.randn(5120, 2880) * 0.05)  # qkv
x = torch.randn(64, 2880).to(bf)
k["make_fp8_gemm"](*f8.quantize_activation_group128(x), wq, ws, torch.randn(5120).to(bf))()
k["make_fp8_linear"](x, wq, ws, torch.randn(5120).to(bf))()
for E, H, I, T in ((4, 2880, 2880, 64), (128, 256, 128, 8)):  # gpt-oss dims; a decode batch (small-numel align)
    w1q, s1 = f8.quantize_weight_block128(torch.randn(E, 2 * I, H) * 0.05)
    w2q, s2 = f8.quantize_weight_block128(torch.randn(E, H, I) * 0.05)
    ids = torch.stack([torch.randperm(E)[:4] for _ in range(T)]).to(torch.int32)
    k["make_fused_experts"](torch.randn(T, H).to(bf), torch.rand(T, 4), ids, w1q, s1, torch.randn(E, 2 * I).to(bf),
                            w2q, s2, torch.randn(E, H).to(bf))()
want = {"get_num_kv_splits_triton", "_fwd_grouped_kernel_stage1", "_fwd_kernel_stage2", "_fwd_kernel",
        "_w8a8_block_fp8_matmul", "_per_token_group_quant_8bit", "fused_moe_kernel", "_moe_sum_reduce_kernel",
        "_moe_align_small_numel_kernel"}
assert want <= set(compiled) and all(compiled.values()), (triton.__version__, compiled)
print("triton", triton.__version__, "sm_90 cubins:", compiled)
print("ok")
"""


def _run(code: str, interpret: bool = True, **extra_env) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    env.update(TORCHDYNAMO_DISABLE="1", PYTHONDONTWRITEBYTECODE="1", **extra_env)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", PRELUDE + code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-6000:]


def test_adapters_match_torch_references():
    _run(CHECKS)


def test_imports_as_on_an_h200():
    _run(AS_H200)


@pytest.mark.skipif(os.environ.get("SGLANG_PEERS_SM90") != "1",
                    reason="opt-in, ~50 s: SGLANG_PEERS_SM90=1 compiles every peer kernel for sm_90")
def test_kernels_compile_for_sm90(tmp_path):
    _run(SM90_COMPILE, interpret=False, TRITON_CACHE_DIR=str(tmp_path))
