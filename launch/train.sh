#!/usr/bin/env bash
# The first command on a fresh machine: installs missing Debian packages, builds,
# tokenizes the shipped tinyshakespeare corpus, trains a small GPT-2
# (configs/gpt2-shakespeare.yaml) on the CPU and prints a sample from it.
# Extra arguments go to `moetrain train`, e.g.  launch/train.sh --set train.max_steps=50
set -euo pipefail
cd "$(dirname "$0")/.."

launch/setup.sh
launch/build.sh

if [[ ! -f data/shakespeare/val_000000.bin ]]; then
  build/moetrain prepare data/tinyshakespeare.txt --out data/shakespeare --tokenizer gpt2
fi
build/moetrain train -c configs/gpt2-shakespeare.yaml "$@"

run_dir=$(build/moetrain train -c configs/gpt2-shakespeare.yaml "$@" --print-config | sed -n 's/^  dir: //p' | tr -d "'\"")
echo
echo "== sample from ${run_dir}/model =="
build/moetrain generate --checkpoint "${run_dir}/model" --prompt "ROMEO:" --max-new-tokens 200 \
  --temperature 0.8 --top-k 40 --seed 1
