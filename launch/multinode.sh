#!/usr/bin/env bash
# Training on several machines with Open MPI and a hostfile.
#
#   launch/multinode.sh HOSTFILE N CONFIG [--set key=value ...]
#
# HOSTFILE: Open MPI's format, one line per node, e.g. "node1 slots=8". N ranks
# in all. Every node needs the same checkout at the same path, built
# (launch/build.sh), with the data the config names, and password-less ssh from
# this node. Threads per rank = cores of a node / ranks on it, unless
# train.threads is set. Expert parallelism: --set train.ep=E (E divides N; the E
# ranks of an expert group are consecutive, so E <= slots per node keeps the
# all-to-all inside a node).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $# -lt 3 ]]; then
  echo "usage: launch/multinode.sh HOSTFILE N CONFIG [--set key=value ...]" >&2
  exit 2
fi
hostfile=$1 ranks=$2 config=$3
shift 3
[[ -f "$hostfile" ]] || { echo "launch/multinode.sh: no hostfile '$hostfile'" >&2; exit 2; }
[[ "$ranks" =~ ^[1-9][0-9]*$ ]] || { echo "launch/multinode.sh: N must be a rank count, got '$ranks'" >&2; exit 2; }
[[ -f "$config" ]] || { echo "launch/multinode.sh: no config file '$config'" >&2; exit 2; }
[[ -x build/moetrain ]] || { echo "launch/multinode.sh: build/moetrain is missing; run launch/build.sh" >&2; exit 2; }

mpi_flags=(--hostfile "$hostfile" --map-by slot --bind-to none -x PATH -x LD_LIBRARY_PATH)
[[ $(id -u) -eq 0 ]] && mpi_flags+=(--allow-run-as-root)
exec mpirun -np "$ranks" "${mpi_flags[@]}" "$PWD/build/moetrain" train -c "$config" "$@"
