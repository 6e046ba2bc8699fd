#!/usr/bin/env bash
# Ray and NIXL for an offline GPU machine whose python already has CUDA torch and transformers.
#
#   bash bench/gpu_bundle.sh [DEST]     # default DEST: .devsite/site.tar.xz (ignored by git here)
#
# Downloads (here, where PyPI is reachable) the wheels bench/gpu_check.sh needs beyond such an
# image, for CPython 3.12 on x86-64 Linux, installs them into a folder with --target, drops what
# the checks never import (Ray's Java jars, dashboard build, rllib/data/train/tune/llm; NIXL's
# expert-parallel libraries), and packs the rest as one tar.xz (~42 MB; a device call carries
# 64 MiB). On the GPU machine (how the 2026-12-04 H200 check ran, docs/gpu.md):
#
#   mkdir -p /tmp/site && tar -xJf .devsite/site.tar.xz -C /tmp/site
#   PYTHONPATH=/tmp/site PY=python3 bash bench/gpu_check.sh
#
# PYTHON_VERSION (3.12), NIXL (nixl-cu13==1.5.1: CUDA 13 images) and RAY (ray==2.60.0) override.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/.devsite/site.tar.xz}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
NIXL="${NIXL:-nixl-cu13==1.5.1}"
RAY="${RAY:-ray==2.60.0}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

platforms=()
for tag in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
# The meta package `nixl` (import name) picks nixl_cuXX by the CUDA torch was built with;
# jsonschema and its needs are Ray core's, missing from that image.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  "${platforms[@]}" -d "$WORK/wheels" "$RAY" "$NIXL" "nixl==${NIXL##*==}" \
  jsonschema jsonschema-specifications referencing rpds-py
python3 -m pip install -q --no-deps --target "$WORK/site" --python-version "$PYTHON_VERSION" --implementation cp \
  "${platforms[@]}" --only-binary=:all: "$WORK"/wheels/*.whl
cd "$WORK/site"
rm -rf nixl_ep nixl_ep_cu* ray/jars ray/rllib ray/data ray/train ray/tune ray/llm ray/dashboard/client/build \
  include pkgconfig ray/tests ray/serve/tests
find . -name __pycache__ -prune -exec rm -rf {} +
mkdir -p "$(dirname "$DEST")"
tar -cf - . | xz -9 -T0 > "$DEST"
echo "wrote $DEST ($(du -h "$DEST" | cut -f1)) from $(ls "$WORK/wheels" | tr '\n' ' ')"
