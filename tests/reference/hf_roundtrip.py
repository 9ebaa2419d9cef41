#!/usr/bin/env python3
"""Round trips between moetrain and Hugging Face transformers' own classes
(docs/export.md): GPT2LMHeadModel and KimiLinearForCausalLM.

  hf_roundtrip.py MOETRAIN_BINARY WORK_DIR

HF -> moetrain: random small models built with transformers, saved with
save_pretrained (transformers' save format, including its layer-0
`block_sparse_moe.` spelling of the dense MLP), read by `moetrain eval/generate
--init-from DIR` without a YAML. moetrain -> HF: `moetrain train` (a few steps of a
tiny model on random bytes), `moetrain export`, then from_pretrained, which must load
without a warning. Both ways the mean loss on the same windows must agree to 1e-5
relative (f32) and greedy text must be identical. Also: top_k = 1 both ways (moetrain
does not renormalise one expert's weight; its export says moe_renormalize false, and a
kimi_linear config asking transformers' renormalisation is refused), and a model with
features outside KimiLinear exported as moetrain_hybrid, which transformers refuses.

Prints one line per check; exits 1 on the first failure. Needs transformers and torch;
the C++ test (tests/cli/hf_roundtrip_test.cpp) skips when they are missing. A transformers
without KimiLinearForCausalLM (before 5; CI's 4.47.1 on Debian's torch 1.13, launch/test.sh)
runs the GPT-2 checks and the moetrain_hybrid refusal, and says in one line that the
kimi_linear ones are skipped."""

import contextlib
import io
import json
import logging
import os
import struct
import subprocess
import sys
import warnings

import torch
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

try:
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
except ImportError:
    KimiLinearConfig = KimiLinearForCausalLM = None

TOL = 1e-5     # relative, f32
V = 256        # byte tokenizer
T = 32         # window length
WINDOWS = 6    # eval windows (batches of 2)
PROMPT = "The quick brown fox"
NEW = 24       # greedy tokens
# from_pretrained's dtype argument: `dtype` in transformers 5, `torch_dtype` in 4.
DTYPE_ARG = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"

BIN = None
WORK = None


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def run(args, check=True):
    r = subprocess.run([BIN] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if check and r.returncode != 0:
        fail("moetrain %s exited %d:\n%s" % (" ".join(args), r.returncode, r.stderr.decode(errors="replace")))
    return r


def write_shard(path, tokens):
    """llm.c's token shard (src/data/shard.h): 256 int32 header, uint16 tokens."""
    header = [20240520, 1, len(tokens)] + [0] * 253
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack("<%dH" % len(tokens), *tokens))


def make_data():
    g = torch.Generator().manual_seed(7)
    os.makedirs(os.path.join(WORK, "data"), exist_ok=True)
    val = torch.randint(0, V, (WINDOWS * T + 1,), generator=g).tolist()
    train = torch.randint(0, V, (4096,), generator=g).tolist()
    write_shard(os.path.join(WORK, "data", "val_000.bin"), val)
    write_shard(os.path.join(WORK, "data", "train_000.bin"), train)
    return val


def hf_loss(model, tokens):
    """Mean next-token cross-entropy over windows i of T+1 tokens from iT (as moetrain's loader)."""
    x = torch.tensor([tokens[i * T:i * T + T] for i in range(WINDOWS)])
    y = torch.tensor([tokens[i * T + 1:i * T + T + 1] for i in range(WINDOWS)])
    with torch.no_grad():
        logits = model(input_ids=x).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


def hf_greedy(model):
    ids = torch.tensor([list(PROMPT.encode())])
    with torch.no_grad():
        # synced_gpus given: left None, transformers 4 asks whether the model is FSDP-managed by
        # importing torch.distributed.fsdp, which Debian's torch 1.13 cannot import under Python 3.11.
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, synced_gpus=False)
    return PROMPT.encode() + bytes(out[0, ids.shape[1]:].tolist()) + b"\n"


def moetrain_loss(source):
    r = run(["eval"] + source + ["--data", os.path.join(WORK, "data", "val_*.bin"), "--seq-len", str(T),
                                 "--batch-size", "2", "--json", "--set", "data.tokenizer=byte"])
    return json.loads(r.stdout.decode())["loss"]


def moetrain_greedy(source):
    r = run(["generate"] + source + ["--prompt", PROMPT, "--max-new-tokens", str(NEW), "--temperature", "0",
                                     "--set", "data.tokenizer=byte"])
    return r.stdout


def compare(name, ours, theirs, text_ours, text_theirs):
    rel = abs(ours - theirs) / abs(theirs)
    print("%-44s loss moetrain %.7f  transformers %.7f  rel %.1e  greedy text %s" %
          (name, ours, theirs, rel, "equal" if text_ours == text_theirs else "DIFFERENT"))
    if not rel < TOL:
        fail("%s: losses differ by %.2e relative (tolerance %.0e)" % (name, rel, TOL))
    if text_ours != text_theirs:
        fail("%s: greedy text differs:\n  moetrain     %r\n  transformers %r" % (name, text_ours, text_theirs))


@contextlib.contextmanager
def no_warnings(what):
    """Fails when transformers logs a warning (or Python warns) inside the block."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    logger = transformers.logging.get_logger("transformers")
    logger.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    logger.removeHandler(handler)
    # transformers' KDA and conv fall back to their PyTorch code without fla / causal_conv1d:
    # a note about speed at the first forward, not about the weights.
    logged = [l for l in stream.getvalue().splitlines() if l.strip() and "falling back" not in l]
    caught = [w for w in caught if "falling back" not in str(w.message) and "zero-element" not in str(w.message)]
    if logged or caught:
        fail("%s: transformers warned:\n  %s" % (what, "\n  ".join(logged + [str(w.message) for w in caught])))


def spread(model, scale):
    """Random weights large enough that greedy decoding has clear winners."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(scale)


# ------------------------------------------------------------------ HF -> moetrain

def hf_to_moetrain(tokens):
    torch.manual_seed(1)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=48,
                                      layer_norm_epsilon=1e-5, bos_token_id=None, eos_token_id=None))
    spread(gpt2, 8.0)
    gpt2.eval()
    d = os.path.join(WORK, "hf_gpt2")
    gpt2.save_pretrained(d)
    src = ["--init-from", d]
    compare("gpt2: transformers -> moetrain", moetrain_loss(src), hf_loss(gpt2, tokens), moetrain_greedy(src),
            hf_greedy(gpt2))

    # transformers' fields moetrain's GPT-2 does not compute: refused, naming the field.
    for field, value in [("tie_word_embeddings", False), ("scale_attn_by_inverse_layer_idx", True),
                         ("scale_attn_weights", False), ("activation_function", "gelu")]:
        cfg = json.load(open(os.path.join(d, "config.json")))
        cfg[field] = value
        bad = os.path.join(WORK, "hf_gpt2_" + field)
        os.makedirs(bad, exist_ok=True)
        json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
        os.symlink(os.path.join(d, "model.safetensors"), os.path.join(bad, "model.safetensors"))
        r = run(["eval", "--init-from", bad, "--data", os.path.join(WORK, "data", "val_*.bin"), "--set",
                 "data.tokenizer=byte"], check=False)
        err = r.stderr.decode(errors="replace")
        print("%-44s exit %d, names the field: %s" % ("gpt2 %s = %s" % (field, json.dumps(value)), r.returncode,
                                                     field in err))
        if r.returncode != 2 or field not in err:
            fail("gpt2 with %s = %s: expected exit 2 naming the field, got %d: %s" % (field, value, r.returncode, err))

    if KimiLinearForCausalLM is None:
        print("%-44s skipped: transformers %s has no KimiLinearForCausalLM" % ("kimi_linear -> moetrain",
                                                                            transformers.__version__))
        return
    for name, extra in [("kimi_linear: KDA + MLA, MoE, q_lora", dict(q_lora_rank=12)),
                        ("kimi_linear: top_k 1, not renormalised", dict(num_experts_per_token=1, moe_renormalize=False)),
                        ("kimi_linear: grouped routing, no q_lora", dict(q_lora_rank=None, num_expert_group=2,
                                                                         topk_group=1, num_experts_per_token=2))]:
        kimi = kimi_model(extra)
        d = os.path.join(WORK, "hf_kimi_" + str(abs(hash(name)) % 10000))
        kimi.save_pretrained(d)
        if name.startswith("kimi_linear: KDA"):
            with open(os.path.join(d, "model.safetensors"), "rb") as f:
                header = f.read(8 + struct.unpack("<Q", f.read(8))[0])
            if b"model.layers.0.block_sparse_moe.gate_proj.weight" not in header:
                fail("transformers no longer writes layer 0's dense MLP under block_sparse_moe.: update this check")
        src = ["--init-from", d]
        compare(name + " -> moetrain", moetrain_loss(src), hf_loss(kimi, tokens), moetrain_greedy(src),
                hf_greedy(kimi))

    # top_k 1 with transformers' renormalisation (weight = routed_scaling_factor): refused.
    kimi = kimi_model(dict(num_experts_per_token=1, moe_renormalize=True))
    d = os.path.join(WORK, "hf_kimi_top1_renorm")
    kimi.save_pretrained(d)
    r = run(["eval", "--init-from", d, "--data", os.path.join(WORK, "data", "val_*.bin"), "--set",
             "data.tokenizer=byte"], check=False)
    err = r.stderr.decode(errors="replace")
    print("%-44s exit %d, names moe_renormalize: %s" % ("kimi_linear: top_k 1, renormalised", r.returncode,
                                                        "moe_renormalize" in err))
    if r.returncode != 2 or "moe_renormalize" not in err:
        fail("kimi_linear top_k 1 with moe_renormalize: expected exit 2 naming it, got %d: %s" % (r.returncode, err))


def kimi_model(extra):
    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=4,
               num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4,
               qk_nope_head_dim=8, v_head_dim=8, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
               routed_scaling_factor=2.446, linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3],
                                                                "num_heads": 2, "head_dim": 8,
                                                                "short_conv_kernel_size": 4},
               first_k_dense_replace=1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
               max_position_embeddings=128)
    cfg.update(extra)
    torch.manual_seed(2)
    m = KimiLinearForCausalLM(KimiLinearConfig(**cfg))
    spread(m, 4.0)
    with torch.no_grad():  # router biases off zero, so that a lost bias shows
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.1)
    m.eval()
    return m


# ------------------------------------------------------------------ moetrain -> HF

KIMI_YAML = """
model:
  arch: hybrid
  vocab_size: 256
  d_model: 32
  n_layer: 4
  n_ctx: 128
  layer_mixers: kda,kda,mla,kda
  ffn: swiglu
  d_ff: 40
  attn_res: false
  tie_embeddings: {tie}
  kda: {{n_head: 2, head_dim: 8, gate: softplus, full_rank_output_gate: false, chunk_size: 16}}
  mla: {{n_head: 2, q_lora_rank: 12, kv_lora_rank: 8, qk_nope_head_dim: 8, qk_rope_head_dim: 4, v_head_dim: 8,
         output_gate: false, rope: false}}
  moe: {{num_experts: 4, top_k: {top_k}, num_shared_experts: 1, expert_d_ff: 16, first_dense_layers: 1,
         router_score: sigmoid, renormalize: true, routed_scaling_factor: 2.0, bias_update_rate: 0.01}}
  init_std: 0.3
  embed_init_std: 1.0
data:
  tokenizer: byte
  train: {work}/data/train_*.bin
  val: ''
train:
  batch_size: 2
  seq_len: 32
  max_steps: 3
  warmup_steps: 1
  eval_every: 0
  sample_every: 0
  threads: 1
  log_every: 1000
run:
  dir: {run}
"""

GPT2_YAML = """
model: {{arch: gpt2, vocab_size: 256, n_layer: 2, n_head: 4, d_model: 32, n_ctx: 64, d_ff: 48, init_std: 0.4}}
data: {{tokenizer: byte, train: {work}/data/train_*.bin, val: ''}}
train: {{batch_size: 2, seq_len: 32, max_steps: 3, warmup_steps: 1, eval_every: 0, sample_every: 0, threads: 1,
        log_every: 1000}}
run: {{dir: {run}}}
"""


def read_safetensors_shape(path, name):
    """The shape of one tensor from a .safetensors header (8-byte length, then JSON)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))[name]["shape"]


def train_and_export(name, yaml_text):
    run_dir = os.path.join(WORK, "run_" + name)
    cfg = os.path.join(WORK, name + ".yaml")
    with open(cfg, "w") as f:
        f.write(yaml_text.format(work=WORK, run=run_dir))
    run(["train", "-c", cfg])
    out = os.path.join(WORK, "export_" + name)
    r = run(["export", "--checkpoint", os.path.join(run_dir, "model"), "--out", out, "--no-progress"])
    return out, r.stderr.decode(errors="replace")


def moetrain_to_hf(tokens):
    # gpt2_padded: wte padded to 288 rows (model.vocab_pad_multiple, docs/model.md#padded-vocabulary);
    # the export holds the 256 real ones, so transformers loads vocab_size 256 exactly.
    cases = [("gpt2", GPT2_YAML, "gpt2"),
             ("gpt2_padded", GPT2_YAML.replace("vocab_size: 256,", "vocab_size: 256, vocab_pad_multiple: 96,"), "gpt2"),
             ("kimi", KIMI_YAML.replace("{tie}", "false").replace("{top_k}", "2"), "kimi_linear"),
             ("kimi_tied", KIMI_YAML.replace("{tie}", "true").replace("{top_k}", "2"), "kimi_linear"),
             ("kimi_top1", KIMI_YAML.replace("{tie}", "false").replace("{top_k}", "1"), "kimi_linear")]
    for name, yaml_text, model_type in cases:
        if model_type == "kimi_linear" and KimiLinearForCausalLM is None:
            print("%-44s skipped: transformers %s has no KimiLinearForCausalLM" % (name + ": moetrain -> transformers",
                                                                                transformers.__version__))
            continue
        out, log = train_and_export(name, yaml_text)
        cfg = json.load(open(os.path.join(out, "config.json")))
        if cfg["model_type"] != model_type:
            fail("%s: exported model_type %s, expected %s" % (name, cfg["model_type"], model_type))
        if "model_type moetrain_hybrid" in log:
            fail("%s: the export says moetrain_hybrid: %s" % (name, log))
        if name == "gpt2_padded":
            shape = read_safetensors_shape(os.path.join(out, "model.safetensors"), "wte.weight")
            if cfg["vocab_size"] != 256 or shape != [256, 32]:
                fail("gpt2_padded: exported vocab_size %s, wte %s; expected 256 and [256, 32]" % (cfg["vocab_size"], shape))
        if name == "kimi_top1" and cfg["moe_renormalize"] is not False:
            fail("kimi_top1: exported moe_renormalize %s; one expert's weight is not renormalised" % cfg["moe_renormalize"])
        with no_warnings(name + ": from_pretrained"):
            model = AutoModelForCausalLM.from_pretrained(out, **{DTYPE_ARG: torch.float32})
        model.eval()
        src = ["--checkpoint", out]
        compare("%s: moetrain -> transformers (%s)" % (name, type(model).__name__), moetrain_loss(src),
                hf_loss(model, tokens), moetrain_greedy(src), hf_greedy(model))
        # And back in through the config.json alone (no YAML).
        back = ["--init-from", out]
        compare("%s: ... -> moetrain --init-from" % name, moetrain_loss(back), hf_loss(model, tokens),
                moetrain_greedy(back), hf_greedy(model))

    # Features outside KimiLinear (K3: AttnRes, SiTU, lower-bound gate, MLA gate...):
    # moetrain's own model_type, a notice naming them, and transformers refuses it.
    k3 = (KIMI_YAML.replace("{tie}", "false").replace("{top_k}", "2").replace("attn_res: false", "attn_res: true")
          .replace("ffn: swiglu", "ffn: situ_glu"))
    out, log = train_and_export("k3", k3)
    cfg = json.load(open(os.path.join(out, "config.json")))
    notice = [l for l in log.splitlines() if "moetrain_hybrid" in l]
    print("%-44s model_type %s, notice: %s" % ("k3 features: moetrain -> export", cfg["model_type"],
                                               notice[0].split("]")[-1].strip() if notice else None))
    if cfg["model_type"] != "moetrain_hybrid" or not notice or "Block AttnRes" not in notice[0] \
            or "SiTU-GLU" not in notice[0]:
        fail("k3: expected model_type moetrain_hybrid and a notice naming Block AttnRes and SiTU-GLU: %s" % log)
    try:  # trust_remote_code=False said: transformers 4 would otherwise ask on the terminal
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)
        fail("k3: transformers loaded a moetrain_hybrid export")
    except (ValueError, KeyError) as e:
        print("%-44s transformers refuses: %s" % ("", str(e).splitlines()[0][:90]))


def main(argv):
    global BIN, WORK
    BIN, WORK = os.path.abspath(argv[1]), os.path.abspath(argv[2])
    os.makedirs(WORK, exist_ok=True)
    transformers.logging.set_verbosity_warning()
    torch.set_num_threads(1)
    print("transformers %s, torch %s" % (transformers.__version__, torch.__version__))
    tokens = make_data()
    hf_to_moetrain(tokens)
    moetrain_to_hf(tokens)
    print("all round trips agree")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
