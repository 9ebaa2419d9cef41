#!/usr/bin/python3
"""Validation loss of several runs at equal steps and at equal optimizer-step time
(bench/muon_side_by_side.sh): the time is the sum of step_ms up to each evaluation,
so evaluations and pauses between steps do not count.

    bench/side_by_side.py RUN_DIR [RUN_DIR ...]
"""
import json
import os
import sys


def load(run_dir):
    """{step: (val_loss, seconds of steps so far)} and the total seconds of steps."""
    val, seconds = {}, 0.0
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if "val_loss" in r:
                val[r["step"]] = (r["val_loss"], seconds)
            elif "step_ms" in r:
                seconds += r["step_ms"] / 1000
    return val, seconds


def main():
    runs = sys.argv[1:]
    if not runs:
        sys.exit(__doc__)
    data = {r: load(r) for r in runs}
    names = [os.path.basename(os.path.normpath(r)) for r in runs]
    print("| step | " + " | ".join(f"{n}: val loss (s of steps)" for n in names) + " |")
    print("|---|" + "---|" * len(runs))
    for step in sorted(data[runs[0]][0]):
        cells = [f"{data[r][0][step][0]:.4f} ({data[r][0][step][1]:.0f} s)" if step in data[r][0] else "-"
                 for r in runs]
        print(f"| {step} | " + " | ".join(cells) + " |")
    for n, r in zip(names, runs):
        print(f"{n}: {data[r][1]:.0f} s of steps in all")


if __name__ == "__main__":
    main()
