// train.zero 1, the distributed optimizer (docs/parallelism.md, "Distributed
// optimizer"), against train.zero 0 in-process: the Trainer driven step by step
// on every rank, once with each setting, and the parameters compared element by
// element. Under mpirun (comm_mpi_np2 / np4) the world is 2 or 4 ranks (4: dp 2 x
// ep 2 of a small k3 model); run by one process, zero 1 has nothing to shard and
// the cases check that it changes nothing. Gradient clipping is active (the
// limit is below every step's norm).
//
// What is bitwise (docs/parallelism.md): with replica groups of at most two ranks
// every sum is a + b whichever collective adds it, and the norm is the same fold,
// so zero 1 gives zero 0's parameters bit for bit, f64 and f32. A group of four
// (the world at dp 2 x ep 2) is summed by MPI_Reduce_scatter at zero 1 and by
// MPI_Allreduce at zero 0, which add the four in different trees: the parameters
// then agree to rounding (bounds below); with train.overlap_grad_sync both use
// the same all-reduces, and zero 1 is bitwise again. A NaN gradient and an
// overflowing update skip the step on every rank at zero 1 as at zero 0.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <regex>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "testing.h"
#include "train/trainer.h"

using namespace moetrain;
using moetrain::testing::TempDir;
using std::string;

namespace {

struct ZeroRun {
  std::vector<Tensor> params;  // after the last step, on the CPU
  std::vector<double> losses, norms;
  std::vector<string> skipped;  // per step: why it was skipped, or ""

  int64_t state_bytes = 0;     // this rank's AdamW moments
  int64_t replicated_numel = 0, expert_numel = 0;  // this rank's parameters
};

// A small k3 (4 layers: KDA and MLA, latent MoE with 16 experts top 4, AttnRes
// blocks of 2) on tinyshakespeare bytes, `steps` steps of 2 x 16 tokens per rank.
ZeroRun train_zero(const string& dir, int zero, const string& dtype, int ep, bool overlap, int steps = 4,
                   const std::vector<string>& extra = {}) {
  std::vector<string> sets = {
      "data.train=" + dir + "/data/train_*.bin", "data.val=", "train.max_steps=" + std::to_string(steps),
      "train.warmup_steps=1", "train.batch_size=2", "train.seq_len=16", "train.eval_every=0", "train.threads=1",
      "train.log_every=100", "train.peak_tflops=1", "model.n_layer=4", "model.attn_res_block_size=2", "ckpt.every=0",
      "train.grad_clip=0.05", "train.dtype=" + dtype, "train.ep=" + std::to_string(ep),
      "train.zero=" + std::to_string(zero), "train.overlap_grad_sync=" + string(overlap ? "true" : "false"),
      "run.dir=" + dir + "/run_zero" + std::to_string(zero) + dtype + (overlap ? "_overlap" : "")};
  sets.insert(sets.end(), extra.begin(), extra.end());
  Config config = Config::load(string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml", sets);
  ZeroRun out;
  Trainer trainer(config);
  trainer.resume();
  while (!trainer.done()) {
    const StepResult r = trainer.train_step();
    out.skipped.push_back(r.skipped ? r.skip_reason : "");
    out.losses.push_back(r.loss);
    out.norms.push_back(r.grad_norm);
  }
  for (const NamedParameter& p : trainer.model().parameters()) {
    out.params.push_back(p.tensor.detach().to(kCpu).clone());
    (p.group == "experts" ? out.expert_numel : out.replicated_numel) += p.tensor.numel();
  }
  out.state_bytes = trainer.optimizer().state_bytes();
  return out;
}

// Elements whose bits differ, and the worst relative difference.
std::pair<int64_t, double> compare(const ZeroRun& a, const ZeroRun& b) {
  int64_t differ = 0;
  double worst = 0;
  REQUIRE(a.params.size() == b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    REQUIRE(a.params[i].shape() == b.params[i].shape());
    const std::vector<double> x = a.params[i].to_vector(), y = b.params[i].to_vector();
    for (size_t j = 0; j < x.size(); ++j) {
      if (std::memcmp(&x[j], &y[j], sizeof(double)) != 0) ++differ;
      worst = std::max(worst, std::abs(x[j] - y[j]) / std::max(1e-3, std::abs(x[j])));
    }
  }
  return {differ, worst};
}

int world_size() { return comm::world().size(); }

// Why each step was skipped, without its numbers: which check refused it ("loss #,
// gradient norm nan"), "" for a step taken. The numbers in a reason (the loss to 17
// digits) follow the parameters: in a replica group of four they differ between
// zero 0 and zero 1 in the last digit (measured on an Intel Xeon: 6.029141353768241
// against 6.0291413537682415), so only groups of at most two compare them exactly.
std::vector<string> skip_kinds(const ZeroRun& z) {
  static const std::regex number("[-+]?[0-9]+(\\.[0-9]*)?([eE][-+]?[0-9]+)?");
  std::vector<string> kinds;
  for (const string& why : z.skipped) kinds.push_back(std::regex_replace(why, number, "#"));
  return kinds;
}

// The worst relative difference of two runs' losses (skipped steps included).
double worst_loss_difference(const ZeroRun& a, const ZeroRun& b) {
  REQUIRE(a.losses.size() == b.losses.size());
  double worst = 0;
  for (size_t i = 0; i < a.losses.size(); ++i)
    worst = std::max(worst, std::abs(a.losses[i] - b.losses[i]) / std::max(1e-3, std::abs(a.losses[i])));
  return worst;
}

}  // namespace

TEST_CASE("train.zero 1 gives the parameters of zero 0 (f64 and f32, clipping active; bitwise where the replica "
          "groups have at most 2 ranks)", "[train][mpi]") {
  TempDir tmp;
  const string dir = tmp.path();
  testing::prepare_byte_shards(dir);
  const int world = world_size();
  const int ep = world % 2 == 0 ? 2 : 1;  // 2 ranks: dp 1 x ep 2; 4 ranks: dp 2 x ep 2
  for (const string dtype : {"f64", "f32"}) {
    DYNAMIC_SECTION("dtype " << dtype << ", " << world << " rank(s), ep " << ep) {
      const ZeroRun z0 = train_zero(dir, 0, dtype, ep, false);
      const ZeroRun z1 = train_zero(dir, 1, dtype, ep, false);
      CHECK(z1.skipped == std::vector<string>(4));
      for (double n : z0.norms) CHECK(n > 0.05);  // clipping scaled every step
      const auto [differ, worst] = compare(z0, z1);
      UNSCOPED_INFO("zero 1 vs zero 0: " << differ << " elements differ, worst relative " << worst);
      if (world <= 2) {
        CHECK(differ == 0);
        CHECK(z1.losses == z0.losses);
        CHECK(z1.norms == z0.norms);
      } else {
        // A 4-rank replica group: MPI adds the four in another tree (measured: see
        // docs/parallelism.md); the difference stays at rounding.
        CHECK(worst < (dtype == "f64" ? 1e-11 : 1e-3));
      }
    }
  }
}

TEST_CASE("train.zero 1 with overlapped gradient sync gives zero 0's parameters bit for bit at any world size (f64)",
          "[train][mpi]") {
  TempDir tmp;
  const string dir = tmp.path();
  testing::prepare_byte_shards(dir);
  const int ep = world_size() % 2 == 0 ? 2 : 1;
  const ZeroRun z0 = train_zero(dir, 0, "f64", ep, true);
  const ZeroRun z1 = train_zero(dir, 1, "f64", ep, true);
  const auto [differ, worst] = compare(z0, z1);
  INFO("zero 1 vs zero 0, overlapped sums: " << differ << " elements differ, worst relative " << worst);
  CHECK(differ == 0);
  CHECK(z1.norms == z0.norms);
}

TEST_CASE("train.zero 1 holds about 1/replicas of zero 0's AdamW moments on each rank", "[train][mpi]") {
  TempDir tmp;
  const string dir = tmp.path();
  testing::prepare_byte_shards(dir);
  const int world = world_size();
  const int ep = world % 2 == 0 ? 2 : 1, dp = world / ep;
  const ZeroRun z0 = train_zero(dir, 0, "f32", ep, false, 1);
  const ZeroRun z1 = train_zero(dir, 1, "f32", ep, false, 1);
  // zero 0: two f32 moments per parameter element of this rank.
  CHECK(z0.state_bytes == 8 * (z0.replicated_numel + z0.expert_numel));
  // zero 1: replicated parameters split over the world, expert shards over dp
  // (each rank within one element of its share per group).
  // (with ep 1 the experts are replicated parameters too).
  const double want = 8.0 * (static_cast<double>(z0.replicated_numel) / world +
                             static_cast<double>(z0.expert_numel) / (ep > 1 ? dp : world));
  INFO("zero 0: " << z0.state_bytes << " bytes, zero 1: " << z1.state_bytes << " bytes, expected about " << want);
  if (world == 1) CHECK(z1.state_bytes == z0.state_bytes);
  CHECK(std::abs(static_cast<double>(z1.state_bytes) - want) <= 8.0 * 2);
}

TEST_CASE("train.zero 1 skips a step with a NaN gradient or a non-finite update on every rank, as zero 0 does",
          "[train][mpi]") {
  TempDir tmp;
  const string dir = tmp.path();
  testing::prepare_byte_shards(dir);
  const int world = world_size();
  const int ep = world % 2 == 0 ? 2 : 1;
  SECTION("a NaN in one gradient of the last rank at step 2 (fault.kind nan_grad)") {
    const std::vector<string> fault = {"fault.kind=nan_grad", "fault.step=2",
                                       "fault.rank=" + std::to_string(world - 1)};
    const ZeroRun z0 = train_zero(dir, 0, "f64", ep, false, 4, fault);
    const ZeroRun z1 = train_zero(dir, 1, "f64", ep, false, 4, fault);
    REQUIRE(z1.skipped.size() == 4);
    CHECK(z1.skipped[0].empty());
    CHECK_THAT(z1.skipped[1], Catch::Contains("gradient norm nan"));
    CHECK(z1.skipped[2].empty());
    CHECK(z1.skipped[3].empty());
    // The same steps skipped for the same reason; the numbers exactly only where
    // every sum is a + b (see skip_kinds), else to f64 rounding.
    CHECK(skip_kinds(z1) == skip_kinds(z0));
    if (world <= 2) {
      CHECK(z1.skipped == z0.skipped);
      CHECK(compare(z0, z1).first == 0);
    } else {
      CHECK(worst_loss_difference(z0, z1) < 1e-12);
      CHECK(compare(z0, z1).second < 1e-11);
    }
  }
  SECTION("an update that overflows f32 (train.lr 1e38, train.check_update)") {
    const std::vector<string> huge = {"train.lr=1e38", "train.min_lr=1e38", "train.warmup_steps=0"};
    const ZeroRun z0 = train_zero(dir, 0, "f32", ep, false, 2, huge);
    const ZeroRun z1 = train_zero(dir, 1, "f32", ep, false, 2, huge);
    // Every step skipped by the update check at both settings (the parameter the
    // reason names is the first bad one in the part a rank updates: zero 1's differs).
    for (const ZeroRun* z : {&z0, &z1}) {
      REQUIRE(z->skipped.size() == 2);
      for (const string& why : z->skipped) CHECK_THAT(why, Catch::Contains("the update (lr 1e+38) would make"));
    }
    CHECK(compare(z0, z1).first == 0);  // nothing moved, at zero 0 or 1
  }
}

TEST_CASE("train.zero 1 under pipeline parallelism gives zero 0's parameters bit for bit (pp 2, f64), and is refused "
          "with tied embeddings", "[train][mpi]") {
  const int world = world_size();
  if (world != 4) return;  // pp 2 x dp 2: stage groups of two ranks
  TempDir tmp;
  const string dir = tmp.path();
  testing::prepare_byte_shards(dir);
  const std::vector<string> pp = {"train.pp=2", "train.grad_accum=2"};
  const ZeroRun z0 = train_zero(dir, 0, "f64", 1, false, 4, pp);
  const ZeroRun z1 = train_zero(dir, 1, "f64", 1, false, 4, pp);
  CHECK(z1.skipped == std::vector<string>(4));
  for (double n : z0.norms) CHECK(n > 0.05);  // clipping scaled every step
  const auto [differ, worst] = compare(z0, z1);
  INFO("pp 2: zero 1 vs zero 0: " << differ << " elements differ, worst relative " << worst);
  CHECK(differ == 0);
  CHECK(z1.norms == z0.norms);
  CHECK(z1.state_bytes * 2 <= z0.state_bytes + 16);  // each stage's state over its 2 ranks
  std::vector<string> tied = pp;
  tied.push_back("model.tie_embeddings=true");
  CHECK_THROWS_WITH(train_zero(dir, 1, "f64", 1, false, 1, tied),
                    Catch::Contains("train.zero") && Catch::Contains("tie_embeddings"));
}
