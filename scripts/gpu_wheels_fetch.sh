#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels a GPU device run carries, into the
# git-ignored .whl/ folder, for the device's Python 3.12 on x86-64. See docs/gpu.md.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
mkdir -p "$root/.whl"
grep -v '^#' "$root/scripts/gpu_wheels.txt" | xargs "$python" -m pip download -q \
  --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$root/.whl"
ls -l "$root/.whl"
