#!/usr/bin/env bash
# Trains a model: installs missing Debian packages, builds, tokenizes the shipped
# tinyshakespeare corpus when the config's data is missing, trains, and prints a
# sample from the trained model.
#
#   launch/train.sh [-n N] [--set key=value ...]
#       the quickstart: the K3-style hybrid (configs/k3-shakespeare.yaml) on the
#       bytes of tinyshakespeare, on 2 ranks (-n N: N) with its experts sharded over
#       them (train.ep = the rank count), about four minutes on 2 cores
#   launch/train.sh [-n N] CONFIG [--set key=value ...]
#       -n N    N ranks on this machine under mpirun (oversubscribed if N > cores;
#               threads per rank = cores / N unless train.threads is set). With an
#               MoE config, --set train.ep=E shards the experts over E ranks.
#   e.g. launch/train.sh -n 4 configs/k3-tiny.yaml --set train.ep=4
# The run continues from its newest checkpoint when there is one (ckpt.resume
# auto, unless --set ckpt.resume=... says otherwise): after a crash or a stop
# signal (Ctrl-C, SIGTERM: a checkpoint at the end of the step, exit 75), run the
# same command again. Several nodes: launch/multinode.sh; Slurm: launch/slurm.sbatch.
set -euo pipefail
cd "$(dirname "$0")/.."

ranks=
if [[ "${1:-}" == "-n" ]]; then
  [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || { echo "launch/train.sh: -n needs a rank count, got '${2:-}'" >&2; exit 2; }
  ranks=$2
  shift 2
fi
if [[ $# -gt 0 && "$1" != -* ]]; then
  config=$1
  shift
  ranks=${ranks:-1}
else
  # The quickstart: 2 ranks unless -n says otherwise, the experts sharded over all of
  # them (its 16 experts divide over 1, 2, 4, 8 or 16 ranks; the trainer refuses
  # other counts, naming train.ep), and the config's batch split over the ranks
  # below (train.batch_size is per rank): every -n trains the same run.
  config=configs/k3-shakespeare.yaml
  ranks=${ranks:-2}
  quickstart=1
  set -- --set train.ep="$ranks" "$@"
fi
[[ -f "$config" ]] || { echo "launch/train.sh: no config file '$config'" >&2; exit 2; }

# MOETRAIN_SKIP_SETUP=1: the packages and build/ are there already (the docs test,
# tests/docs/doc_commands.py, runs this right after the test command built).
if [[ "${MOETRAIN_SKIP_SETUP:-0}" != 1 ]]; then
  launch/setup.sh
  launch/build.sh
fi
set -- --set ckpt.resume=auto "$@"

# Tokenize the shipped corpus for the config's tokenizer when its shards are missing.
resolved=$(build/moetrain train -c "$config" "$@" --print-config)
train_glob=$(sed -n 's/^  train: //p' <<<"$resolved" | head -1 | tr -d "'\"")
tokenizer=$(sed -n 's/^  tokenizer: //p' <<<"$resolved" | head -1 | tr -d "'\"")
data_dir=$(dirname "$train_glob")
if [[ -n "${quickstart:-}" ]]; then
  batch=$(sed -n 's/^  batch_size: //p' <<<"$resolved" | head -1)
  if (( batch % ranks == 0 )); then set -- --set train.batch_size=$(( batch / ranks )) "$@"; fi
fi
if [[ "$data_dir" == data/shakespeare* ]] && ! compgen -G "$train_glob" >/dev/null; then
  build/moetrain prepare data/tinyshakespeare.txt --out "$data_dir" --tokenizer "$tokenizer"
fi

if [[ "$ranks" -gt 1 ]]; then
  mpi_flags=(--oversubscribe --bind-to none)
  [[ $(id -u) -eq 0 ]] && mpi_flags+=(--allow-run-as-root)
  # launch/mpirun.sh: Ctrl-C and SIGTERM reach the ranks as a stop (a checkpoint), not as mpirun's teardown.
  launch/mpirun.sh -np "$ranks" "${mpi_flags[@]}" build/moetrain train -c "$config" "$@"
else
  build/moetrain train -c "$config" "$@"
fi

run_dir=$(sed -n 's/^  dir: //p' <<<"$resolved" | tail -1 | tr -d "'\"")
# About as much text either way (a GPT-2 BPE token is ~4 bytes of English), within
# the model's context after the prompt (generate refuses more than fits).
tokens=200
[[ "$tokenizer" == byte ]] && tokens=600
n_ctx=$(sed -n 's/^  n_ctx: //p' <<<"$resolved" | head -1)
[[ "$n_ctx" =~ ^[0-9]+$ ]] && (( tokens > n_ctx - 16 )) && tokens=$(( n_ctx > 32 ? n_ctx - 16 : n_ctx / 2 ))
echo
echo "== sample from ${run_dir}/model =="
build/moetrain generate --checkpoint "${run_dir}/model" --prompt "ROMEO:" --max-new-tokens "$tokens" \
  --temperature 0.8 --top-k 40 --seed 1
