// train.profile: a K3-shaped run prints the time per component after its steps.
#include <catch2/catch.hpp>

#include <regex>
#include <string>

#include "testing.h"

using moetrain::testing::TempDir;
using std::string;

TEST_CASE("cli: train.profile prints the time per step of each component", "[cli][profile]") {
  TempDir tmp;
  const string source = MOETRAIN_SOURCE_DIR;
  const string args = "train -c " + source + "/configs/evolution/07-k3.yaml --set run.dir=" + tmp.path() +
                      "/run --set data.synthetic=repeated_key --set data.synthetic_num_pairs=6 "
                      "--set data.synthetic_num_queries=3 --set data.synthetic_num_rebinds=3 --set train.seq_len=17 "
                      "--set train.batch_size=4 --set train.max_steps=4 --set train.eval_every=0 "
                      "--set train.threads=1 --set train.profile=true";
  auto run = moetrain::testing::run_moetrain(args);
  INFO(run.output);
  REQUIRE(run.code == 0);
  CHECK(run.output.find("time per step by component (train.profile; this rank, mean of 3 steps after the first)") !=
        string::npos);
  // Every component of a K3 layer stack appears with a time, and the shares add up.
  double share_sum = 0;
  for (const char* component : {"kda", "mla", "moe", "ffn", "attnres", "embedding/head", "optimizer", "update check", "data",
                                "grad sync\\+clip", "autograd", "other"}) {
    std::smatch m;
    const std::regex row(string("\\n.*  ") + component + " +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+)%");
    INFO(component);
    REQUIRE(std::regex_search(run.output, m, row));
    CHECK(std::stod(m[3]) >= 0);
    share_sum += std::stod(m[4]);
  }
  CHECK(share_sum > 99.4);
  CHECK(share_sum < 100.6);
  // The layers' work is most of it.
  std::smatch kda;
  REQUIRE(std::regex_search(run.output, kda, std::regex("\\n.*  kda +[0-9.]+ +[0-9.]+ +([0-9.]+)")));
  CHECK(std::stod(kda[1]) > 0);
  // And the kernel launches per step (core/launch_count.h): every profiled step runs the
  // same kernels, so a whole mean, and more than a handful.
  std::smatch launches;
  REQUIRE(std::regex_search(run.output, launches,
                            std::regex("launches per step \\(train\\.profile; this rank, mean of 3 steps\\): "
                                       "([0-9]+) CPU kernel calls")));
  CHECK(std::stoll(launches[1]) > 100);

  auto off = moetrain::testing::run_moetrain(args + " --set train.profile=false --set run.dir=" + tmp.path() + "/b");
  CHECK(off.code == 0);
  CHECK(off.output.find("by component") == string::npos);
}
