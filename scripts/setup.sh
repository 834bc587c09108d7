#!/usr/bin/env bash
# Creates .venv with everything tidepool needs. Usage: scripts/setup.sh [extras], e.g. "test".
# torch is installed first, pinned to the CPU wheel, so that the project's torch range is met
# without pulling a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-default-model}"
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[${extras}]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import tidepool, torch; print('tidepool', tidepool.__version__, 'torch', torch.__version__)"
