"""Tiny gpt-oss checkpoints (launch/make_tiny.py) have the official Hugging Face layout (SPEC section 1),
their MXFP4 experts dequantise (transformers' own convert_moe_packed_tensors) to the bf16 experts exactly,
and the tokenizer folder (launch/tokenizer.py) is the o200k_harmony one with the official chat template.

CPU only. The o200k vocabulary and the built tokenizer.json are cached in ``$SGLANG_EXT_CACHE_DIR`` (default
``~/.cache/sglang_ext``); the very first run downloads ``quicktok-v1==0.4.0`` from PyPI and builds the
tokenizer (~15 s more).
"""

import importlib.util
import json
import os
import re
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name):
    try:
        return importlib.import_module(f"sglang_ext.launch.{name}")
    except ImportError:
        path = os.path.join(HERE, "..", "..", "launch", f"{name}.py")
        spec = importlib.util.spec_from_file_location(f"_test_launch_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


mt = _load("make_tiny")
tk = _load("tokenizer")

VARIANTS = ("bf16", "fp32", "mxfp4")
D = mt.TINY_DIMS
E, H, I = D["num_local_experts"], D["hidden_size"], D["intermediate_size"]
NH, NKV, HD, L = D["num_attention_heads"], D["num_key_value_heads"], D["head_dim"], D["num_hidden_layers"]
V = 201088


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tiny_gpt_oss"))
    t0 = time.time()
    paths = mt.generate(root, VARIANTS, log=lambda *a: None)
    paths["_seconds"] = time.time() - t0
    return paths


@pytest.fixture(scope="session")
def vocab_dir():
    return tk.ensure_o200k_vocab()


@pytest.fixture(scope="session")
def hf_tok(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny["bf16"])


def _read_tensors(path):
    """{name: tensor} of a checkpoint dir (single file or index + shards); also checks the index."""
    from safetensors.torch import load_file

    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            index = json.load(f)
        out = {}
        for shard in sorted(set(index["weight_map"].values())):
            out.update(load_file(os.path.join(path, shard)))
        assert set(out) == set(index["weight_map"])
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
        return out
    return load_file(os.path.join(path, "model.safetensors"))


def _expected_layout(variant):
    dt = torch.float32 if variant == "fp32" else torch.bfloat16
    exp = {
        "model.embed_tokens.weight": ([V, H], dt),
        "model.norm.weight": ([H], dt),
        "lm_head.weight": ([V, H], dt),
    }
    for i in range(L):
        p = f"model.layers.{i}."
        exp.update(
            {
                p + "input_layernorm.weight": ([H], dt),
                p + "post_attention_layernorm.weight": ([H], dt),
                p + "self_attn.q_proj.weight": ([NH * HD, H], dt),
                p + "self_attn.q_proj.bias": ([NH * HD], dt),
                p + "self_attn.k_proj.weight": ([NKV * HD, H], dt),
                p + "self_attn.k_proj.bias": ([NKV * HD], dt),
                p + "self_attn.v_proj.weight": ([NKV * HD, H], dt),
                p + "self_attn.v_proj.bias": ([NKV * HD], dt),
                p + "self_attn.o_proj.weight": ([H, NH * HD], dt),
                p + "self_attn.o_proj.bias": ([H], dt),
                p + "self_attn.sinks": ([NH], dt),
                p + "mlp.router.weight": ([E, H], dt),
                p + "mlp.router.bias": ([E], dt),
                p + "mlp.experts.gate_up_proj_bias": ([E, 2 * I], dt),
                p + "mlp.experts.down_proj_bias": ([E, H], dt),
            }
        )
        if variant == "mxfp4":
            exp.update(
                {
                    p + "mlp.experts.gate_up_proj_blocks": ([E, 2 * I, H // 32, 16], torch.uint8),
                    p + "mlp.experts.gate_up_proj_scales": ([E, 2 * I, H // 32], torch.uint8),
                    p + "mlp.experts.down_proj_blocks": ([E, H, I // 32, 16], torch.uint8),
                    p + "mlp.experts.down_proj_scales": ([E, H, I // 32], torch.uint8),
                }
            )
        else:
            exp.update(
                {
                    p + "mlp.experts.gate_up_proj": ([E, H, 2 * I], dt),
                    p + "mlp.experts.down_proj": ([E, I, H], dt),
                }
            )
    return exp


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("variant", VARIANTS)
def test_config(tiny, variant):
    with open(os.path.join(tiny[variant], "config.json")) as f:
        c = json.load(f)
    official = set(mt.OFFICIAL_20B_CONFIG) | ({"quantization_config"} if variant == "mxfp4" else set())
    assert set(c) == official
    assert c["architectures"] == ["GptOssForCausalLM"] and c["model_type"] == "gpt_oss"
    assert c["layer_types"] == ["sliding_attention", "full_attention"] * (L // 2)
    assert c["sliding_window"] == 128 and c["rope_theta"] == 150000 and c["swiglu_limit"] == 7.0
    assert c["rope_scaling"] == {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": False,
    }  # fmt: skip
    assert c["num_local_experts"] == E and c["experts_per_token"] == c["num_experts_per_tok"] == 4
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (H, I, L)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (NH, NKV, HD)
    assert c["initial_context_length"] == 4096 and c["max_position_embeddings"] == 131072
    assert c["attention_bias"] is True and c["tie_word_embeddings"] is False
    assert c["hidden_act"] == "silu" and c["rms_norm_eps"] == 1e-5 and c["vocab_size"] == V
    assert c["eos_token_id"] == 200002 and c["pad_token_id"] == 199999
    assert c["torch_dtype"] == ("float32" if variant == "fp32" else "bfloat16")
    if variant == "mxfp4":
        assert c["quantization_config"] == {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
            ],
        }  # fmt: skip
    with open(os.path.join(tiny[variant], "generation_config.json")) as f:
        g = json.load(f)
    assert g["eos_token_id"] == [200002, 199999, 200012] and g["pad_token_id"] == 199999
    assert g["bos_token_id"] == 199998


def test_config_loads_in_transformers(tiny):
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(tiny["bf16"])
    rp = getattr(c, "rope_parameters", None) or c.rope_scaling
    assert rp["rope_type"] == "yarn" and rp["factor"] == 32.0 and rp["original_max_position_embeddings"] == 4096
    assert (getattr(c, "rope_theta", None) or rp["rope_theta"]) == 150000
    assert c.layer_types[0] == "sliding_attention" and c.sliding_window == 128


# ------------------------------------------------------------------------------------------------ tensors


@pytest.mark.parametrize("variant", VARIANTS)
def test_tensor_names_dtypes_shapes(tiny, variant):
    got = _read_tensors(tiny[variant])
    exp = _expected_layout(variant)
    assert set(got) == set(exp), (set(got) ^ set(exp))
    for k, (shape, dt) in exp.items():
        assert list(got[k].shape) == shape and got[k].dtype == dt, (k, got[k].shape, got[k].dtype)
    if variant == "mxfp4":
        files = sorted(f for f in os.listdir(tiny[variant]) if f.endswith(".safetensors"))
        assert files and all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f) for f in files)


def test_variants_hold_the_same_parameters(tiny):
    bf16, fp32, mx = (_read_tensors(tiny[v]) for v in VARIANTS)
    for k, t in bf16.items():
        assert torch.equal(fp32[k], t.float()), k  # fp32 = the bf16 values upcast
        if k in mx:
            assert torch.equal(mx[k], t), k
    # the init is not degenerate: sinks O(1), biases nonzero, router not near a tie
    assert bf16["model.layers.0.self_attn.sinks"].float().abs().mean() > 0.3
    assert (bf16["model.layers.0.self_attn.q_proj.bias"] != 0).float().mean() > 0.9
    assert bf16["model.layers.0.mlp.experts.gate_up_proj_bias"].float().abs().mean() > 0.1
    assert bf16["model.layers.0.mlp.router.weight"].float().std() > 0.3


def test_mxfp4_dequantises_to_bf16_experts(tiny):
    """The independent oracle: transformers.integrations.mxfp4.convert_moe_packed_tensors. It returns
    [E, K, N] (it transposes the [E, N, K/32, 16] blocks back), i.e. transformers' parameter layout."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    bf16, mx = _read_tensors(tiny["bf16"]), _read_tensors(tiny["mxfp4"])
    for i in range(L):
        p = f"model.layers.{i}.mlp.experts."
        for name in ("gate_up_proj", "down_proj"):
            blocks, scales = mx[p + name + "_blocks"], mx[p + name + "_scales"]
            oracle = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            want = bf16[p + name].float()
            assert oracle.shape == want.shape
            assert torch.equal(oracle, want), (i, name, (oracle - want).abs().max())
            # our reference dequantiser agrees, in the blocks' own (transposed) layout
            assert torch.equal(mt.mxfp4_dequantize(blocks, scales), want.transpose(1, 2))
            # real quantisation: several scales and codes in use, not all one value
            assert scales.unique().numel() > 1 and blocks.unique().numel() > 8


def test_mxfp4_quantizer_properties():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 96, generator=g) * torch.logspace(-6, 2, 40).reshape(1, 40, 1)
    w[0, 0, :32] = 0.0  # an all-zero group
    w[1, 1, 5] = 1e3  # an outlier
    blocks, scales = mt.mxfp4_quantize(w)
    assert blocks.shape == (3, 40, 3, 16) and scales.shape == (3, 40, 3)
    assert blocks.dtype == scales.dtype == torch.uint8
    deq = mt.mxfp4_dequantize(blocks, scales)
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2), deq)
    assert torch.equal(deq[0, 0, :32], torch.zeros(32))
    # per group: no clipping (|w| <= 6 * scale) and error <= half the largest FP4 step (1.0) * scale
    step = torch.pow(2.0, scales.float() - 127).repeat_interleave(32, dim=-1)
    assert ((w - deq).abs() <= step + 1e-30).all()
    assert (w.abs() <= 6 * step).all()
    # quantising the dequantised values is the identity (a fixed point)
    b2, s2 = mt.mxfp4_quantize(deq)
    assert torch.equal(mt.mxfp4_dequantize(b2, s2), deq)
    # nibble order: element 2j is the low nibble
    one = torch.zeros(1, 32)
    one[0, 0], one[0, 1] = 1.0, -6.0  # codes 2 and 15 (scale 2**0)
    b, s = mt.mxfp4_quantize(one)
    assert int(s[0, 0]) == 127 and int(b[0, 0, 0]) == (15 << 4) | 2


# ------------------------------------------------------------------------------------------------ loading


def test_transformers_loads_bf16_and_fp32(tiny):
    from transformers import GptOssForCausalLM

    ids = torch.tensor([mt.random_prompt(n=40, seed=3)])
    out = {}
    for v in ("bf16", "fp32"):
        m = GptOssForCausalLM.from_pretrained(tiny[v], dtype=torch.float32).eval()
        with torch.no_grad():
            out[v] = m(ids).logits
    assert torch.equal(out["bf16"], out["fp32"])  # same parameters
    assert out["fp32"].std() > 0.5


def test_transformers_loads_mxfp4_dequantized(tiny):
    pytest.importorskip("accelerate")  # transformers' Mxfp4HfQuantizer requires it
    from transformers import GptOssForCausalLM

    ref = GptOssForCausalLM.from_pretrained(tiny["bf16"], dtype=torch.bfloat16).state_dict()
    m = GptOssForCausalLM.from_pretrained(tiny["mxfp4"], dtype=torch.bfloat16)  # CPU: dequantises to bf16
    sd = m.state_dict()
    assert set(sd) == set(ref)
    for k in ref:
        assert torch.equal(sd[k].to(torch.bfloat16), ref[k]), k


def test_greedy_decoding_is_varied(tiny):
    from transformers import GptOssForCausalLM

    m = GptOssForCausalLM.from_pretrained(tiny["fp32"], dtype=torch.float32).eval()
    gen = mt.greedy(m, mt.random_prompt(n=150, seed=1), n_new=16)
    assert len(set(gen)) >= 8, gen


def test_generate_is_idempotent(tiny):
    root = os.path.dirname(tiny["bf16"])
    before = {v: os.path.getmtime(os.path.join(tiny[v], "config.json")) for v in VARIANTS}
    t0 = time.time()
    mt.generate(root, VARIANTS, log=lambda *a: None)
    assert time.time() - t0 < 2.0
    assert before == {v: os.path.getmtime(os.path.join(tiny[v], "config.json")) for v in VARIANTS}


# ------------------------------------------------------------------------------------------------ tokenizer


@pytest.mark.parametrize("variant", VARIANTS)
def test_tokenizer_files(tiny, variant):
    files = set(os.listdir(tiny[variant]))
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"} <= files
    with open(os.path.join(tiny[variant], "tokenizer_config.json")) as f:
        tc = json.load(f)
    assert (tc["bos_token"], tc["eos_token"], tc["pad_token"]) == ("<|startoftext|>", "<|return|>", "<|endoftext|>")
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert {int(k): v["content"] for k, v in tc["added_tokens_decoder"].items()} == dict(tk.special_tokens("official"))


def test_tokenizer_specials_and_roundtrip(hf_tok):
    tok = hf_tok
    assert len(tok) == 200019  # like the official tokenizer: 199998 ranks + 21 specials
    specials = {
        "<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002, "<|constrain|>": 200003,
        "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008,
        "<|call|>": 200012, "<|endofprompt|>": 200018, "<|reserved_200000|>": 200000,
        "<|reserved_200017|>": 200017,
    }  # fmt: skip
    for s, i in specials.items():
        assert tok.convert_tokens_to_ids(s) == i and tok.decode([i]) == s
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (199998, 200002, 199999)
    text = "<|start|>user<|message|>Héllo wörld! 12345 日本語 🤖<|end|><|start|>assistant"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:3] == [200006, 1428, 200008] and ids[-2:] == [200006, 173781]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "userHéllo wörld! 12345 日本語 🤖assistant"


def test_tokenizer_matches_tiktoken(hf_tok, vocab_dir, monkeypatch):
    for k, v in tk.harmony_env(vocab_dir).items():
        monkeypatch.setenv(k, v)
    import tiktoken

    enc = tiktoken.get_encoding("o200k_harmony")
    assert enc.n_vocab == V
    for t in ["Hello world!", "  leading spaces\n\nand\ttabs", "I'm DONE, they'll've", "x = f(1234567) // ok", "çé日本語🤖"]:
        assert hf_tok.encode(t, add_special_tokens=False) == enc.encode(t)
    t = "<|start|>system<|message|>hi<|end|><|constrain|><|call|><|return|>"
    assert hf_tok.encode(t, add_special_tokens=False) == enc.encode(t, allowed_special="all")


def test_chat_template_renders_harmony(hf_tok, vocab_dir, monkeypatch):
    with open(tk.CHAT_TEMPLATE_FILE, "rb") as f:
        import hashlib

        assert hashlib.sha256(f.read()).hexdigest() == tk.CHAT_TEMPLATE_SHA256
    msgs = [{"role": "user", "content": "Hi"}]
    text = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n")
    assert "Reasoning: medium" in text and text.endswith("<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant")
    text = hf_tok.apply_chat_template(
        [{"role": "system", "content": "Be terse."}] + msgs, tokenize=False, add_generation_prompt=True,
        reasoning_effort="high",
    )  # fmt: skip
    assert "Reasoning: high" in text and "<|start|>developer<|message|># Instructions\n\nBe terse.\n\n<|end|>" in text

    # openai-harmony renders the same tokens (its date is fixed here, the template uses today's)
    for k, v in tk.harmony_env(vocab_dir).items():
        monkeypatch.setenv(k, v)
    oh = pytest.importorskip("openai_harmony")
    enc = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    sysc = oh.SystemContent.new().with_conversation_start_date("2025-08-05")
    conv = oh.Conversation.from_messages(
        [oh.Message.from_role_and_content(oh.Role.SYSTEM, sysc), oh.Message.from_role_and_content(oh.Role.USER, "Hi")]
    )
    want = list(enc.render_conversation_for_completion(conv, oh.Role.ASSISTANT))
    text = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    text = re.sub(r"Current date: \d{4}-\d{2}-\d{2}", "Current date: 2025-08-05", text)
    assert hf_tok.encode(text, add_special_tokens=False) == want
    assert want[:3] == [200006, 17360, 200008]


# ------------------------------------------------------------------------------------------------ trained profile


def test_chain_prompt_follows_the_trained_task():
    ids, step = mt.chain_task()
    index = {int(t): i for i, t in enumerate(ids)}
    prompt = mt.chain_prompt(300, seed=3)
    lag = mt.CHAIN_TASK["lag"]
    assert len(prompt) == 300 and all(t in index for t in prompt)
    assert all(prompt[i] == int(ids[step[index[prompt[i - lag]]]]) for i in range(lag, 300))
    assert prompt == mt.chain_prompt(300, seed=3) and prompt != mt.chain_prompt(300, seed=4)


def test_trained_profile_has_its_own_marker(tmp_path):
    """A default checkpoint is never taken for a trained one (same init std, different weights)."""
    folder = tmp_path / "bf16"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / mt.MARKER).write_text(json.dumps(mt._marker("bf16", mt.TINY_DIMS, "default")))
    assert mt.is_current(str(folder), "default") and not mt.is_current(str(folder), "trained")
    (folder / mt.MARKER).write_text(json.dumps(mt._marker("bf16", mt.TINY_DIMS, "trained")))
    assert mt.is_current(str(folder), "trained") and not mt.is_current(str(folder), "default")


def test_train_chain_keeps_the_checkpoint_formats_and_lowers_the_loss():
    """A few steps on a 2-layer model: the loss falls, the expert matrices keep their MXFP4-exact init (frozen: 4-bit
    snapping after training would undo it), and every parameter ends bf16-exact."""
    dims = dict(mt.TINY_DIMS, num_hidden_layers=2)
    model = mt.build_model(dims=dims)
    experts = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))}
    losses = []
    mt.train_chain(model, task=dict(mt.CHAIN_TASK, steps=30, batch=4, length=24), device="cpu",
                   log=lambda line: losses.append(float(line.rsplit(" ", 1)[1])))
    assert len(losses) == 2 and losses[-1] < losses[0] - 0.5, losses  # logged at the first and the last step
    for name, p in model.named_parameters():
        assert torch.equal(p, p.to(torch.bfloat16).float()), name
        if name in experts:
            assert torch.equal(p, experts[name]), name
    assert not model.training


def _router_gaps(model, task):
    """Each token's gap between its k-th and (k+1)-th expert logits, every layer, on a batch of the task."""
    ids, step = mt.chain_task(task)
    idx = mt._chain_indices(step, 4, 24, task["lag"], torch.Generator().manual_seed(7))
    gaps = []
    hooks = [layer.mlp.router.register_forward_hook(
        lambda _m, _a, out: gaps.append(out[0].topk(model.config.num_experts_per_tok + 1, -1).values
                                        .diff(dim=-1)[:, -1].abs())) for layer in model.model.layers]
    with torch.no_grad():
        model.model(input_ids=ids[idx])
    for h in hooks:
        h.remove()
    return torch.cat(gaps)


def test_train_chain_weight_decay_and_router_margin_do_what_they_say():
    """The same 30 steps with and without the trained profile's two regularisers: weight decay shrinks the trained
    weight matrices (not the frozen experts), and the router margin widens the k-th vs (k+1)-th expert gap."""
    dims = dict(mt.TINY_DIMS, num_hidden_layers=2)
    task = dict(mt.CHAIN_TASK, steps=30, batch=4, length=24, lr=1e-2, weight_decay=0.0, router_margin=0.0)
    plain, decayed, margined = (mt.build_model(dims=dims) for _ in range(3))
    mt.train_chain(plain, task=task, device="cpu", log=lambda _: None)
    mt.train_chain(decayed, task=dict(task, weight_decay=10.0), device="cpu", log=lambda _: None)
    mt.train_chain(margined, task=dict(task, router_margin=2.0), device="cpu", log=lambda _: None)
    norm = {n: p.norm() for n, p in plain.named_parameters()}
    shrunk = {n: float(p.norm() / norm[n]) for n, p in decayed.named_parameters()}
    assert shrunk["model.layers.0.self_attn.q_proj.weight"] < 0.9 and shrunk["lm_head.weight"] < 0.9, shrunk
    assert shrunk["model.layers.0.mlp.experts.gate_up_proj"] == 1.0  # frozen
    assert shrunk["model.layers.0.input_layernorm.weight"] > 0.95  # norms are not decayed
    small = lambda m: float((_router_gaps(m, task) < 0.5).float().mean())  # noqa: E731
    assert small(margined) < 0.5 * small(plain), (small(margined), small(plain))
