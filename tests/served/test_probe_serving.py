"""SingProbe served end to end: scores from the real server vs the reference head on HF hidden states.

Oracle: transformers' GptOssForCausalLM hidden states (`output_hidden_states[i]` is the
input of layer i) -> weightless RMS-norm taps -> the plain-torch reference head over the
whole sequence -> sigmoid. The score that arrives with output token k is the row of
position (prompt_len - 1 + k).

One fp32 server with the tiny SingProbe for the module (`probe_server`), started with the flags
users pass for gpt-oss (``--reasoning-parser gpt-oss --tool-call-parser gpt-oss``) and custom
logit processors enabled, serves both the probe tests and the Harmony end-to-end tests below
(which had a server of their own, with the same checkpoint, probe and flags, in
test_harmony_serving.py). The chat/completions score checks therefore run with the parsers on,
where they hold text back; a parser-free chat stream's one score per token is checked by
test_faults.py's load test. The bf16 criterion, on the "calm" tiny model with its own server, is
in test_probe_serving_bf16.py.
"""

import datetime
import json
import os
import sys
import time

import pytest
import requests
import torch
from openai_harmony import Conversation, DeveloperContent, Message, Role, SystemContent, ToolDescription

# The Harmony helpers are test_harmony_parser's (tests/harmony); pytest puts only this file's folder on sys.path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "harmony"))
from test_harmony_parser import assistant, call, completion_tokens, enc, openai_view, raw, tool_result  # noqa: E402

from sglang_ext.launch.make_tiny import random_prompt  # noqa: E402
from sglang_ext.launch.server import IDS_ONLY_ARGS, SGLangServer  # noqa: E402

pytestmark = pytest.mark.server

PROMPT_LEN, NEW_TOKENS = 300, 24


@pytest.fixture(scope="module")
def tiny_probe(tiny_checkpoints):
    from sglang_ext.launch.make_tiny_probe import generate

    return generate(str(tiny_checkpoints["fp32"].parent / "probe"), base_dir=str(tiny_checkpoints["fp32"]),
                    log=lambda *_: None)


@pytest.fixture(scope="module")
def probe_server(tiny_checkpoints, tiny_probe, vocab_dir):
    args = ["--dtype", "float32", "--probe-ckpt", tiny_probe, "--load-snapshot-publish-interval", "1",
            "--enable-custom-logit-processor", "--reasoning-parser", "gpt-oss", "--tool-call-parser", "gpt-oss",
            "--enable-response-store"]
    with SGLangServer(tiny_checkpoints["fp32"], args, vocab_dir=vocab_dir) as srv:
        yield srv


def generate(url, ids, n=NEW_TOKENS):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def reference_scores(base_dir, probe_dir, prompt, output_ids, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    from sglang_ext.probe.config import ProbeConfig
    from sglang_ext.probe.model import SingProbeHead, tap_features

    cfg = ProbeConfig.from_json_file(f"{probe_dir}/config.json")
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).eval()
    head = SingProbeHead.from_checkpoint(probe_dir, dtype=dtype)
    with torch.no_grad():
        hs = model(torch.tensor([prompt + output_ids]), output_hidden_states=True).hidden_states
        feats = tap_features([hs[i] for i in cfg.base_model_layer_ids], dtype)
        probs = head.probs(head(feats))[0]
    rows = probs[len(prompt) - 1 : len(prompt) - 1 + len(output_ids)]
    return cfg.labels, rows


def as_matrix(scores, labels):
    return torch.tensor([[s[name] for name in labels] for s in scores])


def test_served_scores_equal_reference_head(probe_server, tiny_checkpoints, tiny_probe):
    prompt = random_prompt(PROMPT_LEN, seed=3)
    out = generate(probe_server.url, prompt)
    scores = out["meta_info"]["token_probe_probs"]
    assert len(scores) == len(out["output_ids"]) == NEW_TOKENS
    labels, want = reference_scores(tiny_checkpoints["fp32"], tiny_probe, prompt, out["output_ids"])
    assert list(scores[0]) == labels == [f"label_{i}" for i in range(10)]
    got = as_matrix(scores, labels)
    assert got.std() > 0.05  # the scores move: a constant would not test alignment
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)


def test_radix_hit_reuses_probe_kv(probe_server):
    prompt = random_prompt(PROMPT_LEN, seed=4)
    requests.post(probe_server.url + "/flush_cache", timeout=60)
    cold = generate(probe_server.url, prompt)
    requests.post(probe_server.url + "/flush_cache", timeout=60)
    generate(probe_server.url, prompt[:260], n=1)
    hit = generate(probe_server.url, prompt)
    assert hit["meta_info"]["cached_tokens"] >= 200
    assert hit["output_ids"] == cold["output_ids"]
    torch.testing.assert_close(as_matrix(hit["meta_info"]["token_probe_probs"], [f"label_{i}" for i in range(10)]),
                               as_matrix(cold["meta_info"]["token_probe_probs"], [f"label_{i}" for i in range(10)]),
                               rtol=0, atol=1e-5)


def test_openai_chat_carries_one_score_per_token(probe_server):
    body = {"model": "default", "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 20, "temperature": 0}
    full = requests.post(probe_server.url + "/v1/chat/completions", json=body, timeout=600).json()
    choice = full["choices"][0]
    assert len(choice["token_probe_probs"]) == full["usage"]["completion_tokens"] == 20
    streamed, chunks = [], 0
    with requests.post(probe_server.url + "/v1/chat/completions", json={**body, "stream": True},
                       stream=True, timeout=600) as r:
        for line in (raw.decode() for raw in r.iter_lines()):  # bytes split on \n, not Unicode line rules
            if not line or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            for c in json.loads(line[6:]).get("choices", []):
                streamed.extend(c.get("token_probe_probs", []))
    assert chunks > 1
    # The second request hits the first's prompt in the radix cache: same scores up to fp32 noise.
    labels = [f"label_{i}" for i in range(10)]
    assert len(streamed) == 20
    torch.testing.assert_close(as_matrix(streamed, labels), as_matrix(choice["token_probe_probs"], labels),
                               rtol=0, atol=1e-5)


def native_stream(url, body):
    """The `data:` events of a streamed native /generate."""
    from sglang_ext.launch.demo import sse_events

    with requests.post(url + "/generate", json={**body, "stream": True}, stream=True, timeout=600) as r:
        r.raise_for_status()
        return list(sse_events(r))


def test_native_stream_chunks_carry_their_own_tokens_scores(probe_server):
    """Each chunk of a streamed /generate carries the scores of the tokens decoded since that output's
    previous chunk (upstream repeats all so far: n^2/2 rows for n tokens); concatenated they are the
    non-streamed response's, one per token. A batched request keeps each output's own."""
    labels = [f"label_{i}" for i in range(10)]
    prompts = [random_prompt(40, seed=5), random_prompt(25, seed=6)]
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    for ids in (prompts[0], prompts):
        full = requests.post(probe_server.url + "/generate", json={"input_ids": ids, "sampling_params": sp},
                             timeout=600).json()
        full = full if isinstance(full, list) else [full]
        events = native_stream(probe_server.url, {"input_ids": ids, "sampling_params": sp})
        for index, want in enumerate(full):
            mine = [e for e in events if e.get("index", 0) == index]
            assert len(mine) > 2
            rows = [r for e in mine for r in e["meta_info"]["token_probe_probs"]]
            assert max(len(e["meta_info"]["token_probe_probs"]) for e in mine) < len(rows) == 24
            assert mine[-1]["output_ids"] == want["output_ids"]
            torch.testing.assert_close(as_matrix(rows, labels), as_matrix(want["meta_info"]["token_probe_probs"],
                                                                          labels), rtol=0, atol=1e-5)


def test_scheduler_received_probe_flag(probe_server, tiny_probe):
    requests.get(probe_server.url + "/health", timeout=30)
    assert f"scheduler received --probe-ckpt {tiny_probe}" in probe_server.log_path.read_text()


def test_chunked_prefill_scores_equal_one_shot(probe_server, tiny_checkpoints, tiny_probe, vocab_dir):
    """Chunked prefill (64-token chunks, no radix cache) vs one shot: the same scores, and greedy
    tokens equal to transformers' (the server-level chunked-prefill check of the base model too)."""
    from transformers import AutoModelForCausalLM

    prompt = random_prompt(PROMPT_LEN, seed=5)
    requests.post(probe_server.url + "/flush_cache", timeout=60)
    want = generate(probe_server.url, prompt)
    # Token ids in and out only: a tokenizer-free server.
    args = ["--dtype", "float32", "--probe-ckpt", tiny_probe, "--chunked-prefill-size", "64", "--disable-radix-cache",
            *IDS_ONLY_ARGS]
    with SGLangServer(tiny_checkpoints["fp32"], args, vocab_dir=vocab_dir) as srv:
        got = generate(srv.url, prompt)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["fp32"], dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                            min_new_tokens=NEW_TOKENS)[0, PROMPT_LEN:].tolist()
    assert got["output_ids"] == want["output_ids"] == hf
    labels = [f"label_{i}" for i in range(10)]
    torch.testing.assert_close(as_matrix(got["meta_info"]["token_probe_probs"], labels),
                               as_matrix(want["meta_info"]["token_probe_probs"], labels), rtol=0, atol=1e-5)


TOOL_CALL_TURN = [{"role": "user", "content": "hi"},
                  {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                        "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


@pytest.mark.parametrize("change,message", [
    ({"messages": [TOOL_CALL_TURN[0], {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": None, "arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].function.name must be a non-empty string"),
    ({"chat_template_kwargs": {"builtin_tools": 5}}, "builtin_tools must be a list of tool names"),
    ({"chat_template_kwargs": {"model_identity": ["x"]}}, "model_identity must be a string"),
], ids=["call_without_name", "builtin_tools_not_a_list", "model_identity_not_a_string"])
def test_bad_tool_history_gets_400_naming_the_field(probe_server, change, message):
    """Our Harmony rendering of tool history (patches/harmony_prompt.py) answered these with 500s
    ("'NoneType' object has no attribute 'split'", "'int' object is not iterable") to malformed input (found by
    fuzzing the server)."""
    body = {"model": "default", "max_tokens": 4, "messages": TOOL_CALL_TURN, **change}
    r = requests.post(probe_server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 400 and message in r.text, (r.status_code, r.text[:300])


def test_anthropic_messages_answer_with_the_probe_on(probe_server):
    """/v1/messages calls the chat handler; with the probe's scores attached to the chat response it answered
    every non-streamed request {"type": "error", "message": "Request failed"} (found by fuzzing the server)."""
    body = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = requests.post(probe_server.url + "/v1/messages", json=body, timeout=300)
    assert r.status_code == 200, r.text[:300]
    out = r.json()
    assert out["type"] == "message" and out["role"] == "assistant", out
    assert out["usage"]["output_tokens"] > 0


def test_openai_sdk_stream_gets_one_score_per_token(probe_server):
    from sglang_ext.launch.stream_client import stream_with_openai_sdk, stream_with_sse

    import io

    sdk = stream_with_openai_sdk(probe_server.url, "default", "Say something", 16, out=io.StringIO())
    sse = stream_with_sse(probe_server.url, "default", "Say something", 16, out=io.StringIO())
    assert len(sdk) == len(sse) == 16
    labels = [f"label_{i}" for i in range(10)]
    torch.testing.assert_close(as_matrix(sdk, labels), as_matrix(sse, labels), rtol=0, atol=1e-5)


def test_openai_completions_streamed_and_not(probe_server):
    body = {"model": "default", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    full = requests.post(probe_server.url + "/v1/completions", json=body, timeout=600).json()
    assert len(full["choices"][0]["token_probe_probs"]) == full["usage"]["completion_tokens"] == 12
    streamed = []
    with requests.post(probe_server.url + "/v1/completions", json={**body, "stream": True},
                       stream=True, timeout=600) as r:
        for line in (raw.decode() for raw in r.iter_lines()):  # bytes split on \n, not Unicode line rules
            if line and line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:]).get("choices", []):
                    streamed.extend(c.get("token_probe_probs", []))
    labels = [f"label_{i}" for i in range(10)]
    assert len(streamed) == 12
    torch.testing.assert_close(as_matrix(streamed, labels), as_matrix(full["choices"][0]["token_probe_probs"], labels),
                               rtol=0, atol=1e-5)


def test_eight_concurrent_streams_equal_each_alone(probe_server):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [random_prompt(30 + 37 * i, seed=10 + i) for i in range(8)]
    alone = [generate(probe_server.url, p, n=12) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: generate(probe_server.url, p, n=12), prompts))
    labels = [f"label_{i}" for i in range(10)]
    for a, t in zip(alone, together):
        assert a["output_ids"] == t["output_ids"]
        torch.testing.assert_close(as_matrix(t["meta_info"]["token_probe_probs"], labels),
                                   as_matrix(a["meta_info"]["token_probe_probs"], labels), rtol=0, atol=1e-5)


BAD_CASES = {
    "missing_file": lambda d: (d / "model.safetensors").unlink(),
    "missing_key": "drop:classifier.bias",
    "wrong_shape": "reshape:proj_k.weight",
    "hidden_size": "other_base:hidden_size=96",
    "layer_out_of_range": "config:base_model_layer_ids=[1,3,6]",
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_probe_checkpoint_stops_launch_with_one_line(case, tiny_checkpoints, tiny_probe, tmp_path,
                                                        restore_probe_env):
    """The launcher's own argument path (plugin hooks applied), in-process: one line, no server."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / case
    action = BAD_CASES[case]
    if isinstance(action, str) and action.startswith("other_base:"):
        # A well-formed probe trained for another base model (hidden 96).
        from sglang_ext.launch.make_tiny_probe import generate as make_probe

        other = tmp_path / "other_base"
        other.mkdir()
        base_cfg = json.loads((tiny_checkpoints["fp32"] / "config.json").read_text())
        base_cfg["hidden_size"] = 96
        (other / "config.json").write_text(json.dumps(base_cfg))
        make_probe(str(bad), base_dir=str(other), log=lambda *_: None)
    else:
        shutil.copytree(tiny_probe, bad)
    if callable(action):
        action(bad)
    elif action.startswith("other_base:"):
        pass
    elif action.startswith(("drop:", "reshape:")):
        kind, key = action.split(":")
        tensors = load_file(str(bad / "model.safetensors"))
        if kind == "drop":
            del tensors[key]
        else:
            tensors[key] = tensors[key][:, :-1].contiguous()
        save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    else:
        key, value = action[len("config:"):].split("=")
        cfg = json.loads((bad / "config.json").read_text())
        cfg[key] = json.loads(value)
        (bad / "config.json").write_text(json.dumps(cfg))

    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import prepare_server_args

    from sglang_ext import plugin

    plugin.load()
    HookRegistry.apply_hooks()
    with pytest.raises(SystemExit) as stop:
        prepare_server_args(["--model-path", str(tiny_checkpoints["fp32"]), "--device", "cpu",
                             "--probe-ckpt", str(bad)])
    message = str(stop.value)
    print(f"{case}: {message}")
    assert message.startswith("--probe-ckpt") and "\n" not in message
    expected = {"missing_file": "model.safetensors", "missing_key": "classifier.bias",
                "wrong_shape": "proj_k.weight", "hidden_size": "96", "layer_out_of_range": "6"}[case]
    assert expected in message


def test_guard_stops_request_with_content_filter(probe_server):
    prompt = random_prompt(50, seed=7)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True,
                                                     "custom_params": {"probe_stop": {"label_3": 0.0}}}}
    out = requests.post(probe_server.url + "/generate", json=body, timeout=600).json()
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "content_filter" and reason["label"] == "label_3", reason
    assert len(out["output_ids"]) == 1  # the first token's score already crossed 0
    # a threshold of 1 never fires; a bad spec ends only that request, with a message
    body["sampling_params"]["custom_params"] = {"probe_stop": "label_3=1.0"}
    assert requests.post(probe_server.url + "/generate", json=body, timeout=600).json()[
        "meta_info"]["finish_reason"]["type"] == "length"
    body["sampling_params"]["custom_params"] = {"probe_stop": "label_3=2"}
    bad = requests.post(probe_server.url + "/generate", json=body, timeout=600).json()
    assert "must lie in [0, 1]" in json.dumps(bad)
    # OpenAI: the SDK sees finish_reason content_filter
    from openai import OpenAI

    client = OpenAI(base_url=probe_server.url + "/v1", api_key="none")
    chunks = list(client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=16, stream=True,
        extra_body={"custom_params": {"probe_stop": {"label_3": 0.0}}}))
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["content_filter"]
    # the server keeps serving normally
    assert generate(probe_server.url, prompt, n=4)["meta_info"]["finish_reason"]["type"] == "length"


def _load(url):
    body = requests.get(url + "/v1/loads", timeout=30).json()
    loads = body.get("loads", body) if isinstance(body, dict) else body
    return loads[0] if isinstance(loads, list) else loads


def test_hundred_aborted_streams_leave_kv_pool_at_baseline(probe_server):
    """Clients disconnect mid-stream; afterwards nothing runs, a cache flush empties the KV pool
    (a leaked slot would keep it non-zero) and the server still answers with scores."""
    import random
    import time
    from concurrent.futures import ThreadPoolExecutor

    url = probe_server.url

    def abort_after(seed):
        rng = random.Random(seed)
        body = {"input_ids": random_prompt(rng.randint(5, 200), seed=100 + seed), "stream": True,
                "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}}
        with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
            for n, _line in enumerate(r.iter_lines()):
                if n >= rng.randint(1, 6):
                    break  # closing the response drops the connection mid-stream

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(abort_after, range(100)))
    deadline = time.time() + 120
    while time.time() < deadline:
        load = _load(url)
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
            break
        time.sleep(1)
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0, load
    assert requests.post(url + "/flush_cache", timeout=60).status_code == 200
    time.sleep(2.5)  # two snapshot intervals
    assert _load(url)["num_used_tokens"] == 0
    out = generate(url, random_prompt(40, seed=9), n=4)
    assert len(out["meta_info"]["token_probe_probs"]) == 4


@pytest.fixture
def restore_probe_env():
    """The launcher hooks export the flags to the environment for child processes; keep them
    out of this test process's later tests."""
    import os

    saved = {k: os.environ.get(k) for k in ("SGLANG_EXT_PROBE_CKPT", "SGLANG_EXT_PROBE_STOP")}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.parametrize("spec,expected", [
    ("label_8=0.9,label_1=0.8", None),
    ("label_99=0.5", "unknown label(s) ['label_99']"),
    ("label_8=1.5", "must lie in [0, 1]"),
    ("label_8", "expected label=threshold"),
    ("label_8=0.9|noprobe", "needs --probe-ckpt"),
])
def test_server_wide_probe_stop_flag_is_checked_at_launch(spec, expected, tiny_checkpoints, tiny_probe,
                                                          restore_probe_env):
    """The launcher's argument path in-process (plugin hooks applied); a valid spec reaches the
    scheduler through SGLANG_EXT_PROBE_STOP."""
    import os

    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import prepare_server_args

    from sglang_ext import plugin

    plugin.load()
    HookRegistry.apply_hooks()
    argv = ["--model-path", str(tiny_checkpoints["fp32"]), "--device", "cpu", "--dtype", "float32"]
    if spec.endswith("|noprobe"):
        spec = spec.split("|")[0]
    else:
        argv += ["--probe-ckpt", tiny_probe]
    argv += ["--probe-stop", spec]
    if expected is None:
        args = prepare_server_args(argv)
        assert args._probe_stop == {"label_8": 0.9, "label_1": 0.8}
        assert json.loads(os.environ["SGLANG_EXT_PROBE_STOP"]) == args._probe_stop
        return
    with pytest.raises(SystemExit) as stop:
        prepare_server_args(argv)
    assert str(stop.value).startswith("--probe-stop") and expected in str(stop.value)
    assert "probe_stop:" not in str(stop.value)  # one prefix, the flag's


# -- Harmony end to end on the same server ----------------------------------------------------
#
# The tiny checkpoint's weights are random, so the assistant tokens are forced through SGLang's
# custom logit processor (``sglang_ext.harmony.forced_tokens``) to a Harmony sequence rendered by
# openai-harmony. What the client receives (reasoning_content, content, streamed tool_calls,
# finish_reason) must be what the documented mapping derives from openai-harmony's parse of that
# sequence, or of the sequence the model meant where the script is malformed on purpose. The
# server runs with the tiny SingProbe, so every token must still carry one score however the
# parsers chunk the text.

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": CITY}}]
QUESTION = [{"role": "user", "content": "Weather in Paris and Rome?"}]


@pytest.fixture(scope="module")
def client(probe_server):
    import openai

    return openai.OpenAI(base_url=probe_server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def scripted(client, ids, stream, messages=QUESTION, max_tokens=None, **extra):
    from sglang_ext.harmony.forced_tokens import PARAM, ForcedTokens

    body = {"custom_logit_processor": ForcedTokens.to_str(), "custom_params": {PARAM: list(ids)}, **extra}
    kwargs = {"stream_options": {"include_usage": True}} if stream else {}
    return client.chat.completions.create(model="default", messages=messages, tools=TOOLS, temperature=0,
                                          max_tokens=max_tokens or len(ids) + 8, stream=stream,
                                          extra_body=body, **kwargs)


def collect(chunks):
    """What a streaming client assembles, plus the shape of every tool-call delta."""
    got = {"reasoning": "", "content": "", "calls": {}, "call_deltas": [], "finish": None, "scores": 0,
           "usage": None}
    for chunk in chunks:
        got["usage"] = chunk.usage or got["usage"]
        for choice in chunk.choices:
            got["scores"] += len((choice.model_extra or {}).get("token_probe_probs") or [])
            delta = choice.delta
            got["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            got["content"] += delta.content or ""
            for tc in delta.tool_calls or []:
                got["call_deltas"].append(tc)
                entry = got["calls"].setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
            got["finish"] = choice.finish_reason or got["finish"]
    got["calls"] = [tuple(got["calls"][i]) for i in sorted(got["calls"])]
    return got


def test_streamed_reasoning_preamble_and_tool_call(client):
    meant = [assistant("The user wants the weather. Call the tool.", "analysis"),
             assistant("Let me look that up.", "commentary"),
             call("functions.get_weather", '{"city": "Paris", "unit": "celsius"}')]
    ids = completion_tokens(meant)
    assert ids[-1] == 200012  # <|call|>: generation stops there, as with the real model
    got = collect(scripted(client, ids, stream=True))
    want_reasoning, want_content, want_calls = openai_view(enc().parse_messages_from_completion_tokens(ids, Role.ASSISTANT))
    assert (got["reasoning"], got["content"], got["calls"]) == (want_reasoning, want_content, want_calls)
    assert got["finish"] == "tool_calls"
    first, rest = got["call_deltas"][0], got["call_deltas"][1:]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert len(rest) > 1, "arguments stream as they decode, not as one piece"
    assert all(d.id is None and d.function.name is None for d in rest)
    # One probe score per generated token, whatever the parsers held back.
    assert got["scores"] == got["usage"].completion_tokens == len(ids)


def test_non_streamed_matches_streamed(client):
    meant = [assistant("Plan: one call.", "analysis"), call("functions.get_weather", '{"city":"Rome"}')]
    ids = completion_tokens(meant)
    response = scripted(client, ids, stream=False)
    choice = response.choices[0]
    message = choice.message
    want_reasoning, want_content, want_calls = openai_view(enc().parse_messages_from_completion_tokens(ids, Role.ASSISTANT))
    assert (message.model_extra or {}).get("reasoning_content") == want_reasoning
    assert (message.content or "") == want_content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == want_calls
    assert choice.finish_reason == "tool_calls"
    assert len((choice.model_extra or {})["token_probe_probs"]) == response.usage.completion_tokens == len(ids)


def test_several_calls_and_malformed_ones_are_recovered(client):
    # ignore_eos lets the stream run past <|call|>: two calls, the second one malformed the way
    # gpt-oss writes them in the wild (analysis channel, recipient twice, no <|constrain|>), and a
    # final answer without its <|message|> token.
    good = completion_tokens([assistant("Two cities, two calls.", "analysis"),
                              call("functions.get_weather", '{"city":"Paris"}')])
    bad = raw('<|start|>assistant<|channel|>analysis to=functions.get_weather to=functions.get_weather code'
              '<|message|>{"city":"Rome"}<|call|><|start|>assistant<|channel|>final Paris sunny, Rome rainy.'
              '<|return|>')
    meant = completion_tokens([assistant("Two cities, two calls.", "analysis"),
                               call("functions.get_weather", '{"city":"Paris"}'),
                               call("functions.get_weather", '{"city":"Rome"}', channel="analysis", content_type="code"),
                               assistant("Paris sunny, Rome rainy.", "final")])
    ids = good + bad
    got = collect(scripted(client, ids, stream=True, max_tokens=len(ids), ignore_eos=True))
    assert (got["reasoning"], got["content"], got["calls"]) == openai_view(
        enc().parse_messages_from_completion_tokens(meant, Role.ASSISTANT))
    assert [d.index for d in got["call_deltas"] if d.id] == [0, 1]
    assert got["scores"] == got["usage"].completion_tokens == len(ids)


def test_without_reasoning_separation_content_has_all_text_and_no_markup(client):
    ids = completion_tokens([assistant("Thinking about it.", "analysis"), assistant("It is sunny.", "final")])
    got = collect(scripted(client, ids, stream=True, separate_reasoning=False))
    assert got["reasoning"] == "" and got["content"] == "Thinking about it.It is sunny."
    assert got["finish"] == "stop"


def test_multi_turn_tool_results_are_rendered_as_openai_harmony_renders_them(client):
    history = QUESTION + [
        {"role": "assistant", "content": "", "reasoning_content": "Two calls.",
         "tool_calls": [{"id": "call_a", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
                        {"id": "call_b", "type": "function",
                         "function": {"name": "get_time", "arguments": '{"city":"Rome"}'}}]},
        # Answered out of order: each result is attributed by its tool_call_id.
        {"role": "tool", "tool_call_id": "call_b", "content": "17:05"},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"sky": "clear", "temp": 21}'},
    ]
    response = scripted(client, [enc().encode("ok")[0]], stream=False, messages=history, max_tokens=1,
                        return_prompt_token_ids=True)
    served = response.choices[0].model_extra["prompt_token_ids"]
    conversation = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_conversation_start_date(
            datetime.date.today().isoformat())),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_function_tools(
            [ToolDescription.new(t["function"]["name"], t["function"]["description"],
                                 parameters=t["function"]["parameters"]) for t in TOOLS])),
        Message.from_role_and_content(Role.USER, QUESTION[0]["content"]),
        assistant("Two calls.", "analysis"),
        call("functions.get_weather", '{"city":"Paris"}'),
        call("functions.get_time", '{"city":"Rome"}'),
        tool_result("functions.get_time", "17:05"),
        tool_result("functions.get_weather", '{"sky": "clear", "temp": 21}'),
    ])
    want = enc().render_conversation_for_completion(conversation, Role.ASSISTANT)
    assert served == list(want)


def test_unscripted_output_streamed_and_not_is_the_parse_of_its_tokens(client):
    # The tiny model's own (random) output: special tokens anywhere. Served streamed and not,
    # it must be what our parser makes of the very tokens the server generated, every token scored.
    from sglang_ext.harmony.streaming import OpenAIHarmonyStream

    kwargs = dict(model="default", messages=[{"role": "user", "content": "Say something."}], tools=TOOLS,
                  max_tokens=40, temperature=0)
    full = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True})
    choice = full.choices[0]
    ids = choice.model_extra["response_token_ids"]
    want = OpenAIHarmonyStream()
    want.feed(ids)
    want.finish()
    want_calls = [(c.name, c.arguments) for c in want.tool_calls]
    assert len(choice.model_extra["token_probe_probs"]) == full.usage.completion_tokens == len(ids)
    assert ((choice.message.model_extra or {}).get("reasoning_content") or "") == want.reasoning
    assert (choice.message.content or "") == want.content
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == want_calls
    got = collect(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert (got["reasoning"], got["content"], got["calls"]) == (want.reasoning, want.content, want_calls)
    assert got["scores"] == got["usage"].completion_tokens == len(ids)


# -- the OpenAI Responses API (patches/responses_api.py) --------------------------------------
#
# gpt-oss's Responses path renders the prompt with openai-harmony and parses the output with it.
# The tiny model's own tokens rarely form Harmony messages: those requests check what the path
# returns beside the text (one probe score per generated token, the reference head's on the tokens
# /generate produces from the same prompt; the usage; the guard's stop). A scripted Harmony output
# (the custom logit processor) checks the output items and the scores on the streamed events.


def responses_prompt(text):
    """What the Responses path renders for a plain-text input, by openai-harmony: the default
    system message dated today, an empty developer message, the user's text."""
    conversation = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_conversation_start_date(
            datetime.date.today().isoformat())),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new()),
        Message.from_role_and_content(Role.USER, text),
    ])
    return list(enc().render_conversation_for_completion(conversation, Role.ASSISTANT))


def responses(url, body):
    """The response object, or for `stream: true` the list of SSE event payloads."""
    r = requests.post(url + "/v1/responses", json=body, stream=bool(body.get("stream")), timeout=600)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()
    return [json.loads(raw[6:]) for raw in r.iter_lines() if raw.startswith(b"data: ")]  # bytes split on \n only


LABELS = [f"label_{i}" for i in range(10)]


def test_responses_api_carries_one_score_per_token_and_the_usage(probe_server, tiny_checkpoints, tiny_probe):
    text = "Is the sky blue today?"
    body = {"input": text, "max_output_tokens": 26, "temperature": 0}  # no model: the one served
    full = responses(probe_server.url, body)
    served_name = requests.get(probe_server.url + "/v1/models", timeout=60).json()["data"][0]["id"]
    assert full["model"] == served_name
    prompt = responses_prompt(text)
    usage, scores = full["usage"], full["token_probe_probs"]
    assert usage["input_tokens"] == len(prompt)  # upstream said 0
    assert usage["output_tokens"] == len(scores) > 1
    # The same prompt through /generate gives the same greedy tokens; the reference head scores them.
    out = generate(probe_server.url, prompt, n=len(scores))
    labels, want = reference_scores(tiny_checkpoints["fp32"], tiny_probe, prompt, out["output_ids"])
    assert labels == LABELS
    torch.testing.assert_close(as_matrix(scores, labels), want, rtol=0, atol=2e-4)

    events = responses(probe_server.url, {**body, "stream": True})
    final = events[-1]
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert final["type"] == "response." + full["status"]
    streamed = [s for e in events for s in e.get("token_probe_probs", [])]
    assert final["response"]["token_probe_probs"] == streamed
    assert (final["response"]["usage"]["input_tokens"], final["response"]["usage"]["output_tokens"]) == (
        usage["input_tokens"], usage["output_tokens"])  # upstream streamed 0 / 0
    torch.testing.assert_close(as_matrix(streamed, LABELS), as_matrix(scores, LABELS), rtol=0, atol=1e-5)


def test_responses_api_reports_the_guards_stop(probe_server):
    # Threshold 0, per request (the Responses API forwards custom_params as chat does): the first token's score
    # (a sigmoid, > 0) trips the guard. The module's server stores responses (--enable-response-store).
    srv = probe_server
    guard = {"custom_params": {"probe_stop": {"label_0": 0}}}
    body = {"input": "Hello", "max_output_tokens": 20, "temperature": 0, **guard}
    full = responses(srv.url, body)
    stored = requests.get(f"{srv.url}/v1/responses/{full['id']}", timeout=60).json()
    events = responses(srv.url, {**body, "stream": True})
    stored_streamed = requests.get(f"{srv.url}/v1/responses/{events[-1]['response']['id']}", timeout=60).json()
    queued = responses(srv.url, {**body, "background": True})
    for _ in range(600):
        background = requests.get(f"{srv.url}/v1/responses/{queued['id']}", timeout=60).json()
        if background["status"] not in ("queued", "in_progress"):
            break
        time.sleep(0.2)
    chat = requests.post(srv.url + "/v1/chat/completions", timeout=600, json={
        "model": "default", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 20, **guard}).json()
    assert chat["choices"][0]["finish_reason"] == "content_filter"  # the guard itself, as chat reports it
    scores = full["token_probe_probs"]
    assert full["status"] == "incomplete"  # upstream: "completed"
    assert full["usage"]["output_tokens"] == len(scores) == 1
    details = full["incomplete_details"]
    assert details == {"reason": "content_filter", "label": "label_0", "threshold": 0.0,
                       "score": pytest.approx(scores[0]["label_0"], rel=1e-6)}
    assert details["score"] > 0
    assert (stored["status"], stored["incomplete_details"]) == ("incomplete", details)
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"]["reason"] == "content_filter"
    assert len(final["response"]["token_probe_probs"]) == 1
    assert stored_streamed["status"] == "incomplete"
    assert queued["status"] == "queued"
    assert (background["status"], background["incomplete_details"]["reason"]) == ("incomplete", "content_filter")


RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"]} for t in TOOLS]


def test_responses_api_harmony_output_streamed_and_not_with_one_score_per_token(probe_server):
    # Scripted through the same custom logit processor as the chat tests (a request extra the Responses
    # schema drops; patches/responses_api.py reads it from the body): reasoning, then a tool call.
    from sglang_ext.harmony.forced_tokens import PARAM, ForcedTokens

    meant = [assistant("Check the weather first.", "analysis"), call("functions.get_weather", '{"city": "Paris"}')]
    ids = completion_tokens(meant)
    assert ids[-1] == 200012  # <|call|>: a stop token of the Responses path
    body = {"input": "Weather in Paris?", "tools": RESPONSES_TOOLS, "temperature": 0,
            "max_output_tokens": len(ids) + 10, "custom_logit_processor": ForcedTokens.to_str(),
            "custom_params": {PARAM: ids}}
    full = responses(probe_server.url, body)
    parsed = enc().parse_messages_from_completion_tokens(ids, Role.ASSISTANT)
    reasoning, tool_call = full["output"]
    assert reasoning["type"] == "reasoning"
    assert [c["text"] for c in reasoning["content"]] == [parsed[0].content[0].text]
    assert (tool_call["type"], "functions." + tool_call["name"], tool_call["arguments"]) == (
        "function_call", parsed[1].recipient, parsed[1].content[0].text)
    assert full["status"] == "completed"
    assert len(full["token_probe_probs"]) == full["usage"]["output_tokens"] == len(ids)

    events = responses(probe_server.url, {**body, "stream": True})
    carriers = [e for e in events[:-1] if e.get("token_probe_probs")]
    assert len(carriers) > 5, "scores arrive with the events, not all at the end"
    streamed = [s for e in events for s in e.get("token_probe_probs", [])]
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["token_probe_probs"] == streamed
    torch.testing.assert_close(as_matrix(streamed, LABELS), as_matrix(full["token_probe_probs"], LABELS),
                               rtol=0, atol=1e-5)
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert arguments == tool_call["arguments"]


def test_responses_api_takes_per_request_guard_thresholds_and_refuses_bad_ones(probe_server):
    base = {"input": "Hello", "max_output_tokens": 12, "temperature": 0}
    guarded = responses(probe_server.url, {**base, "custom_params": {"probe_stop": {"label_0": 0}}})
    assert (guarded["status"], guarded["incomplete_details"]["reason"]) == ("incomplete", "content_filter")
    assert len(guarded["token_probe_probs"]) == 1
    for stream in (False, True):
        for extra, problem in ((("custom_params", {"probe_stop": "label_0=2"}), "must lie in [0, 1]"),
                               (("custom_params", {"probe_stop": {"label_99": 0.5}}), "unknown label"),
                               (("custom_params", "label_0=0.5"), "must be a JSON object")):
            r = requests.post(probe_server.url + "/v1/responses", timeout=600,
                              json={**base, extra[0]: extra[1], "stream": stream})
            assert r.status_code == 400 and problem in r.json()["error"]["message"], (stream, r.text)
    assert responses(probe_server.url, base)["status"] in ("completed", "incomplete")  # the server goes on
