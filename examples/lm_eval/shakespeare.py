"""Two small lm-evaluation-harness tasks built from the shipped corpus's held-out text
(docs/export.md#lm-evaluation-harness). Nothing is downloaded and no data file is kept in
the repository: the YAMLs beside this file name these functions as `custom_dataset`.

The held-out text is the first 32,768 bytes of data/tinyshakespeare.txt: what
`moetrain prepare data/tinyshakespeare.txt --tokenizer byte` writes to val_000000.bin
(--val-tokens 32768, one token per byte), which training never reads.

  shakespeare_ppl        loglikelihood_rolling over the held-out speeches (the text between
                         blank lines; the last one, cut by the split, is left out): 223 docs
  shakespeare_next_line  multiple choice: a speaker and the speech's first line, pick its
                         second line among 4 (the true one and 3 other held-out lines,
                         drawn with a fixed seed): one question per speech of 3+ lines

  python3 examples/lm_eval/shakespeare.py [OUT_DIR]   prints the counts; with OUT_DIR also
                                                      writes both as JSON Lines there
"""

import json
import os
import random
import sys

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data", "tinyshakespeare.txt")
HELD_OUT_BYTES = 32768   # moetrain prepare's default --val-tokens, one byte per token
SEED = 1234


def held_out_text(corpus=CORPUS):
    with open(corpus, "rb") as f:
        return f.read(HELD_OUT_BYTES).decode("utf-8")


def speeches(corpus=CORPUS):
    """The held-out speeches ("SPEAKER:\\nline\\nline"), without the last, which the split cuts."""
    return [s for s in held_out_text(corpus).split("\n\n")[:-1] if s.strip()]


def ppl_docs(corpus=CORPUS):
    return [{"text": s} for s in speeches(corpus)]


def next_line_docs(corpus=CORPUS):
    all_speeches = speeches(corpus)
    pool = sorted({line for s in all_speeches for line in s.split("\n")[1:] if line.strip()})
    rng = random.Random(SEED)
    docs = []
    for s in all_speeches:
        lines = s.split("\n")
        if len(lines) < 3:
            continue
        truth = lines[2]
        others = rng.sample([line for line in pool if line != truth], 3)
        label = rng.randrange(4)
        choices = others[:label] + [truth] + others[label:]
        docs.append({"context": lines[0] + "\n" + lines[1] + "\n", "choices": choices, "label": label})
    return docs


def _dataset(docs):
    import datasets
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def ppl_dataset(**kwargs):
    """custom_dataset of shakespeare_ppl.yaml (lm-eval passes the task's metadata as kwargs)."""
    return _dataset(ppl_docs())


def next_line_dataset(**kwargs):
    """custom_dataset of shakespeare_next_line.yaml."""
    return _dataset(next_line_docs())


def main(argv):
    ppl, mc = ppl_docs(), next_line_docs()
    print("shakespeare_ppl: %d docs, %d bytes; shakespeare_next_line: %d questions"
          % (len(ppl), sum(len(d["text"].encode()) for d in ppl), len(mc)))
    if len(argv) > 1:
        os.makedirs(argv[1], exist_ok=True)
        for name, docs in (("shakespeare_ppl", ppl), ("shakespeare_next_line", mc)):
            with open(os.path.join(argv[1], name + ".jsonl"), "w") as f:
                for d in docs:
                    f.write(json.dumps(d) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
