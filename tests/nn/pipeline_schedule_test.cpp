// The pipeline orders and their lock-step timeline (nn/pipeline_schedule.h,
// issue 37): every rank runs each (micro-batch, chunk) forward and backward once,
// every message is sent and received in the same tick and used later, 1F1B's
// memory bound holds, and the modelled bubble is (pp - 1) / (V M + pp - 1).
#include <catch2/catch.hpp>

#include <map>
#include <set>
#include <tuple>

#include "nn/pipeline_schedule.h"

using namespace moetrain;
using K = PipelineAction::Kind;

TEST_CASE("pipeline schedule: the plain 1F1B order (one chunk)", "[nn][pipeline]") {
  // pp 4, M 6, rank 1: 2 forwards, then F B alternating, then the 2 last backwards.
  const std::vector<PipelineAction> a = pipeline_actions(4, 1, 6, 1);
  const std::vector<PipelineAction> want = {{K::forward, 0, 0},  {K::forward, 1, 0},  {K::forward, 2, 0},
                                            {K::backward, 0, 0}, {K::forward, 3, 0},  {K::backward, 1, 0},
                                            {K::forward, 4, 0},  {K::backward, 2, 0}, {K::forward, 5, 0},
                                            {K::backward, 3, 0}, {K::backward, 4, 0}, {K::backward, 5, 0}};
  CHECK(a == want);
  for (int64_t pp : {1, 2, 3, 5})
    for (int64_t M : {1, 2, 7})
      for (int64_t r = 0; r < pp; ++r) CHECK(pipeline_max_in_flight(pipeline_actions(pp, 1, M, r)) == std::min(pp - r, M));
}

TEST_CASE("pipeline schedule: the interleaved order (Megatron-LM's, by hand)", "[nn][pipeline]") {
  // pp 2, V 2, M 4, rank 0: warmup (2 - 0 - 1) 2 + (2 - 1) 2 = 4 forwards: micro-batches 0, 1 through
  // chunk 0, then 0, 1 through chunk 1; then forward k and backward k - 4 alternate; backwards go
  // from the last chunk down in the same groups of pp.
  const std::vector<PipelineAction> a = pipeline_actions(2, 2, 4, 0);
  const std::vector<PipelineAction> want = {
      {K::forward, 0, 0},  {K::forward, 1, 0},  {K::forward, 0, 1},  {K::forward, 1, 1},
      {K::forward, 2, 0},  {K::backward, 0, 1}, {K::forward, 3, 0},  {K::backward, 1, 1},
      {K::forward, 2, 1},  {K::backward, 0, 0}, {K::forward, 3, 1},  {K::backward, 1, 0},
      {K::backward, 2, 1}, {K::backward, 3, 1}, {K::backward, 2, 0}, {K::backward, 3, 0}};
  CHECK(a == want);
  CHECK(pipeline_max_in_flight(a) == 5);
  // Rank 1: warmup 0 2 + 2 = 2.
  CHECK(pipeline_actions(2, 2, 4, 1).front() == PipelineAction{K::forward, 0, 0});
  CHECK(pipeline_actions(2, 2, 4, 1)[2] == PipelineAction{K::forward, 0, 1});
  CHECK(pipeline_actions(2, 2, 4, 1)[3] == PipelineAction{K::backward, 0, 1});
  CHECK_THROWS_WITH(pipeline_actions(2, 2, 3, 0), Catch::Contains("multiple of pp = 2"));
}

TEST_CASE("pipeline schedule: every timeline is complete, causal and paired", "[nn][pipeline]") {
  for (int64_t pp : {1, 2, 3, 4, 8})
    for (int64_t V : {1, 2, 3, 4})
      for (int64_t groups : {1, 2, 3}) {
        const int64_t M = V == 1 ? groups + pp - 1 : groups * pp;
        INFO("pp " << pp << " V " << V << " M " << M);
        const PipelineTimeline tl = pipeline_timeline(pp, V, M);
        REQUIRE(static_cast<int64_t>(tl.ranks.size()) == pp);
        const int64_t S = pp * V;
        // When each (kind, micro-batch, virtual stage) ran; each exactly once.
        std::map<std::tuple<bool, int64_t, int64_t>, int64_t> ran;
        std::multiset<std::tuple<int64_t, int64_t, int, bool, int64_t, int64_t>> sent, received;  // tick, from, to, ...
        for (int64_t r = 0; r < pp; ++r) {
          const auto& ticks = tl.ranks[static_cast<size_t>(r)];
          REQUIRE(static_cast<int64_t>(ticks.size()) == tl.ticks);
          for (int64_t t = 0; t < tl.ticks; ++t) {
            const PipelineTick& tick = ticks[static_cast<size_t>(t)];
            if (tick.has_action) {
              const int64_t g = tick.action.chunk * pp + r;
              CHECK(ran.emplace(std::tuple{tick.action.kind == K::backward, tick.action.micro, g}, t).second);
            }
            CHECK(tick.sends.size() <= 1);
            std::set<int> from;
            for (const PipelineMessage& m : tick.recvs) CHECK(from.insert(m.peer).second);  // one per peer
            for (const PipelineMessage& m : tick.sends)
              sent.insert({t, r, m.peer, m.gradient, m.micro, m.chunk});
            for (const PipelineMessage& m : tick.recvs)
              received.insert({t, m.peer, static_cast<int>(r), m.gradient, m.micro, m.chunk});
          }
        }
        CHECK(static_cast<int64_t>(ran.size()) == 2 * M * S);
        CHECK(sent == received);
        CHECK(static_cast<int64_t>(sent.size()) == 2 * M * (S - 1));
        for (int64_t m = 0; m < M; ++m)
          for (int64_t g = 0; g < S; ++g) {
            const int64_t f = ran.at({false, m, g}), b = ran.at({true, m, g});
            CHECK(f < b);
            if (g > 0) CHECK(ran.at({false, m, g - 1}) < f);  // its input arrived in an earlier tick
            if (g < S - 1) CHECK(ran.at({true, m, g + 1}) < b);
          }
      }
}

TEST_CASE("pipeline schedule: the modelled bubble is (pp - 1) / (V M + pp - 1)", "[nn][pipeline]") {
  // A backward twice a forward (the usual model); the timeline's idle share is the analytic one.
  for (int64_t pp : {2, 4})
    for (int64_t V : {1, 2, 4})
      for (int64_t M : {pp, 2 * pp, 4 * pp}) {
        INFO("pp " << pp << " V " << V << " M " << M);
        const PipelineTimeline tl = pipeline_timeline(pp, V, M, 2);
        CHECK(tl.bubble == Approx(pipeline_bubble_model(pp, V, M)).epsilon(1e-12));
      }
  CHECK(pipeline_bubble_model(4, 1, 8) == Approx(3.0 / 11.0));
  CHECK(pipeline_bubble_model(4, 2, 8) == Approx(3.0 / 19.0));
}
