#!/usr/bin/env bash
# Install the peers' wheels (scripts/fetch_gpu_wheels.py wrote them to wheels/gpu) on a machine
# without network, into their own folder, so the interpreter's packages, its CUDA torch first,
# stay as they are; then import them through PYTHONPATH.
#
#   bash scripts/install_gpu_wheels.sh DIR && export PYTHONPATH="DIR:$PYTHONPATH"
#
# PYTHON picks the interpreter (default python3), WHEELS the folder (default wheels/gpu).
set -euo pipefail
TARGET=${1:?usage: bash scripts/install_gpu_wheels.sh DIR}
WHEELS=${WHEELS:-wheels/gpu}
PY=${PYTHON:-python3}
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if ((${#wheels[@]} == 0)); then
    echo "install_gpu_wheels: no wheels in $WHEELS; run 'python scripts/fetch_gpu_wheels.py' on a" \
        "machine with pip and a package index, and carry $WHEELS (ignored by git) with the tree" >&2
    exit 1
fi
"$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$TARGET" "${wheels[@]}"
echo "install_gpu_wheels: ${#wheels[@]} wheels from $WHEELS in $TARGET"
