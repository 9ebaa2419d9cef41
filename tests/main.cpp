// Catch2 runner: OpenMP spin and thread count set the way the CLI does before any test.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "backend/cpu/parallel.h"

int main(int argc, char** argv) {
  moetrain::cpu::reexec_with_short_spin(argv);
  moetrain::cpu::init_threads();
  return Catch::Session().run(argc, argv);
}
