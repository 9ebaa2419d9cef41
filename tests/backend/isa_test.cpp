#include "backend/cpu/isa.h"

#include <catch2/catch.hpp>
#include <string>

#include "testing.h"

using namespace moetrain;

TEST_CASE("isa: MOETRAIN_ISA caps the KDA kernels' copy; MOETRAIN_GEMM=portable keeps it at AVX2", "[backend]") {
  const std::string info_cmd = std::string(MOETRAIN_BINARY_DIR) + "/moetrain info";
  const std::string cpu_isa = cpu::vector_isa_name(cpu::cpu_vector_isa());
  auto plain = moetrain::testing::capture_command("MOETRAIN_ISA= MOETRAIN_GEMM= " + info_cmd);
  REQUIRE(plain.code == 0);
  CHECK_THAT(plain.output, Catch::Contains("vector isa  " + cpu_isa + " (MOETRAIN_ISA=auto; CPU: " + cpu_isa + ")"));
  auto generic = moetrain::testing::capture_command("MOETRAIN_ISA=generic " + info_cmd);
  CHECK_THAT(generic.output, Catch::Contains("vector isa  generic (MOETRAIN_ISA=generic"));
  if (cpu::cpu_vector_isa() >= cpu::VectorIsa::avx2) {
    auto avx2 = moetrain::testing::capture_command("MOETRAIN_ISA=avx2 " + info_cmd);
    CHECK_THAT(avx2.output, Catch::Contains("vector isa  avx2 (MOETRAIN_ISA=avx2"));
    auto portable = moetrain::testing::capture_command("MOETRAIN_ISA= MOETRAIN_GEMM=portable " + info_cmd);
    if (portable.code == 0)  // needs BLIS
      CHECK_THAT(portable.output, Catch::Contains("vector isa  avx2 (MOETRAIN_ISA=auto, capped at avx2 by "
                                                  "MOETRAIN_GEMM=portable"));
  }
  auto bad = moetrain::testing::capture_command("MOETRAIN_ISA=sse9 " + info_cmd);
  CHECK(bad.code != 0);
  CHECK_THAT(bad.output, Catch::Contains("MOETRAIN_ISA=sse9") && Catch::Contains("auto, avx512, avx2, generic"));
}
