// Thread pinning (backend/cpu/parallel.h): each OpenMP thread ends up on the one
// CPU pin_threads() reports, distinct CPUs while there are enough; the variable
// that turns it on is checked.
#include <catch2/catch.hpp>

#include <sched.h>

#include <set>
#include <string>
#include <vector>

#include "backend/cpu/parallel.h"
#include "testing.h"

using namespace moetrain;

TEST_CASE("threads: pin_threads puts each OpenMP thread on its own CPU", "[backend][threads]") {
  cpu_set_t original;
  REQUIRE(sched_getaffinity(0, sizeof(original), &original) == 0);
  const int n = cpu::num_threads();
  std::vector<int> chosen = cpu::pin_threads();
  REQUIRE(static_cast<int>(chosen.size()) == n);
  std::vector<int> seen(static_cast<size_t>(n), -2);
#pragma omp parallel num_threads(n)
  {
    cpu_set_t now;
    if (sched_getaffinity(0, sizeof(now), &now) == 0 && CPU_COUNT(&now) == 1)
      for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &now)) seen[static_cast<size_t>(omp_get_thread_num())] = c;
  }
  CHECK(seen == chosen);
  for (int c : chosen) CHECK(CPU_ISSET(c, &original));
  if (n <= CPU_COUNT(&original)) CHECK(std::set<int>(chosen.begin(), chosen.end()).size() == chosen.size());
  // Unpin again for the tests that follow.
#pragma omp parallel num_threads(n)
  sched_setaffinity(0, sizeof(original), &original);
}

TEST_CASE("threads: MOETRAIN_PIN_THREADS must be 0 or 1", "[backend][threads]") {
  auto bad = moetrain::testing::capture_command("MOETRAIN_PIN_THREADS=yes " + std::string(MOETRAIN_BINARY_DIR) +
                                                "/moetrain info");
  CHECK(bad.code != 0);
  CHECK_THAT(bad.output, Catch::Contains("MOETRAIN_PIN_THREADS=yes"));
  auto ok = moetrain::testing::capture_command("MOETRAIN_PIN_THREADS=1 " + std::string(MOETRAIN_BINARY_DIR) +
                                               "/moetrain info");
  CHECK(ok.code == 0);
}

TEST_CASE("threads: the CLI restarts itself with a short OpenMP spin unless the user chose one",
          "[backend][threads]") {
  const std::string bin = std::string(MOETRAIN_BINARY_DIR) + "/moetrain info";
  auto plain = moetrain::testing::capture_command("env -u GOMP_SPINCOUNT -u OMP_WAIT_POLICY " + bin);
  REQUIRE(plain.code == 0);
  CHECK_THAT(plain.output, Catch::Contains(std::string("openmp      GOMP_SPINCOUNT=") + cpu::kDefaultSpinCount));
  auto chosen = moetrain::testing::capture_command("env -u OMP_WAIT_POLICY GOMP_SPINCOUNT=300000 " + bin);
  CHECK_THAT(chosen.output, Catch::Contains("openmp      GOMP_SPINCOUNT=300000"));
  auto policy = moetrain::testing::capture_command("env -u GOMP_SPINCOUNT OMP_WAIT_POLICY=passive " + bin);
  CHECK_THAT(policy.output, Catch::Contains("openmp      OMP_WAIT_POLICY=passive"));
  // The arguments survive the restart.
  auto args = moetrain::testing::capture_command("env -u GOMP_SPINCOUNT -u OMP_WAIT_POLICY " +
                                                 std::string(MOETRAIN_BINARY_DIR) + "/moetrain info --bogus");
  CHECK(args.code != 0);
  CHECK_THAT(args.output, Catch::Contains("--bogus"));
}
