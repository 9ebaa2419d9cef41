#!/usr/bin/env bash
# The one-shot GPU check (docs/cuda.md, "Proof on a GPU"), made for one call of
# 540 s (its budget: 520 s) on a bare GPU machine that received the work tree and a bundle:
#   launch/gpu-check.sh --bundle .gpu-bundle/moetrain-gpu.tar.xz OUT_DIR
# The bundle (launch/gpu-bundle.sh, built on a Debian machine) holds our binaries
# and the Debian libraries they load; NVIDIA's libraries come from this machine
# (launch/gpu-libs.sh). Steps, each under its own timeout, each writing its record
# the moment it has it, so a step killed at its limit leaves what it had:
#   setup    unpack, glibc/GLIBCXX floors, find NVIDIA's libraries, loader check
#   nvidia-smi optional: missing or failing is recorded "noted" and the run goes on -> device.txt
#   device   moetrain info --require-cuda                     -> device.txt
#   sass     one cuobjdump -sass pass: kernels, HMMA per kernel -> sass.txt (beside the tests: CPU only)
#   tests    each moetrain_tests "[cuda]" case in its own process, under its own
#            timeout (T_CASE), one line each in cases.tsv as it ends -> tests.log, cases.tsv
#   bench    each moetrain_bench_cuda --list case in its own process (--case NAME), under
#            its own timeout (T_ROW), one line each in cases.tsv: rows -> bench.md
#            and each training row's per-component device times -> components.md
#   tests_mpi moetrain_tests "[cuda][mpi]" under mpirun, only with 2+ GPUs and an mpirun -> tests.log
# steps.tsv gets a line per step as it ends (step, status, exit code, seconds,
# note): ok, failed, timeout or skipped; gpu-check.log is this script's output.
# Eight files at most (the device tool brings back eight): steps.tsv, cases.tsv, gpu-check.log,
# device.txt, sass.txt, tests.log, bench.md, components.md. The failed cases of cases.tsv are
# rerun one by one under compute-sanitizer by launch/gpu-recheck.sh OUT_DIR (the second command).
# Exits 0 when every step passed, 1 otherwise (2: usage, bundle unusable).
#
# Knobs (environment): MOETRAIN_GPU_BUDGET total seconds (520: a 540 s call); T_SETUP T_DEVICE
# T_SASS T_TESTS T_BENCH per-step limits (60 40 120 250 160); T_CASE one test case's limit (60,
# cut to what is left of T_TESTS); T_ROW one bench case's limit (60); CASES_FROM an earlier cases.tsv (cheapest cases first); BENCH_STEPS (5);
# NVIDIA_SMI, CUOBJDUMP (commands); TESTS_SPEC ("[cuda]"). Without --bundle the
# binaries come from MOETRAIN_BIN_DIR (default build/, a build made on this machine).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
bundle_arg=
if [ "${1:-}" = "--bundle" ]; then bundle_arg=${2:?usage: launch/gpu-check.sh [--bundle FILE.tar.xz|DIR] OUT_DIR}; shift 2; fi
out=${1:?usage: launch/gpu-check.sh [--bundle FILE.tar.xz|DIR] OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
# shellcheck source=launch/gpu-libs.sh
. "$repo/launch/gpu-libs.sh"

budget=${MOETRAIN_GPU_BUDGET:-520}
start=$(date +%s.%N)
elapsed() { awk -v s="$start" -v n="$(date +%s.%N)" 'BEGIN {printf "%.0f", n - s}'; }
exec > >(tee -a "$out/gpu-check.log") 2>&1
printf 'step\tstatus\trc\tseconds\tnote\n' >"$out/steps.tsv"
failed=0
record() {  # record STEP RC SECONDS NOTE  (RC "-": skipped; "noted:RC": noted, not a failure)
  local status=ok rc=$2
  case $2 in 0) ;; 124|137) status=timeout ;; -) status=skipped ;; noted:*) status=noted rc=${2#noted:} ;; *) status=failed ;; esac
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$status" "$rc" "$3" "${4:-}" >>"$out/steps.tsv"
  echo "== $1: $status (exit $rc, $3 s) ${4:-}"
}
# limit T: the step's limit, cut to what is left of the budget (10 s kept for the end).
limit() { local left=$((budget - $(elapsed) - 10)); echo $(($1 < left ? $1 : left)); }
# run_step NAME T OUTFILE CMD...: CMD under timeout, its output straight into OUTFILE.
run_step() {
  local name=$1 t s0 rc
  t=$(limit "$2")
  if [ "$t" -lt 3 ]; then record "$name" - 0 "budget spent"; return 1; fi
  s0=$(date +%s)
  echo "== $name (limit $t s, $(elapsed) s into the budget)"
  timeout --kill-after=5 "$t" "${@:4}" >>"$3" 2>&1
  rc=$?
  record "$name" "$rc" $(($(date +%s) - s0)) "$( [ "$rc" = 124 ] && echo "killed at its limit of $t s")"
  return "$rc"
}

# --- setup: the binaries, the libraries, the floors --------------------------------
s0=$(date +%s)
dev="$out/device.txt"
{
  echo "# machine"
  uname -a
  (. /etc/os-release 2>/dev/null && echo "os: $PRETTY_NAME")
  echo "glibc: $(glibc_version)   libstdc++: GLIBCXX_$(glibcxx_version)"
} >"$dev" 2>&1
setup_fail() { echo "gpu-check: $*" | tee -a "$dev" >&2; record setup 2 $(($(date +%s) - s0)) "$*"; exit 2; }
if [ -n "$bundle_arg" ]; then
  if [ -d "$bundle_arg" ]; then
    bundle=$(cd "$bundle_arg" && pwd)
  else
    bundle=${MOETRAIN_BUNDLE_DIR:-/tmp/moetrain-bundle}
    rm -rf "$bundle" && mkdir -p "$bundle"
    timeout "$(limit "${T_SETUP:-60}")" tar xJf "$bundle_arg" -C "$bundle" || setup_fail "cannot unpack $bundle_arg"
  fi
  manifest() { sed -n "s/^$1=//p" "$bundle/manifest.txt"; }
  { echo; echo "# bundle $bundle_arg"; cat "$bundle/manifest.txt"; } >>"$dev"
  bin=$bundle/bin
  # The test binary reaches the sources (configs, fixtures) and the CLI through the
  # paths it was built with: point them at this checkout and the bundle's binaries.
  src=$(manifest source_dir) sub=$(manifest binary_subdir)
  if [ "$src" != "$repo" ] && [ ! -e "$src" ]; then mkdir -p "$(dirname "$src")" && ln -s "$repo" "$src"; fi
  # (A real file there is the build the bundle was made from, on the machine that made it: left alone.)
  mkdir -p "$src/$sub" && for b in "$bin"/*; do
    t=$src/$sub/$(basename "$b")
    if [ ! -e "$t" ] || [ -L "$t" ]; then ln -sfn "$b" "$t"; fi
  done
  need_glibc=$(manifest glibc_needed) need_cxx=$(manifest glibcxx_needed) nvidia_libs=$(manifest nvidia_libs)
  cxx_glibc=$(manifest cxx_glibc_needed)
  libpath=$bundle/lib
else
  bin=$(cd "${MOETRAIN_BIN_DIR:-build}" && pwd) || setup_fail "no binaries: build/ is missing (or pass --bundle)"
  need_glibc= need_cxx= nvidia_libs= libpath= cxx_glibc=
fi
have_glibc=$(glibc_version) have_cxx=$(glibcxx_version)
if [ -n "$need_glibc" ] && ! version_ge "${have_glibc:-0}" "$need_glibc"; then
  echo "bundle needs glibc >= $need_glibc, this machine has ${have_glibc:-unknown}:" >>"$dev"
  cat "$bundle/needs.txt" >>"$dev"
  setup_fail "this machine's glibc ${have_glibc:-unknown} is older than the bundle's $need_glibc (needs.txt names the files); build here instead (docs/cuda.md)"
fi
if [ -n "$need_cxx" ] && ! version_ge "${have_cxx:-0}" "$need_cxx"; then
  # The bundle's own libstdc++ then loads, and it needs a newer glibc than the rest.
  if [ -n "$cxx_glibc" ] && ! version_ge "${have_glibc:-0}" "$cxx_glibc"; then
    setup_fail "this machine's libstdc++ (GLIBCXX_${have_cxx:-?}) is older than the bundle's $need_cxx, and the bundle's own libstdc++ needs glibc $cxx_glibc (this machine: ${have_glibc:-unknown}); install a newer libstdc++ (GCC 12 or later) or build here (docs/cuda.md)"
  fi
  libpath=$libpath:$bundle/lib/cxx
  echo "libstdc++: this machine's GLIBCXX_${have_cxx:-?} < $need_cxx: the bundle's lib/cxx goes first" >>"$dev"
fi
# NVIDIA's libraries: where the loader does not already know them, the directory found.
echo "# NVIDIA libraries" >>"$dev"
for so in $nvidia_libs; do
  with=
  [[ $so == libcublas.so.* ]] && with=libcublasLt.so.${so#libcublas.so.}
  d=$(nvidia_find "$so" "$with") || setup_fail "$so${with:+ (with $with beside it)} not found on this machine (searched: $(nvidia_roots | tr '\n' ' '))"
  echo "$so${with:+ + $with}: $d ($(readlink -f "$d/$so" | xargs basename))" >>"$dev"
  case ":$libpath:" in *":$d:"*) ;; *) libpath=$libpath:$d ;; esac
done
# The driver (libcuda.so.1, which libcudart opens) where the loader's cache lacks it.
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
  d=$(MOETRAIN_NVIDIA_ROOTS=${MOETRAIN_NVIDIA_ROOTS:-/usr/local/nvidia:/usr/lib/x86_64-linux-gnu:/usr/lib64} nvidia_find libcuda.so.1) &&
    libpath=$libpath:$d && echo "libcuda.so.1 (driver): $d" >>"$dev"
fi
# These folders reach our binaries only: each of our commands runs under
# `env LD_LIBRARY_PATH=...` ("${ours[@]}"); this script's own tools (timeout, awk,
# tar, nvidia-smi, cuobjdump) keep the machine's environment.
our_libs=${libpath#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
ours=(env "LD_LIBRARY_PATH=$our_libs")
echo "LD_LIBRARY_PATH of our binaries: $our_libs" >>"$dev"
for b in moetrain moetrain_tests moetrain_bench_cuda; do
  [ -x "$bin/$b" ] || setup_fail "$bin/$b is missing"
  if "${ours[@]}" ldd "$bin/$b" 2>/dev/null | grep -q "not found"; then
    "${ours[@]}" ldd "$bin/$b" | grep "not found" >>"$dev"
    setup_fail "$b: libraries not found (device.txt)"
  fi
done
# For the second command (launch/gpu-recheck.sh, on this machine): where the binaries are
# and how they load; the case record is copied there as each case ends.
state=${MOETRAIN_GPU_STATE:-/tmp/moetrain-gpu-check}
mkdir -p "$state" && printf 'bin=%q\nour_libs=%q\n' "$bin" "$our_libs" >"$state/env.sh"
echo "binaries: $bin (for launch/gpu-recheck.sh: $state/env.sh)" >>"$dev"
record setup 0 $(($(date +%s) - s0)) "glibc $have_glibc (needs ${need_glibc:-?}), GLIBCXX $have_cxx (needs ${need_cxx:-?})"

# --- sass: in the background, beside the device steps (it needs no GPU) -------------
cuobjdump=${CUOBJDUMP:-$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)}
sass_t=$(limit "${T_SASS:-120}")
(
  s0=$(date +%s)
  if [ ! -x "$cuobjdump" ] && ! command -v "$cuobjdump" >/dev/null; then
    echo "cuobjdump not found" >"$out/sass.txt"; record sass - 0 "no cuobjdump"; exit 0
  fi
  # One pass: per kernel (Function : name) its instruction count and HMMA count; totals at the end.
  timeout --kill-after=5 "$sass_t" "$cuobjdump" -sass "$bin/moetrain" 2>&1 | awk '
    /Function : / { if (name != "") printf "%-8d %-6d %s\n", n, h, name; name = $NF; n = 0; h = 0; k++; next }
    /^ *\/\*[0-9a-f]+\*\/ / { n++; if ($0 ~ /HMMA/) { h++; H++ } }
    /arch = sm_/ { arch[$NF]++ }
    END { if (name != "") printf "%-8d %-6d %s\n", n, h, name
          printf "# kernels %d, HMMA instructions %d; ELF code by arch:", k, H
          for (a in arch) printf " %s x%d", a, arch[a]; printf "\n" }' >"$out/sass.txt"
  rc=${PIPESTATUS[0]}
  record sass "$rc" $(($(date +%s) - s0)) "$(tail -1 "$out/sass.txt")"
) &
sass_pid=$!

# --- device ----------------------------------------------------------------------------
# nvidia-smi is optional: missing or failing, it is recorded (status "noted", not a
# failure) and the run goes on; moetrain info --require-cuda decides whether a GPU is there.
echo "# nvidia-smi" >>"$dev"
smi=${NVIDIA_SMI:-nvidia-smi}
s0=$(date +%s)
if ! command -v "$smi" >/dev/null 2>&1; then
  echo "nvidia-smi: not found ($smi)" >>"$dev"
  record nvidia-smi noted:127 0 "not found: $smi (optional; the tests go on)"
else
  timeout --kill-after=5 "$(limit "${T_SMI:-20}")" "$smi" >>"$dev" 2>&1
  rc=$?
  if [ "$rc" = 0 ]; then record nvidia-smi 0 $(($(date +%s) - s0)); else
    record nvidia-smi "noted:$rc" $(($(date +%s) - s0)) "exit $rc (optional; the tests go on)"; fi
fi
echo "# moetrain info" >>"$dev"
if ! run_step device "${T_DEVICE:-40}" "$dev" "${ours[@]}" "$bin/moetrain" info --require-cuda; then
  gpu=0
else
  gpu=$(grep -o 'built in, [0-9]* device' "$dev" | grep -o '[0-9]*' | tail -1)
fi

# --- tests and bench -------------------------------------------------------------------
# The tests step: each case of TESTS_SPEC in its own process (launch/gpu-cases.sh), in the
# order CASES_FROM (an earlier cases.tsv) gives, cheapest first, else as listed; each under
# T_CASE s cut to what is left of the step's limit; each case's line goes to cases.tsv as
# it ends, its output to tests.log. A case the step's limit leaves no time for is recorded
# "skipped" and the step "timeout".
# shellcheck source=launch/gpu-cases.sh
. "$repo/launch/gpu-cases.sh"
case_header "$out/cases.tsv"
run_tests_cases() {
  local t_step s0 end names name left t n=0 bad=0 cut=0 rc
  t_step=$(limit "${T_TESTS:-250}")
  if [ "$t_step" -lt 3 ]; then record tests - 0 "budget spent"; return 1; fi
  s0=$(date +%s) end=$(($(date +%s) + t_step))
  echo "== tests (limit $t_step s, one process per case, $(elapsed) s into the budget)"
  names=$(timeout $((t_step < 30 ? t_step : 30)) "${ours[@]}" "$bin/moetrain_tests" "${TESTS_SPEC:-[cuda]}" --list-test-names-only 2>>"$out/tests.log")
  if [ -z "$names" ]; then record tests 1 $(($(date +%s) - s0)) "moetrain_tests listed no case for ${TESTS_SPEC:-[cuda]}"; return 1; fi
  if [ -n "${CASES_FROM:-}" ] && [ -r "$CASES_FROM" ]; then
    # Known cases by their seconds there, ascending; the unknown ones after them, as listed.
    names=$(awk -F'\t' 'NR == FNR { if ($1 == "test" && $5 != "") s[$2] = $5; next }
                         { print (($0 in s) ? s[$0] : 1e9) "\t" FNR "\t" $0 }' "$CASES_FROM" - <<<"$names" |
            sort -t$'\t' -k1,1g -k2,2n | cut -f3-)
  fi
  while IFS= read -r name; do
    [ -n "$name" ] || continue
    n=$((n + 1)) left=$((end - $(date +%s)))
    if [ "$left" -lt 3 ]; then
      case_line "$out/cases.tsv" test "$name" skipped - 0 "the tests step's limit of $t_step s was spent"
      cut=$((cut + 1)); continue
    fi
    t=${T_CASE:-60}; [ "$t" -lt "$left" ] || t=$left
    run_case "$out/cases.tsv" test "$name" "$t" "$out/tests.log" "${ours[@]}" stdbuf -oL -eL "$bin/moetrain_tests" \
      "$(catch_spec "$name")" --durations yes --use-colour no || bad=$((bad + 1))
    cp "$out/cases.tsv" "$state/cases.tsv"  # for gpu-recheck.sh, even if this call is killed
  done <<<"$names"
  rc=0; [ "$bad" = 0 ] || rc=1
  # The step's own limit ran out: cases skipped, or the last one cut short by it.
  [ "$cut" = 0 ] && [ "$((end - $(date +%s)))" -ge 1 ] || rc=124
  record tests "$rc" $(($(date +%s) - s0)) "$n cases: $((n - bad - cut)) ok, $bad not ok, $cut skipped (cases.tsv)"
  return "$rc"
}
# The bench step: each case of moetrain_bench_cuda --list in its own process (--case NAME,
# appending its rows to bench.md and components.md), in the listed order (the tables' order),
# each under T_ROW s cut to what is left of T_BENCH; a line per case in cases.tsv (kind
# "bench"). A bench binary without --list runs whole, in one process, as before.
run_bench_cases() {
  local t_step s0 end names name left t n=0 bad=0 cut=0 rc
  local bench=("${ours[@]}" "$bin/moetrain_bench_cuda" --steps "${BENCH_STEPS:-5}" --out "$out/bench.md" --components "$out/components.md")
  t_step=$(limit "${T_BENCH:-160}")
  if [ "$t_step" -lt 3 ]; then record bench - 0 "budget spent"; return 1; fi
  s0=$(date +%s) end=$(($(date +%s) + t_step))
  if ! names=$(timeout $((t_step < 30 ? t_step : 30)) "${ours[@]}" "$bin/moetrain_bench_cuda" --list 2>/dev/null) || [ -z "$names" ]; then
    run_step bench "$((end - $(date +%s)))" "$out/gpu-check.log" "${bench[@]}"
    return
  fi
  echo "== bench (limit $t_step s, one process per case, $(elapsed) s into the budget)"
  : >"$out/bench.md"; : >"$out/components.md"
  while IFS= read -r name; do
    [ -n "$name" ] || continue
    n=$((n + 1)) left=$((end - $(date +%s)))
    if [ "$left" -lt 3 ]; then
      case_line "$out/cases.tsv" bench "$name" skipped - 0 "the bench step's limit of $t_step s was spent"
      cut=$((cut + 1)); continue
    fi
    t=${T_ROW:-60}; [ "$t" -lt "$left" ] || t=$left
    run_case "$out/cases.tsv" bench "$name" "$t" "$out/gpu-check.log" "${bench[@]}" --case "$name" || bad=$((bad + 1))
    cp "$out/cases.tsv" "$state/cases.tsv"
  done <<<"$names"
  rc=0; [ "$bad" = 0 ] || rc=1
  [ "$cut" = 0 ] && [ "$((end - $(date +%s)))" -ge 1 ] || rc=124
  record bench "$rc" $(($(date +%s) - s0)) "$n cases: $((n - bad - cut)) ok, $bad not ok, $cut skipped (cases.tsv)"
  return "$rc"
}
if [ "${gpu:-0}" -gt 0 ]; then
  run_tests_cases
  run_bench_cases
  ngpu=$(grep -o 'built in, [0-9]* device' "$dev" | grep -o '[0-9]*' | tail -1)
  if [ "${ngpu:-1}" -gt 1 ]; then
    if [ ! -e "$bin/libmoetrain_mpi.so" ]; then
      record tests_mpi - 0 "$ngpu GPUs, but the bundle is for one GPU: it carries no MPI (docs/distributed.md); build here for [cuda][mpi]"
    elif command -v mpirun >/dev/null; then
      echo "== tests_mpi: moetrain_tests [cuda][mpi] on $ngpu ranks" >>"$out/tests.log"
      run_step tests_mpi "${T_TESTS_MPI:-120}" "$out/tests.log" mpirun --allow-run-as-root --oversubscribe \
        -np "$ngpu" -x OMP_NUM_THREADS=1 -x "LD_LIBRARY_PATH=$our_libs" "$bin/moetrain_tests" "[cuda][mpi]"
    else
      record tests_mpi - 0 "$ngpu GPUs but no mpirun on this machine (the bundle carries no MPI launcher)"
    fi
  fi
else
  record tests 1 0 "moetrain sees no CUDA device (device.txt)"
  record bench - 0 "no CUDA device"
fi
cp "$out/cases.tsv" "$state/cases.tsv"
wait "$sass_pid"
grep -q "^sass	" "$out/steps.tsv" || record sass 137 "$sass_t" "the SASS pass did not finish"
# The sass step records from a subshell: the verdict comes from the record itself.
cut -f2 "$out/steps.tsv" | grep -qE '^(failed|timeout)$' && failed=1  # "noted" (nvidia-smi) is not a failure
echo "== done in $(elapsed) s: $([ $failed = 0 ] && echo passed || echo FAILED) (steps.tsv)"
exit $failed
