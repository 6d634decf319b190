"""The SGLang plugin entry point (group `sglang.srt.plugins`).

SGLang calls `load()` in every process it starts: the launcher (before argument
parsing), each scheduler/TP worker, the detokenizer and the DP controller. Each
process is spawned, so nothing registered in the parent survives; `load()` runs
again there and must be idempotent.
"""

from __future__ import annotations

import importlib.metadata
import logging

from sglang_ext import PINNED_SGLANG_VERSION, __version__
from sglang_ext.patches import register_all

logger = logging.getLogger(__name__)

_loaded = False


class SGLangVersionMismatch(SystemExit):
    """Stops the process: SGLang's plugin loader catches Exception, not SystemExit."""


def installed_sglang_version() -> str:
    return importlib.metadata.version("sglang")


def check_sglang_version(installed: str | None = None) -> None:
    installed = installed if installed is not None else installed_sglang_version()
    if installed != PINNED_SGLANG_VERSION:
        raise SGLangVersionMismatch(
            f"sglang-ext {__version__} needs sglang=={PINNED_SGLANG_VERSION}, "
            f"but sglang=={installed} is installed: "
            f"pip install 'sglang=={PINNED_SGLANG_VERSION}'"
        )


def load() -> None:
    global _loaded
    if _loaded:
        return
    check_sglang_version()
    register_all()
    _loaded = True
    logger.info("sglang-ext %s loaded", __version__)
