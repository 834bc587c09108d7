#!/usr/bin/env bash
# Creates .venv with everything tidepool needs. Usage: scripts/setup.sh [extras], e.g. "test".
# torch is installed first, pinned to the CPU wheel, so that the project's torch range is met
# without pulling a multi-GB CUDA build. Each step prints one line; pip's own output is kept
# quiet (errors still show).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-default-model}"
pip_install() {
    # pip -q still prints a warning for every unusable local index; those say nothing here.
    .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 \
        | grep -v -e "^WARNING: Location" || true
}
echo "[setup] .venv (python: $(python3 --version 2>&1))"
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
echo "[setup] torch 2.13.0 (CPU build)"
pip_install "torch==2.13.0"
echo "[setup] tidepool[${extras}] and its dependencies (about a minute on a fresh machine)"
pip_install -e ".[${extras}]"
.venv/bin/python -c "import tidepool, torch; print('[setup] done: tidepool', tidepool.__version__, 'torch', torch.__version__)"
