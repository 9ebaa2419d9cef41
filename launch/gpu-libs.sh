# Sourced by launch/gpu-check.sh and tests/launch/: finds, on the GPU machine,
# NVIDIA's libraries that a moetrain bundle (launch/gpu-bundle.sh) leaves out,
# and checks that the machine can load the bundle at all. Functions only; bash.
#
#   nvidia_find SONAME [WITH]  the directory holding SONAME (and WITH beside it:
#                              cuBLAS and cuBLASLt must come from one install);
#                              empty when none
#   nvidia_roots               where it looks, in order (one per line)
#   version_ge A B             A >= B for dotted versions
#   glibc_version              this machine's glibc (2.39)
#   glibcxx_version            the newest GLIBCXX_3.4.N of the libstdc++ the loader finds
#
# Where it looks: MOETRAIN_NVIDIA_ROOTS (colon-separated) alone when set (the
# tests use it); else the loader's cache, $CUDA_HOME and /usr/local/cuda*
# (newest first), the driver's /usr/local/nvidia, the nvidia/ folders of every
# Python's site-packages (pip wheels: nvidia/cu13/lib, nvidia/nccl/lib, ...),
# the system library folders and /opt. Each root is searched to depth 6.

nvidia_roots() {
  if [ -n "${MOETRAIN_NVIDIA_ROOTS:-}" ]; then
    tr ':' '\n' <<<"$MOETRAIN_NVIDIA_ROOTS"
    return
  fi
  # The loader's cache first: what the machine's owner installed as the default.
  ldconfig -p 2>/dev/null | awk -F' => ' '/libcudart|libcublas|libnccl|libcuda\.so/ {print $2}' | xargs -r -n1 dirname | awk '!seen[$0]++'
  [ -n "${CUDA_HOME:-}" ] && echo "$CUDA_HOME"
  echo /usr/local/cuda
  ls -d /usr/local/cuda-* 2>/dev/null | sort -rV
  echo /usr/local/nvidia
  # pip wheels (nvidia-cublas, nvidia-cuda-runtime, nvidia-nccl-cu13): every python3 on the PATH and in /opt.
  local py
  for py in python3 /opt/*/.venv/bin/python3 /opt/*/bin/python3; do
    command -v "$py" >/dev/null 2>&1 || continue
    timeout 10 "$py" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' \
      2>/dev/null | while read -r d; do [ -d "$d/nvidia" ] && echo "$d/nvidia"; done
  done
  echo /usr/lib/x86_64-linux-gnu
  echo /usr/lib64
  echo /usr/local/lib
  echo /opt
}

# nvidia_find SONAME [WITH]: the first directory under the roots (in root order,
# shallowest first within a root) that holds SONAME, and WITH too when given.
nvidia_find() {
  local soname=$1 with=${2:-} root f d
  while read -r root; do
    [ -d "$root" ] || continue
    while read -r f; do
      d=$(dirname "$f")
      if [ -z "$with" ] || [ -e "$d/$with" ]; then
        echo "$d"
        return 0
      fi
    done < <(timeout 20 find -L "$root" -maxdepth 6 -name "$soname" \( -type f -o -type l \) -printf '%d %p\n' \
               2>/dev/null | sort -n | cut -d' ' -f2-)
  done < <(nvidia_roots | awk 'NF && !seen[$0]++')
  return 1
}

version_ge() { [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -1)" = "$2" ]; }

glibc_version() {
  getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}' ||
    ldd --version 2>/dev/null | head -1 | grep -o '[0-9]\+\.[0-9]\+$'
}

glibcxx_version() {
  local lib
  lib=$(ldconfig -p 2>/dev/null | awk -F' => ' '/libstdc\+\+\.so\.6 .*x86-64/ {print $2; exit}')
  [ -n "$lib" ] || lib=$(ls /usr/lib/x86_64-linux-gnu/libstdc++.so.6 /usr/lib64/libstdc++.so.6 2>/dev/null | head -1)
  [ -n "$lib" ] || return 1
  grep -ao 'GLIBCXX_3\.4\.[0-9]*' "$lib" | sort -uV | tail -1 | sed 's/GLIBCXX_//'
}
