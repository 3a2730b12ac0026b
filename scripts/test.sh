#!/usr/bin/env bash
# Install gyre with its test extras into .venv and run ruff + pytest (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/ruff check src tests bench
.venv/bin/python -m pytest -q --durations=25
