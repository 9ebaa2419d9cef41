#!/usr/bin/env bash
# Training on several machines with Open MPI and a hostfile.
#
#   launch/multinode.sh [--iface IFACE] HOSTFILE N CONFIG [--set key=value ...]
#
# HOSTFILE: Open MPI's format, one line per node, e.g. "node1 slots=8". N ranks
# in all. Every node needs the same checkout at the same path, built
# (launch/build.sh), with the data the config names, and password-less ssh from
# this node. Threads per rank = cores of a node / ranks on it, unless
# train.threads is set. Expert parallelism: --set train.ep=E (E divides N; the E
# ranks of an expert group are consecutive, so E <= slots per node keeps the
# all-to-all inside a node).
#
# --iface IFACE: the network between the nodes, as an interface name (eth1,
# ib0) or a subnet (10.0.0.0/16). MPI's TCP traffic and its launcher's wire-up
# stay on it (btl_tcp_if_include, oob_tcp_if_include; shared memory inside a
# node), and NCCL's bootstrap for GPU runs (NCCL_SOCKET_IFNAME, names only).
# Without it Open MPI picks interfaces itself, which fails on hosts with
# docker0/virbr0 bridges or several private networks.
#
# Environment: BUILD_DIR (default build), MOETRAIN_MPIRUN_ARGS (more mpirun
# arguments, e.g. "--mca plm_rsh_agent ssh -x FOO"; tests/cli/cluster_test.cpp
# passes an agent that enters network namespaces this way).
set -euo pipefail
cd "$(dirname "$0")/.."

usage="usage: launch/multinode.sh [--iface IFACE] HOSTFILE N CONFIG [--set key=value ...]"
iface=""
if [[ ${1:-} == --iface ]]; then
  [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
  iface=$2
  shift 2
fi
if [[ $# -lt 3 ]]; then
  echo "$usage" >&2
  exit 2
fi
hostfile=$1 ranks=$2 config=$3
shift 3
build_dir=${BUILD_DIR:-build}
[[ -f "$hostfile" ]] || { echo "launch/multinode.sh: no hostfile '$hostfile'" >&2; exit 2; }
[[ "$ranks" =~ ^[1-9][0-9]*$ ]] || { echo "launch/multinode.sh: N must be a rank count, got '$ranks'" >&2; exit 2; }
[[ -f "$config" ]] || { echo "launch/multinode.sh: no config file '$config'" >&2; exit 2; }
bin=$build_dir/moetrain
[[ $bin == /* ]] || bin=$PWD/$bin
[[ -x $bin ]] || { echo "launch/multinode.sh: $bin is missing; run launch/build.sh" >&2; exit 2; }

mpi_flags=(--hostfile "$hostfile" --map-by slot --bind-to none -x PATH -x LD_LIBRARY_PATH)
[[ $(id -u) -eq 0 ]] && mpi_flags+=(--allow-run-as-root)
if [[ -n $iface ]]; then
  mpi_flags+=(--mca btl self,vader,tcp --mca btl_tcp_if_include "$iface" --mca oob_tcp_if_include "$iface")
  [[ $iface == */* ]] || mpi_flags+=(-x "NCCL_SOCKET_IFNAME=$iface")
fi
# shellcheck disable=SC2206  # word splitting of the extra arguments is wanted
extra=(${MOETRAIN_MPIRUN_ARGS:-})
# launch/mpirun.sh: SIGTERM, SIGINT and SIGHUP reach the ranks as a stop with a
# checkpoint (exit 75) instead of mpirun's teardown (docs/checkpoints.md, "Signals").
exec launch/mpirun.sh -np "$ranks" "${mpi_flags[@]}" "${extra[@]}" "$bin" train -c "$config" "$@"
