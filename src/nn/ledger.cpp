#include "nn/ledger.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "config/config.h"
#include "core/format.h"
#include "nn/gpt2.h"
#include "nn/hybrid.h"

namespace moetrain {

Ledger make_ledger(const Config& config, LedgerLayout layout) {
  Ledger l;
  l.layout = layout;
  l.seq_len = config.get_int("train.seq_len");
  l.batch_size = config.get_int("train.batch_size");
  const uint64_t seed = 0;
  std::unique_ptr<LanguageModel> model;
  const std::vector<ParamSpec>* specs = nullptr;
  int64_t experts = 0, top_k = 0;
  bool tied = true;
  if (config.get_string("model.arch") == "hybrid") {
    HybridConfig hc = HybridConfig::from(config);
    auto m = std::make_unique<HybridModel>(hc, seed, /*allocate=*/false);
    specs = &m->param_specs();
    experts = hc.moe.num_experts;
    top_k = hc.moe.top_k;
    tied = hc.tie_embeddings;
    model = std::move(m);
  } else {
    auto m = std::make_unique<Gpt2>(Gpt2Config::from(config), seed, /*allocate=*/false);
    specs = &m->param_specs();
    model = std::move(m);
  }
  if (experts > 0 && experts % layout.ep != 0)
    config.fail("model.moe.num_experts", fmt::format("cannot be sharded over --ep {} ranks (not a multiple)", layout.ep));
  l.arch = model->arch();
  l.description = model->describe();
  int64_t expert_params = 0, embedding_table = 0;
  for (const ParamSpec& s : *specs) {
    int64_t n = s.shape.numel();
    l.components[s.group] += n;
    l.total += n;
    if (s.group == "experts") expert_params += n;
    if (s.name == "model.embed_tokens.weight" || s.name == "wte.weight") embedding_table = n;
  }
  l.active = l.total - (experts > 0 ? expert_params / experts * (experts - top_k) : 0) - (tied ? 0 : embedding_table);
  l.flops_per_token = model->flops_per_token(l.seq_len);
  l.params_per_rank = l.total - expert_params + expert_params / layout.ep;
  // f32: weights, grads, 2 moments; bf16 (mixed precision) the same 16 bytes: bf16
  // weight and grad, f32 master and 2 moments (the f32-kept weights have no master).
  l.state_bytes_per_rank = 16.0 * static_cast<double>(l.params_per_rank);
  const bool mixed_precision = config.get_string("train.dtype") == "bf16";
  l.activation_bytes_per_rank =
      static_cast<double>(l.batch_size * l.seq_len) * model->activation_bytes_per_token(mixed_precision);
  for (int64_t length : {1024, 8192, 65536}) l.decode_cache_bytes[length] = model->decode_cache_bytes(length);
  return l;
}

std::string ledger_text(const Ledger& l) {
  std::string out = fmt::format("model {}: {}\n", l.arch, l.description);
  for (const auto& [group, n] : l.components)
    out += fmt::format("  {:<16} {:>20} ({:5.1f}%)\n", group, with_commas(n),
                       100.0 * static_cast<double>(n) / static_cast<double>(l.total));
  out += fmt::format("  {:<16} {:>20}\n", "total", with_commas(l.total));
  out += fmt::format("  {:<16} {:>20}  (per token; no input embedding table unless tied)\n", "active",
                     with_commas(l.active));
  out += fmt::format("training FLOPs/token at seq_len {}: {:.4g}\n", l.seq_len, l.flops_per_token);
  out += fmt::format("per rank (dp {} x ep {}): {} parameters, {} weights+grads+AdamW (fp32), ~{} activations "
                     "per micro-batch of {} x {}\n",
                     l.layout.dp, l.layout.ep, with_commas(l.params_per_rank), human_bytes(l.state_bytes_per_rank),
                     human_bytes(l.activation_bytes_per_rank), l.batch_size, l.seq_len);
  std::string cache;
  for (const auto& [length, bytes] : l.decode_cache_bytes)
    cache += fmt::format("{}T={}: {}", cache.empty() ? "" : ", ", length, human_bytes(static_cast<double>(bytes)));
  out += fmt::format("decode cache per sequence: {}\n", cache);
  return out;
}

std::string ledger_json(const Ledger& l) {
  nlohmann::json j = {{"arch", l.arch},
                      {"description", l.description},
                      {"components", l.components},
                      {"total", l.total},
                      {"active", l.active},
                      {"flops_per_token", l.flops_per_token},
                      {"seq_len", l.seq_len},
                      {"batch_size", l.batch_size},
                      {"dp", l.layout.dp},
                      {"ep", l.layout.ep},
                      {"params_per_rank", l.params_per_rank},
                      {"state_bytes_per_rank", l.state_bytes_per_rank},
                      {"activation_bytes_per_rank", l.activation_bytes_per_rank}};
  for (const auto& [length, bytes] : l.decode_cache_bytes) j["decode_cache_bytes"][std::to_string(length)] = bytes;
  return j.dump(2);
}

}  // namespace moetrain
