"""Expert tensors to FP8 block-128, a few experts at a time (`sglang_ext.layers.mxfp4.experts_to_fp8_block128`,
run by both launch/convert.py and the model's loader): SGLang-free, so its GPU test runs on the GPU image.

CPU: the chunking never changes a byte, and MXFP4 values convert exactly where transformers'
`convert_moe_packed_tensors` says they fit e4m3. GPU (`gpu`): a gpt-oss-20b-sized layer of random MXFP4 experts
converts on CUDA to the CPU's bytes, in bounded memory, and the Triton MoE on the result runs inside CUDA graphs
at SGLang's default decode batch sizes (up to 256 at TP < 4, 512 from TP 4 on an H100/H200).
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # the GPU image runs the tests without the package installed
    sys.path.insert(0, ROOT)

from sglang_ext.layers.fp8 import BLOCK, convert_block128, dequantize_weight_block128  # noqa: E402
from sglang_ext.layers.mxfp4 import (  # noqa: E402
    CONVERT_CHUNK_ELEMENTS, DenseExperts, Mxfp4Experts, experts_to_fp8_block128)

FP8 = torch.float8_e4m3fn


def random_mxfp4(experts, rows, cols, seed=0, device="cpu", outliers=1e-3):
    """Random MXFP4 codes with trained-like scales: exponents 2^-8..2^0 around 2^-4, and a share of
    32-groups 2^-16 lower (the blocks around them cannot convert exactly)."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8, device=device)
    exps = torch.randint(119, 128, (experts, rows, cols // 32), generator=g, device=device)
    low = torch.rand(exps.shape, generator=g, device=device) < outliers
    return blocks, (exps - 16 * low).to(torch.uint8)


def stack(chunks):
    qs, ss, stats = [], [], []
    for _first, _last, q, s, st in chunks:
        qs.append(q)
        ss.append(s)
        stats += st
    return torch.cat(qs), torch.cat(ss), stats


@pytest.mark.parametrize("chunk_experts", [1, 2, 5])
def test_chunking_changes_no_byte(chunk_experts):
    blocks, scales = random_mxfp4(5, 256, 320, outliers=0.05)
    source = Mxfp4Experts(blocks, scales)
    whole_q, whole_s, whole_stats = convert_block128(source.matrices(0, 5, "cpu"), exact_source=True)
    q, s, stats = stack(experts_to_fp8_block128(source, 0, 5, "cpu", chunk_elements=chunk_experts * 256 * 320))
    assert torch.equal(q.view(torch.uint8), whole_q.view(torch.uint8)) and torch.equal(s, whole_s)
    assert stats == whole_stats
    # a sub-range (one expert-parallel rank's experts) is the same experts' bytes
    q2, _s2, _ = stack(experts_to_fp8_block128(source, 2, 4, "cpu", chunk_elements=1))
    assert torch.equal(q2.view(torch.uint8), whole_q[2:4].view(torch.uint8))


def test_mxfp4_converts_exactly_where_it_fits_e4m3():
    """Against transformers' dequantisation: a block with no outlier group is exact, a block with one is
    within e4m3's half step (and its exact-block count says so)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4(3, 256, 384, seed=1, outliers=0.01)
    oracle = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    q, s, stats = stack(experts_to_fp8_block128(Mxfp4Experts(blocks, scales), 0, 3, "cpu"))
    got = dequantize_weight_block128(q, s)
    low = (scales.float() < 110).repeat_interleave(32, -1)  # values in an outlier group
    block_has_outlier = low.unflatten(1, (2, BLOCK)).unflatten(-1, (3, BLOCK)).any(dim=2).any(dim=-1)
    block_exact = (got == oracle).unflatten(1, (2, BLOCK)).unflatten(-1, (3, BLOCK)).all(dim=2).all(dim=-1)
    assert bool(block_exact[~block_has_outlier].all())
    assert not bool(block_exact[block_has_outlier].any())  # a 2^-16 group's small values fall below e4m3
    assert sum(st["blocks_exact"] for st in stats) == int(block_exact.sum())
    scale = s.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    assert ((got - oracle).abs() <= torch.maximum(oracle.abs() * 2.0 ** -4, scale * 2.0 ** -10)).all()


def test_dense_experts_read_as_out_in():
    w = torch.randn(2, 96, 200).to(torch.bfloat16)  # [E, in, out], as transformers saves bf16 experts
    q, s, _ = stack(experts_to_fp8_block128(DenseExperts(w), 0, 2, "cpu"))
    want_q, want_s, _ = convert_block128(w.transpose(1, 2), exact_source=False)
    assert q.shape == (2, 200, 96) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)


# gpt-oss-20b's MoE layer: 32 experts, hidden 2880, intermediate 2880 (mlp1 rows interleaved gate/up: 5760)
E20B, HIDDEN, INTER, TOP_K = 32, 2880, 2880, 4
SGLANG_DEFAULT_DECODE_BATCHES = (1, 8, 64, 256, 512)  # max_bs 256 at TP < 4, 512 from TP 4 (H100/H200)


@pytest.mark.gpu
def test_20b_layer_converts_on_cuda_and_serves_in_cuda_graphs():
    from sglang_ext.layers.moe import moe_forward

    dev = torch.device("cuda")
    layer = {}
    cpu_checked = (0, 17, 31)
    report = {}
    for name, rows, cols in (("gate_up_proj", 2 * INTER, HIDDEN), ("down_proj", HIDDEN, INTER)):
        source = Mxfp4Experts(*random_mxfp4(E20B, rows, cols, seed=len(name)))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        q = torch.empty(E20B, rows, cols, dtype=FP8, device=dev)
        s = torch.empty(E20B, -(-rows // BLOCK), -(-cols // BLOCK), device=dev)
        stats = []
        for first, last, cq, cs, st in experts_to_fp8_block128(source, 0, E20B, dev):
            q[first:last], s[first:last] = cq, cs
            stats += st
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        scratch = torch.cuda.max_memory_allocated() - base - q.numel() - s.numel() * 4
        fp32_layer = E20B * rows * cols * 4
        report[name] = {"seconds": round(seconds, 3), "scratch_GiB": round(scratch / 2**30, 3),
                        "fp32_layer_GiB": round(fp32_layer / 2**30, 3),
                        "blocks_exact": sum(x["blocks_exact"] for x in stats),
                        "blocks": sum(x["blocks"] for x in stats)}
        # A few experts at a time: the scratch is a fixed multiple of one chunk in fp32 (the dequantised
        # chunk and the quantiser's temporaries), whatever the layer's size (120b's is four times 20b's)
        assert scratch <= 4 * CONVERT_CHUNK_ELEMENTS * 4, report[name]
        for e in cpu_checked:  # the offline converter's bytes, computed on the CPU
            (_, _, cpu_q, cpu_s, cpu_st), = experts_to_fp8_block128(source, e, e + 1, "cpu")
            assert torch.equal(q[e].cpu().view(torch.uint8), cpu_q[0].view(torch.uint8)), (name, e)
            assert torch.equal(s[e].cpu(), cpu_s[0]), (name, e)
            assert stats[e]["blocks_exact"] == cpu_st[0]["blocks_exact"], (name, e)
        layer[name] = (q, s)
    print(f"20b MoE layer, MXFP4 -> FP8 on {torch.cuda.get_device_name()}: {report}")

    g = torch.Generator(device=dev).manual_seed(3)
    rw = (torch.randn(E20B, HIDDEN, generator=g, device=dev) * 0.05).to(torch.bfloat16)
    rb = (torch.randn(E20B, generator=g, device=dev) * 0.1).to(torch.bfloat16)
    b1 = (torch.randn(E20B, 2 * INTER, generator=g, device=dev) * 0.1).to(torch.bfloat16)
    b2 = (torch.randn(E20B, HIDDEN, generator=g, device=dev) * 0.1).to(torch.bfloat16)
    (w1, s1), (w2, s2) = layer["gate_up_proj"], layer["down_proj"]
    run = lambda x: moe_forward(x, rw, rb, w1, s1, b1, w2, s2, b2, TOP_K, 7.0)  # noqa: E731
    for tokens in SGLANG_DEFAULT_DECODE_BATCHES:
        x = torch.randn(tokens, HIDDEN, generator=g, device=dev).to(torch.bfloat16)
        run(x)  # compile / warm up outside the capture, as SGLang's graph runner does
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(x)
        x.copy_(torch.randn(tokens, HIDDEN, generator=g, device=dev).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        want = run(x)
        assert torch.isfinite(out.float()).all(), tokens
        assert torch.equal(out, want), f"T={tokens}: graph replay differs from eager"
