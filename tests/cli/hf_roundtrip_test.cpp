// Round trips through Hugging Face transformers' own classes (docs/export.md):
// tests/reference/hf_roundtrip.py builds random GPT2LMHeadModel and
// KimiLinearForCausalLM models with transformers and reads them with `moetrain
// eval/generate --init-from`, trains and exports moetrain models and loads them with
// from_pretrained (no warning allowed), and compares losses (1e-5 relative, f32) and
// greedy text both ways; top_k = 1 both ways; a K3 model is exported as
// moetrain_hybrid. Needs a Python with torch and transformers >= 4.47 (testing::hf_python in cli_fixtures.h;
// CI's is launch/test.sh's build/venv-hf-ci, transformers 4.47.1, which has no
// KimiLinearForCausalLM: there the script runs the GPT-2 and moetrain_hybrid checks and says in
// one line that the kimi_linear ones are skipped); skipped with one line when none has them.
#include <catch2/catch.hpp>

#include "cli_fixtures.h"
#include "testing.h"

using moetrain::testing::TempDir;
using std::string;

TEST_CASE("hf: transformers' GPT2LMHeadModel and KimiLinearForCausalLM round-trip through moetrain both ways",
          "[cli][export][hf][reference]") {
  const string python = moetrain::testing::hf_python();
  if (python.empty()) {
    WARN("skipped: no Python with torch, transformers >= 4.47 and safetensors ("
         << moetrain::testing::kHfPythonHint << ")");
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
