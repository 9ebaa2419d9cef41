// `moetrain export` directories (checkpoint/export.h, docs/export.md): round trips
// through the reader that model.init_from uses, the Hugging Face name table, sharding,
// bf16 rounding, the HDF5 format, errors, and the logits of an independent PyTorch
// reader (tests/reference/export_reader.py) on the exported files.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "checkpoint/export.h"
#include "checkpoint/safetensors.h"
#include "io/hdf5.h"
#include "moetrain.h"
#include "nn/gpt2.h"
#include "nn/gpt2_hf.h"
#include "nn/hybrid.h"
#include "nn/hybrid_hf.h"
#include "ops/view/view.h"
#include "nn/fixtures.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::bitwise_equal;
using moetrain::testing::TempDir;
namespace fs = std::filesystem;

namespace {

// KDA (lower-bound gate with GVA; softplus gate with low-rank output gate), MLA with
// query LoRA and output gate, plain attention, AttnRes blocks of 2 layers, latent MoE
// layers 2-4 (4 experts, top 2, one shared expert) with router biases.
HybridConfig tiny(DType dtype, bool learnable_beta = true) {
  HybridConfig c = testing::tiny_hybrid(dtype);
  c.ffn.situ_learnable_beta = learnable_beta;
  return c;
}

ParameterList state_of(const LanguageModel& m) {
  ParameterList s = m.parameters();
  const ParameterList b = m.buffers();
  s.insert(s.end(), b.begin(), b.end());
  return s;
}

// Moves every tensor off its init (AttnRes pseudo-queries start at zero, router biases
// at zero), so that a tensor loaded into the wrong place changes the logits.
void perturb(const LanguageModel& m, uint64_t seed) {
  NoGradGuard no_grad;
  Generator gen(seed);
  for (const NamedParameter& p : state_of(m))
    copy_(p.tensor, add(p.tensor.detach(), randn(p.tensor.shape(), p.tensor.dtype(), gen, 0.0, 0.2)));
}

Tensor ids_for(int64_t vocab) {
  Generator gen(99);
  return randint({2, 9}, vocab, DType::i32, gen);
}

ExportOptions with(ExportFormat format, DType dtype, int64_t max_shard = kDefaultMaxShardBytes) {
  ExportOptions o;
  o.format = format;
  o.dtype = dtype;
  o.max_shard_bytes = max_shard;
  return o;
}

// bf16 bits of an f32 by round to nearest even, written here from the definition.
uint16_t rne_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t upper = u >> 16, lower = u & 0xffffu;
  if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u))) ++upper;
  return static_cast<uint16_t>(upper);
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(testing::read_bytes(path)); }

}  // namespace

TEST_CASE("export: a hybrid model (KDA, MLA, attention, latent MoE with shared experts, AttnRes) round-trips",
          "[checkpoint][export]") {
  TempDir tmp;
  HybridModel a(tiny(DType::f32), 1);
  perturb(a, 2);
  export_model_dir(a, {}, tmp / "out", with(ExportFormat::safetensors, DType::f32));
  CHECK(fs::exists(tmp / "out/model.safetensors"));
  CHECK(fs::exists(tmp / "out/config.json"));
  CHECK(tmp.listing() == std::vector<std::string>{"out"});  // no temp directory left behind

  HybridModel b(tiny(DType::f32), 3);
  ParameterList sb = state_of(b);
  load_hybrid_hf_weights(sb, HfWeights::open(tmp / "out"));
  const ParameterList sa = state_of(a);
  for (size_t i = 0; i < sa.size(); ++i) {
    INFO(sa[i].name);
    CHECK(bitwise_equal(sa[i].tensor, sb[i].tensor));
  }
  Tensor ids = ids_for(23);
  CHECK(bitwise_equal(a.forward(ids, false), b.forward(ids, false)));

  // An f64 model exports f32 and loads back as the f32-rounded values.
  HybridModel a64(tiny(DType::f64), 1), b64(tiny(DType::f64), 4);
  perturb(a64, 2);
  export_model_dir(a64, {}, tmp / "out64", with(ExportFormat::safetensors, DType::f32));
  CHECK(SafetensorsFile::open(tmp / "out64/model.safetensors").entry("model.norm.weight").dtype_name == "F32");
  ParameterList s64 = state_of(b64);
  load_hybrid_hf_weights(s64, HfWeights::open(tmp / "out64"));
  for (size_t i = 0; i < s64.size(); ++i)
    CHECK(bitwise_equal(s64[i].tensor, state_of(a64)[i].tensor.to(DType::f32).to(s64[i].tensor.dtype())));

  nlohmann::json cfg = read_json(tmp / "out/config.json");
  // GVA, the lower-bound and full-rank gates, MLA's gate, AttnRes, latent experts, SiTU:
  // not transformers' KimiLinear, so moetrain's own model_type (the names stay Kimi's).
  CHECK(cfg["model_type"] == "moetrain_hybrid");
  CHECK(cfg["architectures"][0] == "MoetrainHybridForCausalLM");
  CHECK(cfg["linear_attn_config"]["kda_layers"] == nlohmann::json({1, 3, 5}));
  CHECK(cfg["linear_attn_config"]["full_attn_layers"] == nlohmann::json({2, 4}));
  CHECK(cfg["moetrain"]["layer_mixers"][3] == "attention");
  CHECK(cfg["num_experts"] == 4);
  CHECK(cfg["first_k_dense_replace"] == 2);
  CHECK(cfg["routed_expert_hidden_size"] == 4);
  CHECK(cfg["attn_res_block_size"] == 2);
  CHECK(cfg["torch_dtype"] == "float32");
}

TEST_CASE("export: a model with experts sharded over 2 ranks loads its own experts' rows (init_from at train.ep 2)",
          "[checkpoint][export]") {
  TempDir tmp;
  HybridModel full(tiny(DType::f32), 1);
  perturb(full, 2);
  export_model_dir(full, {}, tmp / "out", with(ExportFormat::safetensors, DType::f32));
  const ParameterList want = state_of(full);
  for (int index : {0, 1}) {
    HybridModel part(tiny(DType::f32), 5, true, ExpertShard{index, 2});
    ParameterList got = state_of(part);
    load_hybrid_hf_weights(got, HfWeights::open(tmp / "out"), ExpertShard{index, 2});
    REQUIRE(got.size() == want.size());
    int64_t shards = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      INFO(got[i].name << " on shard " << index);
      REQUIRE(got[i].name == want[i].name);
      if (got[i].group == "experts") {
        ++shards;
        const int64_t rows = got[i].tensor.size(0);  // 2 of the 4 experts
        CHECK(rows == 2);
        CHECK(bitwise_equal(got[i].tensor, slice(want[i].tensor, 0, index * rows, (index + 1) * rows).contiguous()));
      } else {
        CHECK(bitwise_equal(got[i].tensor, want[i].tensor));
      }
    }
    CHECK(shards == 9);  // w1, w2, w3 of the 3 MoE layers
  }
}

TEST_CASE("export: the Hugging Face name table covers every hybrid tensor exactly once", "[checkpoint][export]") {
  TempDir tmp;
  HybridModel a(tiny(DType::f32), 1);
  export_model_dir(a, {}, tmp / "out", with(ExportFormat::safetensors, DType::f32));
  SafetensorsFile f = SafetensorsFile::open(tmp / "out/model.safetensors");
  std::map<std::string, Shape> names;
  for (const TensorEntry& e : f.entries()) names[e.name] = e.shape;
  // Every model tensor once, the 3 stacked expert tensors of 3 MoE layers split into 4 each.
  CHECK(f.entries().size() == state_of(a).size() + 3 * 3 * (4 - 1));
  int64_t elements = 0, model_elements = 0;
  for (const TensorEntry& e : f.entries()) elements += e.shape.numel();
  for (const NamedParameter& p : state_of(a)) model_elements += p.tensor.numel();
  CHECK(elements == model_elements);
  const std::map<std::string, Shape> expected = {
      {"model.embed_tokens.weight", {23, 12}},
      {"lm_head.weight", {23, 12}},
      {"model.norm.weight", {12}},
      {"model.layers.0.input_layernorm.weight", {12}},
      {"model.layers.0.post_attention_layernorm.weight", {12}},
      {"model.layers.0.self_attn.q_conv1d.weight", {6, 1, 4}},
      {"model.layers.0.self_attn.v_conv1d.weight", {12, 1, 4}},
      {"model.layers.0.self_attn.A_log", {1, 1, 4, 1}},
      {"model.layers.0.self_attn.dt_bias", {12}},
      {"model.layers.0.self_attn.f_b_proj.weight", {12, 3}},
      {"model.layers.0.self_attn.g_proj.weight", {12, 12}},
      {"model.layers.0.self_attn.o_norm.weight", {3}},
      {"model.layers.0.mlp.gate_proj.weight", {10, 12}},
      {"model.layers.0.mlp.situ_beta", {1}},
      {"model.layers.0.mlp_res_proj.weight", {1, 12}},
      {"model.layers.1.self_attn.q_a_proj.weight", {5, 12}},
      {"model.layers.1.self_attn.q_a_layernorm.weight", {5}},
      {"model.layers.1.self_attn.kv_a_proj_with_mqa.weight", {6, 12}},
      {"model.layers.1.self_attn.kv_b_proj.weight", {12, 4}},
      {"model.layers.1.self_attn.g_proj.weight", {6, 12}},
      {"model.layers.1.self_attention_res_proj.weight", {1, 12}},
      {"model.layers.1.self_attention_res_norm.weight", {12}},
      {"model.layers.2.block_sparse_moe.gate.weight", {4, 12}},
      {"model.layers.2.block_sparse_moe.gate.e_score_correction_bias", {4}},
      {"model.layers.2.block_sparse_moe.routed_expert_down_proj.weight", {4, 12}},
      {"model.layers.2.block_sparse_moe.routed_expert_norm.weight", {4}},
      {"model.layers.2.block_sparse_moe.routed_expert_up_proj.weight", {12, 4}},
      {"model.layers.2.block_sparse_moe.experts.0.w1.weight", {3, 4}},
      {"model.layers.4.block_sparse_moe.experts.3.w2.weight", {4, 3}},
      {"model.layers.4.block_sparse_moe.experts.3.w3.weight", {3, 4}},
      {"model.layers.3.block_sparse_moe.shared_experts.down_proj.weight", {12, 3}},
      {"model.layers.3.self_attn.q_proj.weight", {12, 12}},
      {"model.output_attn_res_proj.weight", {1, 12}},
      {"model.output_attn_res_norm.weight", {12}},
  };
  for (const auto& [name, shape] : expected) {
    INFO(name);
    REQUIRE(names.count(name));
    CHECK(names[name] == shape);
  }
  for (const auto& [name, shape] : names) {
    INFO(name);
    CHECK(name.find(".mlp.experts.") == std::string::npos);  // no stacked experts
    CHECK(name.find(".attn_res_") == std::string::npos);      // K3's self_attention_res_*
    CHECK(!(name.find("model.layers.2.mlp.") == 0 || name.find("model.layers.4.mlp.") == 0));
  }
  CHECK(!names.count("model.layers.0.self_attention_res_proj.weight"));  // never used: not allocated

  // The reader is strict both ways and names the file and the tensor.
  std::vector<std::pair<std::string, Tensor>> all;
  for (const TensorEntry& e : f.entries()) all.emplace_back(e.name, f.read(e.name));
  HybridModel b(tiny(DType::f32), 2);
  ParameterList sb = state_of(b);
  auto without = all;
  without.erase(std::find_if(without.begin(), without.end(), [](const auto& kv) {
    return kv.first == "model.layers.3.block_sparse_moe.experts.2.w1.weight";
  }));
  write_safetensors(tmp / "missing.safetensors", without);
  CHECK_THROWS_WITH(load_hybrid_hf_weights(sb, HfWeights::open(tmp / "missing.safetensors")),
                    Catch::Contains("missing.safetensors") &&
                        Catch::Contains("missing tensor model.layers.3.block_sparse_moe.experts.2.w1.weight [3, 4]"));
  auto extra = all;
  extra.emplace_back("model.layers.2.block_sparse_moe.experts.4.w1.weight", ones({3, 4}));
  write_safetensors(tmp / "extra.safetensors", extra);
  CHECK_THROWS_WITH(load_hybrid_hf_weights(sb, HfWeights::open(tmp / "extra.safetensors")),
                    Catch::Contains("extra.safetensors") &&
                        Catch::Contains("unexpected tensor model.layers.2.block_sparse_moe.experts.4.w1.weight"));
  auto wrong = all;
  for (auto& kv : wrong)
    if (kv.first == "model.layers.1.self_attn.kv_b_proj.weight") kv.second = ones({4, 12});
  write_safetensors(tmp / "wrong.safetensors", wrong);
  CHECK_THROWS_WITH(load_hybrid_hf_weights(sb, HfWeights::open(tmp / "wrong.safetensors")),
                    Catch::Contains("model.layers.1.self_attn.kv_b_proj.weight is [4, 12]") &&
                        Catch::Contains("expects [12, 4]"));
  // K3 checkpoints carry layer 0's unused attention AttnRes pair: accepted and ignored.
  auto k3 = all;
  k3.emplace_back("model.layers.0.self_attention_res_proj.weight", zeros({1, 12}));
  k3.emplace_back("model.layers.0.self_attention_res_norm.weight", ones({12}));
  write_safetensors(tmp / "k3.safetensors", k3);
  load_hybrid_hf_weights(sb, HfWeights::open(tmp / "k3.safetensors"));
  // Files with moetrain's internal names (runs from before the export) still load.
  std::vector<std::pair<std::string, Tensor>> internal;
  for (const NamedParameter& p : state_of(a)) internal.emplace_back(p.name, p.tensor.detach());
  write_safetensors(tmp / "internal.safetensors", internal);
  HybridModel c(tiny(DType::f32), 5);
  ParameterList sc = state_of(c);
  load_hybrid_hf_weights(sc, HfWeights::open(tmp / "internal.safetensors"));
  Tensor ids = ids_for(23);
  CHECK(bitwise_equal(a.forward(ids, false), c.forward(ids, false)));
}

TEST_CASE("export: above the shard size, shards and model.safetensors.index.json as Hugging Face writes them",
          "[checkpoint][export]") {
  TempDir tmp;
  HybridModel a(tiny(DType::f32), 1);
  perturb(a, 2);
  const int64_t limit = 4000;
  export_model_dir(a, {}, tmp / "out", with(ExportFormat::safetensors, DType::f32, limit));
  CHECK(!fs::exists(tmp / "out/model.safetensors"));
  nlohmann::json index = read_json(tmp / "out/model.safetensors.index.json");
  std::set<std::string> files;
  for (auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
  REQUIRE(files.size() >= 3);
  const size_t n = files.size();
  int64_t total = 0, tensors = 0;
  size_t i = 1;
  for (const std::string& file : files) {
    CHECK(file == fmt::format("model-{:05d}-of-{:05d}.safetensors", i++, n));
    SafetensorsFile f = SafetensorsFile::open(tmp / ("out/" + file));
    int64_t bytes = 0;
    for (const TensorEntry& e : f.entries()) {
      bytes += e.nbytes();
      CHECK(index["weight_map"][e.name] == file);
    }
    CHECK((bytes <= limit || f.entries().size() == 1));
    total += bytes;
    tensors += static_cast<int64_t>(f.entries().size());
  }
  CHECK(index["metadata"]["total_size"] == total);
  CHECK(tensors == static_cast<int64_t>(index["weight_map"].size()));
  CHECK(tensors == static_cast<int64_t>(state_of(a).size()) + 27);

  HybridModel b(tiny(DType::f32), 3);
  ParameterList sb = state_of(b);
  load_hybrid_hf_weights(sb, HfWeights::open(tmp / "out"));
  Tensor ids = ids_for(23);
  CHECK(bitwise_equal(a.forward(ids, false), b.forward(ids, false)));

  // A shard that the index names but that is gone: the error names both.
  fs::remove(tmp / ("out/" + *files.rbegin()));
  CHECK_THROWS_WITH(HfWeights::open(tmp / "out"),
                    Catch::Contains("model.safetensors.index.json") && Catch::Contains(*files.rbegin()));
}

TEST_CASE("export: bf16 is the round to nearest even of the f32 value; A_log, dt_bias and the router bias stay f32",
          "[checkpoint][export]") {
  TempDir tmp;
  HybridModel a(tiny(DType::f32), 1);
  perturb(a, 2);
  export_model_dir(a, {}, tmp / "f32", with(ExportFormat::safetensors, DType::f32));
  export_model_dir(a, {}, tmp / "bf16", with(ExportFormat::safetensors, DType::bf16));
  SafetensorsFile f32 = SafetensorsFile::open(tmp / "f32/model.safetensors");
  SafetensorsFile bf = SafetensorsFile::open(tmp / "bf16/model.safetensors");
  REQUIRE(f32.entries().size() == bf.entries().size());
  int64_t rounded = 0, kept = 0;
  for (const TensorEntry& e : f32.entries()) {
    INFO(e.name);
    const TensorEntry& b = bf.entry(e.name);
    CHECK(b.shape == e.shape);
    Tensor exact = f32.read(e.name), stored = bf.read(e.name);
    const bool stays = e.name.ends_with(".A_log") || e.name.ends_with(".dt_bias") ||
                       e.name.ends_with(".e_score_correction_bias");
    if (stays) {
      CHECK(b.dtype_name == "F32");
      CHECK(bitwise_equal(stored, exact));
      ++kept;
      continue;
    }
    REQUIRE(b.dtype_name == "BF16");
    const float* x = exact.data<float>();
    const auto* bits = static_cast<const uint16_t*>(stored.raw_data());
    bool all = true;
    for (int64_t k = 0; k < exact.numel(); ++k) all = all && bits[k] == rne_bf16(x[k]);
    CHECK(all);
    ++rounded;
  }
  CHECK(kept == 3 * 2 + 3);  // 3 KDA layers x (A_log, dt_bias) + 3 MoE router biases
  CHECK(rounded > 100);
  CHECK(read_json(tmp / "bf16/config.json")["torch_dtype"] == "bfloat16");
  // Ties go to even: 1 + 2^-8 (halfway between two bf16 values) rounds down, 1 + 3*2^-8 up.
  CHECK(rne_bf16(1.0f + 1.0f / 256) == 0x3f80);
  CHECK(rne_bf16(1.0f + 3.0f / 256) == 0x3f82);

  // Loaded into an f32 model: the bf16 values, exactly.
  HybridModel b(tiny(DType::f32), 3);
  ParameterList sb = state_of(b);
  load_hybrid_hf_weights(sb, HfWeights::open(tmp / "bf16"));
  CHECK(bitwise_equal(state_of(b)[0].tensor, state_of(a)[0].tensor.to(DType::bf16).to(DType::f32)));
}

TEST_CASE("export: the HDF5 format holds the same tensors under the same names, bf16 as uint16 bits",
          "[checkpoint][export]") {
  TempDir tmp;
  HybridModel a(tiny(DType::f32), 1);
  perturb(a, 2);
  export_model_dir(a, {}, tmp / "st", with(ExportFormat::safetensors, DType::f32));
  export_model_dir(a, {}, tmp / "h5", with(ExportFormat::hdf5, DType::f32));
  export_model_dir(a, {}, tmp / "h5bf", with(ExportFormat::hdf5, DType::bf16));
  SafetensorsFile st = SafetensorsFile::open(tmp / "st/model.safetensors");
  hdf5::Reader h5(tmp / "h5/model.h5");
  CHECK(h5.datasets("/").size() == st.entries().size());
  for (const TensorEntry& e : st.entries()) {
    INFO(e.name);
    CHECK(bitwise_equal(h5.read("/", e.name), st.read(e.name)));
  }
  CHECK(h5.attr_string("/", "dtype") == "f32");
  hdf5::Reader h5bf(tmp / "h5bf/model.h5");
  CHECK(h5bf.attr_string("/", "dtype") == "bf16");
  Tensor bits = h5bf.read("/", "model.layers.1.self_attn.kv_b_proj.weight");
  CHECK(bits.dtype() == DType::u16);
  CHECK(h5bf.read("/", "model.layers.0.self_attn.A_log").dtype() == DType::f32);
  const Tensor f32 = st.read("model.layers.1.self_attn.kv_b_proj.weight");  // kept alive while x is read
  const float* x = f32.data<float>();
  CHECK(static_cast<const uint16_t*>(bits.raw_data())[5] == rne_bf16(x[5]));
  CHECK(fs::exists(tmp / "h5/config.json"));

  Tensor ids = ids_for(23);
  HybridModel b(tiny(DType::f32), 3);
  ParameterList sb = state_of(b);
  load_hybrid_hf_weights(sb, HfWeights::open(tmp / "h5"));
  CHECK(bitwise_equal(a.forward(ids, false), b.forward(ids, false)));
  ParameterList sbf = state_of(b);
  load_hybrid_hf_weights(sbf, HfWeights::open(tmp / "h5bf"));
  HybridModel c(tiny(DType::f32), 4);
  ParameterList sc = state_of(c);
  load_hybrid_hf_weights(sc, HfWeights::open(tmp / "h5bf"));
  CHECK(bitwise_equal(b.forward(ids, false), c.forward(ids, false)));
}

TEST_CASE("export: GPT-2 keeps GPT2LMHeadModel names and config.json, sharded and bf16 too", "[checkpoint][export]") {
  TempDir tmp;
  Gpt2Config gc;
  gc.vocab_size = 50;
  gc.n_layer = 2;
  gc.n_head = 2;
  gc.d_model = 8;
  gc.n_ctx = 12;
  gc.d_ff = 20;
  Gpt2 a(gc, 1);
  export_model_dir(a, {}, tmp / "one", with(ExportFormat::safetensors, DType::f32));
  export_model_dir(a, {}, tmp / "shards", with(ExportFormat::safetensors, DType::f32, 600));
  export_model_dir(a, {}, tmp / "bf16", with(ExportFormat::safetensors, DType::bf16));
  SafetensorsFile f = SafetensorsFile::open(tmp / "one/model.safetensors");
  CHECK(f.entry("h.1.attn.c_attn.weight").shape == Shape{8, 24});  // Conv1D [in, out]
  CHECK(!f.contains("lm_head.weight"));                           // tied
  nlohmann::json cfg = read_json(tmp / "one/config.json");
  CHECK(cfg["model_type"] == "gpt2");
  CHECK(cfg["n_inner"] == 20);
  CHECK(read_gpt2_hf_config(tmp / "shards/config.json", {}).n_layer == 2);
  REQUIRE(fs::exists(tmp / "shards/model.safetensors.index.json"));
  Tensor ids = ids_for(50);
  Gpt2 b(gc, 2), c(gc, 3);
  load_hf_weights(b, tmp / "shards");
  CHECK(bitwise_equal(a.forward(ids, false), b.forward(ids, false)));
  load_hf_weights(c, tmp / "bf16");
  CHECK(bitwise_equal(c.parameters()[0].tensor, a.parameters()[0].tensor.to(DType::bf16).to(DType::f32)));
}

TEST_CASE("export: refuses a non-empty --out unless replacing; sizes, formats and dtypes are checked",
          "[checkpoint][export][errors]") {
  TempDir tmp;
  HybridModel a(tiny(DType::f32), 1);
  tmp.write("busy/keep.txt", "x");
  std::string err = testing::error_of([&] { export_model_dir(a, {}, tmp / "busy", ExportOptions{}); });
  CHECK(err.find(tmp / "busy") != std::string::npos);
  CHECK(err.find("not empty") != std::string::npos);
  CHECK(fs::exists(tmp / "busy/keep.txt"));
  ExportOptions replace;
  replace.replace = true;
  export_model_dir(a, {}, tmp / "busy/", replace);
  CHECK(!fs::exists(tmp / "busy/keep.txt"));
  CHECK(fs::exists(tmp / "busy/model.safetensors"));
  CHECK(tmp.listing() == std::vector<std::string>{"busy"});
  // A failure while writing (a tensor name twice) leaves the old directory as it was and no temp directory.
  ParameterList twice = state_of(a);
  twice.push_back(twice[3]);
  CHECK(testing::error_of([&] { export_model_dir(a, twice, tmp / "busy", replace); }).find("appears twice") !=
        std::string::npos);
  CHECK(fs::exists(tmp / "busy/model.safetensors"));
  CHECK(tmp.listing() == std::vector<std::string>{"busy"});
  tmp.write("file", "x");
  CHECK(testing::error_of([&] { export_model_dir(a, {}, tmp / "file", replace); }).find("not a directory") !=
        std::string::npos);

  CHECK(parse_byte_size("5GB") == 5'000'000'000);
  CHECK(parse_byte_size("500MB") == 500'000'000);
  CHECK(parse_byte_size("2GiB") == 2LL * 1024 * 1024 * 1024);
  CHECK(parse_byte_size("123") == 123);
  CHECK(parse_byte_size("1.5kB") == 1500);
  for (const char* bad : {"", "GB", "5XB", "-3", "0", "5 G B"})
    CHECK(testing::error_of([&] { parse_byte_size(bad); }).find("not a size in bytes") != std::string::npos);
  CHECK(testing::error_of([] { parse_export_format("onnx"); }).find("'onnx'") != std::string::npos);
  CHECK(testing::error_of([] { parse_export_dtype("f16"); }).find("'f16'") != std::string::npos);
  CHECK(testing::error_of([] { HfWeights::open("/nonexistent/model"); }).find("/nonexistent/model") !=
        std::string::npos);
  tmp.write("empty/x.txt", "");
  CHECK(testing::error_of([&] { HfWeights::open(tmp / "empty"); }).find("no weights") != std::string::npos);
}

TEST_CASE("export: refuses NaN and infinities (NumericalError naming the tensor) before writing anything",
          "[checkpoint][export][errors]") {
  TempDir tmp;
  HybridModel a(tiny(DType::f32), 1);
  const ParameterList state = state_of(a);
  const NamedParameter& victim = state[5];
  const int64_t numel = victim.tensor.numel();
  victim.tensor.data<float>()[numel - 1] = std::nanf("");
  std::string err = testing::error_of<NumericalError>([&] { export_model_dir(a, {}, tmp / "out", ExportOptions{}); });
  CHECK(err.find(tmp / "out") != std::string::npos);
  CHECK(err.find(victim.name + " " + fmt::format("{}", victim.tensor.shape()) + ": 1 of " + std::to_string(numel) +
                 " values are NaN or infinite") != std::string::npos);
  CHECK(tmp.listing().empty());  // no out, no out.tmp.<pid>

  // Replacing an existing export: the old one stays.
  victim.tensor.data<float>()[numel - 1] = 0.5f;
  ExportOptions replace;
  replace.replace = true;
  export_model_dir(a, {}, tmp / "out", replace);
  const std::string before = testing::read_bytes(tmp / "out/model.safetensors");
  const ParameterList buffers = a.buffers();  // the routers' expert biases
  REQUIRE(!buffers.empty());
  const NamedParameter* bias = &buffers.back();
  bias->tensor.data<float>()[0] = -INFINITY;
  err = testing::error_of<NumericalError>([&] { export_model_dir(a, {}, tmp / "out", replace); });
  CHECK(err.find(bias->name) != std::string::npos);
  CHECK(testing::read_bytes(tmp / "out/model.safetensors") == before);
  CHECK(tmp.listing() == std::vector<std::string>{"out"});
  bias->tensor.data<float>()[0] = 0.0f;

  // Finite in the model, infinite once rounded: f64 beyond f32's range.
  HybridModel b(tiny(DType::f64), 1);
  const ParameterList wide = state_of(b);
  REQUIRE(wide[0].tensor.dtype() == DType::f64);
  wide[0].tensor.data<double>()[0] = 1e300;
  err = testing::error_of<NumericalError>([&] { export_model_dir(b, {}, tmp / "wide", ExportOptions{}); });
  CHECK(err.find("rounded to f32") != std::string::npos);
  CHECK(err.find(": 1 of ") != std::string::npos);
  CHECK(!fs::exists(tmp / "wide"));
}

TEST_CASE("export: an independent PyTorch reader of the exported files reproduces the logits",
          "[checkpoint][export][reference]") {
  if (testing::run_command("/usr/bin/python3 -c 'import torch, numpy, h5py' >/dev/null 2>&1") != 0) {
    WARN("skipped: /usr/bin/python3 cannot import torch, numpy and h5py (Debian python3-torch, python3-h5py)");
    return;
  }
  TempDir tmp;
  // f64 models: the exported f32 (or bf16) values, loaded back, run in f64 on both sides.
  HybridConfig hc = tiny(DType::f64, /*learnable_beta=*/false);
  HybridModel src(hc, 1);
  perturb(src, 2);
  Gpt2Config gc;
  gc.vocab_size = 50;
  gc.n_layer = 2;
  gc.n_head = 2;
  gc.d_model = 8;
  gc.n_ctx = 12;
  gc.d_ff = 20;
  gc.dtype = DType::f64;
  Gpt2 gsrc(gc, 1);
  struct Case {
    std::string name;
    const LanguageModel* model;
    ExportOptions options;
  };
  const std::vector<Case> cases = {
      {"hybrid_f32", &src, with(ExportFormat::safetensors, DType::f32)},
      {"hybrid_bf16_shards", &src, with(ExportFormat::safetensors, DType::bf16, 3000)},
      {"hybrid_hdf5_bf16", &src, with(ExportFormat::hdf5, DType::bf16)},
      {"gpt2_bf16", &gsrc, with(ExportFormat::safetensors, DType::bf16)},
  };
  // Export each, load it back (in f64) and run it; then one Python process for all.
  std::vector<Tensor> ours;
  std::string args;
  for (const Case& c : cases) {
    const std::string dir = tmp / c.name;
    export_model_dir(*c.model, {}, dir, c.options);
    std::unique_ptr<LanguageModel> m;
    if (c.model == &src) {
      auto h = std::make_unique<HybridModel>(hc, 7);
      ParameterList s = state_of(*h);
      load_hybrid_hf_weights(s, HfWeights::open(dir));
      m = std::move(h);
    } else {
      auto g = std::make_unique<Gpt2>(gc, 7);
      load_hf_weights(*g, dir);
      m = std::move(g);
    }
    Tensor ids = ids_for(m->vocab_size());
    std::string ids_text;
    std::vector<double> v = ids.to_vector();
    for (size_t k = 0; k < v.size(); ++k) {
      if (k > 0) ids_text.push_back(k % 9 == 0 ? '/' : ',');  // rows of T = 9
      ids_text.append(std::to_string(static_cast<int64_t>(v[k])));
    }
    args += fmt::format(" {} {} {}", testing::shell_quote(dir), ids_text, testing::shell_quote(tmp / (c.name + ".logits")));
    ours.push_back(m->forward(ids, false));
  }
  testing::CommandOutput r = testing::capture_command("/usr/bin/python3 " + std::string(MOETRAIN_SOURCE_DIR) +
                                                      "/tests/reference/export_reader.py" + args);
  INFO(r.output);
  REQUIRE(r.code == 0);
  for (size_t i = 0; i < cases.size(); ++i) {
    INFO(cases[i].name);
    Tensor expected = SafetensorsFile::open(tmp / (cases[i].name + ".logits")).read("logits");
    REQUIRE(expected.shape() == ours[i].shape());
    CHECK(testing::max_abs_diff(ours[i], expected) < 1e-9);
    CHECK(testing::max_abs_diff(ours[i], zeros_like(expected)) > 1e-2);  // not trivially zero
  }
}
