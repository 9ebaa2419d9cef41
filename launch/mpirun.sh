#!/usr/bin/env bash
# mpirun, with stop signals that reach the ranks the way moetrain expects them
# (docs/checkpoints.md, "Signals"):
#
#   launch/mpirun.sh [mpirun arguments ...]      e.g. launch/mpirun.sh -np 4 build/moetrain train -c CONFIG
#
# Open MPI's mpirun forwards SIGUSR1 and SIGUSR2 to every rank, but answers
# SIGTERM, SIGINT and SIGHUP itself by tearing the job down: SIGCONT, SIGTERM
# odls_base_sigkill_timeout (1 s) later, SIGKILL 1 s after that, which leaves
# the ranks no time to save, and it exits 1 whatever they do. Here mpirun runs
# in a process group of its own (a terminal's Ctrl-C reaches only this script)
# and SIGTERM, SIGINT and SIGHUP are passed on as SIGUSR2, which moetrain takes
# as the preemption they are: every rank saves a checkpoint at the end of the
# step and exits 75. SIGUSR1 passes through (save and exit, 0). The exit code is
# mpirun's. mpirun's stdin is /dev/null (moetrain reads none).
set -uo pipefail

set -m  # background jobs get their own process group
mpirun "$@" </dev/null &
pid=$!
set +m
trap 'kill -USR2 "$pid" 2>/dev/null' TERM INT HUP
trap 'kill -USR1 "$pid" 2>/dev/null' USR1
trap 'kill -USR2 "$pid" 2>/dev/null' USR2
# A trapped signal interrupts `wait`: wait again until mpirun itself has ended.
status=0
while true; do
  wait "$pid"
  status=$?
  kill -0 "$pid" 2>/dev/null || break
done
exit "$status"
