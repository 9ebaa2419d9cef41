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
# With the real test binary as argument (ctest passes it): each [cuda] case's name,
# escaped as gpu-check.sh escapes it (launch/gpu-cases.sh: catch_spec), selects that
# case alone in real Catch2.
#   tests/launch/gpu_check_test.sh [BUILD/moetrain_tests]   (ctest: gpu_check_driver)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap '[ -n "${KEEP:-}" ] || rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; [ -n "${out:-}" ] && tail -n +1 "$out"/steps.tsv "$out"/gpu-check.log >&2; exit 1; }

# The fake bundle.
b=$tmp/bundle
mkdir -p "$b/bin" "$b/lib" "$tmp/src"
script() { printf '#!/usr/bin/env bash\n%s\n' "$2" >"$b/bin/$1"; chmod +x "$b/bin/$1"; }
script moetrain 'echo "moetrain 0.1.0 (library path: ${LD_LIBRARY_PATH:-none})"
if [ -n "${FAKE_NO_GPU:-}" ]; then echo "cuda        built in, 0 device(s)"; echo "no CUDA device" >&2; exit 69; fi
echo "cuda        built in, 1 device(s)"; echo "  cuda:0    NVIDIA H200 (fake)"'
# The test binary lists its cases (FAKE_CASES, one per line) and runs the one its spec names
# (Catch2's escapes undone): "segv" kills itself with SIGSEGV, "abort" with SIGABRT, "hang"
# sleeps, "bad" fails, any other passes. FAKE_RUNS gets a line per process.
script moetrain_tests 'cases=${FAKE_CASES:-$(printf "cuda case one\ncuda case two, with a comma\nhang")}
if [ "${2:-}" = --list-test-names-only ]; then printf "%s\n" "$cases"; exit 0; fi
[ -n "${FAKE_RUNS:-}" ] && echo "$1" >>"$FAKE_RUNS"
one() {
  case $1 in
    *segv*) echo "running $1"; kill -SEGV $$ ;;
    *abort*) echo "running $1"; kill -ABRT $$ ;;
    *hang*) echo "0.100 s: $1 started"; sleep 60; echo "never printed" ;;
    *bad*) echo "$1: FAILED"; return 1 ;;
    *) echo "0.512 s: $1" ;;
  esac
}
if [ "${1:0:1}" = "[" ]; then  # a tag: every case, in this one process
  rc=0; while IFS= read -r c; do one "$c" || rc=1; done <<<"$cases"; exit $rc
fi
one "$(printf "%s" "$1" | sed "s/\\\\\(.\)/\\1/g")"'
# The bench lists its cases (FAKE_ROWS) and runs the one --case names, appending its row
# to --out ("segv" crashes, "hang" hangs); FAKE_BENCH_RUNS gets a line per process.
script moetrain_bench_cuda 'c= l=; while [ $# -gt 0 ]; do case $1 in --out) o=$2; shift ;; --case) c=$2; shift ;; --list) l=1 ;; esac; shift; done
rows=${FAKE_ROWS:-$(printf "row 1\nrow 2\nhang row\nrow 3")}
if [ -n "$l" ]; then printf "%s\n" "$rows"; exit 0; fi
[ -n "${FAKE_BENCH_RUNS:-}" ] && echo "$c" >>"$FAKE_BENCH_RUNS"
row() { case $1 in *hang*) echo "| $1 | started"; sleep 60 ;; *segv*) kill -SEGV $$ ;; esac; echo "| $1 | 1.0 |" | tee -a "$o"; }
if [ -z "$c" ]; then echo "| case | ms |" >"$o"; while IFS= read -r r; do row "$r"; done <<<"$rows"; else row "$c"; fi'
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
printf '#!/bin/sh\necho "GPU 0: NVIDIA H200 (fake, UUID: GPU-0)"\necho "nvidia-smi library path: ${LD_LIBRARY_PATH:-none}"\n' >"$tmp/nvidia-smi"
cat >"$tmp/cuobjdump" <<'EOF'
#!/bin/sh
printf '\tFunction : _Z9kernel_av\n        /*0000*/   MOV R1, c[0x0][0x28] ;\n        /*0010*/   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n'
printf '\tFunction : _Z9kernel_bv\n        /*0000*/   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n        /*0010*/   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n        /*0020*/   EXIT ;\n'
EOF
chmod +x "$tmp/nvidia-smi" "$tmp/cuobjdump"
export MOETRAIN_GPU_STATE=$tmp/state  # gpu-check.sh's env.sh and cases.tsv, for gpu-recheck.sh
export MOETRAIN_NVIDIA_ROOTS=$tmp/cuda-decoy:$site NVIDIA_SMI=$tmp/nvidia-smi CUOBJDUMP=$tmp/cuobjdump

check() { grep -q -- "$2" "$1" || fail "$(basename "$1") lacks '$2'"; }
status() { awk -F'\t' -v s="$1" '$1 == s {print $2}' "$out/steps.tsv"; }
casestat() { awk -F'\t' -v s="$1" '$2 == s {print $3}' "$out/cases.tsv"; }
testnames() { awk -F'\t' '$1 == "test" {printf "%s|", $2}' "$out/cases.tsv"; }
casecol() { awk -F'\t' -v s="$1" -v c="$2" '$2 == s {print $c}' "$out/cases.tsv"; }

# 1. Tests and benchmark hang: each is killed at its limit, the record keeps their lines.
out=$tmp/out1
t0=$(date +%s)
rc=0
T_TESTS=5 T_BENCH=5 T_SASS=20 "$repo/launch/gpu-check.sh" --bundle "$b" "$out" >/dev/null 2>&1 || rc=$?
took=$(($(date +%s) - t0))
[ "$rc" = 1 ] || fail "run 1: exit $rc, expected 1 (timeouts are failures)"
[ "$took" -lt 25 ] || fail "run 1 took $took s; its steps' limits add up to 10 s"
for s in setup device sass; do [ "$(status $s)" = ok ] || fail "step $s: $(status $s), expected ok"; done
[ "$(status tests)" = timeout ] || fail "tests: $(status tests), expected timeout"
[ "$(status bench)" = timeout ] || fail "bench: $(status bench), expected timeout"
check "$out/tests.log" "0.512 s: cuda case two, with a comma"
grep -q "never printed" "$out/tests.log" && fail "tests.log: the test run was not stopped"
[ "$(casestat "cuda case one")" = ok ] || fail "cases.tsv: cuda case one $(casestat "cuda case one")"
check "$out/bench.md" "| row 2 | 1.0 |"
grep -q "row 3" "$out/bench.md" && fail "bench.md: the benchmark was not stopped"
[ "$(awk -F'\t' '$1 == "bench" && $2 == "hang row" {print $3}' "$out/cases.tsv")" = timeout ] || fail "bench: hang row not recorded as timeout"
check "$out/sass.txt" "kernels 2, HMMA instructions 3"
check "$out/sass.txt" "_Z9kernel_bv"
check "$out/device.txt" "NVIDIA H200 (fake"
check "$out/device.txt" "built in, 1 device(s)"
check "$out/device.txt" "libcublas.so.13 + libcublasLt.so.13: $site/cu13/lib"
check "$out/device.txt" "libnccl.so.2: $site/nccl/lib"
# The bundle's library path reaches our binaries, not the script's tools (nvidia-smi here).
check "$out/device.txt" "moetrain 0.1.0 (library path: $b/lib:$site/cu13/lib:$site/nccl/lib"
check "$out/device.txt" "nvidia-smi library path: ${LD_LIBRARY_PATH:-none}\$"
grep -q "nvidia-smi library path: .*$b/lib" "$out/device.txt" && fail "the bundle's lib/ reached nvidia-smi"
[ -L "$tmp/src/build/moetrain_tests" ] || fail "the bundle's binaries are not linked where the tests look for them"
[ "$(ls "$out" | wc -l)" -le 8 ] || fail "more than 8 record files: $(ls "$out")"
echo "run 1 (hanging tests and benchmark): ok in $took s"

# 2. The budget: a 20 s budget (10 s of it kept back) cuts the test step's 60 s limit and skips what no longer fits.
out=$tmp/out2
t0=$(date +%s)
FAKE_CASES=hang MOETRAIN_GPU_BUDGET=20 T_TESTS=60 T_BENCH=60 "$repo/launch/gpu-check.sh" --bundle "$b" "$out" >/dev/null 2>&1 || true
took=$(($(date +%s) - t0))
[ "$took" -le 23 ] || fail "run 2 took $took s with a budget of 20 s"
[ "$(status tests)" = timeout ] || fail "budget: tests $(status tests), expected timeout"
[ "$(status bench)" = skipped ] || fail "budget: bench $(status bench), expected skipped"
check "$out/steps.tsv" "budget spent"
echo "run 2 (budget 20 s): ok in $took s"

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
# 4b. The core's floor met, but this machine's libstdc++ is older than the bundle needs
# and the bundle's own (lib/cxx) needs a newer glibc: refused at setup, saying which.
sed -i 's/^glibc_needed=.*/glibc_needed=2.17/; s/^glibcxx_needed=.*/glibcxx_needed=99.0/' "$b/manifest.txt"
echo "cxx_glibc_needed=99.0" >>"$b/manifest.txt"
out=$tmp/out4b
rc=0
"$repo/launch/gpu-check.sh" --bundle "$b" "$out" >/dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "lib/cxx floor: exit $rc, expected 2"
check "$out/steps.tsv" "the bundle's own libstdc++ needs glibc 99.0"
[ -z "$(status device)" ] || fail "lib/cxx floor: the device step ran"
sed -i 's/^glibcxx_needed=.*/glibcxx_needed=3.4.20/; /^cxx_glibc_needed=/d' "$b/manifest.txt"
echo "run 4b (lib/cxx's glibc floor): ok"

# 5. cuBLAS only without cuBLASLt anywhere: refused, naming the pair.
sed -i 's/^glibc_needed=.*/glibc_needed=2.17/' "$b/manifest.txt"
rm "$site/cu13/lib/libcublasLt.so.13"
out=$tmp/out5
rc=0
"$repo/launch/gpu-check.sh" --bundle "$b" "$out" >/dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "no cuBLASLt: exit $rc, expected 2"
check "$out/steps.tsv" "libcublas.so.13 (with libcublasLt.so.13 beside it) not found"
echo "run 5 (cuBLAS without cuBLASLt): ok"
sed -i 's/^glibc_needed=.*/glibc_needed=2.17/' "$b/manifest.txt"
touch "$site/cu13/lib/libcublasLt.so.13"

# 6. Each case in its own process: a segfault, an abort, a hang and a failure cost their
#    case only; the later cases run and every case has its line in cases.tsv.
out=$tmp/out6
runs=$tmp/runs6
t0=$(date +%s)
rc=0
bruns=$tmp/bruns6
FAKE_RUNS=$runs FAKE_BENCH_RUNS=$bruns FAKE_ROWS=$'row 1\nsegv row\nhang row\nlast row' T_ROW=2 \
FAKE_CASES=$'first ok\nsegv case\nabort case, with a comma\nhang case\nbad case\nlast ok' T_CASE=2 T_TESTS=60 T_BENCH=20 \
  "$repo/launch/gpu-check.sh" --bundle "$b" "$out" >/dev/null 2>&1 || rc=$?
took=$(($(date +%s) - t0))
[ "$rc" = 1 ] || fail "run 6: exit $rc, expected 1"
[ "$(wc -l <"$runs")" = 6 ] || fail "run 6: $(wc -l <"$runs") test processes for 6 cases: $(cat "$runs")"
grep -qxF 'abort case\, with a comma' "$runs" || fail "run 6: the comma in a case name was not escaped: $(cat "$runs")"
[ "$(casestat "first ok")" = ok ] || fail "first ok: $(casestat "first ok")"
[ "$(casestat "segv case")" = crashed ] || fail "segv case: $(casestat "segv case"), expected crashed"
[ "$(casecol "segv case" 6)" = SIGSEGV ] || fail "segv case: note '$(casecol "segv case" 6)', expected SIGSEGV"
[ "$(casecol "abort case, with a comma" 6)" = SIGABRT ] || fail "abort case: '$(casecol "abort case, with a comma" 6)'"
[ "$(casestat "hang case")" = timeout ] || fail "hang case: $(casestat "hang case"), expected timeout"
awk -v s="$(casecol "hang case" 5)" 'BEGIN {exit !(s >= 2 && s < 8)}' || fail "hang case took $(casecol "hang case" 5) s, its limit is 2 s"
[ "$(casestat "bad case")" = failed ] || fail "bad case: $(casestat "bad case"), expected failed"
[ "$(casestat "last ok")" = ok ] || fail "last ok: $(casestat "last ok"), expected ok (after a crash and a hang)"
[ "$(testnames)" = "first ok|segv case|abort case, with a comma|hang case|bad case|last ok|" ] ||
  fail "cases.tsv order: $(cut -f2 "$out/cases.tsv" | tr '\n' '|')"
[ "$(status tests)" = failed ] || fail "run 6: tests $(status tests), expected failed"
check "$out/tests.log" "0.512 s: last ok"
grep -q "never printed" "$out/tests.log" && fail "run 6: the hanging case was not stopped"
[ "$(wc -l <"$bruns")" = 4 ] || fail "run 6: $(wc -l <"$bruns") bench processes for 4 rows"
[ "$(awk -F'\t' '$1 == "bench" && $2 == "segv row" {print $3 $6}' "$out/cases.tsv")" = crashedSIGSEGV ] || fail "bench: segv row not recorded as crashed"
check "$out/bench.md" "| last row | 1.0 |"
[ "$(status bench)" = failed ] || fail "run 6: bench $(status bench), expected failed"
[ "$took" -lt 30 ] || fail "run 6 took $took s"
[ "$(ls "$out" | wc -l)" -le 8 ] || fail "more than 8 record files: $(ls "$out")"
cmp -s "$out/cases.tsv" "$MOETRAIN_GPU_STATE/cases.tsv" || fail "run 6: cases.tsv not copied to MOETRAIN_GPU_STATE for gpu-recheck.sh"
check "$MOETRAIN_GPU_STATE/env.sh" "bin="
echo "run 6 (a crash, an abort, a hang, a failure among the cases): ok in $took s"

# 7. Cheapest first from an earlier record; the step's limit spent: the rest "skipped".
out=$tmp/out7
printf 'kind\tname\tstatus\trc\tseconds\tnote\nbench\tc\tok\t0\t0.1\t\ntest\tc\tok\t0\t0.2\t\ntest\thang\ttimeout\t124\t60\t\ntest\ta\tok\t0\t3.5\t\n' >"$tmp/prev.tsv"
FAKE_CASES=$'a\nb\nhang\nc' CASES_FROM=$tmp/prev.tsv T_CASE=60 T_TESTS=6 T_BENCH=3 \
  "$repo/launch/gpu-check.sh" --bundle "$b" "$out" >/dev/null 2>&1 || true
[ "$(testnames)" = "c|a|hang|b|" ] || fail "cheapest first: $(cut -f2 "$out/cases.tsv" | tr '\n' '|')"
[ "$(casestat hang)" = timeout ] || fail "run 7: hang $(casestat hang)"
[ "$(casestat b)" = skipped ] || fail "run 7: b $(casestat b), expected skipped"
[ "$(status tests)" = timeout ] || fail "run 7: tests $(status tests), expected timeout"
echo "run 7 (cheapest first, the step's limit): ok"

# 8. nvidia-smi missing, then failing: recorded, the tests still run and pass.
for smi in "$tmp/no-such-nvidia-smi" "$tmp/failing-smi"; do
  printf '#!/bin/sh\necho "NVIDIA-SMI has failed" >&2; exit 9\n' >"$tmp/failing-smi"; chmod +x "$tmp/failing-smi"
  out=$tmp/out8
  rm -rf "$out"
  rc=0
  NVIDIA_SMI=$smi FAKE_CASES=$'a\nb' T_BENCH=3 "$repo/launch/gpu-check.sh" --bundle "$b" "$out" >/dev/null 2>&1 || rc=$?
  [ "$(status nvidia-smi)" = noted ] || fail "nvidia-smi $smi: $(status nvidia-smi), expected noted"
  [ "$(casestat b)" = ok ] || fail "nvidia-smi $smi: the tests did not run: $(casestat b)"
  [ "$(status tests)" = ok ] || fail "nvidia-smi $smi: tests $(status tests)"
done
echo "run 8 (nvidia-smi missing or failing): ok"
# 9. gpu-recheck.sh with a (fake) compute-sanitizer: the failed, crashed and timed-out
#    cases of a record, one process each, memcheck first, racecheck for those that pass it.
cat >"$tmp/compute-sanitizer" <<'EOF'
#!/usr/bin/env bash
# --tool T --error-exitcode N --print-limit L CMD...: "segv" cases are caught by memcheck
# (exit N), "race" cases by racecheck; anything else runs as it is.
tool=$2 code=$4; shift 6
echo "$tool $*" >>"$FAKE_SAN_RUNS"
case "$tool $*" in
  "memcheck "*segv*) echo "========= Invalid __global__ write of size 4"; exit "$code" ;;
  "racecheck "*race*) echo "========= Error: Race reported"; exit "$code" ;;
esac
"$@"
EOF
chmod +x "$tmp/compute-sanitizer"
prev=$tmp/prev9
mkdir -p "$prev"
{
  printf 'kind\tname\tstatus\trc\tseconds\tnote\n'
  printf 'test\tfirst ok\tok\t0\t0.1\t\n'
  printf 'test\trace case, with a comma\tfailed\t1\t0.1\t\n'
  printf 'test\tsegv case\tcrashed\t139\t0.1\tSIGSEGV\n'
  printf 'test\thang case\ttimeout\t124\t2\t\n'
  printf 'test\tnot run\tskipped\t-\t0\t\n'
  printf 'bench\tsegv row\tcrashed\t139\t0.1\tSIGSEGV\n'
} >"$prev/cases.tsv"
rstat() { awk -F'\t' -v k="$1" -v n="$2" -v t="$3" '$1 == k && $2 == n && $3 == t {print $4 ($7 ~ /sanitizer reported/ ? "+san" : "")}' "$out/recheck.tsv"; }
out=$tmp/out9
rc=0
FAKE_SAN_RUNS=$tmp/san9 COMPUTE_SANITIZER=$tmp/compute-sanitizer T_SANITIZE=2 \
  "$repo/launch/gpu-recheck.sh" --from "$prev" "$out" >/dev/null 2>&1 || rc=$?
[ "$rc" = 1 ] || fail "recheck: exit $rc, expected 1"
[ "$(rstat test "race case, with a comma" memcheck)" = ok ] || fail "recheck race memcheck: $(rstat test "race case, with a comma" memcheck)"
[ "$(rstat test "race case, with a comma" racecheck)" = failed+san ] || fail "recheck race racecheck: $(rstat test "race case, with a comma" racecheck)"
[ "$(rstat test "segv case" memcheck)" = failed+san ] || fail "recheck segv memcheck: $(rstat test "segv case" memcheck)"
[ -z "$(rstat test "segv case" racecheck)" ] || fail "recheck: racecheck ran after memcheck failed"
[ "$(rstat test "hang case" memcheck)" = timeout ] || fail "recheck hang: $(rstat test "hang case" memcheck)"
[ "$(rstat bench "segv row" memcheck)" = failed+san ] || fail "recheck bench segv row: $(rstat bench "segv row" memcheck)"
grep -q "first ok\|not run" "$out/recheck.tsv" && fail "recheck reran a case that passed or was not run"
[ "$(wc -l <"$tmp/san9")" = 5 ] || fail "recheck: $(wc -l <"$tmp/san9") sanitizer runs, expected 5: $(cat "$tmp/san9")"
grep -q "^memcheck .*/moetrain_bench_cuda --steps 1 --case segv row$" "$tmp/san9" || fail "recheck: the bench case was not rerun by the bench: $(cat "$tmp/san9")"
grep -qF 'moetrain_tests race case\, with a comma --use-colour no' "$tmp/san9" || fail "recheck: the test case's spec: $(cat "$tmp/san9")"
check "$out/recheck.log" "Invalid __global__ write"
echo "run 9 (gpu-recheck.sh, compute-sanitizer): ok"

# 10. gpu-recheck.sh without compute-sanitizer: said so, each case rerun plainly; the
#     record and the binaries from what gpu-check.sh left in MOETRAIN_GPU_STATE.
out=$tmp/out10
cp "$prev/cases.tsv" "$MOETRAIN_GPU_STATE/cases.tsv"
rc=0
COMPUTE_SANITIZER=$tmp/no-such-sanitizer T_SANITIZE=2 "$repo/launch/gpu-recheck.sh" "$out" >/dev/null 2>&1 || rc=$?
[ "$rc" = 1 ] || fail "plain recheck: exit $rc, expected 1"
check "$out/recheck.log" "compute-sanitizer not found"
[ "$(rstat test "race case, with a comma" plain)" = ok ] || fail "plain race case: $(rstat test "race case, with a comma" plain)"
[ "$(rstat test "segv case" plain)" = crashed ] || fail "plain segv case: $(rstat test "segv case" plain)"
[ "$(rstat test "hang case" plain)" = timeout ] || fail "plain hang case: $(rstat test "hang case" plain)"
[ "$(rstat bench "segv row" plain)" = crashed ] || fail "plain segv row: $(rstat bench "segv row" plain)"
# No record anywhere: refused (2), naming the first command.
rc=0
MOETRAIN_GPU_STATE=$tmp/empty-state "$repo/launch/gpu-recheck.sh" "$tmp/out10b" >/dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "recheck without a record: exit $rc, expected 2"
check "$tmp/out10b/recheck.log" "run launch/gpu-check.sh first"
echo "run 10 (gpu-recheck.sh without compute-sanitizer; no record): ok"
# 11. The real test binary: every [cuda] name, as a spec, lists exactly that case.
if [ -n "${1:-}" ]; then
  # shellcheck source=launch/gpu-cases.sh
  . "$repo/launch/gpu-cases.sh"
  n=0
  while IFS= read -r name; do
    got=$("$1" "$(catch_spec "$name")" --list-test-names-only) || true
    [ "$got" = "$name" ] || fail "the spec for '$name' ($(catch_spec "$name")) selects: '$got'"
    n=$((n + 1))
  done < <("$1" "[cuda]" --list-test-names-only)
  [ "$n" -gt 0 ] || fail "$1 lists no [cuda] case"
  echo "run 11 (the $n [cuda] names of $1, each selecting itself): ok"
fi
echo "gpu-check driver test passed"
