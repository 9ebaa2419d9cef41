// The sequence mixers of the hybrid decoder (docs/architecture.md, "Mixers"):
// one interface, one implementation per file pair, one make_mixer().
//   kda, deltanet, gated_deltanet  KdaLayer (nn/kda_layer.h): the delta rule with a
//                                  per-channel, no or per-head decay
//   linear_attention               LinearAttentionLayer (nn/linear_attention_layer.h)
//   mla                            MlaLayer (nn/mla.h): gated latent attention
//   attention                      AttentionMixer (nn/attention_mixer.h): plain causal
//                                  softmax attention
// A mixer declares its parameters through the ParamFactory under its prefix
// ("model.layers.3.self_attn."), maps the normed sublayer input x [B, T, D] to
// [B, T, D], and for decoding keeps what it needs of the past in its own cache.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/tensor.h"
#include "nn/param_factory.h"

namespace moetrain {

struct HybridConfig;

enum class MixerKind { kda, mla, attention, linear_attention, deltanet, gated_deltanet };
MixerKind parse_mixer_kind(const std::string& name);
const char* mixer_kind_name(MixerKind kind);

// What a mixer keeps between decoding calls (its own subclass).
class MixerCache {
 public:
  virtual ~MixerCache() = default;
  virtual int64_t bytes() const = 0;
};

class Mixer {
 public:
  virtual ~Mixer() = default;
  virtual MixerKind kind() const = 0;
  // x [B, T, D] (the normed sublayer input) -> [B, T, D]. With a cache (from this
  // mixer's new_cache()): continues from it and updates it.
  virtual Tensor forward(const Tensor& x, MixerCache* cache = nullptr) const = 0;
  virtual std::unique_ptr<MixerCache> new_cache() const = 0;
  // Training FLOPs per token (forward + backward) beyond its matrix products (those
  // are counted from the parameter shapes), at sequence length T.
  virtual double sequence_flops_per_token(int64_t seq_len) const = 0;
  // Bytes of the cache of one sequence after `length` tokens, from the shapes alone
  // (what new_cache() holds then; tested against it).
  virtual int64_t cache_bytes(int64_t length) const = 0;
};

// The mixer of `kind` for layer `prefix` of the hybrid model `c` (its widths,
// heads, norms and init), its parameters made by `factory`.
std::unique_ptr<Mixer> make_mixer(MixerKind kind, const HybridConfig& c, ParamFactory& factory,
                                  const std::string& prefix);

// The cache a mixer handed out, as its own type; an Error for another mixer's.
template <class C>
C* cache_as(MixerCache* cache, const char* mixer) {
  if (!cache) return nullptr;
  C* c = dynamic_cast<C*>(cache);
  MT_CHECK(c, "{} layer: the decode cache belongs to another kind of mixer", mixer);
  return c;
}

}  // namespace moetrain
