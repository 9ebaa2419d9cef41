// evaluate_answers on synthetic memory tasks, scored with oracle "models" written
// here: each reads its input row and puts all its logit mass on the value that a
// rule picks (the latest binding of the queried key, or the first one), so the
// expected accuracies follow from the rule, not from the code under test.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>

#include "data/synthetic.h"
#include "nn/language_model.h"
#include "train/eval.h"

using namespace moetrain;
using namespace moetrain::data;

namespace {

class OracleModel : public LanguageModel {
 public:
  OracleModel(const SyntheticOptions& o, bool latest) : o_(o), latest_(latest) {}
  std::string arch() const override { return "oracle"; }
  std::string describe() const override { return "oracle"; }
  int64_t vocab_size() const override { return o_.vocab_size(); }
  int64_t max_positions() const override { return 1 << 20; }
  DType dtype() const override { return DType::f64; }
  // Logit 10 on the bound value of the key at each position (the latest or first
  // binding earlier in the row, cleared by a switch), else on kUnknownToken.
  Tensor forward(const Tensor& ids, bool) override {
    const int64_t B = ids.size(0), T = ids.size(1), V = vocab_size();
    Tensor logits = zeros({B, T, V}, DType::f64);
    double* l = logits.data<double>();
    const int32_t* x = ids.data<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      std::map<int32_t, int32_t> bound;
      for (int64_t t = 0; t < T; ++t) {
        const int32_t tok = x[b * T + t];
        if (tok == kSwitchToken) bound.clear();
        const bool is_key = tok >= 2 && tok < 2 + o_.num_keys;
        int32_t guess = kUnknownToken;
        if (is_key && bound.count(tok)) guess = bound[tok];
        l[(b * T + t) * V + guess] = 10.0;
        if (is_key && t + 1 < T && (latest_ || !bound.count(tok))) bound[tok] = x[b * T + t + 1];
      }
    }
    return logits;
  }
  std::unique_ptr<DecodeCache> new_cache() const override { return nullptr; }
  Tensor forward_cached(const Tensor& ids, DecodeCache&) override { return forward(ids, false); }
  ParameterList& parameters() override { return params_; }
  double flops_per_token(int64_t) const override { return 0; }
  double activation_bytes_per_token(bool) const override { return 0; }
  int64_t decode_cache_bytes(int64_t) const override { return 0; }

 private:
  SyntheticOptions o_;
  bool latest_;
  ParameterList params_;
};

SyntheticOptions task(SyntheticTask t) {
  SyntheticOptions o;
  o.task = t;
  o.num_keys = 16;
  o.num_values = 8;
  o.num_pairs = 6;
  o.num_queries = 3;
  o.num_rebinds = 3;
  return o;
}

}  // namespace

TEST_CASE("evaluate_answers: accuracy and loss at the answer positions only", "[train][eval]") {
  for (SyntheticTask t : {SyntheticTask::assoc_recall, SyntheticTask::repeated_key, SyntheticTask::context_switch}) {
    INFO(synthetic_task_name(t));
    const SyntheticOptions o = task(t);
    OracleModel latest(o, true), first(o, false);
    AnswerScore a = evaluate_answers(latest, o, 4, 3, 7);
    CHECK(a.answers == 4 * 3 * o.num_queries);
    CHECK(a.accuracy == 1.0);
    // Loss of a logit 10 on the answer against 0 elsewhere: log(e^10 + V - 1) - 10.
    CHECK(a.loss == Approx(std::log(std::exp(10.0) + static_cast<double>(o.vocab_size() - 1)) - 10.0));
    AnswerScore f = evaluate_answers(first, o, 4, 3, 7);
    // Every repeated_key query asks a rebound key: the first binding is always wrong.
    if (t == SyntheticTask::repeated_key) CHECK(f.accuracy == 0.0);
    if (t == SyntheticTask::assoc_recall) CHECK(f.accuracy == 1.0);  // keys are bound once
  }
}
