#!/usr/bin/env bash
# Set up .venv for sglang-ext (used by launch/demo.sh and launch/test.sh).
#
#   bash launch/setup.sh
#
# Idempotent: creates .venv with `python3 -m venv` if it is missing, then runs
# `pip install -e '.[test]'` (sglang==0.5.23, torch 2.14.1, ...; the first install
# downloads ~11 GB and takes ~8 minutes). The install is skipped when .venv holds a
# stamp with the sha256 of pyproject.toml, so reruns take a second. No prompts: safe
# under CI=true with no stdin.
#
# Then Chromium and its driver for the browser test (tests/served/test_playground.py): Debian's `chromium` and
# `chromium-driver` through apt-get, when they are missing, apt-get exists and this runs as root or with
# passwordless sudo; otherwise a line says how, and that test skips. Already there: nothing is run.
#
# Environment: PYTHON (default python3, must be >= 3.10), SGLANG_EXT_VENV (default .venv),
# SGLANG_EXT_SETUP_BROWSER=0 (skip the browser; the demo sets it).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="${SGLANG_EXT_VENV:-.venv}"
VPY="$VENV/bin/python"
STAMP="$VENV/.sglang-ext-install-stamp"

say() { printf '[setup] %s\n' "$*"; }

export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PIP_FLAGS=()
if [ -n "${CI:-}" ] || [ ! -t 1 ]; then
    PIP_FLAGS+=(--progress-bar off)
fi

# 1. The virtual environment.
if [ ! -x "$VPY" ]; then
    command -v "$PYTHON" >/dev/null || { say "error: $PYTHON not found (need Python >= 3.11)"; exit 1; }
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || { say "error: $("$PYTHON" -V 2>&1) is too old (need Python >= 3.11: sglang 0.5.23 requires it)"; exit 1; }
    say "creating $VENV with $("$PYTHON" -V 2>&1) ($(command -v "$PYTHON"))"
    if ! "$PYTHON" -m venv "$VENV" || ! "$VPY" -m pip --version >/dev/null 2>&1; then
        # Debian's python3 without python3-venv leaves a venv with no pip behind: remove it, or the next run uses it
        rm -rf "$VENV"
        say "error: '$PYTHON -m venv' made no working venv (on Debian/Ubuntu: apt-get install python3-venv)"
        exit 1
    fi
elif ! "$VPY" -m pip --version >/dev/null 2>&1; then
    say "error: $VENV has no pip (a failed venv creation?); remove it and run again: rm -rf $VENV"
    exit 1
else
    say "using $VENV ($("$VPY" -V 2>&1))"
fi

# 2. The install, keyed on pyproject.toml.
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
have="$(cat "$STAMP" 2>/dev/null || true)"

installed_ok() {
    # An install made before stamps existed: everything pyproject asks for is importable,
    # sglang is the pinned release and sglang_ext is this checkout (editable).
    "$VPY" - "$ROOT" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, os, sys
import pytest, pytest_timeout, xdist, requests, selenium, sglang, sglang_ext  # noqa: F401
from sglang_ext import PINNED_SGLANG_VERSION
assert md.version("sglang") == PINNED_SGLANG_VERSION
assert os.path.realpath(sglang_ext.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep)
EOF
}

if [ "$have" = "$want" ]; then
    say "install is up to date (stamp matches pyproject.toml sha256 ${want:0:12}); skipping pip"
elif [ -z "$have" ] && installed_ok; then
    say "found a complete install without a stamp (sglang $("$VPY" -m pip show sglang 2>/dev/null | sed -n 's/^Version: //p'), sglang_ext editable from $ROOT); writing the stamp, skipping pip"
    printf '%s\n' "$want" >"$STAMP"
else
    if [ -n "$have" ]; then
        say "pyproject.toml changed since the last install; re-running pip install"
    else
        say "installing (a first install downloads ~11 GB and takes ~8 minutes; later runs skip this)"
    fi
    say "+ $VPY -m pip install --upgrade pip"
    "$VPY" -m pip install "${PIP_FLAGS[@]}" --upgrade pip
    say "+ $VPY -m pip install -e '.[test]'"
    "$VPY" -m pip install "${PIP_FLAGS[@]}" -e '.[test]'
    "$VPY" -c 'import sglang, sglang_ext' \
        || { say "error: the install finished but 'import sglang, sglang_ext' fails"; exit 1; }
    printf '%s\n' "$want" >"$STAMP"
    say "installed; stamp written to $STAMP"
fi

# 3. The browser for tests/served/test_playground.py (system packages, not pip: selenium drives Debian's build).
# `--browser-in-background` (launch/test.sh): return at once and let the install finish beside the tests.
browser_in_background=0
[ "${1:-}" = "--browser-in-background" ] && browser_in_background=1
BROWSER_PENDING=.cache/browser-install.pending  # tests/served/test_playground.py reads this path
browser_hint="apt-get install chromium chromium-driver"
if [ "${SGLANG_EXT_SETUP_BROWSER:-1}" = "0" ]; then
    :
elif command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    say "chromium and chromedriver found (browser test)"
elif ! command -v apt-get >/dev/null 2>&1; then
    say "no apt-get here: install Chromium and chromedriver for tests/served/test_playground.py (it skips without them)"
else
    sudo_cmd=()
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo_cmd=(sudo -n)
        else
            say "not root and no passwordless sudo: the browser test will skip; to run it: sudo $browser_hint"
            sudo_cmd=(skip)
        fi
    fi
    if [ "${sudo_cmd[0]:-}" != "skip" ]; then
        say "installing chromium and chromium-driver for the browser test (+ ${sudo_cmd[*]:+${sudo_cmd[*]} }$browser_hint)"
        export DEBIAN_FRONTEND=noninteractive
        install_browser() {
            # a fresh machine's package lists may be empty or stale: update once if the first try fails
            if "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null \
                || { "${sudo_cmd[@]}" apt-get update -q >/dev/null \
                     && "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null; }; then
                say "installed $(chromium --version 2>/dev/null | head -n1)"
            else
                say "warning: could not install chromium + chromium-driver; the browser test will skip"
            fi
        }
        if [ "$browser_in_background" = 1 ]; then
            # launch/test.sh: the install (a minute or two of download and unpacking) runs beside the first test
            # files; tests/served/test_playground.py waits while this marker names a live process
            mkdir -p .cache
            ( install_browser; rm -f "$BROWSER_PENDING" ) >.cache/browser-install.log 2>&1 &
            echo $! >"$BROWSER_PENDING"
            say "chromium installing in the background (log: .cache/browser-install.log)"
        else
            install_browser
        fi
    fi
fi
