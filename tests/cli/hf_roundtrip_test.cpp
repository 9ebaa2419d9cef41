// Round trips through Hugging Face transformers' own classes (docs/export.md):
// tests/reference/hf_roundtrip.py builds random GPT2LMHeadModel and
// KimiLinearForCausalLM models with transformers and reads them with `moetrain
// eval/generate --init-from`, trains and exports moetrain models and loads them with
// from_pretrained (no warning allowed), and compares losses (1e-5 relative, f32) and
// greedy text both ways; top_k = 1 both ways; a K3 model is exported as
// moetrain_hybrid. Needs a Python with transformers >= 5 and torch: $MOETRAIN_HF_PYTHON,
// else /work/.venv-hf/bin/python, else python3; skipped with one line when none has them
// (CI: launch/setup.sh does not install transformers, docs/export.md says why).
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>

#include "testing.h"

using moetrain::testing::TempDir;
using std::string;

namespace {

bool has_transformers(const string& python) {
  const string probe = moetrain::testing::shell_quote(python) +
                       " -c 'import torch, safetensors, transformers; "
                       "assert int(transformers.__version__.split(\".\")[0]) >= 5' >/dev/null 2>&1";
  return moetrain::testing::run_command(probe) == 0;
}

string find_hf_python() {
  std::vector<string> candidates;
  if (const char* env = std::getenv("MOETRAIN_HF_PYTHON"); env && *env) candidates.push_back(env);
  candidates.push_back("/work/.venv-hf/bin/python");
  candidates.push_back("python3");
  for (const string& p : candidates)
    if ((p.find('/') == string::npos || std::filesystem::exists(p)) && has_transformers(p)) return p;
  return "";
}

}  // namespace

TEST_CASE("hf: transformers' GPT2LMHeadModel and KimiLinearForCausalLM round-trip through moetrain both ways",
          "[cli][export][hf][reference]") {
  const string python = find_hf_python();
  if (python.empty()) {
    WARN("skipped: no Python with transformers >= 5 and torch (set MOETRAIN_HF_PYTHON, or pip install torch "
         "transformers safetensors into /work/.venv-hf)");
    return;
  }
  TempDir tmp;
  const string cmd = moetrain::testing::shell_quote(python) + " " + string(MOETRAIN_SOURCE_DIR) +
                     "/tests/reference/hf_roundtrip.py " + string(MOETRAIN_BINARY_DIR) + "/moetrain " + tmp.path();
  moetrain::testing::CommandOutput r = moetrain::testing::capture_command(cmd);
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(r.output.find("all round trips agree") != string::npos);
}
