// The Mixer seam (nn/mixer.h): make_mixer builds each kind under its prefix, each
// mixer refuses another mixer's cache, and its cache_bytes() is what its cache
// holds after a forward (the model-level check is in hybrid_test.cpp).
#include <catch2/catch.hpp>

#include "moetrain.h"
#include "nn/hybrid.h"
#include "nn/mixer.h"
#include "testing.h"

using namespace moetrain;

namespace {

HybridConfig small() {
  HybridConfig c;
  c.d_model = 12;
  c.attention_n_head = 3;
  c.kda.n_head = 2;
  c.kda.n_value_head = 4;
  c.kda.head_dim = 3;
  c.kda.chunk_size = 4;
  c.mla.n_head = 2;
  c.mla.q_lora_rank = 5;
  c.mla.kv_lora_rank = 4;
  c.mla.qk_nope_head_dim = 3;
  c.mla.qk_rope_head_dim = 2;
  c.mla.v_head_dim = 3;
  c.init_std = 0.3;
  return c;
}

const MixerKind kAll[] = {MixerKind::kda,       MixerKind::mla,           MixerKind::attention,
                          MixerKind::linear_attention, MixerKind::deltanet, MixerKind::gated_deltanet};

}  // namespace

TEST_CASE("mixer: make_mixer builds every kind under its prefix; names round-trip", "[nn][mixer]") {
  for (MixerKind kind : kAll) {
    INFO(mixer_kind_name(kind));
    CHECK(parse_mixer_kind(mixer_kind_name(kind)) == kind);
    ParamFactory f(true, DType::f64, 3);
    std::unique_ptr<Mixer> m = make_mixer(kind, small(), f, "model.layers.7.self_attn.");
    CHECK(m->kind() == kind);
    REQUIRE(!f.params().empty());
    for (const NamedParameter& p : f.params()) CHECK(p.name.rfind("model.layers.7.self_attn.", 0) == 0);
    Generator gen(5);
    const Tensor x = randn({2, 5, 12}, DType::f64, gen);
    const Tensor y = m->forward(x);
    CHECK(y.shape() == x.shape());
  }
  CHECK_THROWS_WITH(parse_mixer_kind("gru"), Catch::Contains("unknown mixer 'gru'"));
}

TEST_CASE("mixer: a cache of another mixer is refused; cache_bytes is what the cache holds", "[nn][mixer]") {
  for (MixerKind kind : kAll) {
    INFO(mixer_kind_name(kind));
    ParamFactory f(true, DType::f32, 3);
    std::unique_ptr<Mixer> m = make_mixer(kind, small(), f, "l.");
    ParamFactory g(true, DType::f32, 4);
    std::unique_ptr<Mixer> other = make_mixer(kind == MixerKind::mla ? MixerKind::attention : MixerKind::mla, small(),
                                              g, "o.");
    Generator gen(6);
    const Tensor x = randn({1, 6, 12}, DType::f32, gen);
    std::unique_ptr<MixerCache> foreign = other->new_cache();
    CHECK_THROWS_WITH(m->forward(x, foreign.get()), Catch::Contains("the decode cache belongs to another kind of mixer"));
    NoGradGuard no_grad;
    std::unique_ptr<MixerCache> cache = m->new_cache();
    m->forward(slice(x, 1, 0, 5).contiguous(), cache.get());
    m->forward(slice(x, 1, 5, 6).contiguous(), cache.get());
    CHECK(m->cache_bytes(6) == cache->bytes());
  }
}
