#include <catch2/catch.hpp>

#include "moetrain.h"
#include "nn/fixtures.h"
#include "nn/gpt2.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::max_abs_diff;

namespace {
Gpt2Config tiny(DType dtype = DType::f64) { return testing::tiny_gpt2(dtype); }
using testing::random_ids;
}  // namespace

// [slow]: 124M parameters allocated; not rerun under the sanitizers (launch/test.sh).
TEST_CASE("gpt2: gpt2-small has exactly 124,439,808 parameters", "[nn][gpt2][slow]") {
  Gpt2Config c;  // defaults are GPT-2 small
  c.n_layer = 12;
  Gpt2 model(c, 1);
  CHECK(count_parameters(model.parameters()) == 124439808);
  CHECK(model.parameters().front().name == "wte.weight");
  CHECK(model.parameters().back().name == "ln_f.bias");
}

TEST_CASE("gpt2: init follows GPT-2 (std 0.02, residual projections scaled, LN 1/0)", "[nn][gpt2]") {
  Gpt2Config c = tiny(DType::f32);
  c.d_model = 64;
  c.n_head = 4;
  c.d_ff = 256;
  c.n_layer = 8;
  c.vocab_size = 500;
  Gpt2 model(c, 3);
  auto stddev = [](const Tensor& t) {
    double s = 0, s2 = 0;
    for (double v : t.to_vector()) s += v, s2 += v * v;
    double n = static_cast<double>(t.numel());
    return std::sqrt(s2 / n - (s / n) * (s / n));
  };
  for (const NamedParameter& p : model.parameters()) {
    INFO(p.name);
    if (p.name == "wte.weight" || p.name.find("c_attn.weight") != std::string::npos)
      CHECK(stddev(p.tensor) == Approx(0.02).epsilon(0.05));
    if (p.name.find("c_proj.weight") != std::string::npos) CHECK(stddev(p.tensor) == Approx(0.02 / 4.0).epsilon(0.05));
    if (p.name.find("ln_") != std::string::npos && p.name.find(".weight") != std::string::npos)
      CHECK(p.tensor.to_vector() == std::vector<double>(64, 1.0));
    if (p.name.find(".bias") != std::string::npos) CHECK(max_abs_diff(p.tensor, zeros_like(p.tensor)) == 0.0);
    CHECK(p.decay == (p.tensor.dim() == 2 && p.group != "embedding"));
  }
}

TEST_CASE("gpt2: gradients of a tiny model match finite differences", "[nn][gpt2]") {
  Gpt2 model(tiny(), 5);
  Tensor ids = random_ids(2, 5, 37, 1), targets = random_ids(2, 5, 37, 2);
  // Central differences of the loss directly on the model's parameters.
  Tensor loss = model.loss(ids, targets);
  loss.backward();
  double worst = 0;
  std::string where;
  NoGradGuard guard;
  for (NamedParameter& p : model.parameters()) {
    std::vector<double> analytic = p.tensor.grad().to_vector();
    double* w = p.tensor.data<double>();
    for (int64_t i = 0; i < p.tensor.numel(); i += 3) {  // every third element keeps the test fast
      double orig = w[i];
      w[i] = orig + 1e-6;
      double up = model.loss(ids, targets).item<double>();
      w[i] = orig - 1e-6;
      double down = model.loss(ids, targets).item<double>();
      w[i] = orig;
      double numeric = (up - down) / 2e-6, a = analytic[static_cast<size_t>(i)];
      double rel = std::abs(a - numeric) / std::max({std::abs(a), std::abs(numeric), 1e-3});
      if (rel > worst) {
        worst = rel;
        where = fmt::format("{}[{}]: analytic {:.12g} numeric {:.12g}", p.name, i, a, numeric);
      }
    }
  }
  INFO(where);
  CHECK(worst < 1e-6);
}

TEST_CASE("gpt2: cached decoding gives the logits of the full forward", "[nn][gpt2]") {
  Gpt2 model(tiny(), 7);
  Tensor ids = random_ids(2, 9, 37, 3);
  Tensor full;
  {
    NoGradGuard guard;
    full = model.forward(ids, false);
  }
  Gpt2Cache cache;
  Tensor prefix = model.forward_cached(slice(ids, 1, 0, 4), cache);
  CHECK(max_abs_diff(prefix, slice(full, 1, 0, 4)) < 1e-12);
  for (int64_t t = 4; t < 9; ++t) {
    Tensor step = model.forward_cached(slice(ids, 1, t, t + 1), cache);
    CHECK(max_abs_diff(step, slice(full, 1, t, t + 1)) < 1e-12);
  }
  CHECK(cache.length() == 9);
}

TEST_CASE("gpt2: decode_cache_bytes is what the cache holds", "[nn][gpt2]") {
  for (DType dtype : {DType::f32, DType::f64}) {
    Gpt2 model(tiny(dtype), 5);
    std::unique_ptr<DecodeCache> cache = model.new_cache();
    model.forward_cached(random_ids(1, 4, 37, 1), *cache);
    CHECK(model.decode_cache_bytes(4) == cache->bytes());
    model.forward_cached(random_ids(1, 1, 37, 2), *cache);
    CHECK(model.decode_cache_bytes(5) == cache->bytes());
    CHECK(model.decode_cache_bytes(5) == 2 * 2 * 5 * 8 * static_cast<int64_t>(dtype_size(dtype)));  // K, V per layer
  }
}

TEST_CASE("gpt2: activation checkpointing gives bitwise the same gradients", "[nn][gpt2]") {
  auto grads = [](bool recompute) {
    Gpt2Config c = tiny(DType::f32);
    c.activation_checkpointing = recompute;
    c.dropout = 0.1;  // random ops must replay identically during recomputation
    Gpt2 model(c, 11);
    default_generator().set_offset(0);
    model.loss(random_ids(2, 7, 37, 4), random_ids(2, 7, 37, 5)).backward();
    Tensors out;
    for (NamedParameter& p : model.parameters()) out.push_back(p.tensor.grad());
    return out;
  };
  Tensors plain = grads(false), recomputed = grads(true);
  for (size_t i = 0; i < plain.size(); ++i) CHECK(moetrain::testing::bitwise_equal(plain[i], recomputed[i]));
}

TEST_CASE("gpt2: bad inputs are reported", "[nn][gpt2][errors]") {
  Gpt2 model(tiny(), 1);
  CHECK_THROWS_WITH(model.forward(random_ids(1, 17, 37, 1)), Catch::Contains("n_ctx"));
  CHECK_THROWS_WITH(model.forward(from_vector({1, 40}, {1, 2}, DType::i32)), Catch::Contains("token id 40"));
  Gpt2Config bad = tiny();
  bad.n_head = 3;
  CHECK_THROWS_WITH(Gpt2(bad, 1), Catch::Contains("divisible"));
}
