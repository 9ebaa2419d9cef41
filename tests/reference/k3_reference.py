#!/usr/bin/python3
"""Independent plain-PyTorch transcription of docs/model.md (Debian python3-torch,
python3-h5py), the reference for `moetrain op` (tests/cli/op_reference_test.cpp,
docs/op.md). Shares no code with moetrain: every formula below is written from
docs/model.md, gradients come from torch.autograd.

  k3_reference.py OUT_DIR [--list]

Writes OUT_DIR/inputs.h5 and OUT_DIR/expected.h5, float64 throughout. Each case is
one group of the same name in both files:
  inputs.h5:/CASE    the op's input datasets (names as in docs/model.md), layer weights
                     under params/ (Hugging Face names), hyper-parameters as
                     attributes, and random upstream gradients dX for outputs X
                     (some cases leave some or all of them out: zeros / outputs only)
  expected.h5:/CASE  the outputs X, the input gradients dNAME, the weight gradients
                     grad/NAME; attributes op (the `moetrain op` name), modes
                     ("recurrent,chunked" for the KDA ops, "" otherwise), chunk_size
Cases: kda (GVA HV = 2H, K != V, T = 37 so chunks of 16 leave a tail of 5, with
h0; without h0 and with dht absent; outputs only; strong decay down to -12 per step
with some channels exactly 0 and beta near 0 or 1; one partial chunk of 64 > T), kda_fused (softplus and
lowerbound gates), kda_layer (softplus gate + low-rank output gate, lowerbound gate
+ full-rank output gate; GVA), attention, attnres, situ_glu (constant beta with
linear_beta; learnable beta without), gpt2_block, mla, latent_moe (docs/model.md#moe: K3 latent MoE with
shared experts and a router bias that changes the selection; plain MoE with SwiGLU and no
shared experts; top_k = 1 on [B, T, D] with a softmax router; an expert that no token
chooses; the experts run densely, a combine matrix masks what the router did not choose).
Buffers (the router bias) go under params/ but get no gradient; latent_moe also writes
topk_idx (int64) and topk_weight, which have no upstream gradient; attention and mla
also write max_logit [H] (QK-Clip's statistic: each head's largest causal logit), a
value without upstream gradient.
--list prints "CASE OP MODES" lines.
"""
import argparse
import math
import os
import zlib

import h5py
import numpy as np
import torch

DT = torch.float64


# ---------------------------------------------------------------- docs/model.md#norms norms

def rms_norm(x, w, eps):
    """y = w * x / sqrt(mean(x^2) + eps), over the last dim."""
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def layer_norm(x, w, b, eps):
    """GPT-2 LayerNorm, biased variance."""
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return w * (x - mu) / torch.sqrt(var + eps) + b


def l2_norm(x, eps):
    """x / sqrt(sum x^2 + eps) over the last dim (eps inside the sqrt, not scaled by the dim)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def sigmoid(x):
    return 1.0 / (1.0 + torch.exp(-x))


def softplus(x):
    """log(1 + e^x), exact for all x (no threshold shortcut)."""
    return torch.clamp(x, min=0) + torch.log1p(torch.exp(-torch.abs(x)))


def silu(x):
    return x * sigmoid(x)


# ---------------------------------------------------------------- docs/model.md#kda-recurrent-form KDA recurrence

def kda_recurrent(q, k, v, g, beta, scale, h0):
    """Naive loop of docs/model.md#kda-recurrent-form. q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K]; beta [B,T,HV]; h0 [B,HV,K,V] or None.
    GVA: q/k head h serves value heads hG..hG+G-1 (repeat_interleave)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    q = q.repeat_interleave(G, dim=2)
    k = k.repeat_interleave(G, dim=2)
    S = h0 if h0 is not None else torch.zeros(B, HV, K, V, dtype=q.dtype)
    outs = []
    for t in range(T):
        S = torch.exp(g[:, t])[..., None] * S                       # S' = Diag(exp(g_t)) S_{t-1}   (decay first)
        kt = k[:, t]                                                  # [B, HV, K]
        delta = v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S)        # δ = v - S'^T k
        S = S + beta[:, t][..., None, None] * kt[..., None] * delta[..., None, :]   # S = S' + β k δ^T
        outs.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S))  # o = S^T (scale q), updated state
    return torch.stack(outs, 1), S


# ---------------------------------------------------------------- docs/model.md#kda-layer KDA layer pieces

def kda_gate(f, A_log, dt_bias, mode, lower_bound):
    """f [..., HV, K], A_log [HV], dt_bias [HV*K] (index h*K + d)."""
    HV, K = f.shape[-2], f.shape[-1]
    a = torch.exp(A_log).view(HV, 1)
    fb = f + dt_bias.view(HV, K)
    if mode == "softplus":
        return -a * softplus(fb)
    return lower_bound * sigmoid(a * fb)


def short_conv(x, w):
    """Depthwise causal conv: c[t, ch] = sum_i w[ch, 0, i] x[t-(W-1)+i, ch] (zero before t = 0). x [B,T,P], w [P,1,W]."""
    B, T, P = x.shape
    W = w.shape[-1]
    xp = torch.cat([torch.zeros(B, W - 1, P, dtype=x.dtype), x], 1)
    return sum(w[:, 0, i] * xp[:, i:i + T, :] for i in range(W))


def kda_layer(x, p, H, K, HV, gate_mode, lower_bound, l2eps, norm_eps):
    B, T, D = x.shape
    q = silu(short_conv(x @ p["q_proj.weight"].T, p["q_conv1d.weight"].view(H * K, 1, -1)))
    k = silu(short_conv(x @ p["k_proj.weight"].T, p["k_conv1d.weight"].view(H * K, 1, -1)))
    v = silu(short_conv(x @ p["v_proj.weight"].T, p["v_conv1d.weight"].view(HV * K, 1, -1)))
    q = l2_norm(q.view(B, T, H, K), l2eps)
    k = l2_norm(k.view(B, T, H, K), l2eps)
    v = v.view(B, T, HV, K)
    f = (x @ p["f_a_proj.weight"].T) @ p["f_b_proj.weight"].T
    g = kda_gate(f.view(B, T, HV, K), p["A_log"], p["dt_bias"].reshape(-1), gate_mode, lower_bound)
    beta = sigmoid(x @ p["b_proj.weight"].T)
    o, _ = kda_recurrent(q, k, v, g, beta, K ** -0.5, None)
    if "g_proj.weight" in p:
        z = x @ p["g_proj.weight"].T
    else:
        z = (x @ p["g_a_proj.weight"].T) @ p["g_b_proj.weight"].T
    o = rms_norm(o, p["o_norm.weight"], norm_eps) * sigmoid(z.view(B, T, HV, K))
    return o.reshape(B, T, HV * K) @ p["o_proj.weight"].T


# ---------------------------------------------------------------- docs/model.md#gpt-2-block, docs/model.md#gated-mla, docs/model.md#situ-glu, docs/model.md#attnres-read

def causal_attention(q, k, v, scale):
    """q, k [B,T,H,Dk], v [B,T,H,Dv] -> [B,T,H,Dv]; softmax(scale q k^T + causal mask) v per head."""
    T = q.shape[1]
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("bhts,bshd->bthd", p, v)


def max_logit(q, k, scale):
    """QK-Clip's statistic (docs/model.md#qk-clip): per head h, the largest pre-softmax logit
    scale q_t . k_s over b, t and the causal keys s <= t -> [H]."""
    T = q.shape[1]
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    return s.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def gpt2_block(x, p, H, eps):
    B, T, D = x.shape
    a = layer_norm(x, p["ln_1.weight"], p["ln_1.bias"], eps)
    qkv = a @ p["attn.c_attn.weight"] + p["attn.c_attn.bias"]  # Conv1D: x W + b, W [in, out]
    q, k, v = (t.reshape(B, T, H, D // H) for t in qkv.split(D, dim=-1))
    o = causal_attention(q, k, v, (D // H) ** -0.5).reshape(B, T, D)
    x = x + o @ p["attn.c_proj.weight"] + p["attn.c_proj.bias"]
    m = layer_norm(x, p["ln_2.weight"], p["ln_2.bias"], eps)
    return x + gelu_tanh(m @ p["mlp.c_fc.weight"] + p["mlp.c_fc.bias"]) @ p["mlp.c_proj.weight"] + p["mlp.c_proj.bias"]


def situ_glu(gate, up, beta, linear_beta):
    a = beta * torch.tanh(gate / beta) * sigmoid(gate)
    u = linear_beta * torch.tanh(up / linear_beta) if linear_beta is not None else up
    return a * u


def attnres(prefix_sum, block_residual, proj, norm, eps):
    V = torch.cat([block_residual, prefix_sum[None]], 0)          # [M, ..., D], partial block last
    Kn = V / torch.sqrt((V * V).mean(-1, keepdim=True) + eps)      # RMSNorm without weight
    s = (Kn * (norm * proj.reshape(-1))).sum(-1)                   # [M, ...]
    alpha = torch.softmax(s, dim=0)
    return (alpha[..., None] * V).sum(0)


def mla(x, p, H, dn, dr, dv, eps, with_max_logit=False):
    B, T, D = x.shape
    cq = rms_norm(x @ p["q_a_proj.weight"].T, p["q_a_layernorm.weight"], eps)
    q = (cq @ p["q_b_proj.weight"].T).view(B, T, H, dn + dr)      # per head [q_nope | q_rot]
    ckr = x @ p["kv_a_proj_with_mqa.weight"].T
    r_kv = p["kv_a_layernorm.weight"].shape[0]
    c, kr = ckr[..., :r_kv], ckr[..., r_kv:]
    kv = (rms_norm(c, p["kv_a_layernorm.weight"], eps) @ p["kv_b_proj.weight"].T).view(B, T, H, dn + dv)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    k = torch.cat([k_nope, kr[:, :, None, :].expand(B, T, H, dr)], -1)
    o = causal_attention(q, k, v, (dn + dr) ** -0.5).reshape(B, T, H * dv)
    o = o * sigmoid(x @ p["g_proj.weight"].T)
    y = o @ p["o_proj.weight"].T
    return (y, max_logit(q, k, (dn + dr) ** -0.5).detach()) if with_max_logit else y


# ---------------------------------------------------------------- docs/model.md#moe MoE

def glu_mlp(x, w_gate, w_up, w_down, activation, beta, linear_beta):
    """docs/model.md#situ-glu SiTU-GLU (K3) or SwiGLU (Kimi-Linear): act(x Wg^T, x Wu^T) Wd^T."""
    g, u = x @ w_gate.T, x @ w_up.T
    h = situ_glu(g, u, beta, linear_beta) if activation == "situ_glu" else silu(g) * u
    return h @ w_down.T


def moe_route(x, gate_w, bias, top_k, score, renormalize, scale):
    """docs/model.md#moe-router, one token at a time. x [N, D] -> (I [N][k] expert lists in descending biased score, ties lower
    index first; combine [N, E]: w_e at the selected experts, 0 elsewhere, differentiable through s)."""
    logits = x @ gate_w.T
    s = sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, dim=-1)
    N, E = s.shape
    chosen, rows = [], []
    for n in range(N):
        c = [float(s[n, e] + bias[e]) for e in range(E)]          # biased score: selection only
        I = sorted(range(E), key=lambda e: (-c[e], e))[:top_k]
        mask = torch.zeros(E, dtype=x.dtype)
        mask[I] = 1.0
        w = s[n] * mask
        if renormalize and top_k > 1:
            w = w / (w.sum() + 1e-20)
        rows.append(w * scale)
        chosen.append(I)
    return chosen, torch.stack(rows)


def moe_margin(x, gate_w, bias, top_k, score):
    """Smallest gap between consecutive biased scores among each token's top_k + 1 (selection and its order
    are unambiguous in f32 when this is well above f32 rounding)."""
    logits = x @ gate_w.T
    s = sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, dim=-1)
    c = torch.sort(s + bias, dim=-1, descending=True).values[:, :top_k + 1]
    return (c[:, :-1] - c[:, 1:]).min(dim=-1).values                # [N]


def latent_moe(x, p, top_k, score="sigmoid", renormalize=True, scale=1.0, activation="situ_glu", beta=4.0,
               linear_beta=None, eps=1e-5):
    """docs/model.md#moe-experts in a dense masked form: every expert runs on every token and the combine matrix (zero for the
    experts a token did not choose) weights the results. x [N, D] or [B, T, D]; p: HF names.
    Returns y (x's shape), topk_idx [N, k] (int64), topk_weight [N, k]."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    E = p["gate.weight"].shape[0]
    chosen, combine = moe_route(x, p["gate.weight"], p["gate.e_score_correction_bias"], top_k, score, renormalize,
                                scale)
    latent = "routed_expert_down_proj.weight" in p
    z = x @ p["routed_expert_down_proj.weight"].T if latent else x
    y = 0
    for e in range(E):
        out = glu_mlp(z, p[f"experts.{e}.w1.weight"], p[f"experts.{e}.w3.weight"], p[f"experts.{e}.w2.weight"],
                      activation, beta, linear_beta)
        y = y + combine[:, e:e + 1] * out                           # weight applied after the expert
    if latent:
        y = rms_norm(y, p["routed_expert_norm.weight"], eps) @ p["routed_expert_up_proj.weight"].T
    if "shared_experts.gate_proj.weight" in p:
        y = y + glu_mlp(x, p["shared_experts.gate_proj.weight"], p["shared_experts.up_proj.weight"],
                        p["shared_experts.down_proj.weight"], activation, beta, linear_beta)
    topk_idx = torch.tensor(chosen, dtype=torch.int64)
    topk_weight = torch.stack([combine[n, chosen[n]] for n in range(len(chosen))])
    return {"y": y.reshape(shape), "topk_idx": topk_idx, "topk_weight": topk_weight}


# ---------------------------------------------------------------- cases

class Case:
    def __init__(self, name, op, modes=""):
        self.name, self.op, self.modes = name, op, modes
        self.chunk_size = 16
        self.inputs, self.params, self.attrs, self.upstream = {}, {}, {}, {}
        self.buffers = {}  # written under params/ like weights, but get no gradient (the router bias)
        self.outputs, self.grads, self.param_grads = {}, {}, {}


def run_case(case, fn, upstream_names):
    """fn(inputs, params) -> dict of outputs. upstream_names: outputs whose dX goes into the file."""
    ins = {k: v.clone().requires_grad_(True) for k, v in case.inputs.items()}
    ps = {k: v.clone().requires_grad_(True) for k, v in case.params.items()}
    outs = fn(ins, dict(ps, **case.buffers))
    case.outputs = {k: v.detach() for k, v in outs.items()}
    if not upstream_names:
        return
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    loss = 0
    for name in upstream_names:
        d = torch.randn(outs[name].shape, generator=gen, dtype=DT)
        case.upstream["d" + name] = d
        loss = loss + (outs[name] * d).sum()
    loss.backward()
    for k, v in ins.items():
        case.grads["d" + k] = v.grad if v.grad is not None else torch.zeros_like(v)
    for k, v in ps.items():
        case.param_grads[k] = v.grad if v.grad is not None else torch.zeros_like(v)


def make_cases():
    gen = torch.Generator().manual_seed(20260)

    def randn(*shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=gen, dtype=DT) * std + mean

    def rand(*shape, low=0.0, high=1.0):
        return torch.rand(*shape, generator=gen, dtype=DT) * (high - low) + low

    def inv_softplus_dt(n):  # fla dt_bias init: softplus^-1 of dt ~ logU(1e-3, 1e-1)
        dt = torch.exp(rand(n) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        return dt + torch.log(-torch.expm1(-dt))

    cases = []
    B, T, H, HV, K, V = 2, 37, 2, 4, 8, 6

    # --- kda core, GVA, K != V
    def kda_inputs(with_h0):
        ins = {"q": l2_norm(randn(B, T, H, K), 1e-6), "k": l2_norm(randn(B, T, H, K), 1e-6), "v": randn(B, T, HV, V),
               "g": -softplus(randn(B, T, HV, K)) * rand(B, T, HV, K, low=0.05, high=1.5),
               "beta": sigmoid(randn(B, T, HV))}
        if with_h0:
            ins["h0"] = randn(B, HV, K, V, std=0.5)
        return ins

    def kda_fn(scale):
        def fn(i, p):
            o, ht = kda_recurrent(i["q"], i["k"], i["v"], i["g"], i["beta"], scale, i.get("h0"))
            return {"o": o, "ht": ht}
        return fn

    c = Case("kda_gva", "kda", "recurrent,chunked")
    c.inputs = kda_inputs(True)
    run_case(c, kda_fn(K ** -0.5), ["o", "ht"])
    cases.append(c)

    c = Case("kda_no_h0_no_dht", "kda", "recurrent,chunked")
    c.inputs = kda_inputs(False)
    c.attrs["scale"] = 0.3
    run_case(c, kda_fn(0.3), ["o"])
    cases.append(c)

    c = Case("kda_outputs_only", "kda", "recurrent,chunked")
    c.inputs = kda_inputs(True)
    run_case(c, kda_fn(K ** -0.5), [])
    cases.append(c)

    # Strong and no decay: g down to -12 per step (|γ| up to ~190 within a chunk of 16; K3's
    # lower bound is -5, Kimi-Linear's softplus gate is unbounded), some channels exactly 0;
    # β near 0 and near 1. One chunk of 64 > T: the whole sequence is one partial chunk.
    for name, chunk in (("kda_strong_decay", 16), ("kda_one_partial_chunk", 64)):
        c = Case(name, "kda", "recurrent,chunked")
        c.chunk_size = chunk
        c.inputs = kda_inputs(True)
        g = -rand(B, T, HV, K, high=12.0)
        g[:, :, :, 0] = 0.0
        c.inputs["g"] = g
        c.inputs["beta"] = torch.where(rand(B, T, HV) < 0.5, rand(B, T, HV, high=1e-3),
                                       rand(B, T, HV, low=0.999, high=1.0))
        run_case(c, kda_fn(K ** -0.5), ["o", "ht"])
        cases.append(c)

    # --- kda_fused: l2norm, gate, sigmoid, then KDA
    for gate_mode in ("softplus", "lowerbound"):
        c = Case("kda_fused_" + gate_mode, "kda_fused", "recurrent,chunked")
        c.inputs = {"q_raw": randn(B, T, H, K), "k_raw": randn(B, T, H, K), "v": randn(B, T, HV, V),
                    "f_raw": randn(B, T, HV, K), "beta_raw": randn(B, T, HV),
                    "A_log": torch.log(rand(HV, low=1.0, high=16.0)),
                    "dt_bias": inv_softplus_dt(HV * K) if gate_mode == "softplus" else randn(HV * K, std=0.5),
                    "h0": randn(B, HV, K, V, std=0.5)}
        c.attrs = {"gate_mode": gate_mode, "lower_bound": -5.0, "l2norm_eps": 1e-6}

        def fused(i, p, gate_mode=gate_mode):
            g = kda_gate(i["f_raw"], i["A_log"], i["dt_bias"], gate_mode, -5.0)
            o, ht = kda_recurrent(l2_norm(i["q_raw"], 1e-6), l2_norm(i["k_raw"], 1e-6), i["v"], g,
                                  sigmoid(i["beta_raw"]), K ** -0.5, i["h0"])
            return {"o": o, "ht": ht}
        run_case(c, fused, ["o", "ht"])
        cases.append(c)

    # --- kda_layer (K = V = head_dim), GVA
    D, W = 24, 4
    for gate_mode, full_rank in (("softplus", False), ("lowerbound", True)):
        c = Case(f"kda_layer_{gate_mode}_{'full' if full_rank else 'lowrank'}", "kda_layer", "recurrent,chunked")
        s = D ** -0.5
        p = {"q_proj.weight": randn(H * K, D, std=s), "k_proj.weight": randn(H * K, D, std=s),
             "v_proj.weight": randn(HV * K, D, std=s),
             "f_a_proj.weight": randn(K, D, std=s), "f_b_proj.weight": randn(HV * K, K, std=K ** -0.5),
             "b_proj.weight": randn(HV, D, std=s), "A_log": torch.log(rand(HV, low=1.0, high=16.0)),
             "dt_bias": inv_softplus_dt(HV * K) if gate_mode == "softplus" else randn(HV * K, std=0.5),
             "o_norm.weight": randn(K, std=0.2, mean=1.0), "o_proj.weight": randn(D, HV * K, std=(HV * K) ** -0.5)}
        # HF Conv1d layout [P, 1, W] in one case, [P, W] in the other (both accepted)
        for name, P in (("q_conv1d.weight", H * K), ("k_conv1d.weight", H * K), ("v_conv1d.weight", HV * K)):
            p[name] = randn(P, W, std=0.5) if full_rank else randn(P, 1, W, std=0.5)
        if full_rank:
            p["g_proj.weight"] = randn(HV * K, D, std=s)
        else:
            p["g_a_proj.weight"] = randn(K, D, std=s)
            p["g_b_proj.weight"] = randn(HV * K, K, std=K ** -0.5)
        c.params = p
        c.inputs = {"x": randn(B, T, D)}
        c.attrs = {"gate_mode": gate_mode, "lower_bound": -5.0, "l2norm_eps": 1e-6, "o_norm_eps": 1e-5,
                   "conv_size": W, "full_rank_output_gate": np.bool_(full_rank), "H": H}

        def layer(i, p, gate_mode=gate_mode):
            return {"y": kda_layer(i["x"], p, H, K, HV, gate_mode, -5.0, 1e-6, 1e-5)}
        run_case(c, layer, ["y"])
        cases.append(c)

    # --- attention (Dk != Dv)
    c = Case("attention", "attention")
    c.inputs = {"q": randn(2, 19, 3, 8), "k": randn(2, 19, 3, 8), "v": randn(2, 19, 3, 5)}
    run_case(c, lambda i, p: {"out": causal_attention(i["q"], i["k"], i["v"], 8 ** -0.5),
                              "max_logit": max_logit(i["q"], i["k"], 8 ** -0.5).detach()}, ["out"])
    cases.append(c)

    # --- attnres: 3 completed blocks + the partial one
    Dr = 16
    c = Case("attnres", "attnres")
    c.inputs = {"prefix_sum": randn(2, 5, Dr), "block_residual": randn(3, 2, 5, Dr, std=2.0),
                "proj": randn(1, Dr), "norm": randn(Dr, std=0.3, mean=1.0)}
    c.attrs = {"eps": 1e-5}
    run_case(c, lambda i, p: {"out": attnres(i["prefix_sum"], i["block_residual"], i["proj"], i["norm"], 1e-5)},
             ["out"])
    cases.append(c)

    # --- situ_glu: constant beta with linear_beta; learnable beta without (values reach the soft caps)
    c = Case("situ_glu", "situ_glu")
    c.inputs = {"gate": randn(2, 5, 12, std=4.0), "up": randn(2, 5, 12, std=20.0)}
    c.attrs = {"beta": 4.0, "linear_beta": 25.0}
    run_case(c, lambda i, p: {"out": situ_glu(i["gate"], i["up"], 4.0, 25.0)}, ["out"])
    cases.append(c)

    c = Case("situ_glu_learnable_beta", "situ_glu")
    c.inputs = {"gate": randn(3, 7, std=4.0), "up": randn(3, 7), "beta": torch.tensor([3.5], dtype=DT)}
    run_case(c, lambda i, p: {"out": situ_glu(i["gate"], i["up"], i["beta"], None)}, ["out"])
    cases.append(c)

    # --- gpt2_block (HF Conv1D layout)
    Dg, Hg, Fg = 32, 4, 128
    c = Case("gpt2_block", "gpt2_block")
    c.inputs = {"x": randn(2, 11, Dg)}
    c.params = {"ln_1.weight": randn(Dg, std=0.1, mean=1.0), "ln_1.bias": randn(Dg, std=0.1),
                "attn.c_attn.weight": randn(Dg, 3 * Dg, std=0.2), "attn.c_attn.bias": randn(3 * Dg, std=0.1),
                "attn.c_proj.weight": randn(Dg, Dg, std=0.1), "attn.c_proj.bias": randn(Dg, std=0.1),
                "ln_2.weight": randn(Dg, std=0.1, mean=1.0), "ln_2.bias": randn(Dg, std=0.1),
                "mlp.c_fc.weight": randn(Dg, Fg, std=0.1), "mlp.c_fc.bias": randn(Fg, std=0.1),
                "mlp.c_proj.weight": randn(Fg, Dg, std=0.1), "mlp.c_proj.bias": randn(Dg, std=0.1)}
    c.attrs = {"H": Hg, "ln_eps": 1e-5}
    run_case(c, lambda i, p: {"y": gpt2_block(i["x"], p, Hg, 1e-5)}, ["y"])
    cases.append(c)

    # --- mla (query LoRA, NoPE, output gate)
    Dm, Hm, rq, rkv, dn, dr, dv = 32, 4, 16, 12, 8, 4, 6
    c = Case("mla", "mla")
    c.inputs = {"x": randn(2, 13, Dm)}
    c.params = {"q_a_proj.weight": randn(rq, Dm, std=Dm ** -0.5), "q_a_layernorm.weight": randn(rq, std=0.2, mean=1.0),
                "q_b_proj.weight": randn(Hm * (dn + dr), rq, std=rq ** -0.5),
                "kv_a_proj_with_mqa.weight": randn(rkv + dr, Dm, std=Dm ** -0.5),
                "kv_a_layernorm.weight": randn(rkv, std=0.2, mean=1.0),
                "kv_b_proj.weight": randn(Hm * (dn + dv), rkv, std=rkv ** -0.5),
                "g_proj.weight": randn(Hm * dv, Dm, std=Dm ** -0.5),
                "o_proj.weight": randn(Dm, Hm * dv, std=(Hm * dv) ** -0.5)}
    c.attrs = {"H": Hm, "eps": 1e-6}
    run_case(c, lambda i, p: dict(zip(("y", "max_logit"), mla(i["x"], p, Hm, dn, dr, dv, 1e-6, True))), ["y"])
    cases.append(c)
    # --- latent_moe (docs/model.md#moe): K3 latent MoE + shared experts, the bias changing the selection; a plain
    # Kimi-Linear-style MoE (SwiGLU, no latent, no shared); top_k = 1 on [B, T, D]; an expert no token
    # chooses (its bias puts it last for every token). Inputs are redrawn per token until the top_k + 1
    # biased scores are 2e-3 apart, so the selection and its order are the same in f32.
    Dx, Lx, Fx = 16, 8, 12

    def moe_params(E, latent, n_shared, gain):
        W = Lx if latent else Dx
        p = {"gate.weight": randn(E, Dx, std=Dx ** -0.5)}
        for e in range(E):
            p[f"experts.{e}.w1.weight"] = randn(Fx, W, std=gain * W ** -0.5)
            p[f"experts.{e}.w3.weight"] = randn(Fx, W, std=gain * W ** -0.5)
            p[f"experts.{e}.w2.weight"] = randn(W, Fx, std=Fx ** -0.5)
        if n_shared:
            Fs = Fx * n_shared
            p["shared_experts.gate_proj.weight"] = randn(Fs, Dx, std=gain * Dx ** -0.5)
            p["shared_experts.up_proj.weight"] = randn(Fs, Dx, std=gain * Dx ** -0.5)
            p["shared_experts.down_proj.weight"] = randn(Dx, Fs, std=Fs ** -0.5)
        if latent:
            p["routed_expert_down_proj.weight"] = randn(Lx, Dx, std=Dx ** -0.5)
            p["routed_expert_up_proj.weight"] = randn(Dx, Lx, std=Lx ** -0.5)
            p["routed_expert_norm.weight"] = randn(Lx, std=0.2, mean=1.0)
        return p

    def moe_x(shape, p, bias, top_k, score):
        x = randn(*shape).reshape(-1, Dx)
        for _ in range(100):
            bad = moe_margin(x, p["gate.weight"], bias, top_k, score) < 2e-3
            if not bad.any():
                return x.reshape(shape)
            x[bad] = randn(int(bad.sum()), Dx)
        raise RuntimeError("latent_moe: no inputs with a clear top-k margin")

    moe_cases = [
        # name, E, k, latent, n_shared, x shape, attrs (beyond num_experts, top_k)
        ("latent_moe_k3", 8, 3, True, 2, (20, Dx), 3.0,
         {"routed_scaling_factor": 2.5, "beta": 4.0, "linear_beta": 25.0, "eps": 1e-5,
          "router_score": "sigmoid", "renormalize": np.bool_(True)}),
        ("latent_moe_plain_swiglu", 6, 2, False, 0, (20, Dx), 1.0,
         {"routed_scaling_factor": 2.446, "activation": "swiglu", "renormalize": np.bool_(True)}),
        ("latent_moe_top1", 4, 1, False, 1, (2, 7, Dx), 2.0, {"router_score": "softmax", "beta": 4.0}),
        ("latent_moe_idle_expert", 6, 2, True, 0, (18, Dx), 2.5,
         {"routed_scaling_factor": 1.5, "beta": 2.0, "linear_beta": 3.0, "eps": 1e-6, "router_score": "softmax",
          "renormalize": np.bool_(False)}),
    ]
    for name, E, k, latent, n_shared, shape, gain, attrs in moe_cases:
        c = Case(name, "latent_moe")
        c.params = moe_params(E, latent, n_shared, gain)
        score = attrs.get("router_score", "sigmoid")
        if name == "latent_moe_idle_expert":
            bias = torch.zeros(E, dtype=DT)
            bias[3] = -1.0                                          # softmax scores < 1: expert 3 is always last
        elif name == "latent_moe_top1":
            bias = torch.zeros(E, dtype=DT)
        else:
            bias = randn(E, std=0.15)
        c.buffers = {"gate.e_score_correction_bias": bias}
        c.inputs = {"x": moe_x(shape, c.params, bias, k, score)}
        c.attrs = dict(attrs, num_experts=E, top_k=k)

        def moe(i, p, k=k, attrs=attrs):
            return latent_moe(i["x"], p, k, score=attrs.get("router_score", "sigmoid"),
                              renormalize=bool(attrs.get("renormalize", True)),
                              scale=attrs.get("routed_scaling_factor", 1.0),
                              activation=attrs.get("activation", "situ_glu"), beta=attrs.get("beta", 4.0),
                              linear_beta=attrs.get("linear_beta"), eps=attrs.get("eps", 1e-5))
        run_case(c, moe, ["y"])
        idx = c.outputs["topk_idx"]
        if name == "latent_moe_k3":                                 # the bias changes some selections
            unbiased, _ = moe_route(c.inputs["x"], c.params["gate.weight"], torch.zeros(E, dtype=DT), k, score,
                                    True, 1.0)
            assert any(set(a) != set(b) for a, b in zip(unbiased, idx.tolist())), name
        if name == "latent_moe_idle_expert":
            assert not (idx == 3).any() and c.param_grads["experts.3.w1.weight"].abs().max() == 0, name
        cases.append(c)
    return cases


def write(out_dir, cases):
    os.makedirs(out_dir, exist_ok=True)
    tmp_in, tmp_exp = os.path.join(out_dir, "inputs.h5.tmp"), os.path.join(out_dir, "expected.h5.tmp")
    with h5py.File(tmp_in, "w") as fi, h5py.File(tmp_exp, "w") as fe:
        for c in cases:
            gi, ge = fi.create_group(c.name), fe.create_group(c.name)
            for k, v in c.inputs.items():
                gi[k] = v.numpy()
            for k, v in list(c.params.items()) + list(c.buffers.items()):
                gi["params/" + k] = v.numpy()
            for k, v in c.upstream.items():
                gi[k] = v.numpy()
            for k, v in c.attrs.items():
                gi.attrs[k] = v
            for k, v in c.outputs.items():
                ge[k] = v.numpy()
            for k, v in c.grads.items():
                ge[k] = v.numpy()
            for k, v in c.param_grads.items():
                ge["grad/" + k] = v.numpy()
            ge.attrs["op"] = c.op
            ge.attrs["modes"] = c.modes
            ge.attrs["chunk_size"] = c.chunk_size
    os.replace(tmp_in, os.path.join(out_dir, "inputs.h5"))
    os.replace(tmp_exp, os.path.join(out_dir, "expected.h5"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--list", action="store_true", help="print CASE OP MODES lines")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = make_cases()
    write(args.out, cases)
    if args.list:
        for c in cases:
            print(c.name, c.op, c.modes or "-")


if __name__ == "__main__":
    main()
