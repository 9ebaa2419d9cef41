#!/usr/bin/env bash
# k3-shakespeare with AdamW and with MuonClip (train.optimizer muon, train.qk_clip)
# at the same steps, one process, 2 threads (docs/training.md, "AdamW and Muon side
# by side"), then the comparison table (bench/side_by_side.py) and the plot.
#   bench/muon_side_by_side.sh OUT_DIR ["adamw 3e-3" "muon 3e-3" ...]
# Default runs: AdamW and Muon at the config's lr (3e-3). Needs build/moetrain.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/muon_side_by_side.sh OUT_DIR [\"OPTIMIZER LR\" ...]}
shift || true
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=("adamw 3e-3" "muon 3e-3")
mkdir -p "$out"
[ -f "$out/data/train_000000.bin" ] ||
  build/moetrain prepare data/tinyshakespeare.txt --out "$out/data" --tokenizer byte > "$out/prepare.log"
runs=()
for spec in "${specs[@]}"; do
  read -r opt lr <<< "$spec"
  name="$opt-$lr"
  clip=false
  [ "$opt" = muon ] && clip=true
  build/moetrain train -c configs/k3-shakespeare.yaml --set "data.train=$out/data/train_*.bin" \
    --set "data.val=$out/data/val_*.bin" --set train.optimizer="$opt" --set train.lr="$lr" \
    --set train.min_lr="$(/usr/bin/python3 -c "print($lr / 10)")" --set train.qk_clip=$clip \
    --set train.threads=2 --set run.dir="$out/runs/$name" --set run.overwrite=true > "$out/$name.log" 2>&1
  runs+=("$out/runs/$name")
done
/usr/bin/python3 bench/side_by_side.py "${runs[@]}"
/usr/bin/python3 launch/plot.py "${runs[@]}" -o "$out/side_by_side.png" --title "k3-shakespeare: ${specs[*]}"
