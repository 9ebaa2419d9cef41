#!/usr/bin/env bash
# The second GPU command (docs/cuda.md, "Proof on a GPU"), run on the machine that ran
# launch/gpu-check.sh, in the call after it:
#   launch/gpu-recheck.sh [--from DIR] OUT_DIR
# Reads the first run's case record (cases.tsv: DIR/cases.tsv; without --from, OUT_DIR's
# when it has one, else the copy gpu-check.sh left in MOETRAIN_GPU_STATE,
# /tmp/moetrain-gpu-check) and reruns each case recorded failed, crashed or timeout, one
# by one, each in its own process under its own timeout:
#   1. compute-sanitizer --tool memcheck;
#   2. compute-sanitizer --tool racecheck, for the cases memcheck passed.
# Without compute-sanitizer (COMPUTE_SANITIZER, then PATH, then /usr/local/cuda/bin) it
# says so and reruns each case plainly (tool "plain"). Files in OUT_DIR:
#   recheck.tsv  a line per rerun as it ends: kind (test or bench), name, tool
#                (memcheck, racecheck, plain), status (ok, failed, timeout, crashed,
#                skipped), exit code, seconds, note (sanitizer errors: exit 86)
#   recheck.log  the reruns' output (the sanitizers' reports) and this script's
# The binaries and their library path come from gpu-check.sh's env.sh in MOETRAIN_GPU_STATE
# (or MOETRAIN_BIN_DIR, with the caller's LD_LIBRARY_PATH); the path is given to the reruns
# only (with compute-sanitizer, which passes it to the binary it starts), not to this script. Exits 0 when every rerun passed, 1 otherwise, 2 when there is no
# record or no binaries (run launch/gpu-check.sh first).
#
# Knobs (environment): RECHECK_BUDGET total seconds (520: a 540 s call); T_SANITIZE one
# rerun's limit (120, cut to what is left); BENCH_STEPS for bench cases (1).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
repo=$PWD
from=
if [ "${1:-}" = "--from" ]; then from=${2:?usage: launch/gpu-recheck.sh [--from DIR] OUT_DIR}; shift 2; fi
out=${1:?usage: launch/gpu-recheck.sh [--from DIR] OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
state=${MOETRAIN_GPU_STATE:-/tmp/moetrain-gpu-check}
# shellcheck source=launch/gpu-cases.sh
. "$repo/launch/gpu-cases.sh"

budget=${RECHECK_BUDGET:-520}
start=$(date +%s)
exec 3>&2 > >(tee -a "$out/recheck.log") 2>&1
# Straight to the log and the caller's stderr: the tee above may not have written yet at exit.
die() { echo "gpu-recheck: $*" | tee -a "$out/recheck.log" >&3; exit 2; }

if [ -n "$from" ]; then record=$from/cases.tsv
elif [ -f "$out/cases.tsv" ]; then record=$out/cases.tsv
else record=$state/cases.tsv; fi
[ -r "$record" ] || die "no case record at $record: run launch/gpu-check.sh first (docs/cuda.md, \"Proof on a GPU\")"
if [ -n "${MOETRAIN_BIN_DIR:-}" ]; then
  bin=$(cd "$MOETRAIN_BIN_DIR" && pwd) || die "MOETRAIN_BIN_DIR=$MOETRAIN_BIN_DIR is not a directory"
elif [ -r "$state/env.sh" ]; then
  # shellcheck source=/dev/null
  . "$state/env.sh"
else
  die "no $state/env.sh (written by launch/gpu-check.sh on this machine) and no MOETRAIN_BIN_DIR"
fi
for b in moetrain_tests moetrain_bench_cuda; do [ -x "$bin/$b" ] || die "$bin/$b is missing"; done
ours=(env "LD_LIBRARY_PATH=${our_libs-${LD_LIBRARY_PATH:-}}")

sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [ -x "$sanitizer" ] || command -v "$sanitizer" >/dev/null 2>&1; then
  tools="memcheck racecheck"
  echo "== compute-sanitizer: $sanitizer"
else
  tools=plain
  echo "== compute-sanitizer not found ($sanitizer): each case is rerun plainly, without a sanitizer"
fi

# The cases to rerun: kind and name of each failed, crashed or timed-out line.
reruns=$(awk -F'\t' 'NR > 1 && ($3 == "failed" || $3 == "crashed" || $3 == "timeout") {print $1 "\t" $2}' "$record")
rec=$out/recheck.tsv
printf 'kind\tname\ttool\tstatus\trc\tseconds\tnote\n' >"$rec"
n=$(grep -c . <<<"$reruns")
echo "== $n case(s) to rerun from $record (budget $budget s)"
[ -n "$reruns" ] || { echo "== nothing to rerun"; exit 0; }

# One rerun: TOOL (memcheck, racecheck or plain) on KIND NAME; its line goes to recheck.tsv.
rerun() {
  local kind=$1 name=$2 tool=$3 left t cmd tmp rc
  left=$((budget - ($(date +%s) - start) - 5))
  if [ "$left" -lt 3 ]; then
    printf '%s\t%s\t%s\tskipped\t-\t0\tthe budget of %s s was spent\n' "$kind" "$name" "$tool" "$budget" >>"$rec"
    return 2
  fi
  t=${T_SANITIZE:-120}; [ "$t" -lt "$left" ] || t=$left
  if [ "$kind" = bench ]; then cmd=("$bin/moetrain_bench_cuda" --steps "${BENCH_STEPS:-1}" --case "$name")
  else cmd=("$bin/moetrain_tests" "$(catch_spec "$name")" --use-colour no); fi
  [ "$tool" = plain ] || cmd=("$sanitizer" --tool "$tool" --error-exitcode 86 --print-limit 20 "${cmd[@]}")
  cmd=("${ours[@]}" "${cmd[@]}")
  # run_case's record (kind name status rc seconds note) with the tool put in after the name.
  tmp=$(mktemp)
  run_case "$tmp" "$kind" "$name" "$t" "$out/recheck.log" "${cmd[@]}"
  rc=$?
  awk -F'\t' -v OFS='\t' -v tool="$tool" '{ note = $6; if ($4 == 86) note = "the sanitizer reported errors (recheck.log)"
                                            print $1, $2, tool, $3, $4, $5, note }' "$tmp" >>"$rec"
  rm -f "$tmp"
  return "$rc"
}

bad=0
while IFS=$'\t' read -r kind name; do
  [ -n "$name" ] || continue
  for tool in $tools; do
    # racecheck only for the cases memcheck passed.
    if rerun "$kind" "$name" "$tool"; then continue; fi
    bad=1
    break
  done
done <<<"$reruns"
echo "== done in $(($(date +%s) - start)) s (recheck.tsv)"
exit "$bad"
