#!/usr/bin/env bash
# The GPU bundle (launch/gpu-bundle.sh) starts on a machine that has none of our
# Debian packages: its binaries run in a minimal root that holds only glibc and
# the C++ runtime (what any Linux image has), NVIDIA's libraries laid out as pip
# wheels (nvidia/cu13/lib, nvidia/nccl/lib: what the GPU image has) and the
# bundle, with an empty environment (env -i) and no loader cache. They must get as
# far as looking for a GPU and say there is none:
#   moetrain info --require-cuda   exit 69, "built in, 0 device(s)"
#   moetrain_tests "[cuda][router]"  exit 0, "[cuda] tests skipped: no CUDA device is visible"
#   moetrain_bench_cuda            exit 69, "no CUDA device"
# and the controls must fail as the loader fails (exit 127, "error while loading
# shared libraries"): without the bundle's lib/, and without NVIDIA's libraries.
# The NVIDIA libraries' directories are found by launch/gpu-libs.sh's search,
# past a decoy cuBLAS without its cuBLASLt (one install must provide both).
#   tests/launch/gpu_bundle_test.sh BUILD_DIR      (ctest: gpu_bundle_clean_env)
# Needs chroot (root or a user namespace); where neither is allowed it falls back
# to an audit of what the loader opened (LD_DEBUG=libs), a weaker proof, and says so.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:?usage: gpu_bundle_test.sh BUILD_DIR}" && pwd)
. "$repo/launch/gpu-libs.sh"
t0=$(date +%s.%N)
tmp=$(mktemp -d)
trap '[ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

root=$tmp/root
MOETRAIN_BUNDLE_PARTIAL=1 "$repo/launch/gpu-bundle.sh" --dir "$build" "$root/bundle"
cat "$root/bundle/manifest.txt"
nvidia_libs=$(sed -n 's/^nvidia_libs=//p' "$root/bundle/manifest.txt")
[ -n "$nvidia_libs" ] || fail "the manifest names no NVIDIA libraries"
# One GPU, no MPI: Open MPI and NCCL live in the MPI plugin (docs/distributed.md), which the
# bundle leaves out, so nothing in it needs more than glibc 2.34 (Ubuntu 22.04, EL9).
glibc_needed=$(sed -n 's/^glibc_needed=//p' "$root/bundle/manifest.txt")
[ "$(printf '%s\n2.34\n' "$glibc_needed" | sort -V | tail -1)" = 2.34 ] ||
  fail "the bundle needs glibc $glibc_needed, above the 2.34 floor: $(grep " glibc=$glibc_needed " "$root/bundle/needs.txt" | head -5)"
mpi_libs=$(ls "$root/bundle/lib" "$root/bundle/bin" | grep -E '^(libmpi|libopen-|libevent|libhwloc|libnccl|libmoetrain_mpi)' || true)
[ -z "$mpi_libs" ] || fail "the one-GPU bundle carries MPI or NCCL: $mpi_libs"
case " $nvidia_libs " in *" libnccl"*) fail "the binaries load NCCL themselves: $nvidia_libs" ;; esac

# Link, or copy across file systems.
put() { mkdir -p "$(dirname "$2")"; ln -f "$1" "$2" 2>/dev/null || cp "$1" "$2"; }
# glibc and the C++ runtime of this machine, standing in for the GPU image's own.
for so in libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 libresolv.so.2 libstdc++.so.6 libgcc_s.so.1; do
  put "$(readlink -f "/lib/x86_64-linux-gnu/$so")" "$root/lib/x86_64-linux-gnu/$so"
done
put "$(readlink -f /lib64/ld-linux-x86-64.so.2)" "$root/lib64/ld-linux-x86-64.so.2"
mkdir -p "$root/tmp" "$root/dev" "$root/proc"
# NVIDIA's libraries as the wheels lay them out, from wherever this machine's loader finds them.
site=$root/opt/venv/lib/python3.12/site-packages/nvidia
for b in "$build"/moetrain "$build"/moetrain_tests; do ldd "$b"; done | awk '$2 == "=>" {print $1, $3}' | sort -u |
  while read -r so path; do
    case $so in
      libcudart.so.*|libcublas.so.*|libcublasLt.so.*) put "$(readlink -f "$path")" "$site/cu13/lib/$so" ;;
      libnccl.so.*) put "$(readlink -f "$path")" "$site/nccl/lib/$so" ;;
    esac
  done
# A decoy install, searched first: cuBLAS without its cuBLASLt.
put "$site/cu13/lib/libcudart.so.13" "$root/usr/local/cuda-decoy/lib64/libcudart.so.13"
put "$site/cu13/lib/libcublas.so.13" "$root/usr/local/cuda-decoy/lib64/libcublas.so.13"

# The search, as gpu-check.sh runs it.
libpath=/bundle/lib
for so in $nvidia_libs; do
  with=
  [[ $so == libcublas.so.* ]] && with=libcublasLt.so.${so#libcublas.so.}
  d=$(MOETRAIN_NVIDIA_ROOTS=$root/usr/local/cuda-decoy:$site nvidia_find "$so" "$with") ||
    fail "gpu-libs.sh did not find $so"
  echo "found $so${with:+ with $with}: ${d#"$root"}"
  [[ $so == libcublas.so.* && $d == */cuda-decoy/* ]] && fail "cuBLAS taken from the install without cuBLASLt"
  case ":$libpath:" in *":${d#"$root"}:"*) ;; *) libpath=$libpath:${d#"$root"} ;; esac
done
nvidia_path=${libpath#/bundle/lib:}

# run EXPECTED_RC PATTERN LD_LIBRARY_PATH CMD...: CMD in the root with an empty environment.
chroot=$(command -v chroot || echo /usr/sbin/chroot) unshare=$(command -v unshare || echo /usr/bin/unshare)
if [ -n "${MOETRAIN_ISOLATION:-}" ]; then mode=$MOETRAIN_ISOLATION  # chroot, unshare or audit: to test each
elif chroot "$root" /lib64/ld-linux-x86-64.so.2 --help >/dev/null 2>&1; then mode=chroot
elif unshare -r chroot "$root" /lib64/ld-linux-x86-64.so.2 --help >/dev/null 2>&1; then mode=unshare
else mode=audit; fi
echo "isolation: $mode"
run() {
  local want=$1 pattern=$2 path=$3 rc=0
  shift 3
  case $mode in
    chroot) env -i LD_LIBRARY_PATH="$path" "$chroot" "$root" "$@" >"$tmp/out" 2>&1 || rc=$? ;;
    unshare) env -i LD_LIBRARY_PATH="$path" "$unshare" -r "$chroot" "$root" "$@" >"$tmp/out" 2>&1 || rc=$? ;;
    audit)  # the same paths outside a root: every library opened must come from the allowed places
      local p
      p=$(tr ':' '\n' <<<"$path" | sed "s#^#$root#" | paste -sd:)
      env -i LD_LIBRARY_PATH="$p" LD_DEBUG=libs LD_DEBUG_OUTPUT="$tmp/ld" "$root$1" "${@:2}" >"$tmp/out" 2>&1 || rc=$?
      if [ "$rc" != 127 ]; then
        cat "$tmp"/ld.* | sed -n 's/.*calling init: //p' | sort -u | while read -r lib; do
          case $lib in
            "$root"/*|/lib/x86_64-linux-gnu/lib[cm].so.6|/lib/x86_64-linux-gnu/lib*pthread*|/lib/x86_64-linux-gnu/libdl.so.2|\
            /lib/x86_64-linux-gnu/librt.so.1|/lib/x86_64-linux-gnu/libresolv.so.2|/lib/x86_64-linux-gnu/libstdc++.so.6|\
            /lib/x86_64-linux-gnu/libgcc_s.so.1|/lib64/ld-linux-x86-64.so.2) ;;
            *) echo "loaded from outside the bundle: $lib" >>"$tmp/out"; echo 1 >"$tmp/leak" ;;
          esac
        done
        [ -e "$tmp/leak" ] && rc=99
        rm -f "$tmp"/ld.* "$tmp/leak"
      fi ;;
  esac
  echo "-- $* (LD_LIBRARY_PATH=$path): exit $rc"
  sed 's/^/   /' "$tmp/out" | head -8
  [ "$rc" = "$want" ] || fail "$*: exit $rc, expected $want"
  grep -q -- "$pattern" "$tmp/out" || fail "$*: output lacks '$pattern'"
}

run 69 "built in, 0 device(s)" "$libpath" /bundle/bin/moetrain info --require-cuda
grep -q "no CUDA device" "$tmp/out" || fail "moetrain info --require-cuda: no 'no CUDA device' line"
run 0 "no CUDA device is visible" "$libpath" /bundle/bin/moetrain_tests "[cuda][router]"
if [ -x "$root/bundle/bin/moetrain_bench_cuda" ]; then
  run 69 "no CUDA device" "$libpath" /bundle/bin/moetrain_bench_cuda --steps 1
else
  echo "-- moetrain_bench_cuda not built (MOETRAIN_BENCH=OFF): its libraries are the other two's"
fi
# Controls: the loader's failures look different.
if [ "$mode" != audit ]; then
  run 127 "error while loading shared libraries" "$nvidia_path" /bundle/bin/moetrain info --require-cuda
  run 127 "error while loading shared libraries: lib\(cudart\|cublas\|nccl\)" /bundle/lib /bundle/bin/moetrain info
fi
echo "bundle: $(du -sh "$root/bundle" | cut -f1) unpacked; clean-environment test ($mode) passed in $(awk -v s="$t0" -v n="$(date +%s.%N)" 'BEGIN {printf "%.1f", n - s}') s"
