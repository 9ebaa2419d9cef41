// The parameter / FLOP / memory ledger of a model config (`moetrain ledger`).
// Counts come from the model's own construction code run on shapes only
// (ParamFactory without allocation), so any size is counted in a second.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace moetrain {

class Config;

struct LedgerLayout {
  int64_t dp = 1;  // data-parallel replicas
  int64_t ep = 1;  // expert-parallel ranks (routed experts sharded over them)
};

struct Ledger {
  std::string arch, description;
  std::map<std::string, int64_t> components;  // parameters per component (group)
  int64_t total = 0;
  int64_t active = 0;  // per token: routed experts at top_k / num_experts, no input embedding table (unless tied)
  double flops_per_token = 0;  // training (forward + backward) at seq_len
  int64_t seq_len = 0, batch_size = 0;
  LedgerLayout layout;
  int64_t params_per_rank = 0;  // replicated parameters + this rank's expert shard
  double state_bytes_per_rank = 0;        // weights + gradients + AdamW moments (fp32)
  double activation_bytes_per_rank = 0;   // one micro-batch of batch_size x seq_len (estimate)
  // Decoding cache of one sequence at lengths 1k, 8k and 64k (the model's dtype):
  // KV caches grow with the length, recurrent states do not.
  std::map<int64_t, int64_t> decode_cache_bytes;
};

// Throws ConfigError (naming the key) when the layout does not fit the config.
Ledger make_ledger(const Config& config, LedgerLayout layout);
std::string ledger_text(const Ledger& ledger);
std::string ledger_json(const Ledger& ledger);

}  // namespace moetrain
