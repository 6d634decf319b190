"""benchmarks/served/trained_conditioning.py: device calls' rows merged into the committed results."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "served"))
import trained_conditioning as tc  # noqa: E402


def _call(folder: Path, card: str, rows=(), parity=()):
    folder.mkdir()
    (folder / "env.json").write_text(json.dumps({"device": card}))
    for r in rows:
        (folder / f"cond_{r['recipe']}.json").write_text(json.dumps({"rows": [r]}))
    if parity:
        (folder / "parity.json").write_text(json.dumps({"parity": list(parity), "stub_calls": []}))
    return folder


def _row(recipe, err, **task):
    return {"recipe": recipe, "init": "calm", "task": dict(tc.BASE_TASK, **task), "loss": 0.01, "chain_ok": 48,
            "min_margin": 5.0, "bf16_tokens": 48, "bf16_probe_ref_err": 0.01, "fp8_tokens": 48,
            "fp8_probe_ref_err": err, "tap_rel_err": [0.01, 0.02, 0.03]}


def test_collect_merges_calls_and_a_recipe_measured_again_replaces_its_row(tmp_path):
    results = tmp_path / "out.json"
    a = _call(tmp_path / "a", "H100", [_row("x", 0.05), _row("y", 0.02, router_margin=1.0)])
    tc.collect([a], results)
    b = _call(tmp_path / "b", "H200", [_row("x", 0.03)],
              parity=[{"checkpoint": "trained_fp8", "tokens_match": 48, "tokens_total": 48, "probe_err_truth": 0.015,
                       "cached_equals_cold": True}])
    data = tc.collect([b], results)
    assert [(r["recipe"], r["card"], r["fp8_probe_ref_err"]) for r in data["rows"]] == [("y", "H100", 0.02),
                                                                                         ("x", "H200", 0.03)]
    assert data["served"][0]["checkpoint"] == "trained_fp8" and data["served"][0]["card"] == "H200"
    md = results.with_suffix(".md").read_text()
    assert "| y | calm | 600 | 8 | 0.003 |  | 1 |" in md and "| trained_fp8 | 48 | 48 |" in md
    assert json.loads(results.read_text()) == data


def test_profile_recipe_is_make_tinys_trained_profile():
    """The recipe the results call the profile is the one make_tiny trains."""
    from sglang_ext.launch import make_tiny as mt

    init, overrides = tc.RECIPES[tc.PROFILE]
    assert dict(tc.BASE_TASK, **overrides) == mt.CHAIN_TASK
    assert mt.INIT_PROFILES["trained"] == mt.INIT_PROFILES[init]
