"""The prefill's small kernels at their launch choices: which are far from their read/write floor, and
whether another tile of the same maths closes the gap.

Why: in the 120b 8k prefill (bench_prefill_tp1.md) the MoE front (routing + x's e4m3 groups) takes 40 us a
layer against a ~17 us floor, the o projection's activation quantisation 42 against ~24, and the pair sort
(count + align) 52 us for 32768 ids. Each variant here only re-tiles the same per-element maths, so its
outputs must equal the shipped choice's bit for bit (checked; a row that differs says so).

  - front: `moe._front` (routing of 8192 x 128 logits, top-4, and x's 1x128 e4m3 groups) at QUANT_BLOCK_T
    tokens per quantisation program (and ROUTE_BLOCK_T per routing program);
  - sort: `moe._launch_sort` (count + align of the pairs into 64-row expert blocks) at align_chunk pairs a
    program;
  - quant: `fp8_gemm.quantize_activation_group128` of the attention output [8192, 4096] bf16 at block_rows.

CUDA graph of 3 calls, median of replays; floor: bytes read + written / copy bandwidth of this run.

    python benchmarks/diag_prefill_small.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

FRONT_VARIANTS = ((16, 16), (16, 32), (16, 64), (32, 32), (32, 64))  # (ROUTE_BLOCK_T, QUANT_BLOCK_T)
SORT_CHUNKS = (128, 256, 512, 1024)
QUANT_ROWS = (8, 16, 32, 64, 128)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--stem", default="diag_prefill_small")
    ap.add_argument("--device", default="cuda", help="cpu: check the script under TRITON_INTERPRET=1 (small sizes)")
    args = ap.parse_args()
    bc.import_project()
    from sglang_ext.kernels import fp8_gemm, moe

    meta = bc.run_meta("python benchmarks/diag_prefill_small.py " + " ".join(sys.argv[1:]))
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    bw = bc.copy_bandwidth(dev) if cuda else 1e9
    t, hidden, experts, top_k, attn_cols = args.tokens, 2880, 128, 4, 4096
    dt = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, hidden, device=dev, generator=g).to(dt)
    logits = torch.randn(t, experts, device=dev, generator=g).to(dt)
    attn = torch.randn(t, attn_cols, device=dev, generator=g).to(dt)
    rows = []

    def row(part, variant, fn, nbytes, want=None):
        try:
            got = fn()
            if cuda:
                torch.cuda.synchronize()
            us = bc.graph_time_calls([fn] * 3, iters=20, device=dev) * 1e6
        except Exception as e:  # noqa: BLE001  (a variant that fails is a row too)
            rows.append({"part": part, "variant": variant, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            print(rows[-1], flush=True)
            return None
        r = {"part": part, "variant": variant, "us": us, "floor_us": nbytes / bw * 1e6,
             "pct_floor": 100 * nbytes / bw / (us * 1e-6)}
        if want is not None:
            r["bits_equal"] = all(torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(
                torch.uint8) if b.dtype.itemsize == 1 else b) for a, b in zip(got, want))
        rows.append(r)
        print(r, flush=True)
        return got

    # front: logits read, weights + ids written, x read, codes + scales written
    front_bytes = logits.numel() * logits.element_size() + t * top_k * (2 + 4) + x.numel() * (x.element_size() + 1) \
        + t * ((hidden + 127) // 128) * 4
    saved = (moe.ROUTE_BLOCK_T, moe.QUANT_BLOCK_T)
    want = None
    try:
        for route_t, quant_t in FRONT_VARIANTS:
            moe.ROUTE_BLOCK_T, moe.QUANT_BLOCK_T = route_t, quant_t
            name = f"route {route_t} / quant {quant_t} tokens a program" + (" (shipped)" if (route_t, quant_t) == saved
                                                                            else "")
            got = row("front", name, lambda: moe._front(x, logits, None, top_k)[:4], front_bytes, want)
            if want is None and (route_t, quant_t) == saved:
                want = got
    finally:
        moe.ROUTE_BLOCK_T, moe.QUANT_BLOCK_T = saved
    # the sort of the shipped front's ids
    ids = moe._front(x, logits, None, top_k)[1]
    num_pairs = t * top_k
    block_m = moe.select_config(t).block_m
    max_blocks = moe._max_blocks(num_pairs, experts, block_m)
    sort_bytes = num_pairs * 4 * 2 + max_blocks * (block_m + 1) * 4
    shipped_chunk = moe.select_config(t).align_chunk
    want = None
    for chunk in sorted(SORT_CHUNKS, key=lambda c: c != shipped_chunk):  # the shipped chunk first: the bits
        def sort(chunk=chunk):
            sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
            block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
            moe._launch_sort(ids, num_pairs, experts, 0, block_m, chunk, sorted_pairs, block_expert, max_blocks)
            # the slots of blocks past the last used one are never written (block_expert -1 says so)
            used = (block_expert >= 0).repeat_interleave(block_m)
            return torch.where(used, sorted_pairs, -1), block_expert
        got = row("sort", f"align_chunk {chunk}" + (" (shipped)" if chunk == shipped_chunk else ""), sort,
                  sort_bytes, want)
        if want is None:
            want = got
    # o's activation quantisation
    quant_bytes = attn.numel() * (attn.element_size() + 1) + t * (attn_cols // 128) * 4
    want = None
    for block_rows in sorted(QUANT_ROWS, key=lambda r: r != 32):
        got = row("quant", f"block_rows {block_rows}" + (" (shipped)" if block_rows == 32 else ""),
                  lambda b=block_rows: fp8_gemm.quantize_activation_group128(attn, block_rows=b), quant_bytes, want)
        if want is None:
            want = got
    md = [f"# Prefill's small kernels by launch choice ({meta.get('gpu', 'cpu')})", "",
          f"`{meta['command']}` — {meta.get('date', '')}", "",
          f"{t} tokens, hidden {hidden}, {experts} experts, top-{top_k}; quant: [{t}, {attn_cols}]. us: per call, CUDA "
          f"graph of 3 calls, median. floor: bytes read + written / copy bandwidth ({bw / 1e12:.2f} TB/s). bits: "
          "outputs equal to the shipped choice's.", "",
          bc.md_table(rows, [("part", "part", None), ("variant", "variant", None), ("us", "us", "{:.1f}"),
                             ("floor us", "floor_us", "{:.1f}"), ("% of floor", "pct_floor", "{:.0f}"),
                             ("bits equal", "bits_equal", None), ("error", "error", None)]), ""]
    bc.write_results(args.out, args.stem, meta, rows, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
