#!/usr/bin/env bash
# Packs a CUDA build made on this (Debian) machine for a GPU machine that has the
# CUDA toolkit and driver but not our Debian packages, so that
# `MOETRAIN_BUNDLE=FILE launch/gpu-check.sh OUT_DIR` there runs the tests and the
# benchmark without building (docs/cuda.md, "Proof on a GPU"):
#   launch/gpu-bundle.sh BUILD_DIR FILE.tar.xz
# BUILD_DIR must hold moetrain, moetrain_tests and moetrain_bench_cuda built with
# the CUDA backend. The bundle holds them stripped, the shared libraries they load
# from Debian (OpenBLAS, OpenMPI, HDF5, yaml-cpp, spdlog, ...; not CUDA's, which
# the GPU machine has, nor the C/C++ runtime), and manifest.txt with the paths the
# test binary has compiled in (the source and binary directories).
set -euo pipefail
build=${1:?usage: launch/gpu-bundle.sh BUILD_DIR FILE.tar.xz}
file=${2:?usage: launch/gpu-bundle.sh BUILD_DIR FILE.tar.xz}
cd "$(dirname "$0")/.."
repo=$PWD
build=$(cd "$build" && pwd)
bins=(moetrain moetrain_tests moetrain_bench_cuda)
for b in "${bins[@]}"; do
  [ -x "$build/$b" ] || { echo "gpu-bundle: $build/$b is missing; build it first (CUDA on)" >&2; exit 2; }
done
"$build/moetrain" info | grep -q "^cuda *built in" ||
  { echo "gpu-bundle: $build/moetrain was built without CUDA (moetrain info)" >&2; exit 2; }
case "$build" in
  "$repo"/*) ;;
  *) echo "gpu-bundle: $build is outside the repository $repo; the tests find the binaries through it" >&2; exit 2 ;;
esac

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
for b in "${bins[@]}"; do
  cp "$build/$b" "$stage/bin/"
  strip "$stage/bin/$b"
done
# What the binaries load, minus CUDA's libraries and the C/C++ runtime of the GPU machine.
for b in "${bins[@]}"; do ldd "$build/$b"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -v -E '/cuda|lib(c|m|dl|rt|pthread|stdc\+\+|gcc_s)\.so|ld-linux|libcudart|libcublas|libnccl' |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done
{
  echo "source_dir=$repo"
  echo "binary_subdir=${build#"$repo"/}"
  echo "built=$(date -u +%FT%TZ) commit=$(git rev-parse --short HEAD 2>/dev/null || echo none)"
} >"$stage/manifest.txt"
mkdir -p "$(dirname "$file")"
tar cJf "$file" -C "$stage" .
echo "gpu-bundle: $file ($(du -h "$file" | cut -f1)): ${#bins[@]} binaries, $(ls "$stage/lib" | wc -l) libraries"
