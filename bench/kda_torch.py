#!/usr/bin/python3
# Plain-PyTorch baseline for bench/kda_bench.cpp: the chunked KDA form of docs/model.md#kda-chunked-form
# (the algorithm of fla's naive_chunk_kda, vectorised over all chunks and heads), forward
# in PyTorch ops, backward by autograd, as a PyTorch user would write it.
#
#   /usr/bin/python3 bench/kda_torch.py --seq 2048 --heads 4 --dim 64 --chunk 64 --batch 1 --threads 2 --steps 3
#     prints one line: torch_ms_per_step <ms>   (warm-up step, then the mean of --steps
#     forward+backward steps on the inputs of kda_bench.cpp's make_inputs, f32)
#   /usr/bin/python3 bench/kda_torch.py --check
#     checks the chunked form against a naive token-by-token loop (docs/model.md#kda-recurrent-form) in f64, outputs and
#     every gradient, and exits non-zero on a mismatch.
#
# Per chunk of C tokens (all chunks at once): γ = in-chunk cumsum of g; A^kk, A^qk from the
# pairwise decays exp(γ_i - γ_j), i >= j only (the exponent of the pairs above the diagonal
# is set to -inf before exp, so nothing overflows and autograd sees no inf·0);
# M = (I + A^kk)^{-1} by a unit lower-triangular solve; W = M Diag(β) (K ⊙ e^γ),
# U = M Diag(β) V. Then the only sequential part, over chunks: V^new = U - W S_n,
# O_n = (Q̄ ⊙ e^γ) S_n + A^qk V^new, S_{n+1} = Diag(e^{γ_C}) S_n + (K ⊙ e^{γ_C - γ})^T V^new.
import argparse
import sys
import time

import torch


def kda_chunked(q, k, v, g, beta, scale, chunk, h0=None):
    """q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]. Returns o [B, T, H, V], S_T [B, H, K, V]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk
    assert T % C == 0, "T must be a multiple of the chunk size"
    N = T // C

    def chunks(x):  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.reshape(B, N, C, H, *x.shape[3:])
        return x.permute(0, 3, 1, 2, *range(4, x.dim()))

    q, k, v, g, beta = chunks(q) * scale, chunks(k), chunks(v), chunks(g), chunks(beta)
    gam = g.cumsum(-2)  # [B, H, N, C, K]
    idx = torch.arange(C, device=q.device)
    above = idx[:, None] < idx[None, :]  # [C(i), C(j)]: j > i
    kk_cols, qk_cols = [], []
    for j in range(C):  # column j: exp(γ_i - γ_j) for rows i >= j
        dec = (gam - gam[..., j : j + 1, :]).masked_fill(above[:, j, None], float("-inf")).exp()
        kj = k[..., j, :, None]  # [B, H, N, K, 1]
        kk_cols.append((k * dec) @ kj)
        qk_cols.append((q * dec) @ kj)
    Akk = torch.cat(kk_cols, -1)  # [B, H, N, C, C] (stack, not column writes: cheap autograd)
    Aqk = torch.cat(qk_cols, -1)
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), -1)
    Akk = (Akk * beta[..., :, None]).masked_fill(~strict, 0)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    M = torch.linalg.solve_triangular(eye + Akk, eye.expand_as(Akk), upper=False, unitriangular=True)
    Tm = M * beta[..., None, :]
    W = Tm @ (k * gam.exp())
    U = Tm @ v
    qg = q * gam.exp()
    gC = gam[..., -1:, :]  # [B, H, N, 1, K]
    kh = (k * (gC - gam).exp()).transpose(-1, -2)  # [B, H, N, K, C]
    egC = gC.exp().transpose(-1, -2)  # [B, H, N, K, 1]
    S = q.new_zeros(B, H, K, V) if h0 is None else h0
    outs = []
    # unbind, not U[:, :, n]: one backward node per tensor instead of a full-size gradient per chunk
    for u, w, a, qn, kn, e in zip(*(x.unbind(2) for x in (U, W, Aqk, qg, kh, egC))):
        vn = u - w @ S
        outs.append(qn @ S + a @ vn)
        S = S * e + kn @ vn
    o = torch.stack(outs, 2)  # [B, H, N, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(B, T, H, V), S


def kda_recurrent(q, k, v, g, beta, scale, h0=None):
    """docs/model.md#kda-recurrent-form token by token, the reference for --check."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = q.new_zeros(B, H, K, V) if h0 is None else h0
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        delta = v[:, t] - (S * k[:, t, :, :, None]).sum(-2)
        S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((S * (scale * q[:, t])[..., None]).sum(-2))
    return torch.stack(outs, 1), S


def make_inputs(B, T, H, K, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    q = q / q.norm(dim=-1, keepdim=True)
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    g = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen, dtype=dtype))  # K3 lower-bound gate range
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype))
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    grad_o = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    grad_state = torch.randn(B, H, K, K, generator=gen, dtype=dtype)
    return leaves, grad_o, grad_state


def check():
    ok = True
    for T, C in ((128, 64), (96, 16), (64, 64)):
        for h0 in (False, True):
            leaves, go, gs = make_inputs(2, T, 3, 8, torch.float64, seed=T + C)
            S0 = torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True) if h0 else None
            ins = leaves + ([S0] if h0 else [])
            results = []
            for fn in (lambda: kda_chunked(*leaves, 8**-0.5, C, S0), lambda: kda_recurrent(*leaves, 8**-0.5, S0)):
                o, S = fn()
                grads = torch.autograd.grad([o, S], ins, [go, gs])
                results.append([o, S, *grads])
            err = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() for a, b in zip(*results))
            print(f"check T={T} C={C} h0={h0}: max relative error {err:.2e}", file=sys.stderr)
            ok &= err < 1e-10
    print("check ok" if ok else "check FAILED")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.check:
        sys.exit(0 if check() else 1)
    leaves, go, gs = make_inputs(a.batch, a.seq, a.heads, a.dim, torch.float32)

    def step():
        for x in leaves:
            x.grad = None
        o, S = kda_chunked(*leaves, a.dim**-0.5, a.chunk)
        torch.autograd.backward([o, S], [go, gs])

    step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    print(f"torch_ms_per_step {(time.perf_counter() - t0) / a.steps * 1e3:.3f}")


if __name__ == "__main__":
    main()
