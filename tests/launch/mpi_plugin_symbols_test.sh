#!/usr/bin/env bash
# The MPI plugin (libmoetrain_mpi.so, docs/distributed.md "MPI is loaded only under a
# launcher") takes our own symbols from the executable that loads it. A symbol only the
# plugin uses is dropped from an executable by the static link, and the plugin then fails
# to load under mpirun ("undefined symbol"). This checks, without mpirun, that every
# moetrain symbol the plugin needs is exported by each executable given, and that no
# executable links Open MPI or NCCL itself.
#   tests/launch/mpi_plugin_symbols_test.sh PLUGIN EXE...
set -euo pipefail
plugin=${1:?usage: mpi_plugin_symbols_test.sh PLUGIN EXE...}
shift
fail() { echo "FAIL: $*" >&2; exit 1; }
[ -f "$plugin" ] || fail "no plugin at $plugin"
need=$(nm -D --undefined-only "$plugin" | awk '{print $NF}' | grep 'moetrain' | sort -u)
[ -n "$need" ] || fail "$plugin needs no moetrain symbol: is it the plugin?"
nm -D --defined-only "$plugin" | awk '{print $NF}' | grep -qx moetrain_mpi_plugin || fail "$plugin lacks moetrain_mpi_plugin"
for exe in "$@"; do
  missing=$(comm -23 <(echo "$need") <(nm -D --defined-only "$exe" | awk '{print $NF}' | sort -u))
  [ -z "$missing" ] || fail "$exe does not export what $plugin needs:
$(echo "$missing" | c++filt)"
  linked=$(readelf -d "$exe" | grep -E 'NEEDED.*(libmpi|libopen-|libnccl)' || true)
  [ -z "$linked" ] || fail "$exe links MPI or NCCL itself: $linked"
  echo "$(basename "$exe"): exports the $(echo "$need" | wc -l) symbols the plugin needs; no MPI, no NCCL"
done
echo "mpi plugin symbols test passed"
