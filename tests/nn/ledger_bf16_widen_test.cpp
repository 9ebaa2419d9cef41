// The ledger's bf16-on-the-CPU term (nn/ledger.h, StageLedger::cpu_widen_bytes): the f32
// copies that the largest op still widened on the CPU (cpu::run_kernel,
// ops/common/bf16_widen.h) makes of its bf16 inputs and outputs while it runs, one
// micro-batch. Expected values are computed here by hand from the configs' YAML, never
// read back from the ledger.
#include <string>

#include <catch2/catch.hpp>

#include "config/config.h"
#include "nn/ledger.h"

using namespace moetrain;

namespace {

Config widen_config(const std::string& name, std::vector<std::string> overrides) {
  return Config::load(std::string(MOETRAIN_SOURCE_DIR) + "/configs/" + name + ".yaml", overrides);
}

// The ledger of a config at one rank, and the same config's with the term's condition
// taken away (f32, or the GPU): the term is their only difference.
struct WidenPair {
  Ledger with, without;
};
WidenPair widen_pair(const std::string& name, const std::vector<std::string>& extra, const std::string& other) {
  std::vector<std::string> on = extra, off = extra;
  on.insert(on.end(), {"train.dtype=bf16", "train.device=cpu"});
  off.insert(off.end(), {"train.dtype=bf16", other});
  return {make_ledger(widen_config(name, on), {}), make_ledger(widen_config(name, off), {})};
}

}  // namespace

TEST_CASE("ledger: bf16 on the CPU counts the largest widened op's f32 copies, by hand", "[nn][ledger]") {
  SECTION("k3-tiny: MLA's rope key broadcast, backward") {
    // k3-tiny: batch 8 x seq 128 = 1024 tokens; MLA 2 heads, qk_rope_head_dim 16: the
    // backward of the rope key's broadcast over the heads (sum_to) widens grad [2 x 16]
    // and its [16] result: (2 + 1) x 16 = 48 f32 values per token, 1024 x 48 x 4 =
    // 196,608 bytes. (KDA's short conv reads and writes bf16 itself now.)
    const WidenPair p = widen_pair("k3-tiny", {}, "train.dtype=f32");
    CHECK(p.with.stages[0].cpu_widen_bytes == 196608.0);
    CHECK(p.with.cpu_widen_bytes_per_rank == 196608.0);
    CHECK(p.with.cpu_widen_op.find("sum_to") != std::string::npos);
    CHECK(p.without.cpu_widen_bytes_per_rank == 0.0);
    CHECK(p.without.cpu_widen_op.empty());
    const std::string text = ledger_text(p.with);
    INFO(text);
    CHECK(text.find("+ bf16 widening on the CPU 192.0 KiB (sum_to") != std::string::npos);
    CHECK(ledger_text(p.without).find("widening") == std::string::npos);
    CHECK(ledger_json(p.with).find("\"cpu_widen_bytes_per_rank\": 196608") != std::string::npos);
  }
  SECTION("k3-tiny with 4 MLA heads, micro-batch 3") {
    // 3 x 128 = 384 tokens; (4 + 1) x 16 = 80 values, 384 x 80 x 4 = 122,880 bytes.
    const Config c = widen_config("k3-tiny", {"model.mla.n_head=4", "train.dtype=bf16", "train.device=cpu"});
    const Ledger l = make_ledger(c, {1, 1, 1, 0, 3});
    CHECK(l.cpu_widen_bytes_per_rank == 122880.0);
    CHECK(l.cpu_widen_op.find("(4 + 1) x 16") != std::string::npos);
    const Config f = widen_config("k3-tiny", {"model.mla.n_head=4", "train.dtype=f32", "train.device=cpu"});
    CHECK(make_ledger(f, {1, 1, 1, 0, 3}).cpu_widen_bytes_per_rank == 0.0);
  }
  SECTION("a hybrid without MLA layers widens nothing counted") {
    const Config c = widen_config("k3-tiny", {"model.attn_mixer=kda",
                                              "train.dtype=bf16", "train.device=cpu"});
    CHECK(make_ledger(c, {}).cpu_widen_bytes_per_rank == 0.0);
  }
  SECTION("gpt2-small: add_layer_norm, on every pipeline stage") {
    // batch 8 x seq 1024 = 8192 tokens (gpt2-small.yaml), D 768: 4 x 768 values per token,
    // 8192 x 3072 x 4 = 100,663,296 bytes, on each of 2 stages.
    const Config c = widen_config("gpt2-small", {"train.dtype=bf16", "train.device=cpu"});
    const Ledger l = make_ledger(c, {1, 1, 2});
    REQUIRE(l.stages.size() == 2);
    for (const StageLedger& st : l.stages) CHECK(st.cpu_widen_bytes == 100663296.0);
    CHECK(l.cpu_widen_op.find("add_layer_norm") != std::string::npos);
  }
  SECTION("the GPU does not widen") {
    const WidenPair p = widen_pair("k3-tiny", {}, "train.device=cuda");
    CHECK(p.without.cpu_widen_bytes_per_rank == 0.0);
    CHECK(p.with.bytes_per_rank - p.without.bytes_per_rank == 196608.0);
  }
}
