// train.optimizer (docs/training.md#optimizers): which rule updates each
// parameter, and the optimizer the trainer steps.
//   adamw  AdamW on every parameter (one AdamW: the bits of every earlier run).
//   muon   Muon on the hidden matrices (is_hidden_matrix, nn/parameters.h), AdamW
//          on the rest, chained (optim/optimizer.h); the same lr and weight decay
//          for both (Muon's update is scaled to AdamW's RMS, docs/model.md#muon).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "optim/adamw.h"
#include "optim/muon.h"
#include "optim/optimizer.h"

namespace moetrain {

struct OptimizerOptions {
  std::string kind = "adamw";  // train.optimizer: adamw | muon
  AdamWOptions adamw;
  MuonOptions muon;
};

// Whether parameter p is updated by Muon under these options.
bool uses_muon(const OptimizerOptions& options, const NamedParameter& p);
// The cost of updating p, in units of one AdamW element update (train.zero 1
// balances the ranks' shares by it): an AdamW parameter costs its element count;
// a Muon matrix [A, B] (each of E) its elements plus the Newton-Schulz flops,
// ns_steps (4 min² max + 2 min³), over 10 (an AdamW element update is about ten
// flops of memory-bound work).
double update_cost(const OptimizerOptions& options, const NamedParameter& p);

// `shard`: train.zero 1's owned ranges (one per parameter; whole or empty for
// Muon's parameters), or empty.
std::unique_ptr<Optimizer> make_optimizer(const ParameterList& params, const OptimizerOptions& options,
                                          std::vector<ElementRange> shard = {});

}  // namespace moetrain
