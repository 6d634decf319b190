"""MXFP4 checkpoints (and bf16 ones launched with --quantization fp8) loaded straight onto the FP8 block-128
path by the model's own loader (`sglang_ext.models.gpt_oss.CheckpointLoader`), in this process, on a CPU; and
what a default launch resolves to for each checkpoint format.

Oracles: transformers' `convert_moe_packed_tensors` (the MXFP4 values, independent of our dequantiser),
launch/convert.py run on the same checkpoint (its bytes and its report), and the FP8 checkpoint path's
own sharding (`shard_checkpoint_tensor` on the converted tensors) for TP/EP ranks. The served check
(an MXFP4 server's greedy tokens equal its converted copy's) is in tests/served/test_served_parity.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("sglang")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, GptOssConfig  # noqa: E402

import sglang_ext.models.gpt_oss as gpt_oss  # noqa: E402
import sglang_ext.models.gpt_oss_core as core  # noqa: E402
from sglang_ext.launch import make_tiny as mt  # noqa: E402
from sglang_ext.launch.convert import convert  # noqa: E402
from sglang_ext.layers.fp8 import BLOCK, convert_block128, dequantize_weight_block128  # noqa: E402
from sglang_ext.layers.parallel import ParallelLayout  # noqa: E402

FP8 = torch.float8_e4m3fn


def read_checkpoint(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def layers_only(tensors: dict) -> list:
    """The per-layer tensors, in the checkpoint's order (embedding and head need SGLang's TP groups)."""
    return [(k, v) for k, v in tensors.items() if k.startswith("model.layers.")]


def build_layers(cfg, layout=ParallelLayout(1, 0), parts=("self_attn", "mlp"), fp8=None):
    """A module whose parameters are named as the checkpoint's layer keys (model.layers.{i}.*)."""
    tp = core.RankGroups(layout)
    layers = nn.ModuleList()
    for i in range(cfg.num_hidden_layers):
        layer = nn.Module()
        if "self_attn" in parts:
            layer.self_attn = core.GptOssAttention(cfg, i, tp, fp8)
            layer.input_layernorm = core.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            layer.post_attention_layernorm = core.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        layer.mlp = core.GptOssMLP(cfg, tp, fp8)
        layers.append(layer)
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = layers
    for p in root.parameters():  # empty storage: a value the loader forgot would show
        p.data.fill_(float("nan")) if p.is_floating_point() and p.dtype != FP8 else p.data.zero_()
    return root, tp


def load(cfg, tensors, layout=ParallelLayout(1, 0), parts=("self_attn", "mlp"), fp8=None, **kw):
    root, tp = build_layers(cfg, layout, parts, fp8)
    layer0 = root.model.layers[0]
    loader = gpt_oss.CheckpointLoader(root, core.checkpoint_format(cfg), tp, getattr(layer0, "self_attn", None),
                                      layer0.mlp.experts, **kw)
    loader.load(tensors)
    return root, loader


@pytest.fixture(scope="module")
def spread_mxfp4(tiny_checkpoints, tmp_path_factory):
    """The tiny MXFP4 checkpoint with a few 32-groups of layer 0's experts scaled down by 2^-16 (trained
    weights have such outliers): the blocks around them cannot convert exactly (their small values fall
    below e4m3's subnormals under the block's scale), every other block does. Plus launch/convert.py's
    conversion of it."""
    root = tmp_path_factory.mktemp("mxfp4_spread")
    src = root / "mxfp4"
    shutil.copytree(tiny_checkpoints["mxfp4"], src)
    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name in ("model.layers.0.mlp.experts.gate_up_proj_scales", "model.layers.0.mlp.experts.down_proj_scales"):
            if name in tensors:
                s = tensors[name].clone()
                s[0, :5, 0] -= 16  # expert 0: five rows of the first group of 32 columns
                s[3, 40:42, 1] -= 16  # expert 3: two rows of the second group
                tensors[name] = s
        save_file(tensors, str(shard), metadata={"format": "pt"})
    dst = root / "fp8"
    report = convert(str(src), str(dst), log=lambda *_: None)
    return {"src": src, "fp8": dst, "report": report}


def test_mxfp4_experts_load_as_fp8_equal_to_transformers_dequantisation(spread_mxfp4):
    """Every 128x128 block of the loaded e4m3 experts dequantises to transformers' MXFP4 values exactly,
    except the blocks the outliers make inexact, whose values lie within e4m3's half-step of them; the
    count of exact blocks is the loader's report's."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = AutoConfig.from_pretrained(spread_mxfp4["src"])
    assert core.checkpoint_format(cfg) == "mxfp4" and core.serves_fp8(cfg)
    source = read_checkpoint(spread_mxfp4["src"])
    root, loader = load(cfg, layers_only(source))
    params = dict(root.named_parameters())
    inexact_seen = 0
    for i in range(cfg.num_hidden_layers):
        for leaf in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{leaf}"
            w, s = params[name], params[name + "_scale_inv"]
            assert w.dtype == FP8 and s.dtype == torch.float32
            oracle = convert_moe_packed_tensors(source[name + "_blocks"], source[name + "_scales"],
                                                dtype=torch.float32).transpose(1, 2)  # [E, K, N] -> [E, N, K]
            got = dequantize_weight_block128(w, s)
            assert got.shape == oracle.shape
            e, n, k = oracle.shape
            nb, kb = -(-n // BLOCK), -(-k // BLOCK)
            same = torch.ones(e, nb * BLOCK, kb * BLOCK, dtype=torch.bool)
            same[:, :n, :k] = got == oracle
            exact_blocks = same.unflatten(1, (nb, BLOCK)).unflatten(-1, (kb, BLOCK)).all(dim=2).all(dim=-1)
            assert int(exact_blocks.sum()) == loader.report[name]["blocks_exact"], name
            assert exact_blocks.numel() == loader.report[name]["blocks"]
            inexact_seen += int((~exact_blocks).sum())
            scale = s.repeat_interleave(BLOCK, -2)[:, :n].repeat_interleave(BLOCK, -1)[..., :k]
            bound = torch.maximum(oracle.abs() * 2.0 ** -4, scale * 2.0 ** -10)  # e4m3: half a step
            assert ((got - oracle).abs() <= bound).all(), name
            if i > 0:
                assert bool(exact_blocks.all()), name  # untouched layers: every block exact
    assert inexact_seen >= 2, "the outliers made no block inexact: the test lost its point"


def test_loaded_fp8_and_report_equal_launch_convert(spread_mxfp4):
    """Loading the MXFP4 checkpoint gives the bytes of its offline conversion (experts and the q/k/v/o
    projections, codes and scales), and the same report rows."""
    cfg = AutoConfig.from_pretrained(spread_mxfp4["src"])
    root, loader = load(cfg, layers_only(read_checkpoint(spread_mxfp4["src"])))
    want = read_checkpoint(spread_mxfp4["fp8"])
    for name, p in root.named_parameters():
        if p.dtype == FP8:
            assert torch.equal(p.view(torch.uint8), want[name].view(torch.uint8)), name
        else:
            assert torch.equal(p, want[name].to(p.dtype)), name
    report = spread_mxfp4["report"]
    assert set(loader.report) == set(report)
    for name, row in report.items():
        assert (loader.report[name]["blocks_exact"], loader.report[name]["blocks"]) == (row["blocks_exact"], row["blocks"])
        assert loader.report[name]["max_rel_err"] == pytest.approx(row["max_rel_err"], rel=1e-6, abs=0)
        assert loader.report[name]["mean_rel_err"] == pytest.approx(row["mean_rel_err"], rel=1e-6, abs=0)
    # the q/k/v/o weights are bf16 in the source: quantised, not exact, as the converter does
    assert any(r["blocks_exact"] < r["blocks"] for k, r in report.items() if ".self_attn." in k)


def _synthetic_mxfp4(hidden=320, inter=320, experts=4, seed=0):
    """A one-layer MXFP4 MLP whose intermediate size (320 = 2.5 blocks) gives TP ranks block shards."""
    cfg = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=2,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_hidden_layers=1,
                       vocab_size=512, sliding_window=8, layer_types=["sliding_attention"])
    cfg.quantization_config = dict(mt.MXFP4_QUANTIZATION_CONFIG)
    g = torch.Generator().manual_seed(seed)
    p = "model.layers.0.mlp."
    t = {p + "router.weight": torch.randn(experts, hidden, generator=g),
         p + "router.bias": torch.randn(experts, generator=g),
         p + "experts.gate_up_proj_bias": torch.randn(experts, 2 * inter, generator=g),
         p + "experts.down_proj_bias": torch.randn(experts, hidden, generator=g)}
    for leaf, shape in (("gate_up_proj", (experts, 2 * inter, hidden)), ("down_proj", (experts, hidden, inter))):
        w = torch.randn(*shape, generator=g) * torch.logspace(-3, 0, shape[-1])  # magnitudes spread along K
        t[p + f"experts.{leaf}_blocks"], t[p + f"experts.{leaf}_scales"] = mt.mxfp4_quantize(w)
    return cfg, t


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 2), (4, 4)])
@pytest.mark.parametrize("chunk_experts", [1, 3])
def test_parallel_ranks_hold_the_fp8_checkpoints_shards(tp, ep, chunk_experts):
    """Each TP/EP rank converts only its experts, a few at a time, and holds exactly what it would load
    from the converted FP8 checkpoint: the same 128-block cut of codes and scales."""
    cfg, tensors = _synthetic_mxfp4()
    p = "model.layers.0.mlp.experts."
    full = {}
    for leaf in ("gate_up_proj", "down_proj"):
        from sglang_ext.layers.mxfp4 import dequantize_mxfp4

        w = dequantize_mxfp4(tensors[p + leaf + "_blocks"], tensors[p + leaf + "_scales"], torch.float32)
        full[p + leaf], full[p + leaf + "_scale_inv"], _ = convert_block128(w, exact_source=True)
    for rank in range(tp):
        layout = ParallelLayout(tp, rank, ep_size=ep)
        chunk = chunk_experts * 2 * cfg.intermediate_size * cfg.hidden_size
        root, loader = load(cfg, list(tensors.items()), layout, parts=("mlp",), chunk_elements=chunk)
        experts = root.model.layers[0].mlp.experts
        for name, want in full.items():
            want = gpt_oss.shard_checkpoint_tensor(name, want, "checkpoint", core.RankGroups(layout), None, experts)
            got = dict(root.named_parameters())[name]
            assert got.shape == want.shape, (name, rank)
            assert torch.equal(got.view(torch.uint8) if got.dtype == FP8 else got,
                               want.view(torch.uint8) if want.dtype == FP8 else want), (name, rank)
        assert loader.report[p + "down_proj"]["blocks"] == (experts.shard.expert_hi - experts.shard.expert_lo) * 3 * 3


def test_bf16_checkpoint_with_quantization_fp8_loads_its_offline_conversion(tiny_checkpoints, tmp_path):
    """A bf16 checkpoint stays bf16 unless launched with SGLang's --quantization fp8 (its Fp8Config reaches
    the model): then the loader holds launch/convert.py's bf16 -> FP8 conversion, bytes and report."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

    cfg = AutoConfig.from_pretrained(tiny_checkpoints["bf16"])
    assert core.checkpoint_format(cfg) == "dense" and not core.serves_fp8(cfg)
    assert core.serves_fp8(cfg, Fp8Config(is_checkpoint_fp8_serialized=False))
    with pytest.raises(ValueError, match="--quantization mxfp4"):
        core.serves_fp8(cfg, Mxfp4Config())
    report = convert(str(tiny_checkpoints["bf16"]), str(tmp_path / "fp8"), log=lambda *_: None)
    root, loader = load(cfg, layers_only(read_checkpoint(tiny_checkpoints["bf16"])), fp8=True)
    want = read_checkpoint(tmp_path / "fp8")
    for name, p in root.named_parameters():
        if p.dtype == FP8:
            assert torch.equal(p.view(torch.uint8), want[name].view(torch.uint8)), name
        else:
            assert torch.equal(p, want[name].to(p.dtype)), name
    assert set(loader.report) == set(report)
    for name, row in report.items():
        assert loader.report[name]["blocks_exact"] == row["blocks_exact"], name
        assert loader.report[name]["max_rel_err"] == pytest.approx(row["max_rel_err"], rel=1e-6, abs=0)


def test_fp8_checkpoint_tensor_in_bf16_is_refused(tmp_path, tiny_checkpoints):
    """An FP8 checkpoint carries its own codes and scales: a bf16 projection in it is an error, not a
    silent conversion."""
    cfg = AutoConfig.from_pretrained(tiny_checkpoints["mxfp4"])
    cfg.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    tensors = layers_only(read_checkpoint(tiny_checkpoints["bf16"]))
    with pytest.raises(TypeError, match="expected float8_e4m3fn"):
        load(cfg, tensors)


def test_unknown_quant_method_is_refused():
    cfg = GptOssConfig(num_hidden_layers=1)
    cfg.quantization_config = {"quant_method": "awq"}
    with pytest.raises(ValueError, match="awq"):
        core.checkpoint_format(cfg)


def test_dummy_load_of_an_mxfp4_config_is_finite_and_like_fp8(tiny_checkpoints):
    """SGLang's --load-format dummy (initialize_dummy_weights over the model's parameters) on an MXFP4
    config: the parameters are an FP8 checkpoint's (names, shapes, dtypes), every one finite, and the
    layer's MoE computes finite values."""
    from sglang.srt.model_loader.weight_utils import initialize_dummy_weights

    cfg = AutoConfig.from_pretrained(tiny_checkpoints["mxfp4"])
    fp8_cfg = AutoConfig.from_pretrained(tiny_checkpoints["mxfp4"])
    fp8_cfg.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    root, _tp = build_layers(cfg)
    fp8_root, _ = build_layers(fp8_cfg)
    layout = lambda m: {k: (tuple(v.shape), v.dtype) for k, v in m.named_parameters()}  # noqa: E731
    assert layout(root) == layout(fp8_root)
    initialize_dummy_weights(root)
    for name, p in root.named_parameters():
        assert torch.isfinite(p.float()).all(), name
    for layer in root.model.layers:
        layer.self_attn.fuse_qkv()  # what the model's post_load_weights does after a dummy load
        ex = layer.mlp.experts
        for w, s in ((ex.gate_up_proj, ex.gate_up_proj_scale_inv), (ex.down_proj, ex.down_proj_scale_inv)):
            assert torch.isfinite(dequantize_weight_block128(w, s)).all()
        x = torch.randn(5, cfg.hidden_size)  # the parameters' dtype (fp32 here; bf16 under SGLang)
        assert torch.isfinite(layer.mlp(x).float()).all()
        q, k, v = layer.self_attn._project_qkv(x)
        assert torch.isfinite(torch.cat([q, k, v], -1).float()).all()


RESOLVE = r"""
import json, os, sys
sys.argv = ["resolve"]
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.arg_groups.memory_hook as memory_hook
from sglang.srt.arg_groups.model_override_base import model_config_of, resolved_view
from sglang.srt.server_args import prepare_server_args

memory_hook.get_device_memory_capacity = lambda *a, **k: 80 * 1024  # an H100's 80 GB: SGLang's CUDA defaults
out = {}
for name, argv in json.loads(os.environ["CASES"]).items():
    args = prepare_server_args(argv + ["--skip-tokenizer-init"])
    args.resolve_once()
    v = resolved_view(args)
    out[name] = {"max_bs": v.cuda_graph_config.decode.max_bs, "bs": v.cuda_graph_config.decode.bs,
                 "attention": v.attention_backend, "moe_runner": v.moe_runner_backend, "dtype": v.dtype,
                 "quantization": model_config_of(args).quantization}
print("RESOLVED " + json.dumps(out))
"""


def test_default_launch_resolves_per_checkpoint_format(tiny_checkpoints, tmp_path):
    """What `launch_server --model-path X` resolves to on CUDA with no flag (SGLang's resolution pipeline with
    this plugin, an 80 GB GPU's memory faked in, in a fresh process): an MXFP4 checkpoint keeps SGLang's
    default decode CUDA graphs (up to batch 256) on our attention and MoE; a bf16 one is limited to batch 8
    (its torch MoE), unless launched with --quantization fp8 or the user chose the sizes. A CPU is untouched."""
    import json
    import subprocess
    import sys

    from sglang_ext.launch.cpu_shims import cpu_server_env

    mx, bf = str(tiny_checkpoints["mxfp4"]), str(tiny_checkpoints["bf16"])
    cases = {"mxfp4": ["--model-path", mx, "--device", "cuda"],
             "bf16": ["--model-path", bf, "--device", "cuda"],
             "bf16_fp8": ["--model-path", bf, "--device", "cuda", "--quantization", "fp8"],
             "bf16_user_64": ["--model-path", bf, "--device", "cuda", "--cuda-graph-max-bs-decode", "64"],
             "bf16_cpu": ["--model-path", bf, "--device", "cpu"]}
    env = dict(cpu_server_env(), CASES=json.dumps(cases))
    run = subprocess.run([sys.executable, "-c", RESOLVE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESOLVED ")), None)
    assert line, run.stdout[-2000:] + run.stderr[-4000:]
    got = json.loads(line[len("RESOLVED "):])
    assert got["mxfp4"]["max_bs"] == 256 and got["mxfp4"]["bs"][-1] == 256
    assert got["mxfp4"]["attention"] == "ext_sinks" and got["mxfp4"]["moe_runner"] == "triton"
    assert got["mxfp4"]["dtype"] == "bfloat16" and got["mxfp4"]["quantization"] == "mxfp4"
    assert got["bf16"]["max_bs"] == 8 and got["bf16"]["bs"] == [1, 2, 4, 8]
    assert "decode CUDA graphs stop at batch 8" in run.stderr + run.stdout
    assert got["bf16_fp8"]["max_bs"] == 256 and got["bf16_fp8"]["quantization"] == "fp8"
    assert got["bf16_user_64"]["max_bs"] == 64
    assert got["bf16_cpu"]["max_bs"] == 32  # SGLang's CPU default, as without the plugin's limit
