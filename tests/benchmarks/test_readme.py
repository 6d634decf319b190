"""The README stays a short document for users whose numbers come from the results, and the docs' links hold."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_BYTES = 25_000
# The contract: .ci/run calls the second, and a newcomer types both.
COMMANDS = (
    "bash launch/demo.sh     # start a real SGLang server on this CPU and stream tokens from it",
    "bash launch/test.sh     # the test suite (pytest; GPU tests skip without CUDA)",
)
# Links allowed to point at nothing yet: the playground's browser test writes its screenshot there.
EXPECTED_LATER = {ROOT / "docs" / "playground.png"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_short():
    size = README.stat().st_size
    assert size < MAX_README_BYTES, f"README.md is {size} bytes; keep it under {MAX_README_BYTES} (details go to docs/)"


def test_readme_keeps_the_two_commands():
    text = README.read_text()
    for command in COMMANDS:
        assert command in text, f"README.md lost the command line: {command}"


def test_results_table_is_generated_and_current():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "readme_table.py"), "--check"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr or out.stdout


def test_relative_links_point_to_files():
    missing = []
    for doc in _documents():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # URLs and in-page anchors
            path = (doc.parent / unquote(target.split("#", 1)[0])).resolve()
            if not path.exists() and path not in EXPECTED_LATER:
                missing.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)
