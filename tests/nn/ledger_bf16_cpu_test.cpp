// The ledger's bf16-on-the-CPU term (nn/ledger.h, StageLedger::cpu_widen_bytes): the f32
// tensors the model's largest-holding bf16 op keeps while it runs on the CPU, one
// micro-batch. Since every kernel of both families reads and writes bf16 itself, that
// is GPT-2's MLP product in f32 (oneDNN's f32 result of c_fc before its bias, GELU and
// rounding pass, and GELU's input gradient) and nothing for the hybrid (no biased
// linears). Expected values are computed here by hand from the configs' YAML, never
// read back from the ledger.
#include <string>

#include <catch2/catch.hpp>

#include "config/config.h"
#include "nn/ledger.h"

using namespace moetrain;

namespace {

Config bf16_cpu_config(const std::string& name, std::vector<std::string> overrides) {
  return Config::load(std::string(MOETRAIN_SOURCE_DIR) + "/configs/" + name + ".yaml", overrides);
}

}  // namespace

TEST_CASE("ledger: bf16 on the CPU counts GPT-2's f32 MLP product, by hand", "[nn][ledger]") {
  SECTION("gpt2-small: on every pipeline stage") {
    // batch 8 x seq 1024 = 8192 tokens (gpt2-small.yaml), D 768: 4 x 768 values per token,
    // 8192 x 3072 x 4 = 100,663,296 bytes, on each of 2 stages.
    const Config c = bf16_cpu_config("gpt2-small", {"train.dtype=bf16", "train.device=cpu"});
    const Ledger l = make_ledger(c, {1, 1, 2});
    REQUIRE(l.stages.size() == 2);
    for (const StageLedger& st : l.stages) CHECK(st.cpu_widen_bytes == 100663296.0);
    CHECK(l.cpu_widen_op.find("MLP's f32 product") != std::string::npos);
    const std::string text = ledger_text(l);
    INFO(text);
    CHECK(text.find("+ f32 transients of bf16 ops on the CPU 96.0 MiB (the MLP's f32 product") != std::string::npos);
    CHECK(ledger_json(l).find("\"cpu_widen_bytes_per_rank\": 100663296") != std::string::npos);
  }
  SECTION("gpt2-shakespeare at micro-batch 3") {
    // 3 x 128 = 384 tokens, D 128: 384 x 512 x 4 = 786,432 bytes; f32 and the GPU: none.
    for (const std::string& where : {"train.dtype=bf16", "train.dtype=f32"}) {
      const std::string device = "train.device=cpu";
      const Ledger l = make_ledger(bf16_cpu_config("gpt2-shakespeare", {where, device}), {1, 1, 1, 0, 3});
      CHECK(l.cpu_widen_bytes_per_rank == (where == "train.dtype=bf16" ? 786432.0 : 0.0));
    }
    const Ledger gpu = make_ledger(bf16_cpu_config("gpt2-shakespeare", {"train.dtype=bf16", "train.device=cuda"}),
                                   {1, 1, 1, 0, 3});
    CHECK(gpu.cpu_widen_bytes_per_rank == 0.0);
    CHECK(gpu.cpu_widen_op.empty());
    CHECK(ledger_text(gpu).find("transients") == std::string::npos);
  }
  SECTION("the hybrid counts nothing, with or without MLA layers") {
    for (const std::string& mixer : {"model.attn_mixer=mla", "model.attn_mixer=kda"}) {
      INFO(mixer);
      const Ledger l = make_ledger(bf16_cpu_config("k3-tiny", {mixer, "train.dtype=bf16", "train.device=cpu"}), {});
      CHECK(l.cpu_widen_bytes_per_rank == 0.0);
      CHECK(l.cpu_widen_op.empty());
      CHECK(ledger_text(l).find("transients") == std::string::npos);
    }
  }
}
