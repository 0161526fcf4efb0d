#!/usr/bin/env bash
# Create ./.venv and install overlord-dask into it, from scratch.
#   scripts/install.sh          the service, CLI and demo (the `service` extra)
#   scripts/install.sh --test   the same plus everything the test suite needs (and, as root with
#                               apt-get, Chromium: the page tests load /overlord in a real browser)
# (a trainer node needs only `pip install overlord-dask` beside its torch)
# torch is installed first and pinned (`torch==2.13.0`, a CPU wheel): an unpinned torch pulls gigabytes of
# CUDA packages, so nothing below may ask for torch without the pin already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="[service]"
if [ "${1:-}" = "--test" ]; then extras="[service,test]"; fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".${extras}" "torch==2.13.0"
if [ "${1:-}" = "--test" ] && ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  # the page tests load /overlord in a real browser (overlord_dask/testing/browser.py)
  apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
if [ "${1:-}" = "--test" ]; then
  # benchmarks/shuffle.py compares with MosaicML Streaming's shuffles (pure numpy); without its
  # dependencies, which would pull torchvision and another torch
  .venv/bin/python -m pip install --quiet --no-deps "mosaicml-streaming==0.13.0"
fi
# compile the planner's numba kernels once now (cached beside the code), not in the first run
.venv/bin/python -c "from overlord_dask.planner.policies.kernels import warm; warm()"
