// Pipeline orders and their lock-step timeline (nn/pipeline_schedule.h;
// docs/parallelism.md#interleaved-virtual-stages).
#include "nn/pipeline_schedule.h"

#include <algorithm>

#include "core/error.h"

namespace moetrain {

std::vector<PipelineAction> pipeline_actions(int64_t pp, int64_t V, int64_t M, int64_t rank) {
  MT_CHECK(pp >= 1 && V >= 1 && M >= 1 && rank >= 0 && rank < pp,
           "pipeline schedule: rank {} of pp {}, {} chunks, {} micro-batches", rank, pp, V, M);
  MT_CHECK(V == 1 || M % pp == 0,
           "pipeline schedule: {} virtual stages per rank need the micro-batches ({}) to be a multiple of pp = {}", V,
           M, pp);
  using K = PipelineAction::Kind;
  const int64_t total = M * V;
  // The k-th forward and backward of this rank.
  auto forward = [&](int64_t k) -> PipelineAction {
    if (V == 1) return {K::forward, k, 0};
    return {K::forward, (k / (pp * V)) * pp + k % pp, (k / pp) % V};
  };
  auto backward = [&](int64_t k) -> PipelineAction {
    if (V == 1) return {K::backward, k, 0};
    return {K::backward, (k / (pp * V)) * pp + k % pp, V - 1 - (k / pp) % V};
  };
  const int64_t warmup = std::min(V == 1 ? pp - rank - 1 : (pp - rank - 1) * 2 + (V - 1) * pp, total);
  std::vector<PipelineAction> out;
  out.reserve(static_cast<size_t>(2 * total));
  for (int64_t k = 0; k < warmup; ++k) out.push_back(forward(k));
  for (int64_t k = 0; k < total - warmup; ++k) {
    out.push_back(forward(warmup + k));
    out.push_back(backward(k));
  }
  for (int64_t k = total - warmup; k < total; ++k) out.push_back(backward(k));
  return out;
}

double pipeline_peak_in_flight(const std::vector<PipelineAction>& actions, const std::vector<double>& chunk_bytes) {
  double now = 0, peak = 0;
  for (const PipelineAction& a : actions) {
    MT_CHECK(a.chunk >= 0 && a.chunk < static_cast<int64_t>(chunk_bytes.size()),
             "pipeline schedule: chunk {} of {}", a.chunk, chunk_bytes.size());
    const double b = chunk_bytes[static_cast<size_t>(a.chunk)];
    now += a.kind == PipelineAction::Kind::forward ? b : -b;
    peak = std::max(peak, now);
  }
  return peak;
}

int64_t pipeline_max_in_flight(const std::vector<PipelineAction>& actions) {
  int64_t chunks = 1;
  for (const PipelineAction& a : actions) chunks = std::max(chunks, a.chunk + 1);
  return static_cast<int64_t>(pipeline_peak_in_flight(actions, std::vector<double>(static_cast<size_t>(chunks), 1.0)));
}

PipelineTimeline pipeline_timeline(int64_t pp, int64_t V, int64_t M, int64_t backward_cost) {
  MT_CHECK(backward_cost >= 1, "pipeline schedule: backward cost {}", backward_cost);
  using K = PipelineAction::Kind;
  const int64_t S = pp * V;
  std::vector<std::vector<PipelineAction>> order(static_cast<size_t>(pp));
  for (int64_t r = 0; r < pp; ++r) order[static_cast<size_t>(r)] = pipeline_actions(pp, V, M, r);
  // end[(kind, m, virtual stage)]: when that action finished (-1: not yet placed).
  auto key = [&](K kind, int64_t m, int64_t g) {
    return static_cast<size_t>(((kind == K::forward ? 0 : 1) * M + m) * S + g);
  };
  std::vector<int64_t> end(static_cast<size_t>(2 * M * S), -1);
  std::vector<std::vector<int64_t>> start(static_cast<size_t>(pp));
  std::vector<int64_t> free_at(static_cast<size_t>(pp), 0);
  std::vector<size_t> next(static_cast<size_t>(pp), 0);
  // Place every rank's next action as soon as what it consumes has been placed.
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t r = 0; r < pp; ++r) {
      const auto& acts = order[static_cast<size_t>(r)];
      size_t& i = next[static_cast<size_t>(r)];
      while (i < acts.size()) {
        const PipelineAction& a = acts[i];
        const int64_t g = a.chunk * pp + r;
        int64_t ready = free_at[static_cast<size_t>(r)];
        if (a.kind == K::forward && g > 0) {
          const int64_t e = end[key(K::forward, a.micro, g - 1)];
          if (e < 0) break;
          ready = std::max(ready, e);
        }
        if (a.kind == K::backward) {
          const int64_t e = g < S - 1 ? end[key(K::backward, a.micro, g + 1)] : end[key(K::forward, a.micro, g)];
          if (e < 0 || end[key(K::forward, a.micro, g)] < 0) break;
          ready = std::max(ready, e);
        }
        const int64_t cost = a.kind == K::forward ? 1 : backward_cost;
        start[static_cast<size_t>(r)].push_back(ready);
        end[key(a.kind, a.micro, g)] = ready + cost;
        free_at[static_cast<size_t>(r)] = ready + cost;
        ++i;
        progress = true;
      }
    }
  }
  PipelineTimeline tl;
  int64_t busy = 0;
  for (int64_t r = 0; r < pp; ++r) {
    MT_ASSERT(next[static_cast<size_t>(r)] == order[static_cast<size_t>(r)].size(),
              "pipeline schedule (pp {}, V {}, M {}): rank {} stops after {} of its {} actions", pp, V, M, r,
              next[static_cast<size_t>(r)], order[static_cast<size_t>(r)].size());
    tl.ticks = std::max(tl.ticks, free_at[static_cast<size_t>(r)]);
    busy += M * V * (1 + backward_cost);
  }
  tl.bubble = 1.0 - static_cast<double>(busy) / static_cast<double>(tl.ticks * pp);
  tl.ranks.assign(static_cast<size_t>(pp), std::vector<PipelineTick>(static_cast<size_t>(tl.ticks)));
  for (int64_t r = 0; r < pp; ++r) {
    const auto& acts = order[static_cast<size_t>(r)];
    for (size_t i = 0; i < acts.size(); ++i) {
      const PipelineAction& a = acts[i];
      // Its messages leave in the tick it ends in (its last tick).
      const int64_t t0 = start[static_cast<size_t>(r)][i];
      const int64_t t = t0 + (a.kind == K::forward ? 1 : backward_cost) - 1;
      PipelineTick& tick = tl.ranks[static_cast<size_t>(r)][static_cast<size_t>(t0)];
      tick.has_action = true;
      tick.action = a;
      const int64_t g = a.chunk * pp + r;
      const int64_t to = a.kind == K::forward ? g + 1 : g - 1;
      if (to < 0 || to >= S) continue;
      const int peer = static_cast<int>(to % pp);
      const bool gradient = a.kind == K::backward;
      tl.ranks[static_cast<size_t>(r)][static_cast<size_t>(t)].sends.push_back({gradient, a.micro, to / pp, peer});
      tl.ranks[static_cast<size_t>(peer)][static_cast<size_t>(t)].recvs.push_back(
          {gradient, a.micro, to / pp, static_cast<int>(r)});
    }
  }
  return tl;
}

double pipeline_bubble_model(int64_t pp, int64_t V, int64_t M) {
  return static_cast<double>(pp - 1) / static_cast<double>(V * M + pp - 1);
}

}  // namespace moetrain
