#!/usr/bin/python3
"""PyTorch baseline for bench/gpt2_step: one GPT-2 124M training step (forward,
backward, AdamW) in fp32 with the same model code as tests/reference/gpt2_reference.py.

  gpt2_step_torch.py --batch 4 --seq 64 --steps 3 --threads 2
prints one line: "torch_ms_per_step <ms>"
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))
from gpt2_reference import loss_of, make_params  # noqa: E402

GPT2_SMALL = dict(vocab_size=50257, n_layer=12, n_head=12, n_embd=768, n_positions=1024, layer_norm_epsilon=1e-5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    params = {k: v.requires_grad_(True) for k, v in make_params(torch.float32, gen, GPT2_SMALL).items()}
    opt = torch.optim.AdamW(params.values(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, GPT2_SMALL["vocab_size"], (a.batch, a.seq + 1), generator=gen)

    def step():
        opt.zero_grad(set_to_none=True)
        _, loss = loss_of(params, tokens[:, :-1], tokens[:, 1:], GPT2_SMALL)
        loss.backward()
        opt.step()

    step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    print(f"torch_ms_per_step {(time.perf_counter() - t0) / a.steps * 1e3:.1f}")


if __name__ == "__main__":
    main()
