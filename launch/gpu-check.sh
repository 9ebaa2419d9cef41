#!/usr/bin/env bash
# The GPU proof, on a machine with an NVIDIA GPU (see docs/cuda.md):
#   launch/gpu-check.sh OUT_DIR
# builds moetrain with the CUDA backend (Release, sm_90 + PTX unless
# MOETRAIN_CUDA_ARCHITECTURES says otherwise) into build-gpu/, shows the sm_90
# code of the kernels, runs every [cuda] test (each CUDA op against its CPU twin,
# gradients included; a tiny GPT-2 trained on the GPU against the CPU's losses),
# the [cuda][mpi] tests under mpirun when more than one GPU is visible, then the
# benchmark table (bench/cuda_bench.cpp). Logs and the table go to OUT_DIR:
#   nvidia-smi.txt build.log info.txt sass.txt tests.log tests-mpi.log bench.md
# Extra cmake arguments: CMAKE_ARGS="-DCMAKE_PREFIX_PATH=/deps/usr ..." (a machine
# without our Debian packages installed points the build at an unpacked copy).
# Or no build: MOETRAIN_BUNDLE=FILE.tar.xz (made by launch/gpu-bundle.sh on a
# Debian machine) unpacks prebuilt binaries and their Debian libraries instead.
# Exits non-zero when the build or a test fails; the benchmark runs either way.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: launch/gpu-check.sh OUT_DIR}
mkdir -p "$out"
status=0
step() { echo "== $* ($(date +%T))"; }

step "GPU"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || { echo "gpu-check: nvidia-smi failed: no NVIDIA GPU or driver" >&2; exit 1; }
head -15 "$out/nvidia-smi.txt"
ngpu=$(nvidia-smi -L | grep -c '^GPU ')

if [ -n "${MOETRAIN_BUNDLE:-}" ]; then
  step "prebuilt binaries from $MOETRAIN_BUNDLE"
  bundle=$(mktemp -d)
  tar xJf "$MOETRAIN_BUNDLE" -C "$bundle" || { echo "gpu-check: cannot unpack $MOETRAIN_BUNDLE" >&2; exit 1; }
  src=$(sed -n 's/^source_dir=//p' "$bundle/manifest.txt")
  sub=$(sed -n 's/^binary_subdir=//p' "$bundle/manifest.txt")
  cat "$bundle/manifest.txt"
  # The test binary runs the CLI and reads data through the paths it was built with.
  if [ "$src" != "$PWD" ] && [ ! -e "$src" ]; then mkdir -p "$(dirname "$src")" && ln -s "$PWD" "$src"; fi
  mkdir -p "$sub" && cp "$bundle"/bin/* "$sub/"
  bin=$PWD/$sub
  export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # CUDA's libraries from this machine's toolkit or Python wheels, where the loader does not know them.
  for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    ldconfig -p | grep -q "$lib" && continue
    found=$(find /usr/local /opt /usr/lib -name "$lib" 2>/dev/null | head -1)
    if [ -n "$found" ]; then LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(dirname "$found")"; else echo "gpu-check: $lib not found"; fi
  done
  ldd "$bin/moetrain_tests" | grep "not found" && { echo "gpu-check: libraries missing (above)" >&2; exit 1; }
else
  step "build (build-gpu/, log in $out/build.log)"
  # shellcheck disable=SC2086
  if ! { cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOETRAIN_CUDA=ON -DMOETRAIN_BENCH=ON \
           -DMOETRAIN_UNITY=ON ${CMAKE_ARGS:-} &&
         cmake --build build-gpu -j "${JOBS:-$(nproc)}" --target moetrain moetrain_tests moetrain_bench_cuda; } \
       >"$out/build.log" 2>&1; then
    tail -40 "$out/build.log"
    echo "gpu-check: build failed (log: $out/build.log)" >&2
    exit 1
  fi
  bin=$PWD/build-gpu
fi

"$bin/moetrain" info | tee "$out/info.txt"

step "sm_90 code of the kernels ($out/sass.txt)"
if command -v cuobjdump >/dev/null; then
  cuobjdump --list-elf "$bin/moetrain" >"$out/sass.txt" 2>&1
  cuobjdump -sass "$bin/moetrain" 2>/dev/null | grep -E "Function : .*(attention|kda|adamw|index_add|select_experts)" \
    | head -80 >>"$out/sass.txt"
  grep -c "sm_90" "$out/sass.txt" | xargs echo "sm_90 ELF entries:"
  # Tensor-core instructions (the bf16 attention and the TF32 KDA kernels).
  cuobjdump -sass "$bin/moetrain" 2>/dev/null | grep -c "HMMA" | xargs echo "HMMA instructions:" | tee -a "$out/sass.txt"
else
  echo "cuobjdump not found; skipped" | tee "$out/sass.txt"
fi

step "[cuda] tests ($out/tests.log)"
if ! "$bin/moetrain_tests" "[cuda]" --durations yes >"$out/tests.log" 2>&1; then status=1; fi
tail -5 "$out/tests.log"

if [ "$ngpu" -gt 1 ]; then
  step "[cuda][mpi] tests on $ngpu GPUs ($out/tests-mpi.log)"
  if ! mpirun --allow-run-as-root --oversubscribe -np "$ngpu" -x OMP_NUM_THREADS=1 \
       "$bin/moetrain_tests" "[cuda][mpi]" >"$out/tests-mpi.log" 2>&1; then status=1; fi
  tail -5 "$out/tests-mpi.log"
else
  echo "one GPU: the [cuda][mpi] tests need two or more" | tee "$out/tests-mpi.log"
fi

step "benchmark ($out/bench.md)"
"$bin/moetrain_bench_cuda" --steps "${BENCH_STEPS:-10}" --out "$out/bench.md" || status=1

step "done: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status
