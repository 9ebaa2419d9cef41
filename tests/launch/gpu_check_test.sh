#!/usr/bin/env bash
# launch/gpu-check.sh's driver logic without a GPU: a fake bundle whose binaries
# are scripts (a test run and a benchmark that print some lines and then hang), a
# fake nvidia-smi and cuobjdump, NVIDIA's libraries as empty files in a wheel-like
# tree beside a decoy. Checked: each step ends at its own timeout and the run at
# the budget; the record files hold what the steps printed before they were killed
# (tests.log lines, bench.md rows); steps.tsv says ok / failed / timeout / skipped
# per step; the library search takes cuBLAS from the install that has cuBLASLt;
# a glibc floor above the machine's stops the run before anything starts; no GPU
# (moetrain info --require-cuda exits 69) skips the tests and the benchmark.
#   tests/launch/gpu_check_test.sh           (ctest: gpu_check_driver)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; [ -n "${out:-}" ] && tail -n +1 "$out"/steps.tsv "$out"/gpu-check.log >&2; exit 1; }

# The fake bundle.
b=$tmp/bundle
mkdir -p "$b/bin" "$b/lib" "$tmp/src"
script() { printf '#!/usr/bin/env bash\n%s\n' "$2" >"$b/bin/$1"; chmod +x "$b/bin/$1"; }
script moetrain 'echo "moetrain 0.1.0"
if [ -n "${FAKE_NO_GPU:-}" ]; then echo "cuda        built in, 0 device(s)"; echo "no CUDA device" >&2; exit 69; fi
echo "cuda        built in, 1 device(s)"; echo "  cuda:0    NVIDIA H200 (fake)"'
script moetrain_tests 'echo "0.512 s: cuda case one"; echo "0.734 s: cuda case two"; sleep 60; echo "never printed"'
script moetrain_bench_cuda 'while [ $# -gt 0 ]; do [ "$1" = --out ] && o=$2; shift; done
echo "| case | ms |" >"$o"; for r in 1 2; do echo "| row $r | 1.0 |" | tee -a "$o"; sleep 0.2; done
sleep 60; echo "| row 3 | 1.0 |" >>"$o"'
cat >"$b/manifest.txt" <<EOF
source_dir=$tmp/src
binary_subdir=build
commit=fake
nvidia_libs=libcublas.so.13 libcudart.so.13 libnccl.so.2
glibc_needed=2.17
glibcxx_needed=3.4.20
EOF
: >"$b/needs.txt"
# NVIDIA's libraries: a decoy cuBLAS without cuBLASLt, then a wheel tree with both.
site=$tmp/site-packages/nvidia
mkdir -p "$tmp/cuda-decoy/lib64" "$site/cu13/lib" "$site/nccl/lib"
touch "$tmp/cuda-decoy/lib64/libcublas.so.13" "$site/cu13/lib/"{libcublas.so.13,libcublasLt.so.13,libcudart.so.13} \
      "$site/nccl/lib/libnccl.so.2"
# Fake tools.
printf '#!/bin/sh\necho "GPU 0: NVIDIA H200 (fake, UUID: GPU-0)"\n' >"$tmp/nvidia-smi"
cat >"$tmp/cuobjdump" <<'EOF'
#!/bin/sh
printf '\tFunction : _Z9kernel_av\n        /*0000*/   MOV R1, c[0x0][0x28] ;\n        /*0010*/   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n'
printf '\tFunction : _Z9kernel_bv\n        /*0000*/   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n        /*0010*/   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n        /*0020*/   EXIT ;\n'
EOF
chmod +x "$tmp/nvidia-smi" "$tmp/cuobjdump"
export MOETRAIN_NVIDIA_ROOTS=$tmp/cuda-decoy:$site NVIDIA_SMI=$tmp/nvidia-smi CUOBJDUMP=$tmp/cuobjdump

check() { grep -q -- "$2" "$1" || fail "$(basename "$1") lacks '$2'"; }
status() { awk -F'\t' -v s="$1" '$1 == s {print $2}' "$out/steps.tsv"; }

# 1. Tests and benchmark hang: each is killed at its limit, the record keeps their lines.
out=$tmp/out1
t0=$(date +%s)
rc=0
T_TESTS=3 T_BENCH=3 T_SASS=20 "$repo/launch/gpu-check.sh" --bundle "$b" "$out" >/dev/null 2>&1 || rc=$?
took=$(($(date +%s) - t0))
[ "$rc" = 1 ] || fail "run 1: exit $rc, expected 1 (timeouts are failures)"
[ "$took" -lt 25 ] || fail "run 1 took $took s; its steps' limits add up to 6 s"
for s in setup device sass; do [ "$(status $s)" = ok ] || fail "step $s: $(status $s), expected ok"; done
[ "$(status tests)" = timeout ] || fail "tests: $(status tests), expected timeout"
[ "$(status bench)" = timeout ] || fail "bench: $(status bench), expected timeout"
check "$out/tests.log" "0.734 s: cuda case two"
grep -q "never printed" "$out/tests.log" && fail "tests.log: the test run was not stopped"
check "$out/bench.md" "| row 2 | 1.0 |"
grep -q "row 3" "$out/bench.md" && fail "bench.md: the benchmark was not stopped"
check "$out/sass.txt" "kernels 2, HMMA instructions 3"
check "$out/sass.txt" "_Z9kernel_bv"
check "$out/device.txt" "NVIDIA H200 (fake"
check "$out/device.txt" "built in, 1 device(s)"
check "$out/device.txt" "libcublas.so.13 + libcublasLt.so.13: $site/cu13/lib"
check "$out/device.txt" "libnccl.so.2: $site/nccl/lib"
[ -L "$tmp/src/build/moetrain_tests" ] || fail "the bundle's binaries are not linked where the tests look for them"
[ "$(ls "$out" | wc -l)" -le 8 ] || fail "more than 8 record files: $(ls "$out")"
echo "run 1 (hanging tests and benchmark): ok in $took s"

# 2. The budget: a 14 s budget cuts the test step's 60 s limit and skips what no longer fits.
out=$tmp/out2
t0=$(date +%s)
MOETRAIN_GPU_BUDGET=14 T_TESTS=60 T_BENCH=60 "$repo/launch/gpu-check.sh" --bundle "$b" "$out" >/dev/null 2>&1 || true
took=$(($(date +%s) - t0))
[ "$took" -le 16 ] || fail "run 2 took $took s with a budget of 14 s"
[ "$(status tests)" = timeout ] || fail "budget: tests $(status tests), expected timeout"
[ "$(status bench)" = skipped ] || fail "budget: bench $(status bench), expected skipped"
check "$out/steps.tsv" "budget spent"
echo "run 2 (budget 14 s): ok in $took s"

# 3. No GPU: the device query fails (69), the tests and the benchmark do not start.
out=$tmp/out3
rc=0
FAKE_NO_GPU=1 "$repo/launch/gpu-check.sh" --bundle "$b" "$out" >/dev/null 2>&1 || rc=$?
[ "$rc" = 1 ] || fail "no GPU: exit $rc, expected 1"
[ "$(status device)" = failed ] || fail "no GPU: device $(status device), expected failed"
[ "$(status tests)" = failed ] || fail "no GPU: tests $(status tests), expected failed (no device)"
[ "$(status bench)" = skipped ] || fail "no GPU: bench $(status bench), expected skipped"
[ ! -e "$out/tests.log" ] || fail "no GPU: the tests ran"
echo "run 3 (no GPU): ok"

# 4. A glibc floor above this machine's: refused at setup, nothing else runs.
sed -i 's/^glibc_needed=.*/glibc_needed=99.0/' "$b/manifest.txt"
out=$tmp/out4
rc=0
"$repo/launch/gpu-check.sh" --bundle "$b" "$out" >/dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "glibc floor: exit $rc, expected 2"
[ "$(status setup)" = failed ] || fail "glibc floor: setup $(status setup)"
check "$out/steps.tsv" "older than the bundle's 99.0"
[ -z "$(status device)" ] || fail "glibc floor: the device step ran"
echo "run 4 (glibc floor): ok"

# 5. cuBLAS only without cuBLASLt anywhere: refused, naming the pair.
sed -i 's/^glibc_needed=.*/glibc_needed=2.17/' "$b/manifest.txt"
rm "$site/cu13/lib/libcublasLt.so.13"
out=$tmp/out5
rc=0
"$repo/launch/gpu-check.sh" --bundle "$b" "$out" >/dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "no cuBLASLt: exit $rc, expected 2"
check "$out/steps.tsv" "libcublas.so.13 (with libcublasLt.so.13 beside it) not found"
echo "run 5 (cuBLAS without cuBLASLt): ok"
echo "gpu-check driver test passed"
