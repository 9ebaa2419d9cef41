// What the command-line tests share: a tiny GPT-2 config, tables of command lines
// with their expected exit code and message fragments, and the steps a run's
// metrics.jsonl records.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "testing.h"

namespace moetrain::testing {

// The Python for the comparisons with Hugging Face transformers (tests/reference/hf_*.py): the
// first of $MOETRAIN_HF_PYTHON (launch/test.sh sets it to build/venv-hf-ci: Debian's torch 1.13
// with transformers 4.47.1, docs/export.md#transformers-in-ci), /work/.venv-hf/bin/python (a
// developer's PyPI torch with transformers 5) and python3 that imports torch, safetensors,
// transformers >= 4.47 and the modules in `also` (comma-separated, e.g. "yaml"); "" when none
// does, and the caller skips with one WARN line (kHfPythonHint says what to do). Probed once
// per `also` in a process.
inline std::string hf_python(const std::string& also = "") {
  static std::map<std::string, std::string> found;  // by `also`
  if (auto it = found.find(also); it != found.end()) return it->second;
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("MOETRAIN_HF_PYTHON"); env && *env) candidates.push_back(env);
  candidates.push_back("/work/.venv-hf/bin/python");
  candidates.push_back("python3");
  const std::string probe = " -c 'import torch, safetensors, transformers" + (also.empty() ? "" : ", " + also) +
                            "; v = transformers.__version__.split(\".\"); "
                            "assert (int(v[0]), int(v[1])) >= (4, 47)' >/dev/null 2>&1";
  std::string& python = found[also];
  for (const std::string& p : candidates)
    if ((p.find('/') == std::string::npos || std::filesystem::exists(p)) && run_command(shell_quote(p) + probe) == 0) {
      python = p;
      break;
    }
  return python;
}
inline constexpr const char* kHfPythonHint =
    "set MOETRAIN_HF_PYTHON to a Python with them, or run launch/test.sh, which builds build/venv-hf-ci; "
    "docs/export.md#transformers-in-ci";

// GPT-2 at toy size on bytes: 4 steps of 2 x 16 tokens, one thread.
inline const char* kTinyGpt2Yaml =
    "model:\n  vocab_size: 256\n  n_layer: 2\n  n_head: 2\n  d_model: 32\n  n_ctx: 64\n"
    "data:\n  tokenizer: byte\n"
    "train:\n  batch_size: 2\n  seq_len: 16\n  max_steps: 4\n  warmup_steps: 1\n  eval_every: 0\n  threads: 1\n"
    "  log_every: 100\n";

// One command line (`moetrain ARGS`), its exit code and the fragments its output holds.
struct CommandCase {
  std::string what, args;
  int code;
  std::vector<std::string> fragments;
};

// Runs each case under a hard time limit: a regression that blocks (on a FIFO,
// which a stop signal does not end) or reads /dev/zero ends as exit 137, not as a
// hung test. No case may end in a crash report or exit 1's "unexpected error".
inline void check_command_cases(const std::vector<CommandCase>& cases) {
  for (const CommandCase& c : cases) {
    const CommandOutput r =
        capture_command("timeout -s KILL 30 " + std::string(MOETRAIN_BINARY_DIR) + "/moetrain " + c.args);
    INFO(c.what << "\n$ moetrain " << c.args << "\n" << r.output);
    CHECK(r.code == c.code);
    for (const std::string& f : c.fragments) CHECK_THAT(r.output, Catch::Contains(f));
    CHECK_THAT(r.output, !Catch::Contains("internal error"));
    CHECK_THAT(r.output, !Catch::Contains("unexpected error"));
  }
}

// A directory with byte shards of the shipped corpus and tiny GPT-2 runs in it,
// each run checkpointing every 10 steps (tiny_gpt2_train_args).
struct TinyGpt2Runs {
  TempDir tmp;
  std::string dir = tmp.path();

  TinyGpt2Runs() { prepare_byte_shards(dir); }
  std::string args(const std::string& run, int steps, const std::string& extra = "") const {
    return tiny_gpt2_train_args(dir, dir + "/" + run, steps) + " --set ckpt.every=10 " + extra;
  }
  CommandOutput train(const std::string& run, int steps, const std::string& extra = "") const {
    return run_moetrain(args(run, steps, extra));
  }
  std::string path(const std::string& run, const std::string& file = "") const {
    return dir + "/" + run + (file.empty() ? "" : "/" + file);
  }
};

// The tiny k3 (configs/k3-tiny.yaml at 4 layers, AttnRes blocks of 2) on byte
// shards, 2 x 16 tokens per rank, one thread per rank; `steps` steps with a
// checkpoint every `every`; train(np, ...) runs it on one process or under mpirun.
struct TinyK3Runs {
  TempDir tmp;
  std::string dir = tmp.path();
  int steps, every, warmup;

  TinyK3Runs(int steps_, int every_, int warmup_) : steps(steps_), every(every_), warmup(warmup_) {
    prepare_byte_shards(dir);
  }
  std::string args(const std::string& run, const std::string& sets) const {
    return "train -c " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml --set data.train=" + dir +
           "/data/train_*.bin --set data.val= --set train.max_steps=" + std::to_string(steps) +
           " --set train.warmup_steps=" + std::to_string(warmup) +
           " --set train.batch_size=2 --set train.seq_len=16 --set train.eval_every=0 --set train.threads=1 "
           "--set train.log_every=100 --set model.n_layer=4 --set model.attn_res_block_size=2 --set ckpt.every=" +
           std::to_string(every) + " --set run.dir=" + dir + "/" + run + " " + sets;
  }
  CommandOutput train(int np, const std::string& run, const std::string& sets) const {
    if (np == 1) return run_moetrain(args(run, sets));
    return capture_command(std::string(kLocalMpirun) + "-np " + std::to_string(np) + " " +
                           std::string(MOETRAIN_BINARY_DIR) + "/moetrain " + args(run, sets));
  }
};

// The largest |got - want| / want over indices from `from` on (losses: positive).
inline double worst_relative(const std::vector<double>& got, const std::vector<double>& want, size_t from) {
  double worst = 0;
  for (size_t i = from; i < want.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / want[i]);
  return worst;
}

// The "step" of every record of a metrics.jsonl text, in file order.
inline std::vector<int64_t> steps_of(const std::string& metrics) {
  std::vector<int64_t> out;
  std::stringstream in(metrics);
  static const std::regex step(R"(^\{"step":(\d+))");
  std::smatch m;
  for (std::string line; std::getline(in, line);)
    if (std::regex_search(line, m, step)) out.push_back(std::stoll(m[1]));
  return out;
}

// 1, 2, ..., n.
inline std::vector<int64_t> one_to(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 1; i <= n; ++i) out.push_back(i);
  return out;
}

}  // namespace moetrain::testing
