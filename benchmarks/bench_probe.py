"""SingProbe decode-step cost on one H200 at the real gpt-oss-120b dims (random weights).

One probe step for B decode rows = project (features [B, 8640] -> q [B, 512] and K|V
[B, 128]), write K|V into the paged pool, windowed MQA over the last 2048 positions of
each row's request (the Triton kernel), the fp32 tail (o_proj, residual, RMSNorm,
classifier, sigmoid). Timed as CUDA-graph replays (median of many, after warm-up).

Ceilings measured in the same run: device copy bandwidth (bytes/s) and the time to read
the probe's weights once (the floor of any projection at small batch). The bytes floor
of a step = probe weights (bf16) + the K|V window each row reads.
The "decode step" it is compared with is modelled, not measured (no model-step
benchmark yet): gpt-oss-120b at batch B reads ~6.03 GB of weights + KV per step on one
H200 (bytes counted, not timed) at the measured copy bandwidth; labelled "modelled".

    python benchmarks/bench_probe.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import import_project  # noqa: E402

import_project()
from sglang_ext.kernels.probe_attention import probe_attention, probe_attention_ref  # noqa: E402
from sglang_ext.kernels.probe_tail import probe_tail  # noqa: E402
from sglang_ext.probe.config import ProbeConfig  # noqa: E402
from sglang_ext.probe.model import SingProbeHead  # noqa: E402

GPT_OSS_120B_DECODE_BYTES_BS1 = 6.03e9  # issue 7: weights + KV read per decode step, batch 1, ctx 8192


def copy_bandwidth(nbytes=2 << 30):
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); b.copy_(a); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return 2 * a.numel() * 2 / times[len(times) // 2]  # read + write


def graph_time(fn, iters=50, repeat=20):
    """Per-call time of `fn` inside a CUDA graph that runs it `repeat` times back to back,
    as it runs inside a model's decode graph; a graph of one small step would mostly time
    the graph launch (~15 us here), not the step."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(repeat):
            fn()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); g.replay(); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / repeat)
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=8192)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = ProbeConfig.from_dict({
        "architectures": ["SingProbeAttnModel"], "model_type": "sing_probe_attn", "hidden_size": 2880,
        "base_model_layer_ids": [10, 22, 34], "num_attention_heads": 8, "head_dim": 64,
        "sliding_window": 2048, "num_labels": 10, "base_model_name": "openai/gpt-oss-120b",
        "torch_dtype": "bfloat16"})
    head = SingProbeHead(cfg).cuda().bfloat16().requires_grad_(False)
    for p in head.parameters():
        p.data.normal_(0, 0.02)
    head.norm.weight.data.fill_(1.0)
    weight_bytes = sum(p.numel() * p.element_size() for p in head.parameters())
    bw = copy_bandwidth()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ctx = args.context
        slots = batch * ctx + 1
        kv_pool = torch.randn(slots, 128, device="cuda", dtype=torch.bfloat16)
        perm = torch.randperm(slots - 1, device="cuda") + 1
        req_to_token = perm.view(batch, ctx).to(torch.int32)
        row_req = torch.arange(batch, device="cuda", dtype=torch.int64)
        row_pos = torch.full((batch,), ctx - 1, device="cuda", dtype=torch.int64)
        out_loc = req_to_token[:, ctx - 1].long()
        features = torch.randn(batch, cfg.input_size, device="cuda", dtype=torch.bfloat16)
        result = torch.empty(batch, cfg.num_labels, device="cuda", dtype=torch.float32)

        def step():
            q, kv = head.project(features)
            kv_pool[out_loc] = kv
            ctx_ = probe_attention(q, kv_pool, req_to_token, row_req, row_pos, cfg.sliding_window, 0.125)
            result.copy_(torch.sigmoid(head.tail(q, ctx_)))

        w_qkv = torch.cat([head.proj_q.weight, head.proj_k.weight, head.proj_v.weight])

        def fused_step():
            qkv = torch.nn.functional.linear(features, w_qkv)
            q = qkv[:, :512].unflatten(-1, (8, 64))
            kv_pool[out_loc] = qkv[:, 512:]
            ctx_ = probe_attention(q, kv_pool, req_to_token, row_req, row_pos, cfg.sliding_window, 0.125)
            probe_tail(q, ctx_, head.o_proj.weight, head.norm.weight, head.classifier.weight,
                       head.classifier.bias, out=result)

        def attention_only():
            probe_attention(q0, kv_pool, req_to_token, row_req, row_pos, cfg.sliding_window, 0.125)

        q0, _ = head.project(features)
        # correctness at full size against the torch reference
        want = probe_attention_ref(q0, kv_pool, req_to_token, row_req, row_pos, cfg.sliding_window, 0.125)
        got = probe_attention(q0, kv_pool, req_to_token, row_req, row_pos, cfg.sliding_window, 0.125)
        max_err = (got - want).abs().max().item()
        t_step_unfused = graph_time(step)
        unfused_probs = result.clone()
        t_step = graph_time(fused_step)
        tail_err = (result - unfused_probs).abs().max().item()
        t_attn = graph_time(attention_only)
        qkv_buf = torch.empty(batch, 640, device="cuda", dtype=torch.bfloat16)
        ctx_fixed = probe_attention(q0, kv_pool, req_to_token, row_req, row_pos, cfg.sliding_window, 0.125)
        t_qkv = graph_time(lambda: torch.matmul(features, w_qkv.t(), out=qkv_buf))
        t_write = graph_time(lambda: kv_pool.index_copy_(0, out_loc, qkv_buf[:, 512:]))
        t_tail = graph_time(lambda: probe_tail(q0, ctx_fixed, head.o_proj.weight, head.norm.weight,
                                               head.classifier.weight, head.classifier.bias, out=result))
        kv_bytes = batch * cfg.sliding_window * 128 * 2
        floor_bytes = weight_bytes + kv_bytes
        # KV one sequence reads at ctx 8192: 18 full layers x 8192 + 18 sliding x 128 positions,
        # 8 KV heads x 64 x (K, V) x 2 bytes. Extra experts touched at batch > 1 are not
        # counted: the modelled step is a lower bound, so the overhead shown is an upper bound.
        kv_per_seq = (18 * 8192 + 18 * 128) * 8 * 64 * 2 * 2
        decode_bytes = GPT_OSS_120B_DECODE_BYTES_BS1 + (batch - 1) * kv_per_seq
        decode_floor_s = decode_bytes / bw
        rows.append({
            "batch": batch, "window": cfg.sliding_window, "context": ctx,
            "probe_step_us": t_step * 1e6, "unfused_step_us": t_step_unfused * 1e6, "attention_us": t_attn * 1e6,
            "fused_vs_unfused_max_prob_diff": tail_err,
            "qkv_gemm_us": t_qkv * 1e6, "kv_write_us": t_write * 1e6, "tail_kernel_us": t_tail * 1e6,
            "bytes_floor": floor_bytes, "floor_us": floor_bytes / bw * 1e6,
            "achieved_bw_TBps": floor_bytes / t_step / 1e12,
            "attention_max_abs_err_vs_ref": max_err,
            "modelled_120b_decode_step_us": decode_floor_s * 1e6,
            "overhead_vs_modelled_decode_pct": t_step / decode_floor_s * 100,
        })
        print(json.dumps(rows[-1]))
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "copy_bandwidth_TBps": bw / 1e12,
            "probe_weight_bytes": weight_bytes, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "python benchmarks/bench_probe.py --out $OUT", "host": platform.node()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_decode_h200.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lines = ["# SingProbe decode step on one H200 (gpt-oss-120b probe dims, random weights)", "",
             f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. "
             f"Measured copy bandwidth {bw / 1e12:.2f} TB/s. Probe weights {weight_bytes / 1e6:.1f} MB (bf16). "
             "Times are per step: medians of 50 replays of a CUDA graph that runs the step 20 times back to back (as inside a decode graph). The decode step is **modelled** "
             "(bytes / measured copy bandwidth), not measured.", "",
             "| batch | window | probe step, fused (us) | unfused torch step (us) | attention (us) | bytes floor (us) | "
             "achieved TB/s | modelled 120b decode step (us) | overhead (%) | attn max err | fused vs unfused max |dp| |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['window']} | {r['probe_step_us']:.1f} | {r['unfused_step_us']:.1f} | "
                     f"{r['attention_us']:.1f} | "
                     f"{r['floor_us']:.1f} | {r['achieved_bw_TBps']:.2f} | {r['modelled_120b_decode_step_us']:.0f} | "
                     f"{r['overhead_vs_modelled_decode_pct']:.2f} | {r['attention_max_abs_err_vs_ref']:.1e} | "
                     f"{r['fused_vs_unfused_max_prob_diff']:.1e} |")
    lines += ["", f"Command: `{meta['command']}`"]
    with open(os.path.join(args.out, "probe_decode_h200.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
