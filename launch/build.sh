#!/usr/bin/env bash
# Configures and builds moetrain (Release) into build/ (or $BUILD_DIR).
# Extra arguments go to cmake, e.g.  launch/build.sh -DMOETRAIN_CUDA=OFF
# The CLI is then build/moetrain, the tests build/moetrain_tests.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
mkdir -p "$build_dir"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" "$@" >"$build_dir/configure.log" 2>&1 \
  || { cat "$build_dir/configure.log" >&2; echo "build: cmake configure failed (log above)" >&2; exit 1; }
cmake --build "$build_dir" -j "$jobs"
