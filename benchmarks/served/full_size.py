"""Full-size gpt-oss folders with no weights, for SGLang's `--load-format dummy` on the GPU machine (its disk is
64 GB; the real weights cannot be fetched there).

Each folder holds the official config.json (launch/make_tiny.py: OFFICIAL_20B_CONFIG; 120b differs in layers and
experts) with the quantization_config of the variant (`mxfp4`: the official one; `fp8`: e4m3 block-128), the
o200k_harmony tokenizer files, and beside them a SingProbe of the real shape (hidden 2880 x 3 taps) with random
weights (launch/make_tiny_probe.py) and the released probe's taps and window.

    python benchmarks/served/full_size.py --out /tmp/full --models 20b --variants fp8,mxfp4
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from sglang_ext.launch.make_tiny import MXFP4_QUANTIZATION_CONFIG, OFFICIAL_20B_CONFIG, OFFICIAL_GENERATION_CONFIG

FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}
SIZES = {"20b": {}, "120b": {"num_hidden_layers": 36, "num_local_experts": 128,
                             "layer_types": ["sliding_attention", "full_attention"] * 18}}
PROBE_LAYERS = {"20b": [6, 14, 22], "120b": [10, 22, 34]}
PROBE_WINDOW = 2048  # the released probe's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def config(model: str, variant: str) -> dict:
    cfg = json.loads(json.dumps(OFFICIAL_20B_CONFIG))
    cfg.update(SIZES[model])
    cfg["quantization_config"] = {"mxfp4": MXFP4_QUANTIZATION_CONFIG, "fp8": FP8_QUANTIZATION_CONFIG}[variant]
    return cfg


def prepare(out: Path, models: list[str], variants: list[str]) -> dict:
    from sglang_ext.launch.make_tiny_probe import generate as make_probe
    from sglang_ext.launch.tokenizer import build_harmony_tokenizer

    tokenizer = Path(build_harmony_tokenizer(str(out / "tokenizer")))

    made = {}
    for model in models:
        for variant in variants:
            folder = out / f"gpt-oss-{model}-{variant}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "config.json").write_text(json.dumps(config(model, variant), indent=1))
            (folder / "generation_config.json").write_text(json.dumps(OFFICIAL_GENERATION_CONFIG, indent=1))
            for name in TOKENIZER_FILES:
                shutil.copy(tokenizer / name, folder / name)
            made[f"{model}-{variant}"] = str(folder)
        probe = make_probe(str(out / f"probe-{model}"), base_dir=made[f"{model}-{variants[0]}"],
                           layer_ids=PROBE_LAYERS[model], log=lambda *_: None)
        cfg = json.loads((Path(probe) / "config.json").read_text())
        cfg.update(sliding_window=PROBE_WINDOW, base_model_name=f"openai/gpt-oss-{model}")
        (Path(probe) / "config.json").write_text(json.dumps(cfg, indent=2))
        made[f"probe-{model}"] = probe
    return made


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="20b")
    ap.add_argument("--variants", default="fp8,mxfp4")
    args = ap.parse_args(argv)
    print(json.dumps(prepare(args.out, args.models.split(","), args.variants.split(","))))


if __name__ == "__main__":
    main()
