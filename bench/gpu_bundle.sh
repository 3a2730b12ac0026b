#!/usr/bin/env bash
# Build .gpu_bundle/: the wheels gyre needs that the GPU machine's image lacks, for an offline
# install there (no registry is reachable from it). The image has torch, transformers, peft,
# numpy, pyyaml, rich, pytest, sympy, typing-extensions (/work/.library/device/KINDS.md) but no
# pydantic (gyre's config) and no math-verify (tests/unit/test_reward_builtins.py, which holds
# the @pytest.mark.gpu test, skips itself without it). gyre's own pin torch==2.13.0 is never
# installed there: gyre runs from src/ on PYTHONPATH over the image's torch.
#
#   bash bench/gpu_bundle.sh            # downloads into .gpu_bundle/, prints size and command
#
# Pins are the versions of this checkout's venv (what the tests ran with); pydantic-core is
# compiled, so it is fetched for CPython 3.10 .. 3.14 on manylinux x86_64 (the image's python3
# was 3.12.3 when last read); the rest are pure-Python wheels. typing-extensions comes along
# because pydantic 2.14 asks for >= 4.16, newer than the image may have.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-/work/main/.venv/bin/python}
DEST=.gpu_bundle
PURE=(
  "pydantic==2.14.4"
  "annotated-types==0.8.0"
  "typing-inspection==0.4.5"
  "typing-extensions==4.16.0"
  "math-verify==0.9.0"
  "latex2sympy2_extended==1.11.0"
  "antlr4-python3-runtime==4.13.2"
)
COMPILED="pydantic-core==2.50.5"
PLATFORMS=(manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64)

rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST" "${PURE[@]}"
plat_args=()
for p in "${PLATFORMS[@]}"; do plat_args+=(--platform "$p"); done
for v in 3.10 3.11 3.12 3.13 3.14; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
    --python-version "$v" "${plat_args[@]}" -d "$DEST" "$COMPILED"
done
printf '%s\n' "${PURE[@]}" "$COMPILED" >"$DEST/requirements.txt"

ls -l "$DEST"
bytes=$(du -sb "$DEST" | cut -f1)
echo "bundle: $DEST, $(ls "$DEST"/*.whl | wc -l) wheels, $bytes bytes ($((bytes / 1024)) KiB)"
if [ "$bytes" -ge $((64 * 1024 * 1024)) ]; then
  echo "bundle is over the 64 MiB the device run carries" >&2
  exit 1
fi
cat <<'EOF'
device run (carry [".gpu_bundle"], timeout_s 600):
python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site --find-links .gpu_bundle -r .gpu_bundle/requirements.txt && export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 && python3 bench/gpu_check.py --out $OUT/gpu --budget-s 420 2>&1 | tee $OUT/gpu_log.txt
EOF
