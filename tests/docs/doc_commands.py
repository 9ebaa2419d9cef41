#!/usr/bin/python3
"""Runs every shell command the README and docs/quickstart.md show, as written,
in a scratch directory, so a command that fails as written fails the test command
(ctest entry `doc_commands`).

The commands are the lines of the documents' ```sh blocks (a line ending in a
backslash continues on the next; `# ...` comments dropped), run in order with
/bin/bash from a scratch directory that looks like a clone: build/, configs/,
launch/, docker/, bench/ and the shipped data files are symlinks into the
repository, so what the commands write (data/shakespeare*/, runs/, exports/,
pictures) lands in the scratch directory and the repository is untouched.

What is changed, and why (printed for each command):
  * training is shortened: every `moetrain train` (also through launch/train.sh
    and launch/mpirun.sh) gets `--set train.max_steps=4 --set train.eval_every=2
    --set train.eval_batches=2 --set train.sample_every=0` appended, and the
    quickstart's launch/train.sh skips launch/setup.sh and launch/build.sh
    (MOETRAIN_SKIP_SETUP=1: the test command has just run both);
  * a few commands are not run, each with its reason in SKIP below (the test
    command itself, commands for other machines). A command of the documents
    that is neither run nor listed there fails the test.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCUMENTS = ["README.md", "docs/quickstart.md"]
SHORT_TRAINING = ("--set train.max_steps=4 --set train.eval_every=2 --set train.eval_batches=2 "
                  "--set train.sample_every=0")

# Command prefixes not run here, with the reason.
SKIP = {
    "launch/test.sh": "the test command itself (this test runs inside it)",
    "launch/setup.sh": "run by the test command before this test (installs packages)",
    "launch/build.sh": "run by the test command before this test (builds build/)",
    "launch/multinode.sh": "needs a hostfile of other machines",
    "sbatch ": "needs Slurm",
    "launch/gpu-check.sh": "needs a GPU machine",
    "launch/gpu-bundle.sh": "needs the benchmarks' build; tests/launch/gpu_bundle_test.sh runs it (ctest gpu_bundle_clean_env)",
    "build/moetrain_bench": "benchmarks: minutes each, built with -DMOETRAIN_BENCH=ON (bench/README)",
    "bench/gpt2_peer.py": "benchmark against PyTorch >= 2 from a venv the user makes; minutes per round",
    "launch/evolution.sh": "the ladder trains 8 models (minutes); tests/cli/evolution_test.cpp runs it shortened",
    "build/moetrain generate --init-from path/to/hf-gpt2": "a placeholder path for the user's Hugging Face download",
}


def commands(path):
    """(line number, command) for each command in the ```sh blocks of `path`."""
    out, in_sh, pending, start = [], False, "", 0
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            stripped = line.rstrip("\n")
            if stripped.startswith("```"):
                in_sh = stripped.strip() == "```sh" if not in_sh else False
                continue
            if not in_sh:
                continue
            text = re.sub(r"(^|\s)#.*$", "", stripped).rstrip()  # comments (no '#' inside our commands' quotes)
            if not pending:
                start = number
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            text = (pending + text).strip()
            pending = ""
            if text:
                out.append((start, text))
    return out


def adapted(command):
    """The command as run here, and the notes on what changed."""
    notes = []
    env = ""
    if re.search(r"(^|/)moetrain( .*)? train( |$)", command) or command.startswith("launch/train.sh"):
        command += " " + SHORT_TRAINING
        notes.append("training shortened")
    if command.startswith("launch/train.sh"):
        env = "MOETRAIN_SKIP_SETUP=1 "
        notes.append("setup and build skipped")
    return env + command, notes


def scratch_dir():
    root = tempfile.mkdtemp(prefix="moetrain_docs_")
    for name in ["build", "configs", "launch", "docker", "bench", "src", "tests", "CMakeLists.txt"]:
        os.symlink(os.path.join(REPO, name), os.path.join(root, name))
    os.makedirs(os.path.join(root, "data"))
    for entry in os.listdir(os.path.join(REPO, "data")):  # the corpus and tokenizer tables, not prepared shards
        if not entry.startswith("shakespeare"):
            os.symlink(os.path.join(REPO, "data", entry), os.path.join(root, "data", entry))
    os.makedirs(os.path.join(root, "docs"))  # pictures a command writes
    return root


def main():
    root = scratch_dir()
    failures, ran, skipped = [], 0, 0
    try:
        for doc in DOCUMENTS:
            for number, command in commands(doc):
                where = f"{doc}:{number}"
                reason = next((why for prefix, why in SKIP.items() if command.startswith(prefix)), None)
                if reason:
                    print(f"skip  {where}: {command}\n      ({reason})", flush=True)
                    skipped += 1
                    continue
                run, notes = adapted(command)
                print(f"run   {where}: {command}" + (f"  [{', '.join(notes)}]" if notes else ""), flush=True)
                p = subprocess.run(["/bin/bash", "-c", run], cwd=root, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace", timeout=900)
                ran += 1
                if p.returncode != 0:
                    tail = "\n".join(p.stdout.splitlines()[-25:])
                    print(f"FAIL  {where}: exit {p.returncode}\n{tail}", flush=True)
                    failures.append(where)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"doc commands: {ran} run, {skipped} skipped, {len(failures)} failed"
          + (": " + ", ".join(failures) if failures else ""))
    return 1 if failures or ran == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
