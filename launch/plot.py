#!/usr/bin/python3
"""Plots of training runs from their metrics.jsonl (docs/training.md), several runs overlaid.

    launch/plot.py RUN_DIR [RUN_DIR ...] [-o loss.png] [--title TEXT]

RUN_DIR is a run directory (run.dir, holding metrics.jsonl) or a metrics.jsonl file.
Panels: train loss with validation loss (dashed), learning rate, gradient norm (log
scale), tokens/s, and the MoE load imbalance (max/mean tokens per expert over the MoE
layers; 1 = balanced) when a run has MoE layers, and the largest attention logit of
each step (max_logit, recorded with train.qk_clip) when a run has it. Skipped steps (train.nan_policy) are
marked on the loss panel. A resumed run's file is one history (the trainer drops
records after the checkpoint it resumed from).

Uses Debian's matplotlib (python3-matplotlib, installed by launch/setup.sh) through
/usr/bin/python3. Prints one summary line per run. Exit code 2 names the path when a
run has no readable metrics.
"""
import argparse
import json
import os
import sys


def fail(message):
    print(f"plot.py: {message}", file=sys.stderr)
    sys.exit(2)


def load(path):
    """The records of one run: (label, steps dict of lists)."""
    metrics = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(metrics):
        fail(f"{path}: no metrics.jsonl (expected a run directory written by `moetrain train`, or the file itself)")
    label = os.path.basename(os.path.dirname(os.path.abspath(metrics)))
    run = {key: [] for key in ("step", "loss", "lr", "grad_norm", "tok_per_s", "moe", "max_logit", "val_step",
                               "val_loss", "skipped")}
    with open(metrics, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{metrics}:{number}: not a JSON object ({e.msg})")
            step = r.get("step")
            if step is None:
                continue
            if r.get("skipped"):
                run["skipped"].append(step)
            elif "val_loss" in r and r["val_loss"] is not None:
                run["val_step"].append(step)
                run["val_loss"].append(r["val_loss"])
            elif "loss" in r:
                run["step"].append(step)
                run["loss"].append(r["loss"])
                run["lr"].append(r.get("lr"))
                run["grad_norm"].append(r.get("grad_norm"))
                run["tok_per_s"].append(r.get("tok_per_s"))
                run["moe"].append(r.get("moe_max_over_mean"))
                run["max_logit"].append(r.get("max_logit"))
    if not run["step"]:
        fail(f"{metrics}: no training steps recorded yet")
    return label, run


def main():
    parser = argparse.ArgumentParser(description="Plot training runs from metrics.jsonl.")
    parser.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files)")
    parser.add_argument("-o", "--out", default="loss.png", help="output image (.png, .svg, .pdf); default loss.png")
    parser.add_argument("--title", default=None, help="figure title")
    args = parser.parse_args()

    runs = [load(path) for path in args.runs]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_moe = any(any(v is not None for v in run["moe"]) for _, run in runs)
    has_logit = any(any(v is not None for v in run["max_logit"]) for _, run in runs)
    panels = ["loss", "lr", "grad_norm", "tok_per_s"] + (["moe"] if has_moe else []) + \
        (["max_logit"] if has_logit else [])
    titles = {"loss": "loss (train; val dashed)", "lr": "learning rate", "grad_norm": "gradient norm",
              "tok_per_s": "tokens / s", "moe": "MoE load: max / mean tokens per expert",
              "max_logit": "largest attention logit (QK-Clip)"}
    cols = 3 if len(panels) > 4 else 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for index, (label, run) in enumerate(runs):
        color = f"C{index % 10}"
        for ax, key in zip(axes.flat, panels):
            pairs = [(s, v) for s, v in zip(run["step"], run[key]) if v is not None]
            if pairs:
                ax.plot([p[0] for p in pairs], [p[1] for p in pairs], color=color, lw=1.2, label=label)
            if key == "loss":
                if run["val_step"]:
                    ax.plot(run["val_step"], run["val_loss"], color=color, lw=1.2, ls="--", marker="o", ms=3)
                for s in run["skipped"]:
                    ax.axvline(s, color=color, lw=0.6, ls=":")
    for ax, key in zip(axes.flat, panels):
        ax.set_title(titles[key], fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key == "grad_norm":
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        fail(f"{args.out}: the directory {out_dir} does not exist")
    fig.savefig(args.out, dpi=110)
    for label, run in runs:
        val = f", val loss {run['val_loss'][-1]:.4f} at step {run['val_step'][-1]}" if run["val_step"] else ""
        print(f"{label}: {len(run['step'])} steps, last loss {run['loss'][-1]:.4f} at step {run['step'][-1]}{val}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
