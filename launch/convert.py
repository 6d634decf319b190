"""Convert a gpt-oss checkpoint (official MXFP4, or bf16/fp32) to FP8 e4m3 block-128.

    python -m sglang_ext.launch.convert SRC DST

Converted: `self_attn.{q,k,v,o}_proj.weight` and the experts (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`), each to e4m3 plus `*_scale_inv` fp32 per 128x128 block (a
ragged last block where 2880 = 22.5 x 128); experts are written [E, out, in], the MXFP4
layout, so each expert's blocks tile its own GEMM. Everything else (router, sinks,
norms, embedding, lm_head, biases) is copied in its own dtype.

Memory stays bounded by one expert at a time (a 120b layer's experts never sit
dequantised in memory at once), and output shards are flushed at `--shard-size`.
Resumable: each finished output shard is recorded in DST/convert_state.json; a rerun
skips the source tensors already written. `config.json` is written last, so an
interrupted DST never looks like a complete checkpoint.

The report (DST/convert_report.json, one row per converted tensor): blocks converted
exactly (for MXFP4 sources: 128x128 blocks whose values all survive e4m3 bit-exactly
under a power-of-two block scale), max and mean relative error of the dequantised FP8
against the source values.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch

from sglang_ext.layers.fp8 import BLOCK, Block128Report, convert_block128, summarize_block128_report
from sglang_ext.layers.mxfp4 import DenseExperts, Mxfp4Experts, experts_to_fp8_block128

DENSE_FP8 = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")
EXPERTS = ("gate_up_proj", "down_proj")
STATE = "convert_state.json"
REPORT = "convert_report.json"


class ConvertError(RuntimeError):
    pass


def _source_index(src: str) -> dict[str, str]:
    """tensor name -> shard file, from model.safetensors.index.json or the single file."""
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = json.load(open(index))["weight_map"]
        missing = sorted({f for f in weight_map.values() if not os.path.exists(os.path.join(src, f))})
        if missing:
            raise ConvertError(f"{src}: shard(s) listed in the index are missing: {missing}")
        return weight_map
    single = os.path.join(src, "model.safetensors")
    if not os.path.exists(single):
        raise ConvertError(f"{src}: no model.safetensors or model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def convert_matrix(w: torch.Tensor, exact_source: bool):
    """One [N, K] matrix -> (e4m3, scale_inv, stats); the model's loader converts with the same function."""
    q, s, (stats,) = convert_block128(w, exact_source)
    return q, s, stats


class ShardWriter:
    def __init__(self, dst: str, shard_bytes: int, state: dict):
        self.dst, self.shard_bytes, self.state = dst, shard_bytes, state
        self.buffer: dict[str, torch.Tensor] = {}
        self.sources: list[str] = []
        self.size = 0

    def add(self, name: str, tensor: torch.Tensor):
        self.buffer[name] = tensor.contiguous()
        self.size += tensor.numel() * tensor.element_size()

    def source_done(self, source_name: str):
        self.sources.append(source_name)
        if self.size >= self.shard_bytes:
            self.flush()

    def flush(self):
        from safetensors.torch import save_file

        if not self.buffer:
            return
        name = f"model-{len(self.state['shards']) + 1:05d}.safetensors"
        tmp = os.path.join(self.dst, name + ".tmp")
        save_file(self.buffer, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(self.dst, name))
        self.state["shards"].append({"file": name, "tensors": sorted(self.buffer), "sources": self.sources})
        _write_json(os.path.join(self.dst, STATE), self.state)
        self.buffer, self.sources, self.size = {}, [], 0


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def convert(src: str, dst: str, shard_bytes: int = 2 << 30, log=print) -> dict:
    from safetensors import safe_open

    cfg_path = os.path.join(src, "config.json")
    if not os.path.exists(cfg_path):
        raise ConvertError(f"{src}: no config.json")
    config = json.load(open(cfg_path))
    if config.get("model_type") != "gpt_oss":
        raise ConvertError(f"{src}: model_type {config.get('model_type')!r} is not gpt_oss")
    source_quant = (config.get("quantization_config") or {}).get("quant_method")
    if source_quant not in (None, "mxfp4"):
        raise ConvertError(f"{src}: source quantization {source_quant!r}; expected MXFP4 or unquantised")
    weight_map = _source_index(src)
    os.makedirs(dst, exist_ok=True)
    if os.path.exists(os.path.join(dst, "config.json")):
        raise ConvertError(f"{dst} already holds a complete checkpoint (config.json); choose an empty folder")
    state_path = os.path.join(dst, STATE)
    state = json.load(open(state_path)) if os.path.exists(state_path) else {"src": os.path.abspath(src), "shards": [],
                                                                            "report": {}}
    done = {s for shard in state["shards"] for s in shard["sources"]}
    writer = ShardWriter(dst, shard_bytes, state)

    # Group MXFP4 blocks with their scales; every other name is one unit.
    units: list[tuple[str, list[str]]] = []
    for name in sorted(weight_map):
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            if base + "_scales" not in weight_map:
                raise ConvertError(f"{src}: {name} has no {base}_scales")
            units.append((base, [name, base + "_scales"]))
        else:
            units.append((name, [name]))
    todo = [u for u in units if u[0] not in done]
    log(f"convert: {len(units)} tensors, {len(units) - len(todo)} already done, source {source_quant or 'dense'}")
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    bar = tqdm(total=len(todo), unit="tensor", desc="convert", file=sys.stderr) if tqdm else None
    handles: dict[str, object] = {}

    def read(tensor_name):
        shard = weight_map[tensor_name]
        if shard not in handles:
            handles[shard] = safe_open(os.path.join(src, shard), "pt")
        return handles[shard].get_tensor(tensor_name)

    for base, names in todo:
        leaf = base.rsplit(".", 1)[-1]
        is_expert = ".mlp.experts." in base and leaf in EXPERTS
        if is_expert:
            if len(names) == 2:  # MXFP4 blocks + scales: [E, out, in] after dequantisation
                source = Mxfp4Experts(read(names[0]), read(names[1]))
            else:
                dense = read(names[0])
                if not dense.is_floating_point():
                    raise ConvertError(f"{base}: expected a floating-point tensor, got {dense.dtype}")
                source = DenseExperts(dense)  # [E, in, out], read as [E, out, in]
            qs, ss, stats = [], [], Block128Report(source.num)
            # One expert dequantised at a time (a 120b expert tensor would be 8.5 GB in fp32 at once).
            for _first, _last, q, s, st in experts_to_fp8_block128(source, 0, source.num, "cpu", chunk_elements=1):
                qs.append(q)
                ss.append(s)
                for one in st:
                    stats.add(one)
            writer.add(base, torch.cat(qs))
            writer.add(base + "_scale_inv", torch.cat(ss))
            state["report"][base] = stats.row
        elif any(base.endswith(".self_attn." + d) for d in DENSE_FP8):
            w = read(names[0])
            if not w.is_floating_point():
                raise ConvertError(f"{base}: expected a floating-point tensor, got {w.dtype}")
            q, s, stats = convert_matrix(w, exact_source=False)
            writer.add(base, q)
            writer.add(base[: -len("weight")] + "weight_scale_inv", s)
            state["report"][base] = stats
        elif len(names) == 1 and _known_passthrough(base):
            writer.add(base, read(names[0]))
        else:
            raise ConvertError(f"{src}: unknown tensor {base!r} for gpt-oss")
        writer.source_done(base)
        if bar:
            bar.update(1)
    writer.flush()
    if bar:
        bar.close()

    weight_map_out = {t: shard["file"] for shard in state["shards"] for t in shard["tensors"]}
    _write_json(os.path.join(dst, "model.safetensors.index.json"), {"metadata": {}, "weight_map": weight_map_out})
    _write_json(os.path.join(dst, REPORT), state["report"])
    for extra in os.listdir(src):
        if extra.endswith((".json", ".jinja", ".txt", ".model")) and extra not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(os.path.join(src, extra), os.path.join(dst, extra))
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": ["model.layers.*.self_attn.sinks", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }
    config["sglang_ext_converted_from"] = source_quant or "dense"
    _write_json(os.path.join(dst, "config.json"), config)  # last: DST is complete from here on
    return state["report"]


def _known_passthrough(name: str) -> bool:
    tails = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.sinks", "mlp.router.weight",
             "mlp.router.bias", "_proj.bias", "_proj_bias")
    return name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight") or name.endswith(tails)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="gpt-oss (MXFP4 or bf16) -> FP8 e4m3 block-128")
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--shard-size", type=float, default=2.0, help="output shard size in GiB")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        report = convert(args.src, args.dst, int(args.shard_size * (1 << 30)))
    except ConvertError as e:
        print(f"convert: {e}", file=sys.stderr)
        return 2
    total = summarize_block128_report(report)
    print(f"convert: {len(report)} tensors to FP8 in {time.time() - t0:.1f} s; blocks exact "
          f"{total['blocks_exact']}/{total['blocks']}; worst max relative error {total['max_rel_err']:.3e}; "
          f"report {os.path.join(args.dst, REPORT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
