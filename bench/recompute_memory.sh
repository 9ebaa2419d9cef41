#!/usr/bin/env bash
# Peak RSS and step time of hybrid training without activation recomputation, with
# whole layers recomputed (train.activation_checkpointing) and with the selective
# modules (train.recompute_modules=act,experts), against `moetrain ledger`'s memory per rank, on
# k3-small (one process) and k3-topology-mini (mpirun -np 4: ep 4, pp 2 x ep 2, pp 2 x V 2 x ep 2): the numbers of
# docs/performance.md#activation-recomputation. Peak RSS is the trainer's own line
# "memory per rank: peak RSS ... peak / predicted = R" (src/train/trainer.cpp: the
# largest rank's peak resident set during training, against the ledger's estimate plus
# what the process held before the model was built); the final model save after
# training is not in it. The step time is the median of the logged steps after the
# first. Usage (from the repository root, after launch/build.sh):
#   bench/recompute_memory.sh [STEPS]      (default 4 steps per run)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MOETRAIN_BIN:-build/moetrain}
STEPS=${1:-4}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$BIN" prepare data/tinyshakespeare.txt --out "$WORK/gpt2" --tokenizer gpt2 >/dev/null
"$BIN" prepare data/tinyshakespeare.txt --out "$WORK/byte" --tokenizer byte >/dev/null
MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca btl_vader_single_copy_mechanism none"

run() {  # name config np data [extra --set options] [modes]
  local name=$1 config=$2 np=$3 data=$4 extra=${5:-} modes=${6:-none full selective}
  for mode in $modes; do
    local recompute="--set train.activation_checkpointing=false"
    [ "$mode" = full ] && recompute="--set train.activation_checkpointing=true"
    [ "$mode" = selective ] && recompute="--set train.recompute_modules=act,experts"
    local sets="--set data.train=$data/train_*.bin --set data.val= --set train.max_steps=$STEPS --set train.eval_every=0
      --set train.sample_every=0 --set train.log_every=1 --set ckpt.every=0 --set run.dir=$WORK/run_${name}_$mode
      $recompute $extra"
    local launch=()
    [ "$np" -gt 1 ] && launch=($MPIRUN -np "$np" -x OMP_NUM_THREADS=$((2 / np > 0 ? 2 / np : 1)))
    # shellcheck disable=SC2086
    "${launch[@]}" "$BIN" train -c "$config" $sets >"$WORK/log" 2>&1 || { cat "$WORK/log"; exit 1; }
    local memory step_ms
    memory=$(grep -o "memory per rank: peak RSS .*" "$WORK/log" | sed 's/memory per rank: //')
    step_ms=$(grep -o "| [0-9]* ms |" "$WORK/log" | awk '{print $2}' | tail -n +2 | sort -n |
      awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}')
    printf "%-17s recompute %-9s step %6s ms  %s\n" "$name" "$mode" "$step_ms" "$memory"
  done
}

echo "# $(lscpu | grep 'Model name' | sed 's/ *Model name: *//'), $(nproc) cores, $STEPS steps per run"
run k3-small configs/k3-small.yaml 1 "$WORK/gpt2"
run k3-topology-mini configs/k3-topology-mini.yaml 4 "$WORK/byte"
# Pipelines at 4 ranks: pp 2 x ep 2, and with two virtual stages per rank (train.pp_virtual).
run mini-pp2-ep2 configs/k3-topology-mini.yaml 4 "$WORK/byte" "--set train.pp=2 --set train.ep=2 --set train.grad_accum=2" "none full"
run mini-pp2v2-ep2 configs/k3-topology-mini.yaml 4 "$WORK/byte" \
  "--set train.pp=2 --set train.pp_virtual=2 --set train.ep=2 --set train.grad_accum=2" "none full"
