#!/usr/bin/python3
"""Pipeline parallelism (train.pp, docs/parallelism.md#pipeline-parallelism): time
per step against the 1F1B bubble model, with and without virtual stages
(train.pp_virtual), and per-rank peak RSS against the ledger.

Runs `moetrain train` under mpirun on one config (k3-small by default) with
train.pp = P for several micro-batch counts M (train.grad_accum), on tinyshakespeare
bytes prepared into a scratch directory, and reads each run's metrics.jsonl.

Step time model: each stage spends t per micro-batch (forward + backward of its
layers), so a balanced 1F1B step takes (M + P - 1) t plus a fixed part c (gradient
sums, clipping, AdamW). A least-squares fit of step = a M + b over the M values
gives t = a; the bubble the model predicts is (P - 1) / (M + P - 1) of the pipeline
time, the measured pipeline overhead is (step - M a) / step, which also holds c and
any stage imbalance (stage 0 has the embedding, the last stage the head). With V
virtual stages per rank (the interleaved 1F1B, --virtual) the fill and drain take
a chunk, t / V, per stage: step = (M + (P - 1) / V) t + c, bubble (P - 1) / (V M + P - 1);
each V gets its own fit. The runs use train.profile, whose table gives a second,
direct measure: the share of rank 0's step spent in pipeline send/receive (waiting
for a neighbour: the bubble, plus any stage imbalance).

  bench/pipeline_bubble.py --np 4 --pp 4 --micro 2,4,8,16     # the issue's run (4 ranks)
  bench/pipeline_bubble.py --np 2 --pp 2 --micro 1,2,4,8      # one rank per core on a 2-core box
  bench/pipeline_bubble.py --np 2 --pp 2 --micro 2,4,8 --virtual 1,2,4   # interleaved: V = 1, 2, 4

Ranks are given one thread each; with more ranks than cores the ranks share cores,
which hides part of the bubble (an idle rank lends its core): say so when quoting.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, env=None):
    p = subprocess.run(cmd, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"pipeline_bubble: `{cmd}` failed ({p.returncode}):\n{p.stdout[-4000:]}")
    return p.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "k3-small.yaml"))
    ap.add_argument("--np", type=int, default=4, help="ranks (mpirun -np)")
    ap.add_argument("--pp", type=int, default=4, help="pipeline stages (train.pp)")
    ap.add_argument("--ep", type=int, default=1, help="train.ep")
    ap.add_argument("--micro", default="2,4,8,16", help="micro-batch counts M (train.grad_accum), comma separated")
    ap.add_argument("--virtual", default="1", help="virtual stages per rank V (train.pp_virtual), comma separated; "
                    "V > 1 needs every M a multiple of --pp")
    ap.add_argument("--batch-size", type=int, default=2, help="sequences per micro-batch (train.batch_size)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256, help="model.vocab_size: 256 (the byte data's) keeps the last "
                    "stage's LM head from outweighing its layers, which would show as bubble; 0 keeps the config's")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run; the first is not timed")
    ap.add_argument("--moetrain", default=os.path.join(ROOT, "build", "moetrain"))
    a = ap.parse_args()
    micro = [int(m) for m in a.micro.split(",")]
    virtual = [int(v) for v in a.virtual.split(",")]
    if len(micro) < 2:
        sys.exit("pipeline_bubble: give at least two --micro values (the fit needs two)")
    if any(v > 1 for v in virtual) and any(m % a.pp for m in micro):
        sys.exit(f"pipeline_bubble: --virtual > 1 needs every --micro value to be a multiple of --pp {a.pp}")
    if not os.path.exists(a.moetrain):
        sys.exit(f"pipeline_bubble: {a.moetrain} not found: build first (launch/build.sh)")
    env = dict(os.environ, OMP_NUM_THREADS="1", MOETRAIN_NUM_THREADS="1")
    mpirun = "mpirun --oversubscribe --bind-to none" + (" --allow-run-as-root" if os.geteuid() == 0 else "")
    P = a.pp
    print(f"pipeline_bubble: {os.path.basename(a.config)}, {a.np} ranks, pp {P}, ep {a.ep}, micro-batch "
          f"{a.batch_size} x {a.seq_len}, median of {a.steps - 1} steps, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="pipeline_bubble.") as tmp:
        run(f"{a.moetrain} prepare {ROOT}/data/tinyshakespeare.txt --out {tmp}/data --tokenizer byte", env)
        fits = []  # (V, slope, intercept, rows)
        for V in virtual:
            rows = []
            for m in micro:
                run_dir = f"{tmp}/run_v{V}_m{m}"
                out = run(f"{mpirun} -np {a.np} {a.moetrain} train -c {a.config} "
                          f"--set data.train='{tmp}/data/train_*.bin' "
                          f"--set data.val= --set data.tokenizer=byte --set train.pp={a.pp} --set train.ep={a.ep} "
                          f"--set train.pp_virtual={V} --set train.grad_accum={m} --set train.batch_size={a.batch_size} "
                          + (f"--set model.vocab_size={a.vocab} " if a.vocab else "") +
                          f"--set train.seq_len={a.seq_len} --set train.max_steps={a.steps} --set train.warmup_steps=1 "
                          f"--set train.eval_every=0 --set train.sample_every=0 --set ckpt.every=0 "
                          f"--set train.threads=1 --set train.log_every=1 --set train.profile=true "
                          f"--set run.dir={run_dir}", env)
                steps = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl") if '"step_ms"' in line]
                times = [s["step_ms"] for s in steps if s["step"] > 1]
                mem = re.search(r"memory per rank: peak RSS (.+?) \(rank (\d+); lowest (.+?)\) against (.+?) predicted.*"
                                r"peak / predicted = ([0-9.]+)", out)
                # train.profile's table (rank 0): the share of its step spent in pipeline send/receive,
                # i.e. waiting for a neighbour (the transfers themselves are memory copies here).
                p2p = re.search(r"pipeline p2p +[0-9.]+ +[0-9.]+ +([0-9.]+) ", out)
                total = re.search(r"\n +total +([0-9.]+)", out)
                wait = float(p2p.group(1)) / float(total.group(1)) if p2p and total else float("nan")
                rows.append((m, statistics.median(times), mem.groups() if mem else None, wait))
            # Least squares step = a M + b.
            n = len(rows)
            mx = sum(r[0] for r in rows) / n
            my = sum(r[1] for r in rows) / n
            slope = sum((r[0] - mx) * (r[1] - my) for r in rows) / sum((r[0] - mx) ** 2 for r in rows)
            intercept = my - slope * mx
            print(f"V {V}: fit step_ms = {slope:.1f} M + {intercept:.1f}  (t per micro-batch per stage {slope:.1f} ms; "
                  f"the model's bubble alone would give an intercept of (P - 1) t / V = {(P - 1) * slope / V:.1f} ms)")
            print(f"{'V':>3} {'M':>4} {'step ms':>9} {'per micro':>10} {'bubble model':>13} {'measured overhead':>18} "
                  f"{'rank 0 in p2p':>14}  memory")
            for m, step, mem, wait in rows:
                model = (P - 1) / (V * m + P - 1)
                measured = (step - m * slope) / step
                mem_text = (f"peak RSS {mem[0]} (rank {mem[1]}; lowest {mem[2]}) vs {mem[3]} predicted: {mem[4]}"
                            if mem else "no memory line")
                print(f"{V:>3} {m:>4} {step:>9.1f} {step / m:>10.1f} {100 * model:>12.1f}% {100 * measured:>17.1f}% "
                      f"{100 * wait:>13.1f}%  {mem_text}", flush=True)
            fits.append((V, slope, intercept, rows))
        if len(fits) >= 2:
            # Across V: intercept_V = c + b / V, c the step's fixed part (gradient sums, clipping, AdamW), b the
            # fill and drain of one micro-batch per stage, (P - 1) t by the model. Least squares on 1 / V.
            xs = [1.0 / f[0] for f in fits]
            ys = [f[2] for f in fits]
            x0, y0 = sum(xs) / len(xs), sum(ys) / len(ys)
            b = sum((x - x0) * (y - y0) for x, y in zip(xs, ys)) / sum((x - x0) ** 2 for x in xs)
            c = y0 - b * x0
            t = sum(f[1] for f in fits) / len(fits)
            print(f"across V: intercept = {c:.1f} ms + {b:.1f} ms / V  (the model: fixed part c, plus (P - 1) t / V "
                  f"with t = {t:.1f} ms: {(P - 1) * t:.1f} ms / V)")
            print(f"{'V':>3} {'M':>4} {'step ms':>9} {'bubble model':>13} {'bubble measured':>16}   (measured: "
                  f"(intercept_V - c) / (step - c), the idle share of the pipeline's time)")
            for V, slope, intercept, rows in fits:
                for m, step, _, _ in rows:
                    print(f"{V:>3} {m:>4} {step:>9.1f} {100 * (P - 1) / (V * m + P - 1):>12.1f}% "
                          f"{100 * (intercept - c) / (step - c):>15.1f}%")


if __name__ == "__main__":
    main()
