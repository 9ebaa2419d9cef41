#!/usr/bin/python3
"""Independent NumPy (float64) transcription of Muon and QK-Clip as docs/model.md#muon
and docs/model.md#qk-clip state them (Debian python3-numpy, python3-h5py), the
reference for tests/optim/muon_test.cpp. Shares no code with moetrain: the
Newton-Schulz iteration is written as Moonlight's `zeropower_via_newtonschulz5`
(MoonshotAI/Moonlight examples/toy_train.py) with literal transposes, the update as
its `Muon.step` (lr · 0.2 · sqrt(max(A, B))), QK-Clip as the Kimi K2 report §2.1.

  muon_reference.py OUT_DIR

Writes OUT_DIR/inputs.h5 and OUT_DIR/expected.h5; each case is one group of the same
name in both files.
  muon_*   inputs: param [A, B] or [E, A, B], grad, momentum (absent: zeros);
           attributes lr, weight_decay, momentum, nesterov (0/1), ns_steps.
           expected: param, momentum after the step, and orthogonalized (the
           Newton-Schulz output X the step used).
           muon_two_steps also has grad_2 (the second step's gradient) and expects
           param_1, momentum_1 (after step 1) and param, momentum (after step 2).
  qk_clip_* inputs: max_logit [H], weights under params/ (moetrain's [out, in]
           layout with Hugging Face names); attributes kind (mla, attention, gpt2),
           H, tau and for mla qk_nope_head_dim, qk_rope_head_dim, v_head_dim.
           expected: the clipped weights under params/ and gamma [H].
The script checks its own output before writing: every Newton-Schulz output's
singular values lie in [0.68, 1.21] (five-step cases) (numpy.linalg.svd), and after QK-Clip every
logit of head h is gamma_h times the logit before (random inputs, RoPE included).
"""
import os
import sys

import h5py
import numpy as np

A_NS, B_NS, C_NS = 3.4445, -4.7750, 2.0315
EPS = 1e-7


def newton_schulz(g, steps):
    """Moonlight's zeropower_via_newtonschulz5 per matrix (leading dims batch)."""
    x = g.copy()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = np.swapaxes(x, -1, -2)
    x = x / (np.linalg.norm(x, axis=(-2, -1), keepdims=True) + EPS)
    for _ in range(steps):
        a = x @ np.swapaxes(x, -1, -2)
        b = B_NS * a + C_NS * (a @ a)
        x = A_NS * x + b @ x
    if tall:
        x = np.swapaxes(x, -1, -2)
    return x


def muon_step(w, g, m, lr, wd, mu, nesterov, steps):
    """One step; returns (w, m, x)."""
    m = mu * m + g
    n = g + mu * m if nesterov else m
    x = newton_schulz(n, steps)
    rows, cols = w.shape[-2:]
    w = w * (1.0 - lr * wd) - (lr * 0.2 * np.sqrt(max(rows, cols))) * x
    return w, m, x


def check_band(x, case):
    s = np.linalg.svd(x, compute_uv=False)
    s = s[s > 0]  # a zero matrix (an expert with no gradient) stays zero
    assert s.size == 0 or (s.min() >= 0.68 and s.max() <= 1.21), (case, s.min(), s.max())


def muon_cases(rng):
    """name -> (inputs dict, attrs dict, expected dict)."""
    cases = {}

    def one(name, shape, lr=0.05, wd=0.1, mu=0.95, nesterov=True, steps=5, momentum=False, grad_scale=None):
        w = 0.1 * rng.standard_normal(shape)
        g = rng.standard_normal(shape)
        if grad_scale is not None:  # per expert: very different scales, one expert all zero
            g = g * np.asarray(grad_scale).reshape(-1, 1, 1)
        m0 = rng.standard_normal(shape) if momentum else np.zeros(shape)
        w1, m1, x = muon_step(w, g, m0, lr, wd, mu, nesterov, steps)
        if steps == 5:  # the band is five steps' (docs/model.md#muon)
            check_band(x, name)
        inputs = {"param": w, "grad": g}
        if momentum:
            inputs["momentum"] = m0
        attrs = {"lr": lr, "weight_decay": wd, "momentum": mu, "nesterov": int(nesterov), "ns_steps": steps}
        cases[name] = (inputs, attrs, {"param": w1, "momentum": m1, "orthogonalized": x})

    one("muon_wide_5x7", (5, 7))
    one("muon_tall_7x5", (7, 5))
    one("muon_square_6x6", (6, 6))
    one("muon_experts_3x5x7", (3, 5, 7), grad_scale=[1.0, 100.0, 0.01])
    one("muon_experts_tall_3x7x4", (3, 7, 4), grad_scale=[1.0, 0.0, 3.0])
    one("muon_momentum_no_nesterov_7x5", (7, 5), mu=0.9, nesterov=False, momentum=True)
    one("muon_momentum_nesterov_5x7", (5, 7), momentum=True)
    one("muon_three_ns_steps_33x31", (33, 31), lr=0.02, wd=0.0, steps=3)
    one("muon_one_row_1x9", (1, 9))

    # Two consecutive steps: the second starts from the first's parameter and momentum.
    shape = (6, 4)
    w = 0.1 * rng.standard_normal(shape)
    g1, g2 = rng.standard_normal(shape), rng.standard_normal(shape)
    lr, wd, mu = 0.03, 0.1, 0.95
    w1, m1, x1 = muon_step(w, g1, np.zeros(shape), lr, wd, mu, True, 5)
    w2, m2, x2 = muon_step(w1, g2, m1, lr, wd, mu, True, 5)
    check_band(x1, "two_steps 1")
    check_band(x2, "two_steps 2")
    cases["muon_two_steps"] = (
        {"param": w, "grad": g1, "grad_2": g2},
        {"lr": lr, "weight_decay": wd, "momentum": mu, "nesterov": 1, "ns_steps": 5},
        {"param_1": w1, "momentum_1": m1, "param": w2, "momentum": m2, "orthogonalized": x2},
    )
    return cases


def gammas(max_logit, tau):
    return np.array([min(1.0, tau / s) if s > tau else 1.0 for s in max_logit])


def rope(x, pos, theta=10000.0):
    """Rotate-half RoPE of x [.., r] at position pos (linear in x)."""
    r = x.shape[-1]
    half = r // 2
    ang = pos * theta ** (-2.0 * np.arange(half) / r)
    cs, sn = np.cos(np.concatenate([ang, ang])), np.sin(np.concatenate([ang, ang]))
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cs + rot * sn


def mla_logits(wq, wkv, kr, x, c, H, dn, dr, dv):
    """Per head [H, T, T] logits q_i . k_j with k = [k_nope | kr] (kr shared), RoPE on the rotary parts."""
    T = x.shape[0]
    q = (x @ wq.T).reshape(T, H, dn + dr)
    kv = (c @ wkv.T).reshape(T, H, dn + dv)
    out = np.zeros((H, T, T))
    for h in range(H):
        for i in range(T):
            for j in range(T):
                qn, qr = q[i, h, :dn], rope(q[i, h, dn:], i)
                kn, krr = kv[j, h, :dn], rope(kr[j], j)
                out[h, i, j] = qn @ kn + qr @ krr
    return out


def qk_clip_cases(rng):
    cases = {}
    tau = 100.0

    # MLA, H = 3, dn = 4, dr = 2, dv = 3, r_q = 5, r_kv = 6: head 0 far above tau,
    # head 1 below, head 2 exactly at tau (untouched).
    H, dn, dr, dv, rq, rkv = 3, 4, 2, 3, 5, 6
    for qname in ("q_b_proj.weight", "q_proj.weight"):
        wq = rng.standard_normal((H * (dn + dr), rq))
        wkv = rng.standard_normal((H * (dn + dv), rkv))
        s = np.array([437.5, 42.0, 100.0])
        gam = gammas(s, tau)
        wq2, wkv2 = wq.copy(), wkv.copy()
        for h in range(H):
            if gam[h] == 1.0:
                continue
            wq2[h * (dn + dr):h * (dn + dr) + dn] *= np.sqrt(gam[h])
            wq2[h * (dn + dr) + dn:(h + 1) * (dn + dr)] *= gam[h]
            wkv2[h * (dn + dv):h * (dn + dv) + dn] *= np.sqrt(gam[h])
        T = 4
        x, c, kr = rng.standard_normal((T, rq)), rng.standard_normal((T, rkv)), rng.standard_normal((T, dr))
        before = mla_logits(wq, wkv, kr, x, c, H, dn, dr, dv)
        after = mla_logits(wq2, wkv2, kr, x, c, H, dn, dr, dv)
        assert np.allclose(after, gam.reshape(H, 1, 1) * before, rtol=1e-12, atol=1e-12)
        # The value rows are untouched.
        for h in range(H):
            v0 = h * (dn + dv) + dn
            assert np.array_equal(wkv2[v0:v0 + dv], wkv[v0:v0 + dv])
        name = "qk_clip_mla" if qname == "q_b_proj.weight" else "qk_clip_mla_no_lora"
        cases[name] = (
            {"max_logit": s, "params/" + qname: wq, "params/kv_b_proj.weight": wkv},
            {"kind": "mla", "H": H, "tau": tau, "qk_nope_head_dim": dn, "qk_rope_head_dim": dr, "v_head_dim": dv},
            {"gamma": gam, "params/" + qname: wq2, "params/kv_b_proj.weight": wkv2},
        )

    # Plain attention, separate projections (self_attn.q_proj / k_proj [D, D]), D = 6, H = 3.
    D, H = 6, 3
    hd = D // H
    wq, wk = rng.standard_normal((D, D)), rng.standard_normal((D, D))
    s = np.array([99.0, 250.0, 1000.0])
    gam = gammas(s, tau)
    wq2, wk2 = wq.copy(), wk.copy()
    for h in range(H):
        wq2[h * hd:(h + 1) * hd] *= np.sqrt(gam[h])
        wk2[h * hd:(h + 1) * hd] *= np.sqrt(gam[h])
    x = rng.standard_normal((5, D))
    q, k = (x @ wq.T).reshape(5, H, hd), (x @ wk.T).reshape(5, H, hd)
    q2, k2 = (x @ wq2.T).reshape(5, H, hd), (x @ wk2.T).reshape(5, H, hd)
    assert np.allclose(np.einsum("ihd,jhd->hij", q2, k2),
                       gam.reshape(H, 1, 1) * np.einsum("ihd,jhd->hij", q, k), rtol=1e-12, atol=1e-12)
    cases["qk_clip_attention"] = (
        {"max_logit": s, "params/self_attn.q_proj.weight": wq, "params/self_attn.k_proj.weight": wk},
        {"kind": "attention", "H": H, "tau": tau},
        {"gamma": gam, "params/self_attn.q_proj.weight": wq2, "params/self_attn.k_proj.weight": wk2},
    )

    # GPT-2's fused c_attn [3D, D] with its bias [3D], D = 8, H = 2.
    D, H = 8, 2
    hd = D // H
    w, b = rng.standard_normal((3 * D, D)), rng.standard_normal(3 * D)
    s = np.array([160.0, 12.5])
    gam = gammas(s, tau)
    w2, b2 = w.copy(), b.copy()
    for h in range(H):
        for first in (h * hd, D + h * hd):
            w2[first:first + hd] *= np.sqrt(gam[h])
            b2[first:first + hd] *= np.sqrt(gam[h])
    x = rng.standard_normal((3, D))
    qkv, qkv2 = x @ w.T + b, x @ w2.T + b2
    assert np.array_equal(qkv2[:, 2 * D:], qkv[:, 2 * D:])  # v untouched
    lg = np.einsum("ihd,jhd->hij", qkv[:, :D].reshape(3, H, hd), qkv[:, D:2 * D].reshape(3, H, hd))
    lg2 = np.einsum("ihd,jhd->hij", qkv2[:, :D].reshape(3, H, hd), qkv2[:, D:2 * D].reshape(3, H, hd))
    assert np.allclose(lg2, gam.reshape(H, 1, 1) * lg, rtol=1e-12, atol=1e-12)
    cases["qk_clip_gpt2"] = (
        {"max_logit": s, "params/attn.c_attn.weight": w, "params/attn.c_attn.bias": b},
        {"kind": "gpt2", "H": H, "tau": tau},
        {"gamma": gam, "params/attn.c_attn.weight": w2, "params/attn.c_attn.bias": b2},
    )
    return cases


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(36)
    cases = muon_cases(rng)
    cases.update(qk_clip_cases(rng))
    for fname in ("inputs.h5", "expected.h5"):
        tmp = os.path.join(out, fname + ".tmp")
        with h5py.File(tmp, "w") as f:
            for name, (inputs, attrs, expected) in cases.items():
                g = f.create_group(name)
                for k, v in (inputs if fname == "inputs.h5" else expected).items():
                    g.create_dataset(k, data=np.asarray(v, dtype=np.float64))
                if fname == "inputs.h5":
                    for k, v in attrs.items():
                        g.attrs[k] = v
        os.replace(tmp, os.path.join(out, fname))
    print(f"muon_reference: {len(cases)} cases in {out}")


if __name__ == "__main__":
    main()
