#!/usr/bin/env python3
"""moetrain's GPT-2 124M training step against PyTorch's, in one run (issues 25, 38).

The peer is nanoGPT's model (Karpathy's GPT: pre-LayerNorm blocks, causal
self-attention through F.scaled_dot_product_attention, GELU MLP, LM head tied to
the token embedding), written here, with the shapes of our bench's GPT-2 case:
124M parameters, vocab 50257, B = 4, T = 64 and 256, f32 and bf16, one training step =
forward, backward, AdamW (lr 1e-4, betas 0.9/0.95, weight decay 0.1). GELU is the
tanh form, as GPT-2 and moetrain's Gpt2 (nanoGPT's own default is erf).

Each round runs, one process after another, our step (build/moetrain_bench_cpu
--cases gpt2-T --no-torch --no-profile), then PyTorch eager, then PyTorch with
torch.compile (inductor; the first round pays the compile, not timed: a warm-up
step comes before the timed steps in every process). All with the same thread
count. Rounds interleave so that a changing load on a shared machine falls on
all three alike; the table gives the median of the rounds' ms per step and the
ratios PyTorch / moetrain (> 1: moetrain faster).

bf16 (--dtypes f32,bf16, the default): our `gpt2-T-bf16` case (train.dtype bf16 on
the CPU: bf16 weights and activations, f32 masters, oneDNN's bf16 matmuls) against
PyTorch's mixed precision as its users run it on a CPU: f32 weights and AdamW, the
forward and loss under torch.autocast("cpu", dtype=torch.bfloat16), eager and
compiled. Each bf16 row's ratios are against our bf16 step; the f32 row's against
our f32 step.

Which PyTorch: the interpreter named by --python, else $MOETRAIN_TORCH_PYTHON,
else this interpreter if it imports torch >= 2, else Debian's /usr/bin/python3
(torch 1.13: no torch.compile; the output says "fallback"). None with torch: exits
with status 2 and says what to set. Make a venv with PyPI's torch:
  python3 -m venv ~/venv-torch && ~/venv-torch/bin/pip install torch
  MOETRAIN_TORCH_PYTHON=~/venv-torch/bin/python bench/gpt2_peer.py
Not part of the test run (minutes per round).

  bench/gpt2_peer.py [--build build] [--python PY] [--seqs 64,256] [--batch 4]
                     [--steps 3] [--rounds 3] [--threads N] [--no-compile] [--dtypes f32,bf16]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEBIAN_PYTHON = "/usr/bin/python3"


# ---------------------------------------------------------------------------------------------------
# Worker: runs under the PyTorch interpreter (imports torch only here).

def worker(a):
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class CausalSelfAttention(nn.Module):
        def __init__(self, n_embd, n_head):
            super().__init__()
            self.c_attn = nn.Linear(n_embd, 3 * n_embd)
            self.c_proj = nn.Linear(n_embd, n_embd)
            self.n_head = n_head

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
            if hasattr(F, "scaled_dot_product_attention"):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # torch 1.13: the attention written out, as nanoGPT's slow path
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
                mask = torch.ones(T, T, dtype=torch.bool).tril()
                att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
                y = att @ v
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class Block(nn.Module):
        def __init__(self, n_embd, n_head):
            super().__init__()
            self.ln_1 = nn.LayerNorm(n_embd)
            self.attn = CausalSelfAttention(n_embd, n_head)
            self.ln_2 = nn.LayerNorm(n_embd)
            self.c_fc = nn.Linear(n_embd, 4 * n_embd)
            self.c_proj = nn.Linear(4 * n_embd, n_embd)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self, vocab_size=50257, n_positions=1024, n_layer=12, n_head=12, n_embd=768):
            super().__init__()
            self.wte = nn.Embedding(vocab_size, n_embd)
            self.wpe = nn.Embedding(n_positions, n_embd)
            self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(n_embd)
            self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
            self.lm_head.weight = self.wte.weight  # tied, as GPT-2
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
                elif p.dim() == 2:
                    nn.init.normal_(p, 0.0, 0.02)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

        def forward(self, idx, targets):
            T = idx.size(1)
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    fwd = model
    if a.mode.startswith("compile"):
        fwd = torch.compile(model)
    tokens = torch.randint(0, 50257, (a.batch, a.seq + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    bf16 = a.mode.endswith("-bf16")

    def step():
        opt.zero_grad(set_to_none=True)
        if bf16:  # mixed precision as PyTorch users run it on a CPU: autocast around forward and loss
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = fwd(x, y)
        else:
            loss = fwd(x, y)
        loss.backward()
        opt.step()

    t0 = time.perf_counter()
    step()  # warm-up (and the compile)
    warm = time.perf_counter() - t0
    ms = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1e3)
    cap = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "?"
    print(json.dumps({"ms": ms, "warmup_s": warm, "torch": torch.__version__, "capability": cap,
                      "mkldnn": torch.backends.mkldnn.is_available(), "threads": torch.get_num_threads()}))


# ---------------------------------------------------------------------------------------------------
# Driver: any python3.

def torch_version(python):
    try:
        out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def major(version):
    m = re.match(r"(\d+)", version or "")
    return int(m.group(1)) if m else 0


def find_torch(arg):
    """(python, version, label): the interpreter that runs the peer."""
    for python, how in ((arg, "--python"), (os.environ.get("MOETRAIN_TORCH_PYTHON"), "$MOETRAIN_TORCH_PYTHON")):
        if not python:
            continue
        v = torch_version(python)
        if v is None:
            sys.exit(f"gpt2_peer: {how} = {python} cannot import torch; point it at a python with PyTorch >= 2 "
                     f"(e.g. a venv: python3 -m venv DIR && DIR/bin/pip install torch)")
        return python, v, f"{how} = {python}"
    v = torch_version(sys.executable)
    if major(v) >= 2:
        return sys.executable, v, f"this interpreter ({sys.executable})"
    v = torch_version(DEBIAN_PYTHON)
    if v is not None:
        return DEBIAN_PYTHON, v, f"fallback: Debian's {DEBIAN_PYTHON} (no PyTorch >= 2 found; set MOETRAIN_TORCH_PYTHON)"
    print("gpt2_peer: no PyTorch found: set MOETRAIN_TORCH_PYTHON (or --python) to a python with PyTorch >= 2, "
          "e.g. python3 -m venv ~/venv-torch && ~/venv-torch/bin/pip install torch", file=sys.stderr)
    sys.exit(2)


def cpu_name():
    name, family = "?", "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and name == "?":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("cpu family") and family == "?":
                family = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split()
                isa = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
                break
    return f"{name} (CPUID family {family}, {isa}), {os.cpu_count()} CPUs"


def run_ours(binary, case, steps, threads):
    env = dict(os.environ, MOETRAIN_NUM_THREADS=str(threads))
    out = subprocess.run([binary, "--cases", case, "--no-torch", "--no-profile", "--steps", str(steps)],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"gpt2_peer: {binary} failed:\n{out.stdout}{out.stderr}")
    ms = None
    head = out.stdout.splitlines()[0] if out.stdout else ""
    for line in out.stdout.splitlines():
        f = line.split()
        if f and f[0] == case:
            ms = float(f[1])
    if ms is None:
        sys.exit(f"gpt2_peer: no {case} line in the output of {binary}:\n{out.stdout}")
    return ms, head


def run_torch(python, mode, seq, args, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [python, os.path.abspath(__file__), "--worker", "--mode", mode, "--seq", str(seq), "--batch",
           str(args.batch), "--steps", str(args.steps), "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(f"gpt2_peer: PyTorch {mode} at T={seq} failed (status {out.returncode}):\n{out.stderr[-3000:]}",
              file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="eager", help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--python", default=None)
    ap.add_argument("--seqs", default="64,256")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MOETRAIN_NUM_THREADS", os.cpu_count())))
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--dtypes", default="f32,bf16", help="f32, bf16 or both (comma separated)")
    a = ap.parse_args()
    if a.worker:
        return worker(a)

    binary = os.path.join(a.build, "moetrain_bench_cpu")
    if not os.access(binary, os.X_OK):
        sys.exit(f"gpt2_peer: {binary} not found; build it: cmake --build {a.build} --target moetrain_bench_cpu")
    python, version, label = find_torch(a.python)
    compile_ok = major(version) >= 2 and not a.no_compile
    dtypes = [d for d in a.dtypes.split(",") if d]
    if not dtypes or any(d not in ("f32", "bf16") for d in dtypes):
        sys.exit(f"gpt2_peer: --dtypes {a.dtypes}: expected f32, bf16 or f32,bf16")
    modes = ["eager"] + (["compile"] if compile_ok else [])
    print(f"gpt2_peer: GPT-2 124M train step (fwd + bwd + AdamW), {' and '.join(dtypes)}, B={a.batch}, "
          f"{a.threads} threads, {a.rounds} rounds x {a.steps} steps (after a warm-up step) per process")
    print(f"  CPU: {cpu_name()}")
    print(f"  PyTorch {version} from {label}" + ("" if compile_ok else "; torch.compile not run"))
    print(f"  load average before: {open('/proc/loadavg').read().split()[:3]}")
    t_start = time.time()
    seqs = [int(s) for s in a.seqs.split(",")]
    # A case: (T, dtype); our bench case gpt2-T[-bf16], PyTorch's modes eager[-bf16], compile[-bf16].
    cases = [(s, d) for d in dtypes for s in seqs]
    suffix = {"f32": "", "bf16": "-bf16"}
    res = {(s, d, m): [] for s, d in cases for m in ["ours"] + modes}
    info, head = {}, ""
    for r in range(a.rounds):
        for s, d in cases:
            ms, head = run_ours(binary, f"gpt2-{s}{suffix[d]}", a.steps, a.threads)
            res[(s, d, "ours")].append(ms)
            line = f"  round {r + 1} T={s} {d}: moetrain {ms:.0f} ms"
            for m in modes:
                out = run_torch(python, m + suffix[d], s, a, a.threads)
                if out is None:
                    line += f", {m} failed"
                    continue
                info = out
                res[(s, d, m)].append(statistics.mean(out["ms"]))
                line += f", torch {m} {statistics.mean(out['ms']):.0f} ms (warm-up {out['warmup_s']:.1f} s)"
            print(line, flush=True)
    print(f"  ours: {head}")
    if info:
        print(f"  PyTorch: capability {info['capability']}, mkldnn {info['mkldnn']}, threads {info['threads']}")
    print(f"  load average after: {open('/proc/loadavg').read().split()[:3]}; wall time {time.time() - t_start:.0f} s")
    print()
    cols = ["moetrain ms"] + [f"torch {m} ms" for m in modes] + [f"{m}/moetrain" for m in modes]
    print(f"{'case':<15}" + "".join(f"{c:>20}" for c in cols))
    for s, d in cases:
        med = {m: statistics.median(res[(s, d, m)]) if res[(s, d, m)] else float("nan") for m in ["ours"] + modes}
        row = f"{'gpt2-' + str(s) + suffix[d]:<15}" + f"{med['ours']:>20.1f}"
        row += "".join(f"{med[m]:>20.1f}" for m in modes)
        row += "".join(f"{med[m] / med['ours']:>19.2f}x" for m in modes)
        print(row)
    print("(medians over rounds of each process's mean ms per step; ratio > 1: moetrain faster; a -bf16 row: our "
          "train.dtype bf16 against PyTorch's autocast)")


if __name__ == "__main__":
    main()
