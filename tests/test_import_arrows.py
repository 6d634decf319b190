"""The package's imports point one way: kernels -> nothing of ours but kernels and nothing of SGLang; the probe
package -> only itself; the patches are the only code that imports the patches (plugin.py registers them). Read
from the source (every import statement, function-local ones too), so a cycle cannot hide in a function body."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# folder -> its import name (pyproject.toml maps the top-level folders under sglang_ext)
PACKAGES = {"kernels": "sglang_ext.kernels", "probe": "sglang_ext.probe", "patches": "sglang_ext.patches",
            "launch": "sglang_ext.launch", "sglang_ext": "sglang_ext"}


def _modules():
    """(folder, path relative to ROOT, import name) of every module of the package."""
    for folder, name in PACKAGES.items():
        for d, subfolders, files in os.walk(os.path.join(ROOT, folder)):
            subfolders[:] = [s for s in subfolders if s != "__pycache__"]
            for f in sorted(files):
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), os.path.join(ROOT, folder))
                    parts = rel[:-3].split(os.sep)
                    parts = parts[:-1] if parts[-1] == "__init__" else parts
                    yield folder, os.path.relpath(os.path.join(d, f), ROOT), ".".join([name, *parts])


def _imports(path: str, module: str, is_package: bool):
    """(absolute module name, line) of every import in the file, relative imports resolved."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module
            yield target, node.lineno


def _is(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _violations(rule) -> list:
    found = []
    for folder, path, module in _modules():
        for target, line in _imports(path, module, path.endswith("__init__.py")):
            why = rule(folder, path, target)
            if why:
                found.append(f"{path}:{line} imports {target}: {why}")
    return found


def test_every_module_is_read():
    names = [m for _, _, m in _modules()]
    assert "sglang_ext.kernels.moe.routing" in names and "sglang_ext.patches.probe_stop" in names
    assert "sglang_ext.models.gpt_oss" in names and "sglang_ext.probe.checkpoint" in names


@pytest.mark.parametrize("rule_name", ["kernels", "probe", "patches"])
def test_imports_point_one_way(rule_name):
    def kernels(folder, path, target):
        if folder != "kernels":
            return None
        if _is(target, "sglang"):
            return "a kernel module imports nothing of SGLang"
        if _is(target, "sglang_ext") and not _is(target, "sglang_ext.kernels"):
            return "a kernel module imports nothing of ours but kernels (shared references live with the kernels)"
        return None

    def probe(folder, path, target):
        if folder != "probe":
            return None
        if _is(target, "sglang") or (_is(target, "sglang_ext") and not _is(target, "sglang_ext.probe")):
            return "the probe package (config, checkpoint, model) stands alone"
        return None

    def patches(folder, path, target):
        if folder == "patches" or path == os.path.join("sglang_ext", "plugin.py"):
            return None
        if _is(target, "sglang_ext.patches"):
            return "only the patches and plugin.py import the patches (the model, layers and launch do not)"
        return None

    bad = _violations({"kernels": kernels, "probe": probe, "patches": patches}[rule_name])
    assert not bad, "\n".join(bad)


def test_a_wrong_arrow_is_seen(tmp_path):
    """The reader sees a function-local import of the patches from the model code."""
    module = "sglang_ext.models.fake"
    path = tmp_path / "fake.py"
    path.write_text("def f():\n    from sglang_ext.patches.probe_stop import FLAG\n    from ..layers import fp8\n")
    got = list(_imports(str(path), module, False))
    assert ("sglang_ext.patches.probe_stop", 2) in got and ("sglang_ext.layers", 3) in got
