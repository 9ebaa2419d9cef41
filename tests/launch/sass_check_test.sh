#!/usr/bin/env bash
# The tensor-core attention kernels' machine code, checked without a GPU
# (docs/cuda.md, "Attention on tensor cores", has the counts): `cuobjdump -sass`
# of the built attention_tc_cuda object, per kernel that uses the tensor cores
# (HMMA):
#   - LDSM (ldmatrix) at least one per 4 HMMA: every tile product is two HMMA
#     and reads its A and B tiles with one LDSM each, or fewer HMMA per LDSM
#     where a register-path A tile feeds several B tiles (measured with CUDA 13.0:
#     0.68 to 1.0 LDSM per HMMA); a compiler that loses the .shared window turns
#     them into generic loads and the ratio into 0 (the wmma version: 0 LDSM);
#   - generic loads (LD.E*, which also serve shared memory, at a generic
#     address) at most 8: measured 0 in every kernel; one tile load that goes
#     generic again costs 4 or more per unrolled copy (the wmma version had
#     6,392 LD.E, 88 to 800 a kernel);
#   - LDGSTS (cp.async staging) present.
# cuobjdump: $MOETRAIN_CUOBJDUMP, else the toolkit's or PATH's, else NVIDIA's
# wheel (nvidia-cuda-cuobjdump, pinned, --no-deps) installed into a venv beside
# the object's build directory and reused. Only when PyPI cannot be reached does
# the check skip (exit 77, ctest's SKIP_RETURN_CODE), saying so loudly; any other
# install failure fails it.
#   tests/launch/sass_check_test.sh OBJECT [BUILD_DIR]   (ctest: attention_sass)
# --self-test OBJECT: the check must reject OBJECT for missing LDSM and generic
# loads (ctest attention_sass_rejects_wmma: tests/launch/sass_check_wmma.cu, the
# wmma pattern the kernels had before; by hand: the object built from that version).
set -euo pipefail
expect_fail=0
if [ "${1:-}" = --self-test ]; then expect_fail=1; shift; fi
obj=${1:?usage: sass_check_test.sh [--self-test] OBJECT [BUILD_DIR]}
build=${2:-$(dirname "$obj")}
[ -f "$obj" ] || { echo "sass_check: no object file $obj (build with -DMOETRAIN_CUDA=ON first)" >&2; exit 1; }

cuobjdump=${MOETRAIN_CUOBJDUMP:-}
if [ -z "$cuobjdump" ]; then
  for c in /usr/local/cuda/bin/cuobjdump "$(command -v cuobjdump || true)"; do
    [ -n "$c" ] && [ -x "$c" ] && { cuobjdump=$c; break; }
  done
fi
if [ -z "$cuobjdump" ]; then
  venv=$build/venv-cuobjdump
  cuobjdump=$(ls "$venv"/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump 2>/dev/null | head -n 1 || true)
  if [ -z "$cuobjdump" ]; then
    rm -rf "$venv"
    log=$venv.log
    if ! { python3 -m venv "$venv" >"$log" 2>&1 &&
           timeout 300 "$venv/bin/pip" install --disable-pip-version-check --no-deps --timeout 30 \
             "nvidia-cuda-cuobjdump==13.2.86" "nvidia-cuda-nvdisasm==13.2.86" >>"$log" 2>&1; }; then
      # Unreachable: pip's connection warnings (shown without -q), or an index that
      # lists no version at all of a package PyPI has (retries off hide the warnings).
      unreachable="NewConnectionError|Max retries exceeded|Temporary failure in name resolution|Network is unreachable"
      unreachable+="|Connection refused|ProxyError|ConnectTimeout|ReadTimeout|timed out|\\(from versions: none\\)"
      if grep -qiE "$unreachable" "$log"; then
        echo "************************************************************************" >&2
        echo "sass_check: SKIPPED - PyPI cannot be reached, so cuobjdump (nvidia-cuda-cuobjdump)" >&2
        echo "could not be installed into $venv (log: $log). The attention kernels' SASS is NOT" >&2
        echo "checked. Set MOETRAIN_CUOBJDUMP to a cuobjdump to run the check offline." >&2
        echo "************************************************************************" >&2
        exit 77
      fi
      tail -n 20 "$log" >&2
      echo "sass_check: installing nvidia-cuda-cuobjdump into $venv failed (log: $log)" >&2
      exit 1
    fi
    cuobjdump=$(ls "$venv"/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump | head -n 1)
  fi
fi

sass=$(mktemp)
why=$(mktemp)
trap 'rm -f "$sass" "$why"' EXIT
"$cuobjdump" -sass "$obj" >"$sass" || { echo "sass_check: $cuobjdump -sass $obj failed" >&2; exit 1; }

# Per kernel: HMMA, LDSM, generic loads, LDGSTS; then the verdict.
verdict=0
awk -v expect_fail="$expect_fail" '
  function flush() {
    if (name == "") return
    printf "%-6d %-6d %-6d %-6d %s\n", hmma, ldsm, lde, ldgsts, name
    if (hmma > 0) {
      kernels++
      if (ldsm * 4 < hmma) { bad++; why = why "\n  " name ": " ldsm " LDSM for " hmma " HMMA (want >= HMMA/4)" }
      if (lde > 8) { bad++; why = why "\n  " name ": " lde " generic loads LD.E (want <= 8)" }
      if (ldgsts == 0) { bad++; why = why "\n  " name ": no LDGSTS (cp.async staging)" }
    }
    tl += ldsm; th += hmma; te += lde; tg += ldgsts
  }
  BEGIN { print "HMMA   LDSM   LD.E   LDGSTS kernel" }
  /Function : / { flush(); name = $NF; hmma = ldsm = lde = ldgsts = 0; next }
  /[[:space:]]HMMA[.[:space:]]/ { hmma++ }
  /[[:space:]]LDSM[.[:space:]]/ { ldsm++ }
  /[[:space:]]LD\.E[.[:space:];]/ { lde++ }
  /[[:space:]]LDGSTS[.[:space:]]/ { ldgsts++ }
  END {
    flush()
    printf "%-6d %-6d %-6d %-6d total (%d kernels with HMMA)\n", th, tl, te, tg, kernels
    if (kernels == 0) { print "sass_check: no kernel with HMMA in the object" > "/dev/stderr"; exit 1 }
    if (bad > 0) { print "sass_check: " bad " violation(s):" why > "/dev/stderr"; exit 1 }
  }' "$sass" 2>"$why" || verdict=1
cat "$why" >&2

if [ "$expect_fail" = 1 ]; then
  # Rejected for the operand loads themselves, not for finding no kernel at all.
  if [ "$verdict" = 1 ] && grep -q " LDSM for " "$why" && grep -q " generic loads LD.E " "$why"; then
    echo "sass_check --self-test: the check rejects $obj (no LDSM, generic loads), as it must"
    exit 0
  fi
  echo "sass_check --self-test: the check did not reject $obj for its generic operand loads" >&2
  exit 1
fi
[ "$verdict" = 0 ] || { echo "sass_check: FAILED on $obj (cuobjdump: $cuobjdump)" >&2; exit 1; }
echo "sass_check: ok ($obj)"
