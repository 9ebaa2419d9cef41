#!/usr/bin/python3
"""Independent GPT-2 in plain PyTorch (Debian python3-torch), the reference for
tests/nn/gpt2_reference_test.cpp. Shares no code with moetrain.

  gpt2_reference.py OUT_DIR [--dtype f32|f64] [--steps 10]

Writes, for a small GPT-2 with random weights (seeded):
  OUT_DIR/model/config.json, OUT_DIR/model/model.safetensors
      a Hugging Face GPT-2 model directory (names wte.weight, h.{i}.attn.c_attn.weight, ...
      with the Conv1D [in, out] layout) that moetrain imports
  OUT_DIR/expected.safetensors
      ids, targets [B, T]; logits [B, T, V]; loss []; grad.<name> for every parameter
      (HF layout); step_ids, step_targets [S, B, T]; step_losses [S] (loss before each
      AdamW step); final.<name> (weights after S steps); eval_loss [] (see eval.bin)
  OUT_DIR/eval.bin
      an llm.c token shard of 4 T + 1 random tokens; eval_loss is the mean next-token
      loss of the initial model over its 4 windows of T tokens (window i = tokens
      iT..iT+T, targets shifted by one), the definition of `moetrain eval`
Training: torch.optim.AdamW (lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on
the 2-D weights except wte/wpe), clip_grad_norm_(1.0) before every step.
"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_read import write_arrays  # noqa: E402  (independent safetensors writer)

CONFIG = dict(vocab_size=101, n_layer=2, n_head=4, n_embd=32, n_positions=64, layer_norm_epsilon=1e-5)
B, T = 2, 16
LR, BETAS, EPS, WD, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0


def make_params(dtype, gen, cfg=CONFIG):
    V, D, L, P = cfg["vocab_size"], cfg["n_embd"], cfg["n_layer"], cfg["n_positions"]

    def normal(*shape, std=0.02, mean=0.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std + mean).to(dtype)

    p = {"wte.weight": normal(V, D), "wpe.weight": normal(P, D, std=0.05)}
    for l in range(L):
        h = f"h.{l}."
        p[h + "ln_1.weight"] = normal(D, std=0.1, mean=1.0)
        p[h + "ln_1.bias"] = normal(D, std=0.1)
        p[h + "attn.c_attn.weight"] = normal(D, 3 * D, std=0.2)  # Conv1D: [in, out]
        p[h + "attn.c_attn.bias"] = normal(3 * D, std=0.1)
        p[h + "attn.c_proj.weight"] = normal(D, D, std=0.1)
        p[h + "attn.c_proj.bias"] = normal(D, std=0.1)
        p[h + "ln_2.weight"] = normal(D, std=0.1, mean=1.0)
        p[h + "ln_2.bias"] = normal(D, std=0.1)
        p[h + "mlp.c_fc.weight"] = normal(D, 4 * D, std=0.1)
        p[h + "mlp.c_fc.bias"] = normal(4 * D, std=0.1)
        p[h + "mlp.c_proj.weight"] = normal(4 * D, D, std=0.1)
        p[h + "mlp.c_proj.bias"] = normal(D, std=0.1)
    p["ln_f.weight"] = normal(D, std=0.1, mean=1.0)
    p["ln_f.bias"] = normal(D, std=0.1)
    return p


def forward(p, ids, cfg=CONFIG):
    """GPT-2 (HF GPT2LMHeadModel semantics, dropout off), logits [B, T, V]."""
    D, H, L = cfg["n_embd"], cfg["n_head"], cfg["n_layer"]
    eps, hd = cfg["layer_norm_epsilon"], cfg["n_embd"] // cfg["n_head"]
    Bn, Tn = ids.shape
    x = p["wte.weight"][ids] + p["wpe.weight"][:Tn]
    mask = torch.tril(torch.ones(Tn, Tn, dtype=torch.bool))
    for l in range(L):
        h = f"h.{l}."
        a = F.layer_norm(x, (D,), p[h + "ln_1.weight"], p[h + "ln_1.bias"], eps)
        qkv = a @ p[h + "attn.c_attn.weight"] + p[h + "attn.c_attn.bias"]
        q, k, v = qkv.split(D, dim=2)
        q, k, v = (t.view(Bn, Tn, H, hd).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(Bn, Tn, D)
        x = x + y @ p[h + "attn.c_proj.weight"] + p[h + "attn.c_proj.bias"]
        m = F.layer_norm(x, (D,), p[h + "ln_2.weight"], p[h + "ln_2.bias"], eps)
        m = F.gelu(m @ p[h + "mlp.c_fc.weight"] + p[h + "mlp.c_fc.bias"], approximate="tanh")
        x = x + m @ p[h + "mlp.c_proj.weight"] + p[h + "mlp.c_proj.bias"]
    x = F.layer_norm(x, (D,), p["ln_f.weight"], p["ln_f.bias"], eps)
    return x @ p["wte.weight"].T


def loss_of(p, ids, targets, cfg=CONFIG):
    logits = forward(p, ids, cfg)
    return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dtype", choices=["f32", "f64"], default="f32")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    dtype = torch.float32 if args.dtype == "f32" else torch.float64
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1234)
    params = make_params(dtype, gen)
    V = CONFIG["vocab_size"]
    tokens = torch.randint(0, V, (1 + args.steps, B, T + 1), generator=gen)
    ids, targets = tokens[0, :, :-1], tokens[0, :, 1:]

    os.makedirs(os.path.join(args.out, "model"), exist_ok=True)
    with open(os.path.join(args.out, "model", "config.json"), "w") as f:
        json.dump(dict(CONFIG, architectures=["GPT2LMHeadModel"], model_type="gpt2",
                       activation_function="gelu_new"), f, indent=1)
    write_arrays(os.path.join(args.out, "model", "model.safetensors"),
                 {k: v.numpy() for k, v in params.items()}, {"format": "pt"})

    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    logits, loss = loss_of(leaves, ids, targets)
    loss.backward()
    expected = {"ids": ids.numpy().astype(np.int64), "targets": targets.numpy().astype(np.int64),
                "logits": logits.detach().numpy(), "loss": loss.detach().numpy().reshape(())}
    for k, v in leaves.items():
        expected["grad." + k] = v.grad.numpy()

    train = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    decay = [v for k, v in train.items() if v.dim() == 2 and k not in ("wte.weight", "wpe.weight")]
    other = [v for k, v in train.items() if not (v.dim() == 2 and k not in ("wte.weight", "wpe.weight"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": other, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    losses = []
    for s in range(args.steps):
        opt.zero_grad()
        _, l = loss_of(train, tokens[1 + s, :, :-1], tokens[1 + s, :, 1:])
        l.backward()
        torch.nn.utils.clip_grad_norm_(list(train.values()), CLIP)
        opt.step()
        losses.append(l.item())
    expected["step_ids"] = tokens[1:, :, :-1].numpy().astype(np.int64)
    expected["step_targets"] = tokens[1:, :, 1:].numpy().astype(np.int64)
    expected["step_losses"] = np.array(losses, dtype=np.float64)
    for k, v in train.items():
        expected["final." + k] = v.detach().numpy()
    eval_tokens = torch.randint(0, V, (4 * T + 1,), generator=gen)
    header = np.zeros(256, dtype="<i4")
    header[:3] = (20240520, 1, eval_tokens.numel())
    with open(os.path.join(args.out, "eval.bin"), "wb") as f:
        f.write(header.tobytes() + eval_tokens.numpy().astype("<u2").tobytes())
    with torch.no_grad():
        windows = torch.stack([eval_tokens[i * T:(i + 1) * T + 1] for i in range(4)])
        _, eval_loss = loss_of(params, windows[:, :-1], windows[:, 1:])
    expected["eval_loss"] = np.array(eval_loss.item(), dtype=np.float64)
    write_arrays(os.path.join(args.out, "expected.safetensors"), expected)


if __name__ == "__main__":
    main()
