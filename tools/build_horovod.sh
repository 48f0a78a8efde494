#!/usr/bin/env bash
# Build (once) and install Horovod 0.28.1 with PyTorch + Gloo ops against the venv's torch.
#
# PyPI's horovod 0.28.1 sdist asks for C++14, which torch >= 2.1 refuses
# ("C++17 or later compatible compiler is required"). Upstream fixed it after the
# release, so we patch the two CMakeLists.txt lines to C++17 (the torch extension's to
# C++20 where torch's headers ask for it, torch >= 2.15) and build a wheel.
# The wheel is cached outside the repository, keyed by horovod/torch/python versions,
# so a second `make setup` installs it in seconds.
#
# Usage: tools/build_horovod.sh PYTHON   (PYTHON = the venv's python)
set -euo pipefail
PY="${1:?usage: build_horovod.sh PYTHON}"
HVD_VERSION="${HOROVOD_VERSION:-0.28.1}"
TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
PY_TAG="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
CACHE_ROOT="${UNIFIED_DIST_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/unified_dist/wheels}"
CACHE="$CACHE_ROOT/horovod-$HVD_VERSION-torch$TORCH_VERSION-$PY_TAG"

if "$PY" -c 'import horovod.torch' 2>/dev/null; then
  echo "horovod already installed in this venv"; exit 0
fi
if ! ls "$CACHE"/horovod-*.whl >/dev/null 2>&1; then
  echo "building horovod $HVD_VERSION against torch $TORCH_VERSION ($PY_TAG); about 6 minutes on 2 cores"
  WORK="$(mktemp -d)"
  trap 'rm -rf "$WORK"' EXIT
  "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$WORK" "horovod==$HVD_VERSION"
  tar -xzf "$WORK"/horovod-"$HVD_VERSION".tar.gz -C "$WORK"
  SRC="$WORK/horovod-$HVD_VERSION"
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
      "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
  # torch's own headers say which standard they need: C++17 up to torch 2.14, C++20 from 2.15
  # (ATen.h: "#error C++20 or later compatible compiler is required to use ATen."). Only Horovod's torch
  # extension includes them; the rest of Horovod stays at C++17.
  TORCH_CXX="$("$PY" -c 'import os, re, torch; text = open(os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "ATen.h")).read(); found = re.search(r"C\+\+(\d+) or later compatible compiler", text); print(found.group(1) if found else 17)')"
  sed -i "s/set(CMAKE_CXX_STANDARD 17)/set(CMAKE_CXX_STANDARD $TORCH_CXX)/" "$SRC/horovod/torch/CMakeLists.txt"
  grep -q "CMAKE_CXX_STANDARD $TORCH_CXX" "$SRC/horovod/torch/CMakeLists.txt"
  mkdir -p "$WORK/dist"
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
  HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=gloo \
  MAKEFLAGS="${MAKEFLAGS:--j2}" \
    "$PY" -m pip wheel --no-deps --no-build-isolation -w "$WORK/dist" "$SRC"
  mkdir -p "$CACHE"
  cp "$WORK"/dist/horovod-*.whl "$CACHE/"
fi
"$PY" -m pip install --quiet --no-deps "$CACHE"/horovod-*.whl
"$PY" -c 'import horovod.torch as hvd; import horovod; print("horovod", horovod.__version__, "installed with torch ops")'
