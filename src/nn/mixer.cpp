// make_mixer: the one place that maps a MixerKind to its implementation (nn/mixer.h).
#include "nn/mixer.h"

#include "nn/attention_mixer.h"
#include "nn/hybrid.h"
#include "nn/kda_layer.h"
#include "nn/linear_attention_layer.h"
#include "nn/mla.h"

namespace moetrain {

MixerKind parse_mixer_kind(const std::string& name) {
  if (name == "kda") return MixerKind::kda;
  if (name == "mla") return MixerKind::mla;
  if (name == "attention") return MixerKind::attention;
  if (name == "linear_attention") return MixerKind::linear_attention;
  if (name == "deltanet") return MixerKind::deltanet;
  if (name == "gated_deltanet") return MixerKind::gated_deltanet;
  MT_THROW("unknown mixer '{}' (kda, mla, attention, linear_attention, deltanet, gated_deltanet)", name);
}

const char* mixer_kind_name(MixerKind kind) {
  switch (kind) {
    case MixerKind::kda: return "kda";
    case MixerKind::mla: return "mla";
    case MixerKind::attention: return "attention";
    case MixerKind::linear_attention: return "linear_attention";
    case MixerKind::deltanet: return "deltanet";
    case MixerKind::gated_deltanet: return "gated_deltanet";
  }
  return "?";
}

std::unique_ptr<Mixer> make_mixer(MixerKind kind, const HybridConfig& c, ParamFactory& f, const std::string& p) {
  switch (kind) {
    case MixerKind::kda:
    case MixerKind::deltanet:
    case MixerKind::gated_deltanet: {
      KdaLayerConfig kc = c.kda;
      kc.decay = kind == MixerKind::kda        ? DeltaDecay::per_channel
                 : kind == MixerKind::deltanet ? DeltaDecay::none
                                               : DeltaDecay::per_head;
      kc.d_model = c.d_model;
      kc.norm_eps = c.rms_norm_eps;
      kc.init_std = c.init_std;
      return std::make_unique<KdaLayer>(kc, f, p);
    }
    case MixerKind::linear_attention: {
      LinearAttentionConfig lc;
      lc.d_model = c.d_model;
      lc.n_head = c.kda.n_head;
      lc.head_dim = c.kda.head_dim;
      lc.chunked = c.kda.chunked;
      lc.chunk_size = c.kda.chunk_size;
      lc.init_std = c.init_std;
      return std::make_unique<LinearAttentionLayer>(lc, f, p);
    }
    case MixerKind::mla: {
      MlaConfig mc = c.mla;
      mc.d_model = c.d_model;
      mc.init_std = c.init_std;
      return std::make_unique<MlaLayer>(mc, f, p);
    }
    case MixerKind::attention:
      return std::make_unique<AttentionMixer>(AttentionMixerConfig{c.d_model, c.attention_n_head, c.init_std}, f, p);
  }
  MT_ASSERT(false, "mixer kind {} has no implementation", static_cast<int>(kind));
}

}  // namespace moetrain
