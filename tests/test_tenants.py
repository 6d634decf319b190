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
import requests

from sglang_ext.launch.make_tiny import random_prompt
from sglang_ext.launch.server import IDS_ONLY_ARGS, SGLangServer, free_port

pytestmark = pytest.mark.server

TENANT, ADMIN = "tenant-key-5d1b9e", "admin-key-c83f20"
PROMPT = random_prompt(40, seed=3)


def auth(key):
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tiny_probe(tiny_checkpoints):
    from sglang_ext.launch.make_tiny_probe import generate

    return generate(str(tiny_checkpoints["fp32"].parent / "probe"), base_dir=str(tiny_checkpoints["fp32"]),
                    log=lambda *_: None)


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


# -- 3. operator routes need the admin key; a rendezvous that cannot form fails the request -----------


# -- 5. every endpoint serving gpt-oss says when the guard stopped it ---------------------------------


# -- a tenant key alone opens no operator route; a probe that goes NaN fails /health_generate ---------


# -- 6. non-finite probe weights stop the launch --------------------------------------------------------


# Last of the module: on a server without the fix this hangs the `guarded` server's scheduler.
