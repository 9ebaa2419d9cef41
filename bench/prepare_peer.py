#!/usr/bin/env python3
"""Tokens/s of `moetrain prepare` against Hugging Face tokenizers and tiktoken (issue 39).

One corpus, GPT-2's tables everywhere, the same thread count:

  moetrain gpt2        prepare --tokenizer gpt2 (the built-in GPT-2 BPE)
  moetrain json        prepare --tokenizer gpt2.tokenizer.json (the engine, data/bpe.h)
  moetrain tiktoken    prepare --tokenizer gpt2.tiktoken (the engine, ranks as merges)
  HF tokenizers        Tokenizer(BPE from encoder.json + vocab.bpe, ByteLevel).encode_batch
                       (RAYON_NUM_THREADS = threads)
  tiktoken             Encoding(GPT-2's ranks and pattern).encode_ordinary_batch(num_threads)

The corpus: data/tinyshakespeare.txt cut at blank lines into documents, repeated
to --mb MB, as JSONL (one document a line). moetrain's time is the whole command:
reading and parsing the JSONL, encoding, writing the shards; the peers' is the
encode call only, on documents already in memory (that favours them). Token counts
are checked equal (prepare's count less its one <|endoftext|> per document).
Rounds interleave the five so that a changing load on a shared machine falls on all
alike; the table gives each one's median tokens/s and the ratio moetrain gpt2 /
row (> 1: moetrain faster).

Needs a Python with tokenizers and tiktoken: --python, else
$MOETRAIN_TOKENIZERS_PYTHON, else this interpreter (the peers run in a child
process of that Python). Not part of the test run.

  bench/prepare_peer.py [--build build] [--mb 32] [--threads 2] [--rounds 3] [--python PY]
"""
import argparse
import base64
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# The peers, run in the Python that has them: prints {"name": [seconds, tokens], ...}.
PEER = r'''
import json, os, sys, time
threads = int(sys.argv[3])
os.environ["RAYON_NUM_THREADS"] = str(threads)
import tiktoken
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
gpt2_dir, corpus = sys.argv[1], sys.argv[2]
docs = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
hf = Tokenizer(models.BPE.from_file(os.path.join(gpt2_dir, "encoder.json"), os.path.join(gpt2_dir, "vocab.bpe")))
hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
hf.decoder = decoders.ByteLevel()
def byte_level():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
         list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b); cs.append(256 + n); n += 1
    return {chr(c): b for b, c in zip(bs, cs)}
dec = byte_level()
encoder = json.load(open(os.path.join(gpt2_dir, "encoder.json"), encoding="utf-8"))
ranks = {bytes(dec[ch] for ch in tok): i for tok, i in encoder.items() if tok != "<|endoftext|>"}
pat = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
tt = tiktoken.Encoding("gpt2_bench", pat_str=pat, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256})
out = {}
for name, run in (("HF tokenizers", lambda: hf.encode_batch(docs, add_special_tokens=False)),
                  ("tiktoken", lambda: tt.encode_ordinary_batch(docs, num_threads=threads))):
    t = time.perf_counter()
    enc = run()
    dt = time.perf_counter() - t
    out[name] = [dt, sum(len(e.ids) if hasattr(e, "ids") else len(e) for e in enc)]
print(json.dumps(out))
'''


def find_python(given):
    for p in [given, os.environ.get("MOETRAIN_TOKENIZERS_PYTHON"), sys.executable]:
        if p and subprocess.run([p, "-c", "import tokenizers, tiktoken"], capture_output=True).returncode == 0:
            return p
    sys.exit("prepare_peer: no Python with tokenizers and tiktoken: pass --python or set MOETRAIN_TOKENIZERS_PYTHON "
             "(python3 -m venv v && v/bin/pip install tokenizers tiktoken)")


def write_corpus(path, mb):
    text = open(os.path.join(ROOT, "data/tinyshakespeare.txt"), encoding="utf-8").read()
    docs = [d for d in text.split("\n\n") if d.strip()]
    n_docs, size = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < mb * 1e6:
            for d in docs:
                line = json.dumps({"text": d}) + "\n"
                f.write(line)
                size += len(d.encode("utf-8"))
                n_docs += 1
    return n_docs, size


def gpt2_files(tmp, python):
    """GPT-2's tables as a tokenizer.json and a tiktoken rank file with its description (for moetrain)."""
    script = r'''
import base64, json, os, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
d, out = sys.argv[1], sys.argv[2]
t = Tokenizer(models.BPE.from_file(os.path.join(d, "encoder.json"), os.path.join(d, "vocab.bpe")))
t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
t.decoder = decoders.ByteLevel()
t.add_special_tokens(["<|endoftext|>"])  # prepare's document separator, before each document
t.save(os.path.join(out, "gpt2.tokenizer.json"))
'''
    subprocess.run([python, "-c", script, os.path.join(ROOT, "data/gpt2"), tmp], check=True)
    # The rank file: GPT-2's ids are its ranks (merge order), as tiktoken's gpt2 encoding.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    dec = {chr(c): b for b, c in zip(bs, cs)}
    encoder = json.load(open(os.path.join(ROOT, "data/gpt2/encoder.json"), encoding="utf-8"))
    with open(os.path.join(tmp, "gpt2.tiktoken"), "w") as f:
        for tok, i in sorted(encoder.items(), key=lambda kv: kv[1]):
            if tok != "<|endoftext|>":
                f.write(base64.b64encode(bytes(dec[ch] for ch in tok)).decode() + f" {i}\n")
    with open(os.path.join(tmp, "gpt2.tiktoken.json"), "w") as f:
        json.dump({"pattern": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
                   "special_tokens": {"<|endoftext|>": 50256}}, f)


def run_prepare(build, threads, corpus, tokenizer, out):
    shutil.rmtree(out, ignore_errors=True)
    cmd = [os.path.join(build, "moetrain"), "--threads", str(threads), "prepare", corpus, "--out", out,
           "--tokenizer", tokenizer, "--tokenizer-dir", os.path.join(ROOT, "data/gpt2"), "--val-tokens", "0",
           ]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"prepare_peer: {' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    tokens = 0
    for f in os.listdir(out):
        if f.endswith(".bin"):  # llm.c's header: int32 magic, version, number of tokens (data/shard.h)
            with open(os.path.join(out, f), "rb") as h:
                tokens += int.from_bytes(h.read(12)[8:12], "little")
    return dt, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--mb", type=float, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--python")
    a = ap.parse_args()
    python = find_python(a.python)
    tmp = tempfile.mkdtemp(prefix="prepare_peer.")
    try:
        corpus = os.path.join(tmp, "corpus.jsonl")
        n_docs, size = write_corpus(corpus, a.mb)
        gpt2_files(tmp, python)
        moetrain_rows = {"moetrain gpt2": "gpt2", "moetrain json": os.path.join(tmp, "gpt2.tokenizer.json"),
                         "moetrain tiktoken": os.path.join(tmp, "gpt2.tiktoken")}
        times = {name: [] for name in list(moetrain_rows) + ["HF tokenizers", "tiktoken"]}
        counts = {}
        for _ in range(a.rounds):
            for name, tok in moetrain_rows.items():
                dt, tokens = run_prepare(a.build, a.threads, corpus, tok, os.path.join(tmp, "out"))
                times[name].append(dt)
                counts[name] = tokens - n_docs  # less one <|endoftext|> per document
            peers = json.loads(subprocess.run([python, "-c", PEER, os.path.join(ROOT, "data/gpt2"), corpus,
                                               str(a.threads)], check=True, capture_output=True, text=True).stdout)
            for name, (dt, tokens) in peers.items():
                times[name].append(dt)
                counts[name] = tokens
        if len(set(counts.values())) != 1:
            sys.exit(f"prepare_peer: token counts differ: {counts}")
        tokens = next(iter(counts.values()))
        print(f"corpus: {size / 1e6:.1f} MB of tinyshakespeare as {n_docs} JSONL documents, {tokens} GPT-2 tokens; "
              f"{a.threads} threads, median of {a.rounds} rounds")
        base = tokens / statistics.median(times["moetrain gpt2"])
        print(f"| {'':18} | {'tokens/s':>10} | {'MB/s':>6} | moetrain gpt2 / row |")
        print(f"|{'-' * 20}|{'-' * 11}:|{'-' * 7}:|{'-' * 20}:|")
        for name, ts in times.items():
            rate = tokens / statistics.median(ts)
            print(f"| {name:18} | {rate / 1e6:8.2f} M | {size / statistics.median(ts) / 1e6:6.2f} | "
                  f"{base / rate:18.2f} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
