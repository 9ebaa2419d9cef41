#!/usr/bin/env bash
# The evolution ladder (docs/evolution.md): trains every rung of configs/evolution/
# on tinyshakespeare bytes and on two synthetic memory tasks, then writes the table
# and the validation curves: to OUT/evolution.md and OUT/images/evolution.png, or
# with --doc to the shipped docs/evolution.md and docs/images/evolution.png.
#
#   launch/evolution.sh [--rungs 01,03,05] [--steps N] [--task-steps N] [--out DIR] [--doc [FILE]] [--threads N]
#                       [--data DIR] [--set key=value ...]
#     --rungs       a subset by number (default: all seven)
#     --steps       override train.max_steps of the language-model runs (a quick run);
#                   evaluation then happens every max(1, N/4) steps
#     --task-steps  steps of each memory-task run (default 300)
#     --out         run directories and, without --doc, the report (default runs/evolution,
#                   which git ignores)
#     --doc         write the report to the shipped docs/evolution.md (or FILE) instead; its
#                   plot goes next to it, under images/. Only for updating the docs.
#     --threads     train.threads of every run (default 1: on a busy 2-core machine two
#                   threads stall at OpenMP barriers: DeltaNet took 2.4 s per step with two, 0.3 s with one)
#     --data        tokenized tinyshakespeare bytes (default data/shakespeare_byte, prepared when missing)
#     --set         an override for every run, after the script's own (e.g. train.eval_batches=1)
# Needs build/moetrain (launch/build.sh; MOETRAIN_BIN names another binary).
#
# Memory tasks (data.synthetic, seeded; held-out rows from another seed): 32 keys,
# 32 values, 24 key-value pairs per row, 8 queries; the recurrent rungs hold a 16 x 16
# state per head, so 24 pairs exceed a head's key dimension. repeated_key binds 8 of
# the keys twice and asks for the later value. Batches of 32 rows of 63 tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
command="launch/evolution.sh${*:+ $*}"

rungs=""
steps=""
task_steps=300
out=runs/evolution
doc=""
threads=1
data=data/shakespeare_byte
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rungs) rungs=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --task-steps) task_steps=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --doc)  # an optional FILE: the next argument unless it is another option
      if [[ $# -gt 1 && "$2" != -* ]]; then doc=$2; shift 2; else doc=docs/evolution.md; shift; fi ;;
    --threads) threads=$2; shift 2 ;;
    --data) data=$2; shift 2 ;;
    --set) extra+=(--set "$2"); shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "launch/evolution.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for n in "$steps" "$task_steps" "$threads"; do
  [[ -z "$n" || "$n" =~ ^[1-9][0-9]*$ ]] || { echo "launch/evolution.sh: '$n' is not a positive count" >&2; exit 2; }
done

bin=${MOETRAIN_BIN:-build/moetrain}
[[ -x "$bin" ]] || { echo "launch/evolution.sh: $bin is missing; run launch/build.sh first" >&2; exit 2; }

configs=()
if [[ -z "$rungs" ]]; then
  configs=(configs/evolution/0[1-7]-*.yaml)
else
  IFS=, read -ra picked <<< "$rungs"
  for r in "${picked[@]}"; do
    match=(configs/evolution/"$r"-*.yaml)
    [[ -f "${match[0]}" ]] || { echo "launch/evolution.sh: no rung '$r' in configs/evolution (01..07)" >&2; exit 2; }
    configs+=("${match[0]}")
  done
fi

if ! ls "$data"/train_*.bin > /dev/null 2>&1; then
  "$bin" prepare data/tinyshakespeare.txt --out "$data" --tokenizer byte
fi

task_keys=(--set data.synthetic_num_keys=32 --set data.synthetic_num_values=32 --set data.synthetic_num_pairs=24
           --set data.synthetic_num_queries=8 --set data.synthetic_num_rebinds=8 --set train.seq_len=63
           --set train.batch_size=32 --set "train.max_steps=$task_steps" --set train.warmup_steps=30
           --set "train.eval_every=$task_steps" --set train.eval_batches=8 --set train.weight_decay=0.0)
lm_keys=()
if [[ -n "$steps" ]]; then
  every=$(( steps / 4 > 0 ? steps / 4 : 1 ))
  warm=$(( steps / 10 ))
  lm_keys=(--set "train.max_steps=$steps" --set "train.eval_every=$every" --set "train.warmup_steps=$warm")
fi

mkdir -p "$out"
doc=${doc:-$out/evolution.md}  # the default report stays with the runs, out of git's tree
for config in "${configs[@]}"; do
  rung=$(basename "$config" .yaml)
  echo "== $rung"
  "$bin" ledger --json -c "$config" > "$out/$rung.ledger.json"
  rm -rf "$out/$rung" "$out/$rung-assoc_recall" "$out/$rung-repeated_key"
  "$bin" train -c "$config" --set "run.dir=$out/$rung" --set "train.threads=$threads" "${lm_keys[@]}" \
    --set "data.train=$data/train_*.bin" --set "data.val=$data/val_*.bin" "${extra[@]}" \
    > "$out/$rung.log" 2>&1 || { tail -20 "$out/$rung.log"; exit 1; }
  grep "val loss" "$out/$rung.log" | tail -1
  for task in assoc_recall repeated_key; do
    "$bin" train -c "$config" --set "run.dir=$out/$rung-$task" --set "train.threads=$threads" \
      --set "data.synthetic=$task" "${task_keys[@]}" "${extra[@]}" > "$out/$rung-$task.log" 2>&1 \
      || { tail -20 "$out/$rung-$task.log"; exit 1; }
    grep "val acc" "$out/$rung-$task.log" | tail -1
  done
done

/usr/bin/python3 launch/evolution_report.py --out "$out" --doc "$doc" \
  --threads "$threads" --command "$command" "${configs[@]}"
