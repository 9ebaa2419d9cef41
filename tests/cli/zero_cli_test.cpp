// train.zero 1 end to end, as a user meets it: a checkpoint written by the
// sharded optimizer on 4 ranks (dp 2 x ep 2; each rank's file holds the moments
// of the elements it owns) resumes on the same layout bit for bit, and resharded
// on one process (zero 0), on 2 ranks at zero 1 and with another ep, continuing
// the uninterrupted run's losses (f32; only summation orders differ: 1e-5
// relative, as for the EP reshard in checkpoint_cli_test.cpp); a zero 0
// checkpoint resumes at zero 1 (2 ranks: bit for bit); bad values of the key
// are refused naming it. The tiny k3 model of the other CLI tests, one thread
// per rank.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "cli_fixtures.h"
#include "testing.h"

using moetrain::testing::kLocalMpirun;
using moetrain::testing::metrics_losses;
using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

using Result = moetrain::testing::CommandOutput;

// 20 steps, a checkpoint every 10.
struct ZeroJob : moetrain::testing::TinyK3Runs {
  ZeroJob() : TinyK3Runs(20, 10, 5) {}
};

using moetrain::testing::worst_relative;

}  // namespace

TEST_CASE("cli: a train.zero 1 checkpoint from 4 ranks resumes bit for bit on 4, and resharded on 1 and 2 ranks and "
          "another ep; a zero 0 checkpoint resumes at zero 1", "[cli][slow]") {
  ZeroJob job;
  Result r = job.train(4, "ref", "--set train.ep=2 --set train.zero=1");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("train.zero 1: optimizer state on rank 0"));
  const std::vector<double> want = metrics_losses(job.dir + "/ref");
  REQUIRE(want.size() == 20);
  // The manifest: version 2, zero 1, and the pieces of every rank's file.
  const string step10 = job.dir + "/ref/checkpoints/step_00000010";
  const nlohmann::json manifest = nlohmann::json::parse(moetrain::testing::read_bytes(step10 + "/manifest.json"));
  CHECK(manifest.at("version") == 2);
  CHECK(manifest.at("zero") == 1);
  for (const nlohmann::json& f : manifest.at("files")) CHECK(f.contains("optimizer_pieces"));

  struct Layout {
    int np, ep, zero, accum;
    bool exact;
  };
  for (Layout l : {Layout{4, 2, 1, 1, true}, Layout{1, 1, 0, 4, false}, Layout{2, 2, 1, 2, false},
                   Layout{2, 1, 1, 2, false}}) {
    const string name = "np" + std::to_string(l.np) + "ep" + std::to_string(l.ep) + "zero" + std::to_string(l.zero);
    fs::copy(job.dir + "/ref", job.dir + "/" + name, fs::copy_options::recursive);
    Result res = job.train(l.np, name, "--set ckpt.resume=step_00000010 --set train.ep=" + std::to_string(l.ep) +
                                           " --set train.zero=" + std::to_string(l.zero) +
                                           " --set train.grad_accum=" + std::to_string(l.accum));
    INFO(name << "\n" << res.output);
    REQUIRE(res.code == 0);
    CHECK(res.output.find("resumed from " + job.dir + "/" + name + "/checkpoints/step_00000010 (step 10") !=
          string::npos);
    const std::vector<double> got = metrics_losses(job.dir + "/" + name);
    REQUIRE(got.size() == 20);
    if (l.exact) CHECK(got == want);
    else CHECK(worst_relative(got, want, 10) < 1e-5);
  }

  // zero 0 on 2 ranks (dp 2): its checkpoint resumed at zero 1 continues bit for bit.
  Result z0 = job.train(2, "zero0", "--set train.zero=0");
  INFO(z0.output);
  REQUIRE(z0.code == 0);
  const std::vector<double> want0 = metrics_losses(job.dir + "/zero0");
  REQUIRE(want0.size() == 20);
  fs::copy(job.dir + "/zero0", job.dir + "/zero0to1", fs::copy_options::recursive);
  Result z1 = job.train(2, "zero0to1", "--set train.zero=1 --set ckpt.resume=step_00000010");
  INFO(z1.output);
  REQUIRE(z1.code == 0);
  CHECK(metrics_losses(job.dir + "/zero0to1") == want0);
}

TEST_CASE("cli: train.zero values other than 0 and 1 are refused naming the key", "[cli]") {
  ZeroJob job;
  for (const string& bad : {string("2"), string("-1"), string("one"), string("1.5")}) {
    Result r = job.train(1, "bad", "--set train.zero=" + bad);
    INFO("train.zero=" << bad << "\n" << r.output);
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains("train.zero"));
  }
  Result two = job.train(1, "bad", "--set train.zero=2");
  CHECK_THAT(two.output, Catch::Contains("not supported yet"));
}
