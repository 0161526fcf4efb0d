#!/usr/bin/env bash
# Create ./.venv-peers: overlord-dask and the loaders benchmarks/peers.py compares it with, kept
# out of the project's own environment (their pins differ from ours: Streaming asks for an older
# numpy and transformers, Ray and Energon bring their own stacks).
#   benchmarks/install_peers.sh && .venv-peers/bin/python benchmarks/peers.py
# torch stays the pinned CPU wheel. MosaicML Streaming and litdata are installed without their
# declared dependencies, then with the ones their text paths import: both declare torchvision,
# whose PyPI wheel is built for a CUDA torch and does not load beside the CPU torch
# (benchmarks/peer_pipelines.py stubs streaming.vision, the one module that imports it).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-peers/bin/python ]; then
  python3 -m venv .venv-peers
fi
pip=".venv-peers/bin/python -m pip install --quiet"
$pip --upgrade pip
$pip "torch==2.13.0"
$pip -e ".[service]" "torch==2.13.0" "torchdata==0.11.0" "ray[data]==2.60.0" "megatron-energon==7.4.1"
$pip --no-deps "mosaicml-streaming==0.13.0" "litdata==0.2.76"
$pip "torch==2.13.0" brotli python-snappy zstd "xxhash<4" catalogue boto3 transformers \
  lightning-utilities filelock requests tifffile obstore
