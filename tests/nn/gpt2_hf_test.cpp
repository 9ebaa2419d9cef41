#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>

#include "checkpoint/export.h"
#include "checkpoint/safetensors.h"
#include "moetrain.h"
#include "nn/gpt2_hf.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::TempDir;

namespace {
// The export directory (checkpoint/export.h) with its defaults, replacing `dir`.
void export_gpt2_hf(const Gpt2& model, const std::string& dir) {
  ExportOptions options;
  options.replace = true;
  export_model_dir(model, {}, dir, options);
}

Gpt2Config small() {
  Gpt2Config c;
  c.vocab_size = 50;
  c.n_layer = 2;
  c.n_head = 2;
  c.d_model = 8;
  c.n_ctx = 12;
  c.d_ff = 20;
  return c;
}
}  // namespace

TEST_CASE("gpt2 hf: export then import reproduces every weight bit for bit", "[nn][gpt2][hf]") {
  TempDir tmp;
  const std::string& dir = tmp.path();
  Gpt2 a(small(), 1);
  export_gpt2_hf(a, dir);
  REQUIRE(is_hf_model_dir(dir));
  Gpt2Config c = read_gpt2_hf_config(dir + "/config.json", Gpt2Config{});
  CHECK(c.n_layer == 2);
  CHECK(c.d_ff == 20);
  CHECK(c.vocab_size == 50);
  Gpt2 b(c, 2);
  load_hf_weights(b, gpt2_hf_weights_path(dir));
  for (size_t i = 0; i < a.parameters().size(); ++i)
    CHECK(moetrain::testing::bitwise_equal(a.parameters()[i].tensor, b.parameters()[i].tensor));
  // Conv1D layout on disk: c_fc.weight is [in, out] = [8, 20].
  SafetensorsFile f = SafetensorsFile::open(dir + "/model.safetensors");
  CHECK(f.entry("h.0.mlp.c_fc.weight").shape == Shape{8, 20});
  CHECK(f.metadata().at("format") == "pt");
}

TEST_CASE("gpt2 hf: transformer. prefix, mask buffers and lm_head are accepted", "[nn][gpt2][hf]") {
  TempDir tmp;
  const std::string& dir = tmp.path();
  Gpt2 a(small(), 3);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const NamedParameter& p : a.parameters()) {
    Tensor t = p.tensor.detach();
    bool conv = p.name.find("c_attn.weight") != std::string::npos || p.name.find("c_proj.weight") != std::string::npos ||
                p.name.find("c_fc.weight") != std::string::npos;
    tensors.emplace_back("transformer." + p.name, conv ? transpose(t, 0, 1) : t);
  }
  tensors.emplace_back("transformer.h.0.attn.bias", ones({1, 1, 12, 12}));
  tensors.emplace_back("lm_head.weight", a.parameters()[0].tensor.detach());
  write_safetensors(dir + "/weights.safetensors", tensors);
  Gpt2 b(small(), 4);
  load_hf_weights(b, dir + "/weights.safetensors");
  for (size_t i = 0; i < a.parameters().size(); ++i)
    CHECK(moetrain::testing::bitwise_equal(a.parameters()[i].tensor, b.parameters()[i].tensor));
}

TEST_CASE("gpt2 hf: missing, unexpected and misshapen tensors name the file and tensor", "[nn][gpt2][hf][errors]") {
  TempDir tmp, source;
  const std::string& dir = tmp.path();
  Gpt2 a(small(), 5);
  export_gpt2_hf(a, source.path());
  SafetensorsFile src = SafetensorsFile::open(source / "model.safetensors");
  std::vector<std::pair<std::string, Tensor>> all;
  for (const TensorEntry& e : src.entries()) all.emplace_back(e.name, src.read(e.name));
  auto write_without = [&](const std::string& skip, const std::string& extra, Tensor extra_t) {
    std::vector<std::pair<std::string, Tensor>> t;
    for (auto& kv : all)
      if (kv.first != skip) t.push_back(kv);
    if (!extra.empty()) t.emplace_back(extra, extra_t);
    write_safetensors(dir + "/w.safetensors", t);
    return dir + "/w.safetensors";
  };
  Gpt2 b(small(), 6);
  CHECK_THROWS_WITH(load_hf_weights(b, write_without("h.1.mlp.c_fc.weight", "h.1.mlp.c_fc.weight", ones({20, 8}))),
                    Catch::Contains("h.1.mlp.c_fc.weight is [20, 8]") && Catch::Contains("expects [8, 20] (Conv1D"));
  CHECK_THROWS_WITH(load_hf_weights(b, write_without("ln_f.bias", "", {})),
                    Catch::Contains("w.safetensors") && Catch::Contains("missing tensor ln_f.bias"));
  CHECK_THROWS_WITH(load_hf_weights(b, write_without("", "h.9.mlp.c_fc.weight", ones({2}))),
                    Catch::Contains("unexpected tensor h.9.mlp.c_fc.weight"));
  CHECK_THROWS_WITH(load_hf_weights(b, write_without("wpe.weight", "wpe.weight", ones({3, 8}))),
                    Catch::Contains("wpe.weight") && Catch::Contains("[3, 8]") && Catch::Contains("[12, 8]"));
  tmp.write("config.json", "{\"n_layer\": 2, \"n_head\": 3, \"n_embd\": 8}");
  CHECK_THROWS_WITH(read_gpt2_hf_config(dir + "/config.json", {}), Catch::Contains("n_positions"));
  tmp.write("config.json", "{\"n_layer\": 2, nope");
  CHECK_THROWS_WITH(read_gpt2_hf_config(dir + "/config.json", {}), Catch::Contains("not valid JSON"));
}
