#!/usr/bin/env bash
# The one device run (docs/gpu.md): install the carried wheels into a temporary path with
# pip --no-index --no-deps (the image's torch stays), then scripts/gpu_check.py, its report
# written to $OUT after every case. Arguments go to gpu_check.py (or $GPU_CHECK).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-out}"
mkdir -p "$out"
if ls .whl/torch-* >/dev/null 2>&1; then echo "gpu_run: refusing a torch wheel in .whl/" >&2; exit 2; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# GPU_CHECK=gpu_check_mla.py runs another check script the same way (its own report).
check="${GPU_CHECK:-gpu_check.py}"
exec python3 "scripts/$check" --out "$out/${check%.py}.json" "$@"
