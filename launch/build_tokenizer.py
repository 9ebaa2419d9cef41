#!/usr/bin/env python3
"""Builds a byte-level BPE tokenizer of more than 65,536 tokens from the shipped
corpus, for configs/k3-shakespeare-bpe.yaml (docs/training.md#a-vocabulary-beyond-65536).

  python launch/build_tokenizer.py [--corpus data/tinyshakespeare.txt] [--out data/shakespeare_bpe]
                                   [--vocab-size 70000] [--train-vocab 8000]

Needs Hugging Face `tokenizers` (PyPI): launch/test.sh makes build/venv-tokenizers
with it, or `python3 -m venv .venv && .venv/bin/pip install tokenizers`.

Writes OUT/tokenizer.json and OUT/tokenizer_config.json (the Hugging Face layout,
with a chat template; `moetrain export` carries both into the export):
  - Llama 3's pre-tokenizer: Split(Llama 3's pattern, isolated) then ByteLevel
    without its regex; an NFC normalizer (as Qwen2); the ByteLevel decoder;
  - <|begin_of_text|> (BOS, before every document: the post-processor's template)
    and <|end_of_text|> (EOS) as special tokens, the last two ids;
  - a BPE trained by `tokenizers` on the corpus to --train-vocab tokens, then grown
    to --vocab-size by merges of pairs of its most frequent short tokens (tiny
    shakespeare has too few distinct words for 65,536 learned merges; the grown
    tokens are real merges that the corpus's text produces, so ids past 65,535 do
    occur in the shards, as tests/reference/bpe_reference.py's `big` does).
The result is deterministic (the trainer breaks ties by ids; no randomness).
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Llama 3's split pattern (its tokenizer.json; cl100k's without possessive quantifiers).
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# A Llama-3-style chat template (transformers' apply_chat_template renders it with Jinja).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start|>' + message['role'] + '\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default=os.path.join(ROOT, "data", "tinyshakespeare.txt"))
    ap.add_argument("--out", default=os.path.join(ROOT, "data", "shakespeare_bpe"))
    ap.add_argument("--vocab-size", type=int, default=70_000,
                    help="ids in all, the two special tokens included (default 70000)")
    ap.add_argument("--train-vocab", type=int, default=8_000, help="tokens the BPE trainer learns (default 8000)")
    args = ap.parse_args()
    try:
        from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    except ImportError:
        sys.exit(f"{sys.executable}: cannot import `tokenizers`; use build/venv-tokenizers/bin/python (made by "
                 "launch/test.sh) or pip install tokenizers in a venv")
    if not 512 <= args.train_vocab <= args.vocab_size - 2:
        sys.exit(f"--train-vocab {args.train_vocab} must be in [512, --vocab-size - 2 = {args.vocab_size - 2}]")
    try:
        with open(args.corpus, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        sys.exit(f"{args.corpus}: cannot read the corpus as UTF-8: {e}")

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.train_vocab, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator([text], trainer=trainer)
    j = json.loads(tok.to_str())
    vocab = j["model"]["vocab"]
    merges = [m if isinstance(m, list) else m.split(" ") for m in j["model"]["merges"]]
    # Grow: merges of pairs of the most frequent short tokens (the first learned), in order.
    by_id = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    pool = by_id[256:256 + 400]
    target = args.vocab_size - 2
    next_id = len(vocab)
    for left in pool:
        for right in pool:
            if next_id >= target:
                break
            if left + right in vocab:
                continue
            vocab[left + right] = next_id
            merges.append([left, right])
            next_id += 1
    if next_id < target:
        sys.exit(f"could grow the vocabulary to {next_id} tokens only; lower --vocab-size or raise --train-vocab")
    j["model"]["merges"] = merges
    tok = Tokenizer.from_str(json.dumps(j))
    tok.add_special_tokens([BOS, EOS])
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=None, special_tokens=[(BOS, bos)])
    assert tok.get_vocab_size() == args.vocab_size, tok.get_vocab_size()

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tokenizer.json")
    tok.save(path)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "model_max_length": 4096, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    ids = tok.encode(text[:20000], add_special_tokens=False).ids
    print(f"wrote {path}: {tok.get_vocab_size()} tokens ({BOS} = {bos}, {EOS} = {tok.token_to_id(EOS)}); "
          f"ids past 65535 in the corpus's first 20000 characters: {sum(i > 65535 for i in ids)}")


if __name__ == "__main__":
    main()
