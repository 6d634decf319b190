"""Tenants cannot undo each other or the operator: the guard, the keys, the operator routes, the probe's health.

Two CPU servers with the tiny gpt-oss and SingProbe, each tried as a hostile client would:
  - `guarded`: the operator's guard `--probe-stop label_0=0` (every request stops at its first token: a
    sigmoid is > 0), a tenant key and an admin key;
  - `tenant_only`: a tenant key and no admin key, and a probe whose weights are finite but overflow at run
    time (every score NaN).
Aborts by exact id, the rendezvous checks on a keyless server, and the 400s for smaller inputs are in
test_faults.py (its server and oracle).
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from test_probe_serving import tiny_probe  # noqa: F401  (the module fixture, shared)
import requests

from sglang_ext.launch.make_tiny import random_prompt
from sglang_ext.launch.server import IDS_ONLY_ARGS, SGLangServer, free_port

pytestmark = pytest.mark.server

TENANT, ADMIN = "tenant-key-5d1b9e", "admin-key-c83f20"
PROMPT = random_prompt(40, seed=3)


def auth(key):
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def guarded(tiny_checkpoints, tiny_probe, vocab_dir):
    args = ["--dtype", "float32", "--probe-ckpt", tiny_probe, "--probe-stop", "label_0=0",
            "--api-key", TENANT, "--admin-api-key", ADMIN]
    with SGLangServer(tiny_checkpoints["fp32"], args, vocab_dir=vocab_dir) as srv:
        yield srv


def generate(url, key, custom_params=None, n=8, **extra):
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    if custom_params is not None:
        sp["custom_params"] = custom_params
    return requests.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": sp, **extra},
                         headers=auth(key), timeout=300)


def lines_of(r) -> list[str]:
    # bytes split on \n only: Unicode line rules (str.splitlines) would split inside a JSON string
    return [line.decode() for line in r.iter_lines() if line]


# -- 1. the guard is the operator's: a request may tighten it, never loosen it ------------------------


@pytest.mark.parametrize("spec", [{"label_0": 1.0}, "label_0=1", '{"label_0": 1}', {"label_0": 0.5, "label_3": 1}],
                         ids=["dict", "string", "json", "with_another_label"])
def test_a_request_cannot_loosen_the_operators_guard(guarded, spec):
    """Upstream of this fix a request's value replaced the operator's: the request ran to `length`."""
    out = generate(guarded.url, TENANT, {"probe_stop": spec}).json()
    reason = out["meta_info"]["finish_reason"]
    assert (reason["type"], reason["label"], reason["threshold"]) == ("content_filter", "label_0", 0.0), reason
    assert len(out["output_ids"]) == 1
    r = requests.post(guarded.url + "/v1/chat/completions", headers=auth(TENANT), timeout=300, json={
        "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "custom_params": {"probe_stop": spec}})
    assert r.json()["choices"][0]["finish_reason"] == "content_filter", r.text[:300]


@pytest.mark.parametrize("spec,message", [({"label_0": True}, "threshold of 'label_0' is not a number"),
                                          (True, "probe_stop: expected a dict"),
                                          ({"label_0": "1"}, "threshold of 'label_0' is not a number"),
                                          ({"label_99": 0.5}, "unknown label(s) ['label_99']")],
                         ids=["true_threshold", "true", "string_threshold", "unknown_label"])
def test_a_threshold_that_is_not_a_number_or_a_label_the_probe_lacks_gets_400(guarded, spec, message):
    """`true` was read as 1.0 (Python's float(True)) and loosened the guard."""
    r = generate(guarded.url, TENANT, {"probe_stop": spec})
    assert r.status_code == 400 and message in r.text, r.text[:300]


def test_thresholds_merge_to_the_lower_unless_the_operator_allows_loosening():
    from sglang_ext.patches.probe_stop import effective_thresholds

    server = {"label_8": 0.95, "label_1": 0.5}
    assert effective_thresholds(server, {"label_8": 1.0, "label_2": 0.7}) == {
        "label_8": 0.95, "label_1": 0.5, "label_2": 0.7}
    assert effective_thresholds(server, {"label_8": 0.3}) == {"label_8": 0.3, "label_1": 0.5}
    assert effective_thresholds(server, {"label_8": 1.0}, clients_may_loosen=True)["label_8"] == 1.0


def test_labels_with_a_comma_or_an_equals_sign_can_be_named():
    from sglang_ext.patches.probe_stop import parse_probe_stop

    assert parse_probe_stop('{"unsafe, violent": 0.5, "a=b": 0.25}') == {"unsafe, violent": 0.5, "a=b": 0.25}
    assert parse_probe_stop("label_8=0.9, label_1=0.8") == {"label_8": 0.9, "label_1": 0.8}


# -- 2. secrets never leave the server ----------------------------------------------------------------


def test_server_info_and_the_log_hold_no_key(guarded):
    """Upstream: a tenant's GET returned admin_api_key (and launch_command) in clear."""
    for path in ("/server_info", "/get_server_info"):
        r = requests.get(guarded.url + path, headers=auth(TENANT), timeout=60)
        assert r.status_code == 200, (path, r.text[:200])
        assert TENANT not in r.text and ADMIN not in r.text, path
        info = r.json()
        assert info["admin_api_key"] == info["api_key"] == "<redacted>"
        assert "--admin-api-key <redacted>" in info["launch_command"]
    log = guarded.log_path.read_text(errors="replace")
    assert "admin_api_key" in log  # the launch log's server_args line is there, redacted
    assert TENANT not in log and ADMIN not in log


# -- 3. operator routes need the admin key; a rendezvous that cannot form fails the request -----------


OPERATOR_ROUTES = [("POST", "/flush_cache", None), ("POST", "/abort_request", {"rid": "x"}),
                   ("POST", "/configure_logging", {"log_level": "info"}),
                   ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                           "rank_offset": 1, "world_size": 2})]


def test_operator_routes_refuse_the_tenant_key(guarded):
    for method, path, body in OPERATOR_ROUTES:
        r = requests.request(method, guarded.url + path, json=body, headers=auth(TENANT), timeout=60)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])


# -- 5. every endpoint serving gpt-oss says when the guard stopped it ---------------------------------


def test_anthropic_messages_report_the_guards_stop_as_refusal(guarded):
    """Upstream: stop_reason "end_turn", as for a natural end."""
    body = {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    r = requests.post(guarded.url + "/v1/messages", json=body, headers=auth(TENANT), timeout=300)
    assert r.status_code == 200 and r.json()["stop_reason"] == "refusal", r.text[:300]
    with requests.post(guarded.url + "/v1/messages", json={**body, "stream": True}, headers=auth(TENANT),
                       timeout=300, stream=True) as r:
        events = [json.loads(line[len("data: "):]) for line in lines_of(r) if line.startswith("data: ")]
    deltas = [e["delta"]["stop_reason"] for e in events if e.get("type") == "message_delta"]
    assert deltas == ["refusal"], events[-3:]


@pytest.mark.parametrize("path,body", [
    ("/api/chat", {"model": "default", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 8}}),
    ("/api/generate", {"model": "default", "prompt": "hi", "options": {"num_predict": 8}}),
], ids=["chat", "generate"])
def test_ollama_routes_report_the_guards_stop(guarded, path, body):
    """Upstream: done_reason "stop" whatever ended the request."""
    r = requests.post(guarded.url + path, json={**body, "stream": False}, headers=auth(TENANT), timeout=300)
    assert r.status_code == 200 and r.json()["done_reason"] == "content_filter", r.text[:300]
    with requests.post(guarded.url + path, json={**body, "stream": True}, headers=auth(TENANT), timeout=300,
                       stream=True) as r:
        chunks = [json.loads(line) for line in lines_of(r)]
    assert chunks[-1]["done"] is True and chunks[-1]["done_reason"] == "content_filter", chunks[-2:]


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
    ("/api/chat", {"model": "default", "messages": [{"role": "user", "content": "hi"}], "stream": False}),
    ("/api/generate", {"model": "default", "prompt": "hi", "stream": False}),
], ids=["anthropic", "ollama_chat", "ollama_generate"])
def test_other_endpoints_honour_the_guards_per_request_form(guarded, path, body):
    """Upstream ignored custom_params there: label_99 got a 200."""
    r = requests.post(guarded.url + path, json={**body, "custom_params": {"probe_stop": {"label_99": 0.5}}},
                      headers=auth(TENANT), timeout=300)
    assert r.status_code == 400 and "label_99" in r.text, (r.status_code, r.text[:300])
    r = requests.post(guarded.url + path, json={**body, "custom_params": {"probe_stop": {"label_0": True}}},
                      headers=auth(TENANT), timeout=300)
    assert r.status_code == 400 and "is not a number" in r.text, (r.status_code, r.text[:300])


# -- a tenant key alone opens no operator route; a probe that goes NaN fails /health_generate ---------


def _overflowing_probe(tiny_probe, folder) -> str:
    """Finite weights whose query projection overflows float32 on every row: NaN scores at run time."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_probe, folder)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    q = tensors["proj_q.weight"]
    signs = torch.randint(0, 2, q.shape, generator=gen).to(q.dtype) * 2 - 1
    tensors["proj_q.weight"] = (signs * 3e38).to(q.dtype)
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values())
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def tenant_only(tiny_checkpoints, tiny_probe, vocab_dir, tmp_path_factory):
    probe = _overflowing_probe(tiny_probe, str(tmp_path_factory.mktemp("probe") / "overflowing"))
    args = ["--dtype", "float32", "--probe-ckpt", probe, "--api-key", TENANT, *IDS_ONLY_ARGS]
    with pytest.MonkeyPatch.context() as env:
        # ready once it answers /health without generating (its /health_generate fails, as it should)
        env.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
        srv = SGLangServer(tiny_checkpoints["fp32"], args, vocab_dir=vocab_dir, ready_path="/health")
        srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_a_tenant_key_alone_opens_no_operator_route(tenant_only):
    """Upstream: with --api-key and no admin key, the tenant key opened every operator route."""
    for method, path, body in OPERATOR_ROUTES:
        r = requests.request(method, tenant_only.url + path, json=body, headers=auth(TENANT), timeout=60)
        assert r.status_code == 403, (path, r.status_code, r.text[:200])
    r = requests.get(tenant_only.url + "/server_info", headers=auth(TENANT), timeout=60)
    assert r.status_code == 200 and TENANT not in r.text


def test_a_probe_that_goes_nan_fails_health_generate(tenant_only):
    """Upstream: every request failed with 500 while /health_generate answered 200."""
    r = generate(tenant_only.url, TENANT, n=4)
    assert r.status_code == 500 and "NaN" in r.text, r.text[:300]
    assert requests.get(tenant_only.url + "/health_generate", timeout=120).status_code == 503
    assert requests.get(tenant_only.url + "/health_generate", timeout=120).status_code == 503


def test_the_operator_may_open_operator_routes_to_the_tenant_key():
    from sglang.srt.utils.auth import AuthLevel

    from sglang_ext.patches import operator_routes

    def upstream(**kwargs):
        return "upstream's decision"

    ask = dict(method="POST", path="/flush_cache", authorization_header=f"Bearer {TENANT}", api_key=TENANT,
               admin_api_key=None, auth_level=AuthLevel.ADMIN_OPTIONAL)
    with pytest.MonkeyPatch.context() as env:
        env.delenv(operator_routes.ENV_VAR, raising=False)
        assert operator_routes._decide_request_auth(upstream, **ask).error_status_code == 403
        env.setenv(operator_routes.ENV_VAR, "1")
        assert operator_routes._decide_request_auth(upstream, **ask) == "upstream's decision"
        assert operator_routes._decide_request_auth(upstream, **{**ask, "admin_api_key": ADMIN}) == (
            "upstream's decision")


# -- 6. non-finite probe weights stop the launch --------------------------------------------------------


@pytest.mark.parametrize("value,dtype", [(float("nan"), "bfloat16"), (float("inf"), "bfloat16"),
                                         (1e6, "float16")], ids=["nan", "inf", "past_float16"])
def test_non_finite_probe_weights_stop_the_launch_with_one_line(tiny_checkpoints, tiny_probe, tmp_path, value,
                                                                 dtype):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "probe"
    shutil.copytree(tiny_probe, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["o_proj.weight"][3, 5] = value
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})

    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import prepare_server_args

    from sglang_ext import plugin

    plugin.load()
    HookRegistry.apply_hooks()
    saved = {k: os.environ.get(k) for k in ("SGLANG_EXT_PROBE_CKPT", "SGLANG_EXT_PROBE_STOP")}
    try:
        with pytest.raises(SystemExit) as stop:
            prepare_server_args(["--model-path", str(tiny_checkpoints["fp32"]), "--device", "cpu", "--dtype", dtype,
                                 "--probe-ckpt", str(bad)])
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    message = str(stop.value)
    assert message.startswith("--probe-ckpt") and "\n" not in message, message
    assert "non-finite weights" in message and "o_proj.weight (1 of" in message, message


# Last of the module: on a server without the fix this hangs the `guarded` server's scheduler.
def test_a_rendezvous_that_cannot_form_fails_in_seconds_and_the_server_serves(guarded):
    """Upstream: the scheduler waited in the rendezvous for 30 minutes (/health 503, every request timed out)."""
    closed = free_port()  # bound and released: nothing listens there
    cases = [({"master_address": "127.0.0.1", "master_port": closed, "rank_offset": 1, "world_size": 2,
               "backend": "gloo"}, "the rendezvous cannot start"),
             ({"master_address": "127.0.0.1", "master_port": closed, "rank_offset": 0, "world_size": 2,
               "backend": "gloo"}, "give the trainer rank 0"),
             ({"master_address": "127.0.0.1", "master_port": closed, "rank_offset": 2, "world_size": 2,
               "backend": "gloo"}, "must lie in 0 .. world_size - 1")]
    for body, message in cases:
        started = time.time()
        r = requests.post(guarded.url + "/init_weights_update_group", json=body, headers=auth(ADMIN), timeout=30)
        assert r.status_code == 400 and message in r.json()["message"], r.text[:300]
        assert time.time() - started < 10
    assert requests.get(guarded.url + "/health_generate", timeout=60).status_code == 200
    assert generate(guarded.url, TENANT).json()["meta_info"]["finish_reason"]["type"] == "content_filter"


class _Payload:
    """Unpickling it writes the marker file: a pickle beside the safetensors must never be loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('unpickled')",))


def test_a_malicious_probe_folder_runs_no_code_at_launch(tiny_checkpoints, tiny_probe, tmp_path):
    """auto_map + .py files + pickles beside the safetensors: the launch's checks load the probe (and stop at
    nothing), and nothing of the folder but config.json and model.safetensors is read."""
    import pickle
    import sys

    folder = tmp_path / "malicious"
    shutil.copytree(tiny_probe, folder)
    marker = tmp_path / "EXECUTED"
    for name in ("modeling_sing_probe.py", "configuration_sing_probe.py", "__init__.py"):
        (folder / name).write_text(f"open({str(marker)!r}, 'w').write(__name__)\n")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_sing_probe.SingProbeConfig",
                       "AutoModel": "modeling_sing_probe.SingProbeAttnModel"}
    (folder / "config.json").write_text(json.dumps(cfg))
    for name in ("pytorch_model.bin", "model.pt", "training_args.bin"):
        (folder / name).write_bytes(pickle.dumps(_Payload(marker)))

    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import prepare_server_args

    from sglang_ext import plugin
    from sglang_ext.probe_runtime import ProbeRuntime

    plugin.load()
    HookRegistry.apply_hooks()
    saved = {k: os.environ.get(k) for k in ("SGLANG_EXT_PROBE_CKPT", "SGLANG_EXT_PROBE_STOP")}
    try:
        args = prepare_server_args(["--model-path", str(tiny_checkpoints["fp32"]), "--device", "cpu",
                                    "--probe-ckpt", str(folder)])
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert args._probe_ckpt == str(folder)
    import torch
    from transformers import AutoConfig

    ProbeRuntime(str(folder), AutoConfig.from_pretrained(tiny_checkpoints["fp32"]), torch.float32)  # the scheduler's load
    assert not marker.exists()
    assert "modeling_sing_probe" not in sys.modules and "configuration_sing_probe" not in sys.modules
