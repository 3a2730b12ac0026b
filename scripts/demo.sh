#!/usr/bin/env bash
# Install gyre into .venv and run the embedded default: `gyre train` (SFT then GRPO on mazes).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e . 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/gyre train "$@"
