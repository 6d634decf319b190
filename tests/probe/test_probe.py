"""SingProbe head: config parsing, checkpoint validation, hub-id resolution, base binding, reference math.

The reference head is what the serving path is compared against, so it is itself checked against an
independent float64 implementation written here (per-query loop, explicit window range), and the window
edge is checked by perturbing single inputs rather than by re-deriving the mask.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from sglang_ext.launch import make_tiny_probe
from sglang_ext.probe.checkpoint import (
    EXPECTED_SHAPES,
    ProbeBindingError,
    ProbeCheckpointError,
    count_parameters,
    load_probe_checkpoint,
    resolve_probe_path,
    validate_against_base,
)
from sglang_ext.probe.config import ProbeConfig, ProbeConfigError
from sglang_ext.probe.model import SingProbeHead, tap_features

GPT_OSS_120B_PROBE = {
    "architectures": ["SingProbeAttnModel"],
    "model_type": "sing_probe_attn",
    "auto_map": {
        "AutoConfig": "configuration_sing_probe.SingProbeAttnConfig",
        "AutoModel": "modeling_sing_probe.SingProbeAttnModel",
    },
    "hidden_size": 2880,
    "base_model_layer_ids": [10, 22, 34],
    "num_attention_heads": 8,
    "head_dim": 64,
    "sliding_window": 2048,
    "num_labels": 10,
    "base_model_name": "openai/gpt-oss-120b",
    "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def tiny_probe(tmp_path_factory):
    return make_tiny_probe.generate(str(tmp_path_factory.mktemp("probe") / "tiny"), log=lambda *_: None)


def _copy_probe(src, dst):
    os.makedirs(dst, exist_ok=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    return str(dst)


# ---------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------


def test_config_defaults_labels_when_absent():
    cfg = ProbeConfig.from_dict(GPT_OSS_120B_PROBE)
    assert cfg.labels == [f"label_{i}" for i in range(10)]
    assert cfg.input_size == 8640 and cfg.q_size == 512 and cfg.kv_size == 128
    assert cfg.sliding_window == 2048 and cfg.base_model_layer_ids == [10, 22, 34]
    assert "labels" not in cfg.to_dict() and "input_size" not in cfg.to_dict()


def test_config_labels_present_and_checked():
    names = [f"cat{i}" for i in range(10)]
    cfg = ProbeConfig.from_dict(dict(GPT_OSS_120B_PROBE, labels=names))
    assert cfg.labels == names and cfg.to_dict()["labels"] == names
    with pytest.raises(ProbeConfigError, match="labels has 3 names but num_labels is 10"):
        ProbeConfig.from_dict(dict(GPT_OSS_120B_PROBE, labels=["a", "b", "c"]))


def test_config_null_window_is_full_causal_and_dtype_aliases():
    cfg = ProbeConfig.from_dict(dict(GPT_OSS_120B_PROBE, sliding_window=None, torch_dtype="bf16"))
    assert cfg.sliding_window is None and cfg.torch_dtype == "bfloat16"
    d = dict(GPT_OSS_120B_PROBE)
    del d["torch_dtype"]
    assert ProbeConfig.from_dict(dict(d, dtype="float32")).torch_dtype == "float32"  # transformers 5 key


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"model_type": "sing_probe_mlp", "architectures": ["SingProbeMLPModel"]}, "'sing_probe_mlp' (the MLP probe"),
        ({"model_type": "sing_probe_identity"}, "'sing_probe_identity'"),
        ({"model_type": "llama"}, "'llama' (not a SingProbe attention head) is not supported"),
        ({"architectures": ["SingProbeMLPModel"]}, "do not include 'SingProbeAttnModel'"),
        ({"hidden_size": "2880"}, "hidden_size must be a positive integer, got '2880'"),
        ({"num_attention_heads": True}, "num_attention_heads must be a positive integer"),
        ({"base_model_layer_ids": []}, "base_model_layer_ids must be a non-empty list"),
        ({"base_model_layer_ids": [10, -1]}, "non-negative integers"),
        ({"base_model_layer_ids": [10, 10]}, "duplicates"),
        ({"sliding_window": 0}, "sliding_window must be a positive integer or null"),
        ({"labels": ["a"] * 10}, "duplicate names"),
    ],
)
def test_config_rejections_are_one_line(patch, message):
    with pytest.raises(ProbeConfigError) as e:
        ProbeConfig.from_dict(dict(GPT_OSS_120B_PROBE, **patch))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_mlp_config_rejected_before_missing_fields():
    mlp = {"model_type": "sing_probe_mlp", "hidden_size": 2880, "base_model_layer_ids": [1], "intermediate_size": 1024}
    with pytest.raises(ProbeConfigError, match="MLP probe head"):
        ProbeConfig.from_dict(mlp)
    with pytest.raises(ProbeConfigError, match="lacks the required key 'base_model_layer_ids'"):
        ProbeConfig.from_dict({"model_type": "sing_probe_attn", "hidden_size": 64})


def test_config_from_json_file_names_the_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ProbeConfigError, match=f"probe config {p}: unreadable"):
        ProbeConfig.from_json_file(p)
    p.write_text(json.dumps(dict(GPT_OSS_120B_PROBE, model_type="sing_probe_mlp")))
    with pytest.raises(ProbeConfigError, match=f"probe config {p}: model_type 'sing_probe_mlp'"):
        ProbeConfig.from_json_file(p)


def test_parameter_count_gpt_oss_120b():
    cfg = ProbeConfig.from_dict(GPT_OSS_120B_PROBE)
    assert count_parameters(cfg) == 5_797_386
    assert EXPECTED_SHAPES(cfg) == {
        "proj_q.weight": (512, 8640),
        "proj_k.weight": (64, 8640),
        "proj_v.weight": (64, 8640),
        "o_proj.weight": (512, 512),
        "norm.weight": (512,),
        "classifier.weight": (10, 512),
        "classifier.bias": (10,),
    }
    with torch.device("meta"):
        head = SingProbeHead(cfg)
    assert sum(p.numel() for p in head.parameters()) == 5_797_386
    assert {k: tuple(v.shape) for k, v in head.state_dict().items()} == EXPECTED_SHAPES(cfg)


# ---------------------------------------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------------------------------------


def test_tiny_probe_is_in_release_format(tiny_probe):
    from safetensors import safe_open

    with open(os.path.join(tiny_probe, "config.json")) as f:
        cfg_json = json.load(f)
    assert cfg_json["architectures"] == ["SingProbeAttnModel"] and cfg_json["model_type"] == "sing_probe_attn"
    assert cfg_json["base_model_layer_ids"] == [1, 3, 5] and cfg_json["sliding_window"] == 64
    assert cfg_json["torch_dtype"] == "bfloat16" and "labels" not in cfg_json
    with safe_open(os.path.join(tiny_probe, "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    cfg, tensors = load_probe_checkpoint(tiny_probe)
    assert list(tensors) == list(EXPECTED_SHAPES(cfg))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert tensors["classifier.bias"].abs().min() > 0
    # Idempotent: a second call finds it current and leaves the file untouched.
    mtime = os.path.getmtime(os.path.join(tiny_probe, "model.safetensors"))
    logs = []
    make_tiny_probe.generate(tiny_probe, log=logs.append)
    assert "up to date" in logs[0] and os.path.getmtime(os.path.join(tiny_probe, "model.safetensors")) == mtime


def test_tiny_probe_labels_option_and_base(tmp_path, tiny_probe):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 12}))
    out = make_tiny_probe.main([str(tmp_path / "p"), "--base", str(base), "--labels"])
    assert out == 0
    cfg, _ = load_probe_checkpoint(tmp_path / "p")
    assert cfg.labels == make_tiny_probe.SINGPROBE_LABEL_NAMES and cfg.base_model_layer_ids == [2, 6, 11]


def test_checkpoint_lists_missing_unexpected_misshaped_in_one_line(tmp_path, tiny_probe):
    folder = _copy_probe(tiny_probe, tmp_path / "bad")
    _, tensors = load_probe_checkpoint(tiny_probe)
    del tensors["norm.weight"]
    del tensors["classifier.bias"]
    tensors["attn_layer.q.weight"] = torch.zeros(4)
    tensors["proj_q.weight"] = torch.zeros(512, 100, dtype=torch.bfloat16)
    tensors["o_proj.weight"] = torch.zeros(512, 256, dtype=torch.bfloat16)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ProbeCheckpointError) as e:
        load_probe_checkpoint(folder)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (
        f"probe checkpoint {folder}: missing [norm.weight, classifier.bias]; unexpected [attn_layer.q.weight]; "
        "mis-shaped [proj_q.weight: [512, 192] expected, [512, 100] found; "
        "o_proj.weight: [512, 512] expected, [512, 256] found]"
    )


def test_checkpoint_rejects_integer_tensors(tmp_path, tiny_probe):
    folder = _copy_probe(tiny_probe, tmp_path / "int")
    _, tensors = load_probe_checkpoint(tiny_probe)
    tensors["norm.weight"] = torch.ones(512, dtype=torch.int32)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with pytest.raises(ProbeCheckpointError, match=r"not floating point \[norm.weight: I32\]"):
        load_probe_checkpoint(folder)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_checkpoint_missing_file_named(tmp_path, tiny_probe, missing):
    folder = _copy_probe(tiny_probe, tmp_path / "partial")
    os.remove(os.path.join(folder, missing))
    with pytest.raises(ProbeCheckpointError) as e:
        load_probe_checkpoint(folder)
    assert str(e.value) == f"probe checkpoint {folder}: {missing} not found"


def test_checkpoint_bad_config_reported_as_checkpoint_error(tmp_path, tiny_probe):
    folder = _copy_probe(tiny_probe, tmp_path / "mlp")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(GPT_OSS_120B_PROBE, model_type="sing_probe_mlp"), f)
    with pytest.raises(ProbeCheckpointError, match="sing_probe_mlp"):
        load_probe_checkpoint(folder)


def test_remote_code_in_folder_is_never_executed(tmp_path, tiny_probe):
    folder = _copy_probe(tiny_probe, tmp_path / "with_code")
    marker = tmp_path / "EXECUTED"
    payload = f"open({str(marker)!r}, 'w').write(__name__)\nraise RuntimeError('remote code ran')\n"
    for name in ("modeling_sing_probe.py", "configuration_sing_probe.py", "__init__.py"):
        with open(os.path.join(folder, name), "w") as f:
            f.write(payload)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["auto_map"] = GPT_OSS_120B_PROBE["auto_map"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)

    resolved = resolve_probe_path(folder)
    load_probe_checkpoint(resolved)
    head = SingProbeHead.from_checkpoint(resolved, dtype=torch.float32)
    head(torch.randn(1, 3, head.config.input_size))

    assert not marker.exists()
    assert "modeling_sing_probe" not in sys.modules and "configuration_sing_probe" not in sys.modules


# ---------------------------------------------------------------------------------------------------------
# --probe-ckpt resolution
# ---------------------------------------------------------------------------------------------------------


def _fake_hub_cache(cache, repo_id, probe_src, rev="0123456789abcdef0123456789abcdef01234567"):
    """The huggingface_hub cache layout: models--org--name/{refs/main, snapshots/<rev>/...}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    _copy_probe(probe_src, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    return str(snap)


def test_resolve_local_folder(tiny_probe):
    assert resolve_probe_path(tiny_probe) == os.path.abspath(tiny_probe)


def test_resolve_hub_id_from_hf_hub_cache(tmp_path, tiny_probe, monkeypatch):
    snap = _fake_hub_cache(tmp_path / "hub", "inclusionAI/gpt-oss-tiny-singprobe", tiny_probe)
    monkeypatch.chdir(tmp_path)  # so "inclusionAI/..." is not accidentally a relative folder
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    path = resolve_probe_path("inclusionAI/gpt-oss-tiny-singprobe")
    assert os.path.realpath(path) == os.path.realpath(snap)
    cfg, _ = load_probe_checkpoint(path)
    assert cfg.base_model_layer_ids == [1, 3, 5]


def test_resolve_hub_id_from_hf_home(tmp_path, tiny_probe, monkeypatch):
    snap = _fake_hub_cache(tmp_path / "home" / "hub", "org/name", tiny_probe)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert os.path.realpath(resolve_probe_path("org/name")) == os.path.realpath(snap)


@pytest.mark.parametrize("spec", ["org/not-cached", "/no/such/folder", "plainname"])
def test_resolve_missing_is_one_line(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ProbeCheckpointError) as e:
        resolve_probe_path(spec)
    msg = str(e.value)
    assert msg.startswith(f"--probe-ckpt {spec}: not a folder and not in the local Hugging Face cache (")
    assert "\n" not in msg
    if spec == "org/not-cached":
        assert str(tmp_path / "empty-hub") in msg


# ---------------------------------------------------------------------------------------------------------
# binding to the base model
# ---------------------------------------------------------------------------------------------------------


def test_validate_against_base_accepts_matching():
    cfg = ProbeConfig.from_dict(GPT_OSS_120B_PROBE)
    base = SimpleNamespace(hidden_size=2880, num_hidden_layers=36)
    for model_dtype in (torch.bfloat16, torch.float16, torch.float32, "bfloat16"):
        validate_against_base(cfg, base, model_dtype)
    for probe_dtype in ("float16", "float32"):
        validate_against_base(ProbeConfig.from_dict(dict(GPT_OSS_120B_PROBE, torch_dtype=probe_dtype)), base,
                              torch.bfloat16)
    validate_against_base(cfg, {"hidden_size": 2880, "num_hidden_layers": 36}, torch.bfloat16)


@pytest.mark.parametrize(
    "probe_patch, base, model_dtype, message",
    [
        ({}, dict(hidden_size=2048, num_hidden_layers=36), torch.bfloat16,
         "probe hidden_size 2880 (trained on openai/gpt-oss-120b) differs from the base model's hidden_size 2048"),
        ({}, dict(hidden_size=2880, num_hidden_layers=24), torch.bfloat16,
         "[10, 22, 34] has [34] outside the base model's layers 0..23"),
        ({"base_model_layer_ids": [10, 36]}, dict(hidden_size=2880, num_hidden_layers=36), torch.bfloat16,
         "has [36] outside"),
        ({"torch_dtype": "int8"}, dict(hidden_size=2880, num_hidden_layers=36), torch.bfloat16,
         "probe torch_dtype 'int8' cannot be cast to model dtype torch.bfloat16"),
        ({}, dict(hidden_size=2880, num_hidden_layers=36), torch.float8_e4m3fn,
         "cannot be cast to model dtype torch.float8_e4m3fn"),
    ],
)
def test_validate_against_base_mismatches(probe_patch, base, model_dtype, message):
    cfg = ProbeConfig.from_dict(dict(GPT_OSS_120B_PROBE, **probe_patch))
    with pytest.raises(ProbeBindingError) as e:
        validate_against_base(cfg, SimpleNamespace(**base), model_dtype)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_negative_layer_id_rejected_at_binding():
    cfg = ProbeConfig.from_dict(GPT_OSS_120B_PROBE)
    cfg.base_model_layer_ids = [-1, 22]  # bypassing the config check, as a caller mutating it could
    with pytest.raises(ProbeBindingError, match=r"has \[-1\] outside"):
        validate_against_base(cfg, SimpleNamespace(hidden_size=2880, num_hidden_layers=36), torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------
# reference head vs an independent float64 implementation
# ---------------------------------------------------------------------------------------------------------


def head_f64(sd: dict, cfg: ProbeConfig, x: torch.Tensor) -> torch.Tensor:
    """SingProbe attention head in float64, one query at a time with the visible keys listed explicitly."""
    w = {k: v.double() for k, v in sd.items()}
    x = x.double()
    n_heads, dim, win = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    seq = x.shape[0]
    q = (x @ w["proj_q.weight"].T).reshape(seq, n_heads, dim)
    k = x @ w["proj_k.weight"].T
    v = x @ w["proj_v.weight"].T
    logits = torch.empty(seq, cfg.num_labels, dtype=torch.float64)
    for i in range(seq):
        first = 0 if win is None else max(0, i - win + 1)
        ks, vs = k[first:i + 1], v[first:i + 1]
        ctx = torch.empty(n_heads, dim, dtype=torch.float64)
        for h in range(n_heads):
            att = torch.softmax((ks @ q[i, h]) / math.sqrt(dim), dim=0)
            ctx[h] = att @ vs
        hvec = q[i].reshape(-1) + w["o_proj.weight"] @ ctx.reshape(-1)
        hvec = hvec / torch.sqrt((hvec ** 2).mean() + 1e-6) * w["norm.weight"]
        logits[i] = w["classifier.weight"] @ hvec + w["classifier.bias"]
    return logits


@pytest.mark.parametrize("window", ["config", None, 1])
def test_reference_head_matches_float64(tiny_probe, window):
    head = SingProbeHead.from_checkpoint(tiny_probe, dtype=torch.float32)
    if window != "config":
        head.window = window
        head.config.sliding_window = window
    assert head.window == (64 if window == "config" else window)
    cfg = head.config
    g = torch.Generator().manual_seed(1)
    x = tap_features([torch.randn(2, 150, cfg.hidden_size, generator=g) for _ in cfg.base_model_layer_ids],
                     torch.float32)
    with torch.no_grad():
        got = head(x)
    assert got.dtype == torch.float32 and got.shape == (2, 150, 10)
    sd = {k: v.detach() for k, v in head.state_dict().items()}
    for b in range(2):
        torch.testing.assert_close(got[b].double(), head_f64(sd, cfg, x[b]), atol=2e-5, rtol=1e-5)


def test_reference_head_window_edge(tiny_probe):
    """Row i sees input i-W+1 but not i-W (W=64): perturbing x[i-W] leaves logits[i] bit-identical."""
    head = SingProbeHead.from_checkpoint(tiny_probe, dtype=torch.float32)
    w, i = head.config.sliding_window, 130
    x = torch.randn(1, 140, head.config.input_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = head(x)
        for j, visible in ((i - w, False), (i - w + 1, True), (i, True), (i + 1, False)):
            x2 = x.clone()
            x2[0, j] += 3.0
            out = head(x2)
            assert (not torch.equal(out[0, i], base[0, i])) == visible, (j, visible)
            assert torch.equal(out[0, :j], base[0, :j])  # causal: earlier rows never see a later input


def test_reference_pieces_compose(tiny_probe):
    """project/tail are what the runtime reuses: K then V in kv, tail in fp32, probs = sigmoid."""
    head = SingProbeHead.from_checkpoint(tiny_probe)  # bf16, as served
    x = tap_features([torch.randn(1, 20, 64) for _ in range(3)], torch.bfloat16)
    with torch.no_grad():
        q, kv = head.project(x)
        assert q.shape == (1, 20, 8, 64) and kv.shape == (1, 20, 128) and kv.dtype == torch.bfloat16
        torch.testing.assert_close(kv[..., :64], head.proj_k(x), atol=0, rtol=0)
        torch.testing.assert_close(kv[..., 64:], head.proj_v(x), atol=0, rtol=0)
        logits = head(x)
        assert logits.dtype == torch.float32
        # Row 0 attends only to itself: ctx = v_0 for every head.
        ctx0 = kv[0, 0, 64:].float().expand(8, 64)
        torch.testing.assert_close(head.tail(q[0, 0], ctx0), logits[0, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(head.probs(logits), torch.sigmoid(logits), atol=0, rtol=0)


def test_tap_features_normalises_each_tap_in_fp32():
    g = torch.Generator().manual_seed(3)
    taps = [torch.randn(4, 7, 64, generator=g) * s for s in (0.01, 1.0, 300.0)]
    feats = tap_features(taps, torch.bfloat16)
    assert feats.shape == (4, 7, 192) and feats.dtype == torch.bfloat16
    for n, t in enumerate(taps):
        want = (t.double() / torch.sqrt(t.double().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        # fp32 vs float64 normalisation may round to neighbouring bf16 values: one bf16 ulp.
        torch.testing.assert_close(feats[..., 64 * n:64 * (n + 1)].float(), want.float(), atol=1e-6, rtol=2**-7)
    # bf16 inputs are normalised in fp32 too (a bf16 square-mean would lose precision).
    bf = [t.to(torch.bfloat16) for t in taps]
    want = torch.cat([(t.float() * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6)) for t in bf], -1)
    torch.testing.assert_close(tap_features(bf, torch.float32), want, atol=0, rtol=0)
