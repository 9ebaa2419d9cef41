#!/usr/bin/python3
"""Writes the evolution ladder's report from the runs of launch/evolution.sh (to
RUNS/evolution.md by default; launch/evolution.sh --doc: the shipped docs/evolution.md).

    launch/evolution_report.py --out RUNS --doc FILE --command TEXT CONFIG [CONFIG ...]

For every rung CONFIG (configs/evolution/NN-name.yaml) it reads RUNS/NN-name.ledger.json
(`moetrain ledger --json`: parameters, decode cache bytes), RUNS/NN-name/metrics.jsonl
(the tinyshakespeare run: last validation loss, median tokens/s) and
RUNS/NN-name-{assoc_recall,repeated_key}/metrics.jsonl (held-out answer accuracy), then
writes the table, the expected orderings on the memory tasks with what was measured,
and a plot of the validation curves (launch/plot.py) to images/evolution.png next to
the document. Exit code 2 names a missing run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

NAMES = {
    "01-gpt2": "GPT-2 (softmax attention)",
    "02-linear-attention": "linear attention",
    "03-deltanet": "DeltaNet",
    "04-gated-deltanet": "Gated DeltaNet",
    "05-kda": "KDA",
    "06-kimi-linear": "Kimi-Linear (KDA + MLA + MoE)",
    "07-k3": "K3 (KDA + MLA + latent MoE + AttnRes)",
}

TEXT = """# The evolution ladder

From GPT-2 to K3 in seven rungs, each a small model trained on tinyshakespeare
bytes with the same budget (configs/evolution/ladder-base.yaml: 4 layers of width
64, 400 steps x 16 x 128 = 819,200 training tokens, 218k +- 10% active parameters
for dense rungs, active for the MoE rungs), and on two synthetic memory tasks.

| rung | mixer | what changes |
|---|---|---|
| 01 | `model.arch: gpt2` | softmax attention, KV cache grows with the context |
| 02 | `linear_attention` | φ = elu + 1, additive state S += φ(k) vᵀ, normaliser z += φ(k); o = Sᵀφ(q) / (zᵀφ(q) + ε) |
| 03 | `deltanet` | delta rule S += β k (v − Sᵀk)ᵀ, L2-normalised q/k, β = σ: writes replace what a key held |
| 04 | `gated_deltanet` | + one decay per head and step (Mamba-2 gate): α = exp(−e^A_log · softplus(x W_a + dt_bias)) |
| 05 | `kda` | + one decay per key channel (KDA, Kimi-Linear's softplus gate, docs/model.md#decay-gate) |
| 06 | `kda,kda,kda,mla` | Kimi-Linear: + MLA every fourth layer, low-rank output gate, MoE (8 experts, top 2, 1 shared) |
| 07 | K3 | + lower-bound gate, full-rank output gate, latent MoE, SiTU-GLU, Block AttnRes |

Rungs 02-05 share everything but the mixer (pre-norm residual stream, SwiGLU,
4 heads of 16). DeltaNet and Gated DeltaNet are KDA's own kernels with the decay
set to zero or broadcast from one value per head (`ops/kda/kda.h`: `delta_rule`,
`gated_delta_rule`), so their recurrent, chunked and decode forms are KDA's;
linear attention has its own op (`ops/linear_attention/linear_attention.h`) whose normaliser is the
last column of a state computed on [v, 1].

Memory tasks (`data.synthetic`, data/synthetic.h): rows of 24 key-value pairs out
of 32 keys and 32 values, then 8 queries; accuracy is the argmax at the answer
positions of held-out rows. The recurrent rungs hold a 16 x 16 state per head,
so 24 pairs are more than a head's key dimension. `repeated_key` binds 8 keys twice
and asks for the later value (editing). Each task run trains the rung's architecture
from scratch for the same number of steps (batches of 32 rows).

Rerun: `launch/evolution.sh` (after a build) trains every rung into `runs/evolution/`
and writes its report there (`runs/evolution/evolution.md`, the picture under
`runs/evolution/images/`); git ignores `runs/`. Only `launch/evolution.sh --doc`
replaces this file and its picture (`docs/images/evolution.png`).
"""


def fail(message):
    print(f"evolution_report.py: {message}", file=sys.stderr)
    sys.exit(2)


def records(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        fail(f"{path} is missing (did launch/evolution.sh finish this rung?)")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def last(recs, key):
    values = [r[key] for r in recs if key in r]
    return values[-1] if values else None


def human(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return str(n)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--doc", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("configs", nargs="+")
    args = parser.parse_args()

    rows = []
    for config in args.configs:
        rung = os.path.splitext(os.path.basename(config))[0]
        ledger_path = os.path.join(args.out, rung + ".ledger.json")
        if not os.path.isfile(ledger_path):
            fail(f"{ledger_path} is missing")
        with open(ledger_path, encoding="utf-8") as f:
            ledger = json.load(f)
        lm = records(os.path.join(args.out, rung))
        speeds = [r["tok_per_s"] for r in lm if "tok_per_s" in r][1:] or [r["tok_per_s"] for r in lm if "tok_per_s" in r]
        row = {
            "rung": rung,
            "name": NAMES.get(rung, rung),
            "total": ledger["total"],
            "active": ledger["active"],
            "cache": ledger.get("decode_cache_bytes", {}),
            "val_loss": last(lm, "val_loss"),
            "steps": last(lm, "step"),
            "tok_s": statistics.median(speeds) if speeds else None,
        }
        for task in ("assoc_recall", "repeated_key"):
            recs = records(os.path.join(args.out, f"{rung}-{task}"))
            row[task] = last(recs, "val_acc")
            row["task_steps"] = last(recs, "step")
        rows.append(row)

    doc_dir = os.path.dirname(os.path.abspath(args.doc))
    image = os.path.join(doc_dir, "images", "evolution.png")
    os.makedirs(os.path.dirname(image), exist_ok=True)
    plot = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "plot.py")]
    plot += [os.path.join(args.out, r["rung"]) for r in rows]
    plot += ["-o", image, "--title", "Evolution ladder: tinyshakespeare bytes (validation dashed)"]
    subprocess.run(plot, check=True, stdout=subprocess.DEVNULL)

    fmt = lambda x, spec: "-" if x is None else format(x, spec)
    lines = [TEXT, "## Results", "",
             f"Produced by `{args.command}` (launch/evolution_report.py writes this file; "
             f"{rows[0]['steps']} language-model steps per rung, {rows[0]['task_steps']} steps per memory-task run; "
             "chance accuracy on the memory tasks is 1/32 = 0.031).", "",
             "| rung | params total | active | val loss | tokens/s | cache T=1k | 8k | 64k "
             "| assoc. recall acc | repeated-key acc |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r["cache"]
        lines.append(f"| {r['rung']} {r['name']} | {r['total']:,} | {r['active']:,} | {fmt(r['val_loss'], '.4f')} "
                     f"| {fmt(r['tok_s'], ',.0f')} | {human(c.get('1024', 0))} | {human(c.get('8192', 0))} "
                     f"| {human(c.get('65536', 0))} | {fmt(r['assoc_recall'], '.3f')} "
                     f"| {fmt(r['repeated_key'], '.3f')} |")
    lines += ["", "Parameters and decode cache bytes (one sequence, f32) come from `moetrain ledger --json`; "
              "\"active\" leaves out the routed experts a token does not use and the input embedding table "
              f"(unless tied). Tokens/s is the median over the run's steps ({args.threads} thread{'' if args.threads == 1 else 's'}, "
              "on a machine shared with other jobs: a rough guide).", ""]

    by = {r["rung"][:2]: r for r in rows}

    def acc(rung, task):
        r = by.get(rung)
        return None if r is None else r[task]

    checks = [
        ("associative recall beyond the state: softmax attention (01) beats every pure recurrent rung (02-05)",
         "assoc_recall", ["01"], ["02", "03", "04", "05"]),
        ("associative recall: the delta rules (03-05) beat additive linear attention (02)",
         "assoc_recall", ["03", "04", "05"], ["02"]),
        ("associative recall: the hybrids with MLA (06, 07) beat pure KDA (05)", "assoc_recall", ["06", "07"], ["05"]),
        ("repeated-key replacement: the delta rules (03-05) beat additive linear attention (02)",
         "repeated_key", ["03", "04", "05"], ["02"]),
    ]
    lines += ["## Expected orderings on the memory tasks", "",
              "From the literature (Schlag et al. 2021; Yang et al. 2024, DeltaNet and Gated DeltaNet; Kimi Linear "
              "2025): a finite state recalls less than a KV cache once the pairs exceed it; the delta rule edits "
              "what a key holds, which an additive state cannot; hybrids with some attention layers recover recall.",
              ""]
    for text, task, better, worse in checks:
        b = [acc(x, task) for x in better if acc(x, task) is not None]
        w = [acc(x, task) for x in worse if acc(x, task) is not None]
        if not b or not w:
            lines.append(f"- {text}: not measured in this run (rungs missing).")
            continue
        holds = min(b) > max(w)
        lines.append(f"- {text}: {'holds' if holds else 'does NOT hold'} "
                     f"(min of {','.join(better)} = {min(b):.3f}, max of {','.join(worse)} = {max(w):.3f}).")
    lines += ["", "## Validation curves", "", "![validation curves of the rungs](images/evolution.png)", ""]
    notes = os.path.join(os.path.dirname(os.path.abspath(__file__)), "evolution_notes.md")
    if os.path.isfile(notes):
        with open(notes, encoding="utf-8") as f:
            lines += [f.read().rstrip(), ""]
    tmp = args.doc + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    os.replace(tmp, args.doc)
    for r in rows:
        print(f"{r['rung']}: val loss {fmt(r['val_loss'], '.4f')}, assoc {fmt(r['assoc_recall'], '.3f')}, "
              f"repeated {fmt(r['repeated_key'], '.3f')}, {r['total']:,} params ({r['active']:,} active)")


if __name__ == "__main__":
    main()
