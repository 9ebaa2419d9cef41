# shellcheck shell=bash
# Sourced by launch/gpu-check.sh and launch/gpu-recheck.sh (docs/cuda.md, "Proof on a
# GPU"): run one test case or bench row in its own process under its own timeout, and
# append its line to a case record the moment it ends, so a crash (SIGSEGV, abort, a
# sticky CUDA error that poisons its process) costs that case only. Functions only; bash.
#
#   case_header FILE                       writes the record's header line
#   catch_spec NAME                        NAME as a Catch2 test spec matching it alone
#                                          (\ , [ ] " * escaped)
#   run_case FILE KIND NAME T LOG CMD...   CMD under `timeout T` (output appended to LOG,
#                                          stdin closed), then one record line:
#     kind  name  status  rc  seconds  note
#   status: ok; failed (a non-zero exit); timeout (killed at T s); crashed (killed by a
#   signal, named in the note, e.g. SIGSEGV); skipped (rc "-": not run, the note says why).

case_header() { printf 'kind\tname\tstatus\trc\tseconds\tnote\n' >"$1"; }

case_line() {  # case_line FILE KIND NAME STATUS RC SECONDS NOTE
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$2" "$3" "$4" "$5" "$6" "${7:-}" >>"$1"
}

catch_spec() {
  local s=$1
  s=${s//\\/\\\\}
  s=${s//,/\\,}
  s=${s//\[/\\[}
  s=${s//\]/\\]}
  s=${s//\"/\\\"}
  s=${s//\*/\\*}
  printf '%s' "$s"
}

run_case() {
  local file=$1 kind=$2 name=$3 t=$4 log=$5 s0 rc secs status note=
  shift 5
  s0=$(date +%s.%N)
  echo "== $kind: $name (limit $t s)" >>"$log"
  timeout --kill-after=5 "$t" "$@" >>"$log" 2>&1 </dev/null
  rc=$?
  secs=$(awk -v s="$s0" -v n="$(date +%s.%N)" 'BEGIN {printf "%.1f", n - s}')
  case $rc in
    0) status=ok ;;
    124) status=timeout note="killed at its limit of $t s" ;;
    *)
      if [ "$rc" -gt 128 ]; then
        # 137 (SIGKILL) at the limit is timeout's --kill-after; earlier, a real kill (OOM killer).
        if [ "$rc" = 137 ] && awk -v s="$secs" -v t="$t" 'BEGIN {exit !(s >= t)}'; then
          status=timeout note="killed (SIGKILL) at its limit of $t s"
        else
          status=crashed note="SIG$(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128)))"
        fi
      else
        status=failed
      fi ;;
  esac
  case_line "$file" "$kind" "$name" "$status" "$rc" "$secs" "$note"
  echo "== $kind: $name: $status (exit $rc, $secs s) $note" >>"$log"
  echo "   $kind: $name: $status ($secs s) $note"
  [ "$status" = ok ]
}
