"""No single request takes the server down: bad input, faults, disconnects, load and a restart.

One CPU server for the module (tiny bf16 gpt-oss + tiny SingProbe, custom logit processors
enabled). Oracle after every case (`assert_unharmed`): the server process lives, nothing runs
or waits, a cache flush empties the KV pool (the probe's K/V is indexed by the same slots, so
it is empty too), SGLang's idle leak check logged nothing new, and the baseline greedy request
answers with the token ids and probe scores it gave before any fault.

The restart test runs last: it kills this server mid-stream and starts a second one.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # `pytest` without `python -m`: benchmarks/ is a folder of the repo, not installed
    sys.path.insert(0, ROOT)

from benchmarks.bench_load import LEAK_MARKERS, pool_tokens_after_flush, run_load, server_load, wait_idle
from sglang_ext.launch.make_tiny import random_prompt
from sglang_ext.launch.server import SGLangServer, free_port, has_cuda_driver

pytestmark = pytest.mark.server  # (three in-process cases near the end need no server)

VOCAB = 201088  # the tiny checkpoint's vocab_size (o200k_harmony)
BASELINE_PROMPT = random_prompt(60, seed=21)
BASELINE_TOKENS = 12
SCORE_ATOL = 1e-5  # batch composition moves bf16 scores by ~3e-7 here; another request's by ~0.5

# Processors are shipped to the scheduler by value (dill), so they are defined in a `__main__`
# namespace; `__req__` is SGLang's back-reference to the request in each row's params.
PROCESSOR_SOURCE = '''
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

class FailAfterTokens(CustomLogitProcessor):
    """Passes logits through until a row's request has `fail_after` output tokens, then raises."""
    def __call__(self, logits, custom_param_list=None):
        for params in custom_param_list or []:
            limit = (params or {}).get("fail_after")
            if limit is not None and len(params["__req__"].output_ids) >= limit:
                raise RuntimeError("boom after %d tokens" % limit)
        return logits

class WrongShape(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        return logits[:, :5]

class MasksEverything(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        return logits.fill_(float("-inf"))

class ForceToken(CustomLogitProcessor):
    """Samples token `force` of the row's custom_params, whatever the model says."""
    def __call__(self, logits, custom_param_list=None):
        for row, params in enumerate(custom_param_list or []):
            token = (params or {}).get("force")
            if token is not None:
                logits[row, :] = float("-inf")
                logits[row, token] = 0.0
        return logits
'''


def _processors() -> dict[str, str]:
    namespace = {"__name__": "__main__"}
    exec(PROCESSOR_SOURCE, namespace)
    return {name: namespace[name].to_str() for name in ("FailAfterTokens", "WrongShape", "MasksEverything",
                                                        "ForceToken")}


class Tally:
    """Counts for the closing note: cases, requests, error answers, crashes."""

    def __init__(self):
        self.cases = self.requests = self.errors = self.crashes = 0
        self.lock = threading.Lock()

    def sent(self, n=1, errors=0):
        with self.lock:
            self.requests += n
            self.errors += errors


TALLY = Tally()


def post(url, path, body=None, raw: bytes | None = None, stream=False, timeout=300):
    kwargs = {"data": raw, "headers": {"Content-Type": "application/json"}} if raw is not None else {"json": body}
    r = requests.post(url + path, stream=stream, timeout=timeout, **kwargs)
    TALLY.sent(errors=int(r.status_code >= 400))
    return r


def sse_events(r) -> list[dict]:
    events = []
    # bytes split on \n: decoded first, Unicode line rules (str.splitlines) would also split on U+2028
    for line in (raw.decode() for raw in r.iter_lines()):
        if line and line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    if any("error" in e for e in events):
        TALLY.sent(0, errors=1)
    return events


def greedy(url, ids, n=BASELINE_TOKENS, **extra):
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **extra.pop("sampling", {})}
    return post(url, "/generate", {"input_ids": ids, "sampling_params": sp, **extra})


# -- the server and the oracle --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_probe(tiny_checkpoints):
    from sglang_ext.launch.make_tiny_probe import generate

    return generate(str(tiny_checkpoints["fp32"].parent / "probe"), base_dir=str(tiny_checkpoints["fp32"]),
                    log=lambda *_: None)


@pytest.fixture(scope="module")
def server(tiny_checkpoints, tiny_probe, vocab_dir):
    args = ["--probe-ckpt", tiny_probe, "--enable-custom-logit-processor", "--load-snapshot-publish-interval", "1"]
    srv = SGLangServer(tiny_checkpoints["bf16"], args, vocab_dir=vocab_dir, startup_timeout=600)
    srv.start()
    srv.args = args
    srv.log_offset = 0
    yield srv
    srv.stop()
    print(f"\nfault suite: {TALLY.cases} cases, {TALLY.requests} requests, {TALLY.errors} error answers, "
          f"{TALLY.crashes} crashes")


@pytest.fixture(scope="module")
def baseline(server):
    assert pool_tokens_after_flush(server.url) == 0
    out = greedy(server.url, BASELINE_PROMPT).json()
    assert len(out["meta_info"]["token_probe_probs"]) == len(out["output_ids"]) == BASELINE_TOKENS
    return out


def new_log_lines(srv) -> list[str]:
    with open(srv.log_path, errors="replace") as f:
        f.seek(srv.log_offset)
        lines = f.readlines()
        srv.log_offset = f.tell()
    return lines


def same_answer(got: dict, want: dict) -> None:
    assert got["output_ids"] == want["output_ids"]
    for g, w in zip(got["meta_info"]["token_probe_probs"], want["meta_info"]["token_probe_probs"], strict=True):
        assert max(abs(g[k] - w[k]) for k in w) <= SCORE_ATOL


def assert_unharmed(srv, baseline_out: dict) -> None:
    TALLY.cases += 1
    if srv.proc.poll() is not None:
        TALLY.crashes += 1
        pytest.fail(f"server died (exit {srv.proc.returncode}):\n{srv.log_tail()}")
    load = wait_idle(srv.url, timeout_s=120)
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0, load
    assert pool_tokens_after_flush(srv.url) == 0, "KV slots leaked"
    leaks = [line for line in new_log_lines(srv) if any(m in line for m in LEAK_MARKERS)]
    assert not leaks, leaks[:3]
    same_answer(greedy(srv.url, BASELINE_PROMPT).json(), baseline_out)


@pytest.fixture
def unharmed(server, baseline):
    """Run the case, then the oracle."""
    yield server
    assert_unharmed(server, baseline)


# -- bad input: HTTP 400 before anything reaches the scheduler --------------------------------

ENDPOINTS = ("/generate", "/v1/chat/completions", "/v1/completions")


MALFORMED_BODIES = {"truncated": b'{"text": "hi", ', "array": b"[1, 2]", "empty": b"",
                    "trailing_garbage": b'{"text": "hi"} trailing'}


@pytest.mark.parametrize("kind", sorted(MALFORMED_BODIES))
def test_malformed_json_gets_4xx(unharmed, kind):
    body = MALFORMED_BODIES[kind]
    for path in ENDPOINTS:
        r = post(unharmed.url, path, raw=body)
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:200])


def test_invalid_utf8_body_gets_400(unharmed):
    bodies = {"/generate": b'{"text": "\xff\xfe hi", "sampling_params": {"max_new_tokens": 2}}',
              "/v1/chat/completions": b'{"model": "default", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
              "/v1/completions": b'{"model": "default", "prompt": "\xed\xa0\x80", "max_tokens": 2}'}
    for path, body in bodies.items():
        r = post(unharmed.url, path, raw=body)
        assert r.status_code == 400, (path, r.text[:200])


def test_unknown_fields_are_refused_or_ignored(unharmed, baseline):
    url = unharmed.url
    # A top-level field /generate does not know is ignored: the answer is the baseline's.
    same_answer(greedy(url, BASELINE_PROMPT, bogus_field=1).json(), baseline)
    r = greedy(url, BASELINE_PROMPT, sampling={"bogus_knob": 3})
    assert r.status_code == 400 and "bogus_knob" in r.text
    # OpenAI requests ignore extra fields, as OpenAI's API does.
    r = post(url, "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 2, "bogus_field": {"x": 1}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_empty_prompts_get_400(unharmed):
    url = unharmed.url
    cases = [("/generate", {"text": "", "sampling_params": {"max_new_tokens": 2}}),  # killed the server before
             ("/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 2}}),
             ("/generate", {"text": ["hello", ""], "sampling_params": {"max_new_tokens": 2}}),
             ("/v1/completions", {"model": "default", "prompt": "", "max_tokens": 2}),
             ("/v1/chat/completions", {"model": "default", "messages": [], "max_tokens": 2})]
    for path, body in cases:
        r = post(url, path, body)
        assert r.status_code == 400, (path, body, r.text[:200])
        assert "empty" in r.text.lower()


def test_prompt_larger_than_kv_pool_gets_400(unharmed):
    r = greedy(unharmed.url, random_prompt(20000, seed=1), n=2)  # the pool holds 16384 tokens
    assert r.status_code == 400 and "20000" in r.text
    r = post(unharmed.url, "/v1/completions", {"model": "default", "prompt": "lorem ipsum " * 20000, "max_tokens": 2})
    assert r.status_code == 400


def test_prompt_longer_than_context_gets_400(unharmed):
    r = greedy(unharmed.url, [7] * 131073, n=2)  # context length 131072
    assert r.status_code == 400 and "context length" in r.text


def test_max_tokens_negative_gets_400(unharmed):
    url = unharmed.url
    assert greedy(url, BASELINE_PROMPT, n=-1).status_code == 400
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}
    assert post(url, "/v1/chat/completions", chat).status_code == 400
    assert post(url, "/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": -1}).status_code == 400


def test_max_tokens_zero_answers_empty_or_400(unharmed):
    """Upstream's own choice per endpoint: native and chat answer with no tokens, completions refuses."""
    url = unharmed.url
    out = greedy(url, BASELINE_PROMPT, n=0).json()
    assert out["output_ids"] == [] and out["meta_info"]["token_probe_probs"] == []
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    assert post(url, "/v1/chat/completions", chat).json()["usage"]["completion_tokens"] == 0
    r = post(url, "/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens must be positive" in r.text


def test_max_tokens_huge_gets_400(unharmed):
    url = unharmed.url
    assert greedy(url, BASELINE_PROMPT, n=10**12).status_code == 400
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})]:
        r = post(url, path, {"model": "default", "max_tokens": 10**9, **body})
        assert r.status_code == 400 and "context length" in r.text


@pytest.mark.parametrize("spec,message", [
    pytest.param({"label_3": "x"}, "is not a number", id="threshold_text"),
    pytest.param({"label_3": None}, "is not a number", id="threshold_null"),
    pytest.param({"label_3": 2}, "must lie in [0, 1]", id="threshold_above_1"),
    pytest.param({"label_3": -0.1}, "must lie in [0, 1]", id="threshold_negative"),
    pytest.param("label_3=nan", "must lie in [0, 1]", id="threshold_nan"),
    pytest.param("label_3", "expected label=threshold", id="no_threshold"),
    pytest.param([0.5], "expected a dict", id="list"),
    pytest.param({"label_99": 0.5}, "unknown label(s) ['label_99']", id="unknown_label"),
    # `true` was read as 1.0 (Python's float(True)): a client switched the operator's guard off with it
    pytest.param({"label_3": True}, "is not a number", id="threshold_true"),
    pytest.param(True, "expected a dict", id="true"),
    pytest.param({"label_3": "0.5"}, "is not a number", id="threshold_string_in_the_object_form"),
])
def test_invalid_per_request_probe_stop_gets_400(unharmed, spec, message):
    r = greedy(unharmed.url, BASELINE_PROMPT, n=4, sampling={"custom_params": {"probe_stop": spec}})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text[:300]
    r = post(unharmed.url, "/v1/chat/completions", {
        "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
        "custom_params": {"probe_stop": spec}})
    assert r.status_code == 400 and message in r.json()["message"], r.text[:300]
    for stream in (False, True):  # the Responses API: refused before a stream starts
        r = post(unharmed.url, "/v1/responses", {"input": "hi", "max_output_tokens": 4, "stream": stream,
                                                 "custom_params": {"probe_stop": spec}})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text[:300]


def test_probe_stop_threshold_past_floats_range_is_a_spec_error():
    # Not reachable over HTTP (the JSON decoders refuse such a number first, with a 400), but through the
    # Python API: float() raised OverflowError, which was no ProbeStopSpecError.
    from sglang_ext.patches.probe_stop import ProbeStopSpecError, parse_probe_stop

    with pytest.raises(ProbeStopSpecError, match="is not a number"):
        parse_probe_stop({"label_3": 10**400})


@pytest.mark.parametrize("raw, message", [('{"label_3": "0.9"}', "not a number"), ("label_3=2", "must lie in"),
                                          ("{not json", "not a JSON object")])
def test_server_thresholds_set_by_hand_are_checked_like_the_flag(monkeypatch, raw, message):
    # The scheduler reads the operator's thresholds from the variable the flag writes; set by other means
    # (the offline Engine, a wrapper), a bad value is a spec error naming the variable, not a TypeError in
    # the scheduler's comparison.
    from sglang_ext.patches import probe_stop

    monkeypatch.setenv(probe_stop.ENV_VAR, raw)
    with pytest.raises(probe_stop.ProbeStopSpecError, match=f"{probe_stop.ENV_VAR}=.*{message}"):
        probe_stop._server_thresholds()
    monkeypatch.setenv(probe_stop.ENV_VAR, '{"label_3": 0.5}')
    assert probe_stop._server_thresholds() == {"label_3": 0.5}


@pytest.mark.parametrize("processor", [[None], ["x", "y"], {"callable": "zz"}, 5, False],
                         ids=["list_of_null", "list", "object", "number", "false"])
def test_custom_logit_processor_that_is_not_one_string_gets_400(unharmed, processor):
    """Upstream: a list on one request reached the scheduler's batch assembly (unhashable) and ended
    the server with SIGQUIT."""
    r = greedy(unharmed.url, BASELINE_PROMPT, n=2, custom_logit_processor=processor)
    assert r.status_code == 400 and "custom_logit_processor" in r.text, r.text[:300]  # ours or the schema's
    r = post(unharmed.url, "/v1/chat/completions", {
        "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "custom_logit_processor": processor})
    assert r.status_code in (400, 422), r.text[:300]  # 422: the chat schema's own type check
    r = post(unharmed.url, "/v1/responses", {"input": "hi", "max_output_tokens": 4, "stream": True,
                                             "custom_logit_processor": processor})
    assert r.status_code == 400 and "must be a string" in r.json()["error"]["message"], r.text[:300]


# Found by fuzzing the CPU server: each of these ended the scheduler, answered 500, or (the
# logit bias) served garbage, upstream.
SCHEDULER_ENDERS = {
    "stop_id_past_vocab_with_min_new_tokens": ("/generate", {"text": "hello", "sampling_params": {
        "max_new_tokens": 4, "min_new_tokens": 2, "stop_token_ids": [300000]}}, "stop_token_ids"),
    "chat_stop_id_past_vocab_with_min_tokens": ("/v1/chat/completions", {
        "model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "min_tokens": 1,
        "stop_token_ids": [VOCAB + 1]}, "stop_token_ids"),
    "top_k_past_int32": ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4, "top_k": 2**40}},
                         "top_k"),
    "chat_top_k_past_int32": ("/v1/chat/completions", {
        "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "top_k": 2**31},
        "top_k"),
    "session_id_list": ("/generate", {"text": "hello", "session_params": {"id": ["x"]},
                                      "sampling_params": {"max_new_tokens": 4}}, "session_params.id"),
    "session_unknown_field": ("/generate", {"text": "hello", "session_params": {"bogus": 1}}, "unknown field"),
    "top_logprobs_num_list_on_one_request": ("/generate", {"text": "hello", "return_logprob": True,
                                                           "top_logprobs_num": [5],
                                                           "sampling_params": {"max_new_tokens": 4}},
                                             "top_logprobs_num"),
    "logprob_start_len_list_on_one_request": ("/generate", {"text": "hello", "return_logprob": True,
                                                            "logprob_start_len": [0],
                                                            "sampling_params": {"max_new_tokens": 4}},
                                              "logprob_start_len"),
    "sampling_params_list_on_one_request": ("/generate", {"text": "hello", "sampling_params": [
        {"max_new_tokens": 4}]}, "sampling_params"),
    "logit_bias_past_float32": ("/v1/chat/completions", {
        "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "logit_bias": {"5": 1e39}}, "is not a number within"),
    "logit_bias_over_a_small_temperature": ("/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 2, "temperature": 0.5, "top_k": 5, "logit_bias": {"5": 3.4e38}}},
        "is not a number within"),
    "stop_regex_repeat_past_re": ("/generate", {"text": "hello", "sampling_params": {
        "max_new_tokens": 4, "stop_regex": "x{0,4294967295}"}}, "stop_regex"),
    # operator endpoints whose errors were raised in the scheduler
    "update_weights_unknown_load_format": ("/update_weights_from_disk", {"model_path": "/nonexistent",
                                                                         "load_format": "nope"}, "unknown load_format"),
    "release_memory_unknown_tag": ("/release_memory_occupation", {"tags": ["nope"]}, "unknown memory tag"),
    "resume_memory_unknown_tag": ("/resume_memory_occupation", {"tags": ["weights", "nope"]}, "unknown memory tag"),
    "start_profile_output_dir_not_creatable": ("/start_profile", {"output_dir": "/proc/nope", "num_steps": 1},
                                               "cannot be created"),
    # found by fuzzing the request bodies
    "negative_logprob_start_len": ("/generate", {"text": "one two three four five six seven", "return_logprob": True,
                                                 "logprob_start_len": -3, "sampling_params": {"max_new_tokens": 2}},
                                   "logprob_start_len must be -1"),
    "positional_embed_overrides_over_http": ("/generate", {"text": "hi", "positional_embed_overrides": {"a": [1, 2]},
                                                           "sampling_params": {"max_new_tokens": 2}},
                                             "positional_embed_overrides cannot be sent over HTTP"),
}
# Process-group rendezvous that cannot form: upstream's scheduler waited in it for 30 minutes (/health 503, every
# request timed out). Nothing listens on CLOSED_PORT (bound once, released).
CLOSED_PORT = free_port()
SCHEDULER_ENDERS.update({
    "init_weights_update_group_nobody_listening": ("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": CLOSED_PORT, "rank_offset": 1, "world_size": 2,
        "backend": "gloo"}, "the rendezvous cannot start"),
    "init_weights_update_group_server_would_host": ("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": CLOSED_PORT, "rank_offset": 0, "world_size": 2,
        "backend": "gloo"}, "give the trainer rank 0"),
})
if not has_cuda_driver():  # the fixture's server runs on the CPU: a release reached torch.cuda.synchronize
    SCHEDULER_ENDERS["release_memory_on_a_cpu_server"] = ("/release_memory_occupation", {}, "needs a GPU server")


# Grammars no output can satisfy (HTTP 400 at compile time), and sampling parameters whose logits overflow.
# Upstream, sampled (top_p), each ended the scheduler: every logit -inf (or +inf), the multinomial raised.
SCHEDULER_ENDERS_UNSAMPLEABLE = {
    "json_schema_only_itself": ("/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 8, "json_schema": '{"$ref": "#"}', "top_p": 0.5, "top_k": 5}}, "allows no token"),
    "ebnf_rule_that_never_ends": ("/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 8, "ebnf": "root ::= a\na ::= a", "top_p": 0.9}}, "allows no token"),
    "completions_response_format_only_itself": ("/v1/completions", {
        "model": "default", "prompt": "hi", "max_tokens": 8, "top_p": 0.9, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}, "allows no token"),
    "repetition_penalty_1e-45": ("/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 8, "repetition_penalty": 1e-45, "top_p": 0.9}}, "repetition_penalty must be in"),
}
SCHEDULER_ENDERS.update(SCHEDULER_ENDERS_UNSAMPLEABLE)


def test_expert_distribution_endpoints_without_a_recorder_get_400(unharmed):
    """Upstream: one GET of /start_expert_distribution_record ended the scheduler (no recorder mode)."""
    for action in ("start", "stop", "dump"):
        r = requests.get(f"{unharmed.url}/{action}_expert_distribution_record", timeout=60)
        assert r.status_code == 400 and "--expert-distribution-recorder-mode" in r.text, r.text[:300]


def test_a_failing_expert_distribution_request_stays_in_the_scheduler():
    from sglang.srt.managers.io_struct import ExpertDistributionReqOutput

    from sglang_ext.patches import request_isolation as iso

    def recorder_raises(scheduler, recv_req):
        raise Exception("Please set ServerArgs.expert_distribution_recorder_mode")

    out = iso._expert_distribution_failing_alone(recorder_raises, None, SimpleNamespace(action="START_RECORD"))
    assert isinstance(out, ExpertDistributionReqOutput)


@pytest.mark.parametrize("case", sorted(SCHEDULER_ENDERS))
def test_fields_the_scheduler_used_unchecked_get_400(unharmed, case):
    path, body, field = SCHEDULER_ENDERS[case]
    r = post(unharmed.url, path, body)
    assert r.status_code == 400 and field in r.text, r.text[:300]


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


NESTED_480 = _nested(480)

# Requests that upstream answered with HTTP 500 (the server alive): each a 400 naming what is wrong.
UPSTREAM_500S = {
    "batch_sampling_params_short": ("/generate", {"text": ["a", "b", "c"], "sampling_params": [
        {"max_new_tokens": 2}]}, "sampling_params has 1 entries for a batch of 3"),
    "batch_sampling_params_short_with_n": ("/generate", {"text": ["a", "b"], "sampling_params": [
        {"max_new_tokens": 2, "n": 2}]}, "sampling_params has 1 entries for a batch of 2"),
    "batch_return_logprob_short": ("/generate", {"text": ["a", "b"], "return_logprob": [True],
                                                 "sampling_params": {"max_new_tokens": 2}}, "return_logprob"),
    "batch_top_logprobs_num_short": ("/generate", {"text": ["a", "b"], "return_logprob": True,
                                                   "top_logprobs_num": [1],
                                                   "sampling_params": {"max_new_tokens": 2}}, "top_logprobs_num"),
    "batch_token_ids_logprob_short": ("/generate", {"text": ["a", "b"], "return_logprob": True,
                                                    "token_ids_logprob": [[1]],
                                                    "sampling_params": {"max_new_tokens": 2}}, "token_ids_logprob"),
    "batch_custom_logit_processor_short": ("/generate", {"text": ["a", "b"], "custom_logit_processor": [None],
                                                         "sampling_params": {"max_new_tokens": 2}},
                                           "custom_logit_processor has 1 entries"),
    "detokenize_negative_id": ("/detokenize", {"tokens": [5, -1]}, "tokens[1] = -1 is not a token id"),
    "detokenize_id_past_int64": ("/v1/detokenize", {"tokens": [2**63]}, "is not a token id"),
    "detokenize_nested_id_past_vocab": ("/detokenize", {"tokens": [[13], [14, VOCAB]]},
                                        f"tokens[1][1] = {VOCAB} is not a token id"),
    "unknown_reasoning_parser": ("/separate_reasoning", {"text": "x", "reasoning_parser": "nope"},
                                 "unknown reasoning_parser 'nope'"),
    "unknown_tool_call_parser": ("/parse_function_call", {"text": "x", "tool_call_parser": "nope", "tools": []},
                                 "unknown tool_call_parser 'nope'"),
    "no_tool_call_parser": ("/parse_function_call", {"text": "x", "tools": []}, "unknown tool_call_parser None"),
    "unknown_log_level": ("/configure_logging", {"log_level": "loud"}, "unknown log_level 'loud'"),
    "request_log_level_past_3": ("/configure_logging", {"log_requests": True, "log_requests_level": 99},
                                 "log_requests_level must be one of"),
    "vertex_max_new_tokens_string": ("/vertex_generate", {"instances": [{"text": "a"}], "parameters": {
        "sampling_params": {"max_new_tokens": "8"}}}, "wrong type"),
    "vertex_temperature_string": ("/vertex_generate", {"instances": [{"text": "a"}], "parameters": {
        "sampling_params": {"max_new_tokens": 2, "temperature": "x"}}}, "wrong type"),
    "vertex_unknown_parameter": ("/vertex_generate", {"instances": [{"text": "a"}], "parameters": {
        "max_new_tokens": 8, "sampling_params": {"max_new_tokens": 2}}}, "unknown field(s) ['max_new_tokens']"),
    "vertex_prompt_in_parameters": ("/vertex_generate", {"instances": [{"text": "a"}], "parameters": {
        "text": "b"}}, "unknown field(s) ['text']"),
    # found by fuzzing the request bodies
    "chat_template_kwargs_messages": ("/v1/chat/completions", {
        "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"messages": "x"}}, "chat_template_kwargs may not set ['messages']"),
    "chat_template_kwargs_add_generation_prompt": ("/v1/chat/completions", {
        "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"add_generation_prompt": False}}, "may not set ['add_generation_prompt']"),
    "chat_rid_list": ("/v1/chat/completions", {
        "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "rid": ["a", "b"]},
        "rid of one request must be a string"),
    "completion_rid_list_for_one_prompt": ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 4,
                                                               "rid": ["a"]}, "rid of one request must be a string"),
    "stop_profile_without_a_profile": ("/stop_profile", {}, "not in progress"),
    "responses_tool_output_without_call_id": ("/v1/responses", {"input": [
        {"type": "function_call_output", "output": "x"}], "max_output_tokens": 8}, "needs the call_id"),
    # not a 500: 201088 alternatives a token blocked the server for 159 s and answered 315 MB
    "chat_top_logprobs_past_openai_bound": ("/v1/chat/completions", {
        "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
        "top_logprobs": 201088}, "top_logprobs must be at most 20"),
    "chat_n_zero": ("/v1/chat/completions", {"model": "default", "max_tokens": 4, "n": 0,
                                             "messages": [{"role": "user", "content": "hi"}]}, "n must be at least 1"),
    "completion_n_negative": ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 4, "n": -1},
                              "n must be at least 1"),
    "completion_logprobs_past_openai_bound": ("/v1/completions", {"model": "default", "prompt": "hi",
                                                                  "max_tokens": 4, "logprobs": 21},
                                              "logprobs must be at most 20"),
    # crashes inside the request models' own validators (upstream: AttributeError -> 500)
    "chat_body_is_an_array": ("/v1/chat/completions", [{"role": "user", "content": "hi"}],
                              "the request body must be a JSON object, got list"),
    "chat_response_format_string": ("/v1/chat/completions", {
        "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "response_format": "json_object"}, "response_format: Input should be a valid dictionary"),
    "generate_rid_list_for_one_prompt": ("/generate", {"text": "hello there", "rid": ["a"],
                                                       "sampling_params": {"max_new_tokens": 2}},
                                         "rid of one request must be a string"),
    "generate_empty_input_embeds": ("/generate", {"text": None, "input_embeds": [],
                                                  "sampling_params": {"max_new_tokens": 2}}, "cannot be read"),
    "responses_message_without_role": ("/v1/responses", {"input": [{"type": "message", "content": "hi"}],
                                                         "max_output_tokens": 16}, "a message needs a role"),
    "responses_message_without_content": ("/v1/responses", {"input": [{"type": "message", "role": "user"}],
                                                            "max_output_tokens": 16}, "content must be text"),
    "responses_content_parts_not_objects": ("/v1/responses", {"input": [{"role": "user", "content": ["hi", "x"]}],
                                                              "max_output_tokens": 16}, "content must be text"),
    "responses_function_call_without_name": ("/v1/responses", {"input": [
        {"type": "function_call", "call_id": "c1", "arguments": "{}"}], "max_output_tokens": 16},
        "needs the name of the tool"),
    "completion_rids_fewer_than_prompts": ("/v1/completions", {"model": "default", "prompt": ["hi", "yo"],
                                                               "max_tokens": 4, "rid": ["r1"]}, "2 prompts, 1 rids"),
    # a RecursionError while pickling the request for the scheduler
    "custom_params_nested_480_deep": ("/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 2, "custom_params": NESTED_480}}, "custom_params nests more than 32 levels deep"),
    "chat_custom_params_nested_480_deep": ("/v1/chat/completions", {
        "model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
        "custom_params": NESTED_480}, "custom_params nests more than 32 levels deep"),
    "ollama_chat_without_messages": ("/api/chat", {"model": "default", "messages": [], "stream": False},
                                     "messages is empty"),
}


# Fields the request models dropped without a word (a 200 as if they were not sent): a guard threshold put
# there never applied.
DROPPED_FIELDS = {
    "generate_custom_params_at_top": ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2},
                                                    "custom_params": {"probe_stop": {"label_8": 0.0}}},
                                      "custom_params: on /generate it goes in sampling_params.custom_params"),
    "chat_extra_body": ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2,
                                                 "extra_body": {"custom_params": {"probe_stop": {"label_8": 0.0}}}},
                        "extra_body: the OpenAI SDK's extra_body argument"),
    "completion_sampling_params": ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 2,
                                                       "sampling_params": {"custom_params": {}}},
                                   "sampling_params: a /generate field"),
}


# Upstream 400s whose message named something the client never sent (found by fuzzing).
MISLEADING_400S = {
    # was " None" (openai-harmony's NotImplementedError on a dict output)
    "responses_tool_output_object": ("/v1/responses", {"input": [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": {"a": 1}}], "max_output_tokens": 8},
        "input[1]: a function_call_output item's output must be text or a list of content parts"),
    # was "max_new_tokens must be at least 0, got -2"
    "responses_max_output_tokens_zero": ("/v1/responses", {"input": "hi", "max_output_tokens": 0},
                                         "max_output_tokens must be at least 1, got 0"),
}


# One table of (path, body, the 400's message) over the three kinds above.
BAD_REQUESTS = {**UPSTREAM_500S, **DROPPED_FIELDS, **MISLEADING_400S}
assert len(BAD_REQUESTS) == len(UPSTREAM_500S) + len(DROPPED_FIELDS) + len(MISLEADING_400S)


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_get_a_400_in_the_clients_terms(unharmed, case):
    path, body, message = BAD_REQUESTS[case]
    r = post(unharmed.url, path, body)
    assert r.status_code == 400 and message in r.text, (r.status_code, r.text[:300])


def test_requests_upstream_refused_by_mistake_are_served(unharmed):
    """A function tool without a description is valid OpenAI input; upstream answered 400 "'dict object' has no
    attribute 'function'" (the gpt-oss template concatenates the description). It is served as if the
    description were "": the same prompt and tokens. max_output_tokens 1 or 2 (less upstream's 2 tokens of
    headroom) was refused the same way as 0; it now gets one token."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    chat = {"model": "default", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    missing = post(unharmed.url, "/v1/chat/completions", {**chat, "tools": [tool]})
    tool["function"]["description"] = ""
    empty = post(unharmed.url, "/v1/chat/completions", {**chat, "tools": [tool]})
    assert missing.status_code == empty.status_code == 200, (missing.text[:300], empty.text[:300])
    assert missing.json()["usage"] == empty.json()["usage"]
    assert missing.json()["choices"][0]["message"] == empty.json()["choices"][0]["message"]
    for budget in (1, 2):
        r = post(unharmed.url, "/v1/responses", {"input": "hi", "max_output_tokens": budget})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 1, r.text[:300]


def test_the_checks_behind_those_400s_pass_good_requests(unharmed):
    r = post(unharmed.url, "/generate", {"text": ["a", "b"], "return_logprob": [True, False],
                                         "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}]})
    assert r.status_code == 200 and [len(o["output_ids"]) for o in r.json()] == [2, 3], r.text[:300]
    r = post(unharmed.url, "/generate", {"text": ["a", "b"], "sampling_params": [
        {"max_new_tokens": 2, "n": 2}, {"max_new_tokens": 2, "n": 2}]})
    assert r.status_code == 200 and len(r.json()) == 4, r.text[:300]
    r = post(unharmed.url, "/detokenize", {"tokens": [[13, 14], [VOCAB - 1]]})
    assert r.status_code == 200 and len(r.json()["text"]) == 2, r.text[:300]
    r = post(unharmed.url, "/separate_reasoning", {"text": "<think>a</think>b", "reasoning_parser": "qwen3"})
    assert r.status_code == 200 and r.json()["reasoning_text"] == "a", r.text[:300]
    r = post(unharmed.url, "/parse_function_call", {"text": "x", "tool_call_parser": "gpt-oss", "tools": []})
    assert r.status_code == 200 and r.json()["normal_text"] == "x", r.text[:300]
    for body in ({"log_level": "info"}, {"log_requests": False, "log_requests_level": 2}):
        r = post(unharmed.url, "/configure_logging", body)
        assert r.status_code == 200, r.text[:300]
    r = post(unharmed.url, "/vertex_generate", {"instances": [{"input_ids": BASELINE_PROMPT}], "parameters": {
        "sampling_params": {"max_new_tokens": 2, "temperature": 0}}})
    assert r.status_code == 200 and len(r.json()["predictions"][0]["output_ids"]) == 2, r.text[:300]
    chat = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = post(unharmed.url, "/v1/chat/completions", {**chat, "rid": "chat-rid-1",
                                                    "chat_template_kwargs": {"reasoning_effort": "low"}})
    assert r.status_code == 200 and r.json()["id"] == "chat-rid-1", r.text[:300]
    # n > 1: a batch of copies whose modalities the chat endpoint sends as [] (the length check once
    # refused every such request)
    r = post(unharmed.url, "/v1/chat/completions", {**chat, "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text[:300]
    r = post(unharmed.url, "/v1/chat/completions", {**chat, "n": 2, "stream": True}, stream=True)
    assert r.status_code == 200 and {c["index"] for e in sse_events(r) for c in e.get("choices", [])} == {0, 1}
    r = post(unharmed.url, "/v1/completions", {"model": "default", "prompt": ["hi", "yo"], "max_tokens": 2,
                                               "rid": ["co-r1", "co-r2"]})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text[:300]
    r = post(unharmed.url, "/update_weights_from_disk", {"model_path": "/nonexistent", "load_format": "auto"})
    assert r.status_code == 400 and r.json()["success"] is False, r.text[:300]  # upstream's own answer


def test_operator_requests_that_fail_in_the_scheduler_stay_there():
    from sglang.srt.managers.io_struct import (ResumeMemoryOccupationReqInput, ResumeMemoryOccupationReqOutput,
                                               UpdateWeightFromDiskReqInput, UpdateWeightFromDiskReqOutput)

    from sglang_ext.patches import request_isolation as iso

    def raises(updater, recv_req):
        raise KeyError("weights")  # e.g. resuming a tag that was never released

    out = iso._memory_occupation_failing_alone(raises, None, ResumeMemoryOccupationReqInput(tags=["weights"]))
    assert isinstance(out, ResumeMemoryOccupationReqOutput)
    out = iso._weights_update_failing_alone(raises, None, UpdateWeightFromDiskReqInput(model_path="/x"))
    assert isinstance(out, UpdateWeightFromDiskReqOutput) and not out.success and "KeyError" in out.message

    def stop_raises(manager, stage=None):
        raise FileNotFoundError("/proc/nope")

    manager = SimpleNamespace(profile_in_progress=True)
    out = iso._profile_stop_failing_alone(stop_raises, manager)
    assert not out.success and "/proc/nope" in out.message and manager.profile_in_progress is False


def test_custom_params_that_is_not_an_object_gets_400(unharmed):
    r = greedy(unharmed.url, BASELINE_PROMPT, n=2, sampling={"custom_params": "label_3=0.5"})
    assert r.status_code == 400 and "custom_params must be a JSON object" in r.text


TOOL_CASES = {
    "properties_not_an_object": {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": 5}}},
    "unknown_json_type": {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "frob"}}}}},
    "missing_name": {"type": "function", "function": {"parameters": {"type": "object"}}},
    "not_an_object": "get_weather",
}


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_invalid_tool_schemas_get_400(unharmed, tool_choice):
    for name, tool in TOOL_CASES.items():
        r = post(unharmed.url, "/v1/chat/completions", {
            "model": "default", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 4,
            "tools": [tool], "tool_choice": tool_choice})
        assert r.status_code == 400, (name, r.status_code, r.text[:200])


@pytest.mark.parametrize("ids,bad", [([1, VOCAB], VOCAB), ([10**9], 10**9), ([5, -1, 7], -1)],
                         ids=["vocab_size", "huge", "negative"])
def test_out_of_vocabulary_token_ids_get_400(unharmed, ids, bad):
    """Upstream: IndexError in the embedding, scheduler gone. Now: 400 naming the id and the vocab."""
    url = unharmed.url
    r = greedy(url, ids, n=2)
    assert r.status_code == 400, r.text[:200]
    message = r.json()["error"]["message"]
    assert repr(bad) in message and str(VOCAB) in message
    with post(url, "/generate", {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 2}},
              stream=True) as r:
        events = sse_events(r)
    assert [e["error"]["code"] for e in events] == [400] and repr(bad) in events[0]["error"]["message"]
    r = post(url, "/generate", {"input_ids": [[3, 4, 5], ids], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and repr(bad) in r.text
    r = post(url, "/v1/completions", {"model": "default", "prompt": ids, "max_tokens": 2})
    assert r.status_code == 400 and repr(bad) in r.text


def test_top_logprobs_beyond_vocabulary_gets_400(unharmed):
    """Upstream: `topk` out of range in the sampler, scheduler gone."""
    r = greedy(unharmed.url, BASELINE_PROMPT, n=2, return_logprob=True, top_logprobs_num=VOCAB + 1)
    assert r.status_code == 400 and str(VOCAB) in r.text


def test_unloadable_custom_logit_processor_gets_400(unharmed):
    for text in ("garbage", json.dumps({"callable": "zz"}), json.dumps({"callable": "00"})):
        r = greedy(unharmed.url, BASELINE_PROMPT, n=2, custom_logit_processor=text)
        assert r.status_code == 400 and "custom logit processor could not be loaded" in r.text


# -- faults in the middle of a batch: only the faulty request ends -----------------------------


def test_raising_custom_logit_processor_finishes_only_its_request(unharmed, baseline):
    """Upstream: the exception ends the scheduler (SIGQUIT), losing every request in flight."""
    url, processors = unharmed.url, _processors()
    fail = processors["FailAfterTokens"]
    results = {}

    def run(name, fn):
        results[name] = fn()

    def native_stream():
        body = {"input_ids": random_prompt(30, seed=31), "stream": True, "custom_logit_processor": fail,
                "sampling_params": {"max_new_tokens": 20, "temperature": 0, "custom_params": {"fail_after": 5}}}
        with post(url, "/generate", body, stream=True) as r:
            return sse_events(r)

    def chat_stream():
        body = {"model": "default", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 20,
                "temperature": 0, "stream": True, "custom_logit_processor": fail, "custom_params": {"fail_after": 4}}
        with post(url, "/v1/chat/completions", body, stream=True) as r:
            return sse_events(r)

    jobs = {
        "normal": lambda: greedy(url, BASELINE_PROMPT).json(),
        "failing": lambda: greedy(url, random_prompt(40, seed=32), n=24, custom_logit_processor=fail,
                                  sampling={"custom_params": {"fail_after": 3}}),
        # Same processor in the same batch, params that never fail: it must go on to the end.
        "passing": lambda: greedy(url, random_prompt(40, seed=33), n=24, custom_logit_processor=fail,
                                  sampling={"custom_params": {"keep": True}}),
        "no_params": lambda: greedy(url, random_prompt(40, seed=34), n=24, custom_logit_processor=fail),
        "native_stream": native_stream,
        "chat_stream": chat_stream,
    }
    threads = [threading.Thread(target=run, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    same_answer(results["normal"], baseline)
    for name in ("passing", "no_params"):
        out = results[name].json()
        assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 24
    failing = results["failing"]
    assert failing.status_code == 400
    assert "FailAfterTokens failed: RuntimeError: boom after 3 tokens" in failing.json()["error"]["message"]
    last = results["native_stream"][-1]["meta_info"]
    assert last["finish_reason"]["type"] == "abort" and "boom after 5 tokens" in last["finish_reason"]["message"]
    streamed = [row for e in results["native_stream"] for row in e["meta_info"].get("token_probe_probs") or []]
    assert len(streamed) == last["completion_tokens"] >= 5  # each chunk carries its new tokens' scores
    error = results["chat_stream"][-1]["error"]
    assert "boom after 4 tokens" in error["message"] and error["code"] == 400


def test_custom_logit_processor_returning_wrong_shape_finishes_its_request(unharmed):
    r = greedy(unharmed.url, BASELINE_PROMPT, n=4, custom_logit_processor=_processors()["WrongShape"])
    assert r.status_code == 400 and "expected a tensor of shape (1, 201088)" in r.text


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "top_p": 0.9}],
                         ids=["greedy", "sampled"])
def test_custom_logit_processor_masking_every_token_finishes_its_request(unharmed, sampling):
    """Sampled, the all -inf row reached the sampler's multinomial (NaN) and ended the scheduler (seen with the
    check undone); greedy, argmax over a row of -inf serves token 0."""
    r = greedy(unharmed.url, BASELINE_PROMPT, n=4, custom_logit_processor=_processors()["MasksEverything"],
               sampling=sampling)
    assert r.status_code == 400 and "no finite logit" in r.text, r.text[:300]


def test_a_grammar_state_that_allows_no_token_ends_only_its_request(unharmed):
    """An EOS-only grammar under min_new_tokens: the grammar allows only EOS, min_new_tokens masks it, so
    no token is left. Sampled, upstream's multinomial ended the scheduler; here the row samples uniform
    logits, the grammar refuses the token and that request alone ends with an error."""
    for sampling in ({"top_p": 0.9}, {"temperature": 0}):
        r = post(unharmed.url, "/generate", {"text": "hi", "sampling_params": {
            "max_new_tokens": 8, "min_new_tokens": 4, "ebnf": 'root ::= ""', **sampling}})
        assert r.status_code >= 400 and "Grammar accept_token failed" in r.text, r.text[:300]


def test_client_disconnects_at_random_points_of_streams(unharmed):
    url = unharmed.url

    def disconnect(seed):
        rng = random.Random(seed)
        n, after = rng.randint(8, 32), rng.choice([0, 1, 2, 3, 5, 8, 13])
        path, body = [
            ("/generate", {"input_ids": random_prompt(rng.randint(5, 200), seed=seed), "stream": True,
                           "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}),
            ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": f"tell {seed}"}],
                                      "max_tokens": n, "stream": True}),
            ("/v1/completions", {"model": "default", "prompt": f"count {seed}", "max_tokens": n, "stream": True}),
        ][seed % 3]
        with post(url, path, body, stream=True) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i >= after:
                    break  # leaving the `with` drops the connection here

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(disconnect, range(24)))


class Stream(threading.Thread):
    """One native /generate stream with a client-chosen rid: `first` once a token arrived, `last` its last
    event, `ended` once the server ended it (or, with `drop_after`, once the client dropped it)."""

    def __init__(self, url, rid, n=4000, drop_after=None):
        super().__init__(daemon=True)
        self.url, self.rid, self.n, self.drop_after = url, rid, n, drop_after
        self.first, self.ended, self.last = threading.Event(), threading.Event(), None

    def run(self):
        body = {"input_ids": random_prompt(20, seed=len(self.rid)), "rid": self.rid, "stream": True,
                "sampling_params": {"max_new_tokens": self.n, "temperature": 0, "ignore_eos": True}}
        try:
            with post(self.url, "/generate", body, stream=True) as r:
                for raw in r.iter_lines():
                    if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                        continue
                    self.last = json.loads(raw[len(b"data: "):])
                    self.first.set()
                    if self.drop_after is not None and len(self.last.get("output_ids") or [1]) >= self.drop_after:
                        return  # leaving the `with` drops the connection
        finally:
            self.ended.set()

    def finish(self):
        return ((self.last or {}).get("meta_info") or {}).get("finish_reason", {}).get("type")


def _abort(url, rid):
    r = post(url, "/abort_request", {"rid": rid})
    assert r.status_code == 200, r.text[:200]


def test_an_abort_ends_only_the_request_it_names(unharmed):
    """Upstream matched rids by prefix: aborting "a1" ended "a10" and "a1-7f3e" too."""
    url = unharmed.url
    streams = {rid: Stream(url, rid) for rid in ("abort-a1", "abort-a10", "abort-a1-7f3e")}
    for stream in streams.values():
        stream.start()
    for stream in streams.values():
        assert stream.first.wait(120), stream.rid
    _abort(url, "abort-a1")
    assert streams["abort-a1"].ended.wait(60)
    assert streams["abort-a1"].finish() == "abort"
    time.sleep(1.0)  # an abort reaches every queue of the scheduler within its next step
    for rid in ("abort-a10", "abort-a1-7f3e"):
        assert not streams[rid].ended.is_set(), f"{rid} ended with {streams[rid].finish()}"
        _abort(url, rid)
        assert streams[rid].ended.wait(60) and streams[rid].finish() == "abort"


def test_a_dropped_stream_ends_only_its_own_request(unharmed):
    """Upstream: a client dropping its stream "x" ended "xyz" and "x7f3e" two seconds later (the tokenizer
    manager's disconnect abort, matched by prefix in the scheduler)."""
    url = unharmed.url
    others = [Stream(url, rid) for rid in ("dropped-xyz", "dropped-x7f3e")]
    for stream in others:
        stream.start()
    for stream in others:
        assert stream.first.wait(120), stream.rid
    dropped = Stream(url, "dropped-x", drop_after=1)
    dropped.start()
    assert dropped.ended.wait(120)
    time.sleep(4.0)  # the disconnect abort fires 2 s after the drop
    assert server_load(url)["num_running_reqs"] == len(others)  # the dropped one's own request is gone
    for stream in others:
        assert not stream.ended.is_set(), f"{stream.rid} ended with {stream.finish()}"
        _abort(url, stream.rid)
        assert stream.ended.wait(60) and stream.finish() == "abort"


@pytest.mark.parametrize("path", ["/generate", "/v1/responses"])
def test_a_stream_refused_as_a_duplicate_rid_leaves_the_rids_owner_running(unharmed, path):
    """Upstream: a stream that reused a running request's rid was refused as a duplicate, and then ended that
    other request (the disconnect abort two seconds after the refused stream closed; at once on /v1/responses,
    whose error path aborted by rid)."""
    url = unharmed.url
    owner = Stream(url, f"dup-owner{path.replace('/', '-')}")
    owner.start()
    assert owner.first.wait(120)
    body = ({"input_ids": BASELINE_PROMPT, "rid": owner.rid, "stream": True, "sampling_params": {"max_new_tokens": 4}}
            if path == "/generate" else {"input": "hi", "max_output_tokens": 4, "request_id": owner.rid, "stream": True})
    r = post(url, path, body)
    assert "Duplicate request ID" in r.text, r.text[:300]
    time.sleep(4.0)  # past the disconnect abort's two seconds
    assert not owner.ended.is_set(), f"{owner.rid} ended with {owner.finish()}"
    _abort(url, owner.rid)
    assert owner.ended.wait(60) and owner.finish() == "abort"


def test_a_rid_reused_right_after_its_stream_ended_runs_to_its_end(unharmed):
    """Upstream's disconnect abort fires two seconds after a stream closes and ended whatever request held the
    rid by then: a client reusing its rid at once (a retry with a fixed id) saw the new request aborted."""
    url = unharmed.url
    first = Stream(url, "reused-rid", n=2)
    first.start()
    assert first.ended.wait(120) and first.finish() == "length"
    again = Stream(url, "reused-rid")
    again.start()
    assert again.first.wait(120)
    time.sleep(4.0)
    assert not again.ended.is_set(), f"ended with {again.finish()}"
    _abort(url, again.rid)
    assert again.ended.wait(60) and again.finish() == "abort"


U2028 = 51008  # o200k_harmony's token for U+2028 LINE SEPARATOR alone


@pytest.mark.parametrize("path", ENDPOINTS)
def test_line_separators_in_streamed_json_are_escaped(unharmed, path):
    """A stream read with Unicode line rules (str.splitlines, requests' iter_lines(decode_unicode=True)) must
    still be one JSON value per line: upstream wrote U+2028 raw inside the JSON strings."""
    force, params = _processors()["ForceToken"], {"force": U2028}
    body = {"/generate": {"input_ids": BASELINE_PROMPT, "sampling_params": {
                "max_new_tokens": 3, "temperature": 0, "custom_params": params}},
            "/v1/chat/completions": {"model": "default", "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 3, "custom_params": params},
            "/v1/completions": {"model": "default", "prompt": "hi", "max_tokens": 3, "custom_params": params}}[path]
    r = post(unharmed.url, path, {**body, "stream": True, "custom_logit_processor": force})
    assert r.status_code == 200, r.text[:300]
    assert "\u2028".encode() not in r.content and b"\\u2028" in r.content, r.content[:300]
    events = [json.loads(line[len("data: "):]) for line in r.content.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(e.get("text", "") if path == "/generate" else
                   "".join((c.get("delta") or {}).get("content") or c.get("text") or "" for c in e.get("choices", []))
                   for e in events)
    assert "\u2028" in text, events[-2:]


def _stream_kept_or_dropped(url, i, drop) -> str | None:
    """One of the concurrent streams: None when it holds one score per token and ends with [DONE], else why."""
    if i % 2:
        path, body = "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": f"say {i}"}],
                                              "max_tokens": 12, "stream": True,
                                              "stream_options": {"include_usage": True}}
    else:
        path, body = "/generate", {"input_ids": random_prompt(10 + i, seed=i), "stream": True,
                                   "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    scores, tokens, done, last = 0, None, False, None
    with post(url, path, body, stream=True) as r:
        for raw in r.iter_lines():
            if raw == b"data: [DONE]":
                done = True
            elif raw.startswith(b"data: "):
                if drop:
                    return None  # leaving the `with` drops the connection after the first chunk
                last = json.loads(raw[len(b"data: "):])
                for choice in last.get("choices") or []:
                    scores += len(choice.get("token_probe_probs") or [])
                scores += len((last.get("meta_info") or {}).get("token_probe_probs") or [])  # native: its new tokens
                if last.get("usage"):
                    tokens = last["usage"]["completion_tokens"]
    if path == "/generate" and last is not None:
        tokens = len(last["output_ids"])
    if not done or tokens is None or scores != tokens or tokens == 0:
        return f"{path} #{i}: done={done} tokens={tokens} scores={scores} last={json.dumps(last)[:200]}"
    return None


def test_sixty_four_streams_a_third_dropped_three_rounds(unharmed):
    """Every kept stream gets one score per token and [DONE]; the server's memory does not grow from round to round,
    and after the rounds no KV token stays in use.

    The rounds run back to back and the pool is flushed once, after the last: a token leaked by a dropped stream
    stays leaked, so one check at the end sees every round's. A flush between rounds would make each next round's
    prefill miss the radix cache, and after such a round SGLang's CPU scheduler heap grows by about 100 MiB for a
    few rounds whether the probe is loaded or not, which would hide a leak of ours."""
    from benchmarks.bench_load import group_rss_bytes

    rss = []
    for _ in range(3):
        with ThreadPoolExecutor(64) as pool:
            problems = [p for p in pool.map(lambda i: _stream_kept_or_dropped(unharmed.url, i, i % 3 == 2), range(64))
                        if p is not None]
        assert not problems, problems[:5]
        wait_idle(unharmed.url)
        rss.append(group_rss_bytes(unharmed.proc.pid))
    print(f"server RSS after each round (MiB): {[round(r / 2**20) for r in rss]}")
    assert rss[2] - rss[1] < 64 * 2**20, rss  # the first round warms allocations
    assert pool_tokens_after_flush(unharmed.url) == 0, "KV tokens in use after the rounds and a flush"


def test_load_scaled_for_ci(unharmed):
    """benchmarks/bench_load.py at 8 clients x 15 s (the committed full run: 64 x 120 s)."""
    report = run_load(unharmed.url, clients=8, duration_s=15, drop_fraction=0.25, seed=1,
                      server_log=unharmed.log_path)
    TALLY.sent(report["requests"], errors=report["by_status"].get("error", 0))
    print(json.dumps({k: report[k] for k in ("requests", "by_status", "ttft_ms", "itl_ms", "twins")}))
    assert not report["problems"], report["problems"][:10]
    assert report["by_status"].get("finished", 0) >= 8 and report["twins"]["compared"] > 0


# -- our own per-request code, failing on purpose (in-process, no server) ---------------------


def test_probe_failure_finishes_every_request_of_its_forward_and_nothing_else():
    import torch

    from sglang_ext.patches import request_isolation as iso
    from sglang_ext.probe import SCORES_KEY

    class BrokenRuntime:
        labels = [f"label_{i}" for i in range(10)]

        def score(self, forward_batch):
            raise IndexError("slot 99 out of range")

    probs = iso._score_or_nan(BrokenRuntime.score, BrokenRuntime(), SimpleNamespace(batch_size=3))
    assert probs.shape == (3, 10) and torch.isnan(probs).all()
    reqs = [FakeReq(f"r{i}") for i in range(3)]
    rows = [dict(zip(BrokenRuntime.labels, row)) for row in probs.tolist()]
    rows[1] = {label: 0.5 for label in BrokenRuntime.labels}  # a row scored normally stays untouched
    result = SimpleNamespace(logits_output=SimpleNamespace(customized_info={SCORES_KEY: rows}))
    iso._finish_unscored(None, SimpleNamespace(reqs=reqs), result)
    assert reqs[1].to_finish is None
    for req in (reqs[0], reqs[2]):
        reason = req.to_finish.to_json()
        assert reason["status_code"] == 500 and "IndexError: slot 99 out of range" in reason["message"]


class FakeReq:
    def __init__(self, rid):
        self.rid, self.to_finish = rid, None

    def finished(self):
        return False


def test_processor_failure_is_isolated_per_row():
    """Rows sharing a processor: the one that raises keeps its logits and finishes; the others are processed."""
    import torch

    from sglang.srt.sampling.sampling_batch_info import ProcessorEntry
    from sglang_ext.patches import request_isolation as iso

    class AddOneUnlessAsked:
        def __call__(self, logits, params):
            if any(p.get("fail") for p in params):
                raise KeyError("asked to fail")
            return logits + 1

    reqs = [FakeReq(f"r{i}") for i in range(4)]
    params = [{"__req__": reqs[0]}, None, {"__req__": reqs[2], "fail": True}, {"__req__": reqs[3]}]

    class Info:
        custom_params = params
        custom_logit_processor = {1: ProcessorEntry(processor=AddOneUnlessAsked(), rows=[0, 2, 3],
                                                    indices=torch.tensor([0, 2, 3]))}
        device = "cpu"

        def __len__(self):
            return 4

    logits = torch.zeros(4, 6)
    iso.apply_custom_logit_processor(logits, Info())
    assert logits[:, 0].tolist() == [1, 0, 0, 1]
    assert [r.to_finish is not None for r in reqs] == [False, False, True, False]
    assert "AddOneUnlessAsked failed: KeyError" in reqs[2].to_finish.to_json()["message"]


def test_exception_inside_an_openai_stream_ends_it_with_an_error_event():
    import asyncio

    from sglang_ext.patches import request_isolation as iso

    aborted = []
    request = SimpleNamespace(rid="r7")

    class Serving:
        tokenizer_manager = SimpleNamespace(abort_request=aborted.append, rid_to_state={})

        @staticmethod
        def create_streaming_error_response(message, err_type, status_code):
            return json.dumps({"error": {"message": message, "type": err_type, "code": status_code}})

    async def parser_blows_up(serving, adapted_request):
        yield "data: {\"choices\": []}\n\n"
        raise KeyError("channel")

    async def collect():
        return [c async for c in iso._stream_failing_alone(parser_blows_up, Serving(), request)]

    # The rid held by this stream's own request, then by another client's: only the first is aborted.
    for holder, want in ((request, ["r7"]), (SimpleNamespace(rid="r7"), [])):
        aborted.clear()
        Serving.tokenizer_manager.rid_to_state = {"r7": SimpleNamespace(obj=holder)}
        chunks = asyncio.run(collect())
        assert chunks[0].startswith("data: {\"choices\"") and chunks[-1] == "data: [DONE]\n\n"
        error = json.loads(chunks[1][len("data: "):])["error"]
        assert error["code"] == 500 and "KeyError" in error["message"] and aborted == want


# -- the process dies: clients get a clean error, a restarted server serves again --------------


def test_killed_server_gives_clean_connection_error_and_restart_serves(server, baseline, tiny_checkpoints,
                                                                       vocab_dir):
    """Runs last: it kills the module's server. SIGKILL to the whole process group mid-stream."""
    assert_unharmed(server, baseline)
    url, errors, chunks = server.url, [], []

    def long_stream():
        body = {"input_ids": BASELINE_PROMPT, "stream": True,
                "sampling_params": {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}}
        started = time.time()
        try:
            with requests.post(url + "/generate", json=body, stream=True, timeout=(5, 30)) as r:
                for line in r.iter_lines():
                    if line:
                        chunks.append(time.time())
        except requests.RequestException as e:
            errors.append((type(e).__name__, time.time() - started))

    client = threading.Thread(target=long_stream)
    client.start()
    deadline = time.time() + 120
    while len(chunks) < 5 and time.time() < deadline:
        time.sleep(0.05)
    assert len(chunks) >= 5, "the stream never started"
    killed_at = time.time()
    os.killpg(server.proc.pid, signal.SIGKILL)
    client.join(60)
    TALLY.sent(2, errors=1)
    assert not client.is_alive(), "the client hangs after the server died"
    assert errors and errors[0][0] in ("ChunkedEncodingError", "ConnectionError"), errors
    assert time.time() - killed_at < 30
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health", timeout=5)
    server.proc.wait(30)
    server.stop()

    restarted = SGLangServer(tiny_checkpoints["bf16"], server.args, port=server.port, vocab_dir=vocab_dir,
                             log_path=str(server.log_path) + ".restart", startup_timeout=600)
    with restarted:
        out = greedy(restarted.url, BASELINE_PROMPT).json()
        TALLY.cases += 1
    # A fresh process on the same weights: the same greedy tokens and scores as before the kill.
    same_answer(out, baseline)
    assert not math.isnan(out["meta_info"]["token_probe_probs"][0]["label_0"])


def _agreement_rank(rank: int, port: int, queue) -> None:
    """One scheduler of a two-rank group (gloo, this CPU): what agreed_score_rows hands each hook."""
    import ctypes
    import math
    import os

    import torch.distributed as dist

    from sglang_ext.launch.cpu_shims import build_libcuda_stub, has_cuda_driver

    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # conftest's setup, which a spawned process skips
    if not has_cuda_driver():
        ctypes.CDLL(str(build_libcuda_stub() / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
    from sglang_ext.patches import probe_stop
    from sglang_ext.patches import request_isolation as iso
    from sglang_ext.probe import SCORES_KEY

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)

    class Group:  # SGLang's GroupCoordinator, as much of it as the agreement uses
        world_size, rank_in_group, ranks, cpu_group = 2, rank, [0, 1], dist.group.WORLD

        def broadcast_object(self, obj, src):
            box = [obj]
            dist.broadcast_object_list(box, src=src)
            return box[0]

    probe_stop._request_group = lambda: Group()
    labels = [f"label_{i}" for i in range(10)]
    scored = {label: 0.5 for label in labels}
    got = []
    for case in ("plain", "nan", "guarded"):
        reqs = [FakeReq(f"{case}{i}") for i in range(2)]
        for req in reqs:
            req.sampling_params = SimpleNamespace(custom_params={"probe_stop": {"label_3": 0.4}} if case == "guarded"
                                                  else None)
            req.is_chunked = 0
        rows = [dict(scored), {label: math.nan for label in labels} if case == "nan" else dict(scored)]
        # only the first rank ran the probe
        info = {SCORES_KEY: rows} if rank == 0 else None
        result = SimpleNamespace(logits_output=SimpleNamespace(customized_info=info))
        batch = SimpleNamespace(reqs=reqs)
        iso._finish_unscored(None, batch, result)
        probe_stop._check_batch(None, batch, result)  # the same result: no second exchange
        got.append([None if r.to_finish is None else r.to_finish.to_json().get("type", "error") for r in reqs])
    dist.destroy_process_group()
    queue.put((rank, got))


def test_every_rank_of_a_group_finishes_the_same_requests():
    """patches/probe_stop.agreed_score_rows between two real processes: a batch without guards or NaN scores
    finishes nothing (the rows do not travel: one int does); a NaN row, seen by the first rank alone, finishes
    its request on both; a guarded batch is stopped on both. Each hook of a result reads the same exchange
    (a second one on one rank alone would hang the other)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_agreement_rank, args=(rank, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got[0] == got[1] == [[None, None], [None, "abort"], ["content_filter", "content_filter"]], got
