#!/usr/bin/env bash
# Packs a CUDA build made on this (Debian 12) machine for a GPU machine that has
# NVIDIA's driver and libraries but none of our Debian packages, so that
# launch/gpu-check.sh runs the tests and the benchmark there without building
# (docs/cuda.md, "Proof on a GPU"):
#   launch/gpu-bundle.sh BUILD_DIR .gpu-bundle/moetrain-gpu.tar.xz   # for the GPU machine
#   launch/gpu-bundle.sh --dir BUILD_DIR DIR                          # unpacked (tests)
# BUILD_DIR must hold moetrain, moetrain_tests and moetrain_bench_cuda built with
# the CUDA backend. The bundle holds:
#   bin/       the three binaries, stripped
#   lib/       every shared library they load that is neither glibc's (libc, libm,
#              libdl, libpthread, librt, libresolv, the loader: the machine's own,
#              they are one package and must match each other) nor NVIDIA's
#              (libcudart, libcublas, libcublasLt: found there at run time,
#              launch/gpu-libs.sh) nor the C++ runtime. No Open MPI and no NCCL: they
#              live in the MPI plugin (docs/distributed.md), which this one-GPU
#              bundle leaves out, so the core needs glibc 2.34 (Ubuntu 22.04, EL9)
#   lib/cxx/   libstdc++ and libgcc_s, put on the path only where the machine's
#              libstdc++ is older than the bundle needs (its GLIBCXX version)
#   manifest.txt  the source and binary paths the test binary has compiled in,
#              the commit, the NVIDIA sonames to find, the newest glibc and GLIBCXX
#              symbol versions bin/ and lib/ need, and the glibc lib/cxx needs
#              (cxx_glibc_needed); needs.txt: per file
# Why shared libraries and not static linking: Debian 12 ships no libfmt.a nor
# libspdlog.a, so static linking cannot drop the shared C++ runtime, and HDF5's
# archive drags libcurl's TLS/Kerberos/LDAP chain in; docs/cuda.md has the measurements.
set -euo pipefail
dir_mode=0
if [ "${1:-}" = "--dir" ]; then dir_mode=1; shift; fi
build=${1:?usage: launch/gpu-bundle.sh [--dir] BUILD_DIR FILE.tar.xz|DIR}
dest=${2:?usage: launch/gpu-bundle.sh [--dir] BUILD_DIR FILE.tar.xz|DIR}
cd "$(dirname "$0")/.."
repo=$PWD
build=$(cd "$build" && pwd)
bins=(moetrain moetrain_tests moetrain_bench_cuda)
# MOETRAIN_BUNDLE_PARTIAL=1 (the tests, whose build has no benchmarks): without moetrain_bench_cuda.
if [ "${MOETRAIN_BUNDLE_PARTIAL:-0}" = 1 ] && [ ! -x "$build/moetrain_bench_cuda" ]; then bins=(moetrain moetrain_tests); fi
for b in "${bins[@]}"; do
  [ -x "$build/$b" ] || { echo "gpu-bundle: $build/$b is missing; build it first (CUDA on)" >&2; exit 2; }
done
readelf -d "$build/moetrain" | grep -q 'NEEDED.*libcudart' ||
  { echo "gpu-bundle: $build/moetrain was built without CUDA (it does not load libcudart)" >&2; exit 2; }
case "$build" in
  "$repo"/*) ;;
  *) echo "gpu-bundle: $build is outside the repository $repo; the tests find the binaries through it" >&2; exit 2 ;;
esac

# Library classes by soname.
glibc_re='^(ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1|libresolv\.so\.2|libutil\.so\.1|libanl\.so\.1|libnsl\.so\.1|libmvec\.so\.1|libnss_.*|libthread_db\.so\.1|libBrokenLocale\.so\.1|linux-vdso\.so\.1)$'
nvidia_re='^(libcuda\.so.*|libcudart\.so.*|libcublas\.so.*|libcublasLt\.so.*|libnccl\.so.*|libcudnn.*|libnvrtc.*|libnvJitLink.*|libnvidia-.*)$'
cxx_re='^(libstdc\+\+\.so\.6|libgcc_s\.so\.1)$'

# The newest GLIBC_ / GLIBCXX_ version an ELF file needs (its version-needs section).
needs() {  # needs FILE PREFIX
  readelf -V -W "$1" 2>/dev/null | awk '/Version needs section/ {f = 1} /Version definition section/ {f = 0} f' |
    { grep -o "Name: $2_[0-9][0-9.]*" || true; } | sed "s/Name: $2_//" | sort -uV | tail -1
}

vmax() { printf '%s\n%s\n' "$1" "$2" | sort -V | tail -1; }

if [ $dir_mode = 1 ]; then
  rm -rf "$dest"
  mkdir -p "$dest"
  stage=$(cd "$dest" && pwd)
else
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
fi
mkdir -p "$stage/bin" "$stage/lib/cxx"
for b in "${bins[@]}"; do
  cp "$build/$b" "$stage/bin/"
  strip "$stage/bin/$b"
done
nvidia=()
missing=()
while read -r soname path; do
  if [[ $soname =~ $glibc_re ]]; then continue; fi
  if [[ $soname =~ $nvidia_re ]]; then nvidia+=("$soname"); continue; fi
  if [ "$path" = "not" ] || [ "$path" = "-" ]; then missing+=("$soname"); continue; fi
  if [[ $soname =~ $cxx_re ]]; then cp -L "$path" "$stage/lib/cxx/$soname"; continue; fi
  cp -L "$path" "$stage/lib/$soname"
done < <(for b in "${bins[@]}"; do ldd "$build/$b"; done | awk '{n = $1; sub(".*/", "", n)} $2 == "=>" {print n, $3} $2 != "=>" {print n, "-"}' |
           sort -u)
[ ${#missing[@]} -eq 0 ] || { echo "gpu-bundle: the binaries need libraries that are not found here: ${missing[*]}" >&2; exit 2; }
# The NVIDIA sonames the binaries themselves name (what gpu-check.sh must find).
nvidia_needed=$(for b in "${bins[@]}"; do readelf -d "$build/$b"; done | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' |
                  grep -E "$nvidia_re" | sort -u | tr '\n' ' ')

# What each file needs of glibc and of the C++ runtime. lib/cxx is loaded only where the
# machine's libstdc++ is older than the rest needs, so its glibc need is its own line
# (Debian 12's libstdc++ needs glibc 2.36 for arc4random, its libgcc_s 2.35).
glibc_max=0 glibcxx_max=0 cxx_glibc_max=0
: >"$stage/needs.txt"
for f in "$stage"/bin/* "$stage"/lib/*.so* "$stage"/lib/cxx/*; do
  g=$(needs "$f" GLIBC); x=$(needs "$f" GLIBCXX)
  echo "${f#"$stage"/} glibc=${g:-none} glibcxx=${x:-none}" >>"$stage/needs.txt"
  if [ -n "$g" ]; then
    case $f in "$stage"/lib/cxx/*) cxx_glibc_max=$(vmax "$g" "$cxx_glibc_max") ;; *) glibc_max=$(vmax "$g" "$glibc_max") ;; esac
  fi
  # libstdc++ needs itself only; what the others need of it decides whether lib/cxx is used.
  [ -n "$x" ] && [ "$f" != "$stage/lib/cxx/libstdc++.so.6" ] && glibcxx_max=$(vmax "$x" "$glibcxx_max")
done
{
  echo "source_dir=$repo"
  echo "binary_subdir=${build#"$repo"/}"
  echo "commit=$(git rev-parse --short HEAD 2>/dev/null || echo none)$(git diff --quiet HEAD 2>/dev/null || echo +changes)"
  echo "built=$(date -u +%FT%TZ) on $(. /etc/os-release && echo "$PRETTY_NAME"), glibc $(getconf GNU_LIBC_VERSION | awk '{print $2}')"
  echo "nvidia_libs=${nvidia_needed% }"
  echo "glibc_needed=$glibc_max"
  echo "glibcxx_needed=$glibcxx_max"
  echo "cxx_glibc_needed=$cxx_glibc_max"
} >"$stage/manifest.txt"
summary="${#bins[@]} binaries, $(ls "$stage/lib" | grep -c "\.so") libraries (+ $(ls "$stage/lib/cxx" | wc -l) C++ runtime), needs glibc >= $glibc_max and GLIBCXX >= $glibcxx_max (or glibc >= $cxx_glibc_max with lib/cxx)"
if [ $dir_mode = 1 ]; then
  echo "gpu-bundle: $dest ($(du -sh "$stage" | cut -f1)): $summary"
else
  mkdir -p "$(dirname "$dest")"
  tar cf - -C "$stage" . | xz -T0 -6 >"$dest"
  echo "gpu-bundle: $dest ($(du -h "$dest" | cut -f1)): $summary"
fi
