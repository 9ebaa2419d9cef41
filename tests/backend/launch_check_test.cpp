// The CUDA launch limits (backend/cuda/launch_check.h), checked on the host with
// Hopper's limits (H100/H200: grid 2^31-1 x 65535 x 65535, 1024 threads, 48 KiB of
// shared memory by default, 227 KiB opted in). Every launch of the CUDA backend
// goes through cuda::launch, which calls check_launch with the device's limits.
#include <catch2/catch.hpp>

#include <string>

#include "backend/cuda/launch_check.h"
#include "core/error.h"

using namespace moetrain;
using cuda::check_launch;
using cuda::LaunchDims;

namespace {

const cuda::DeviceLaunchLimits kHopper = cuda::hopper_launch_limits();
const cuda::KernelLaunchLimits kPlain{};  // 1024 threads, no static shared memory

// The error text of a launch that must fail ("" when it passes).
std::string refusal(LaunchDims grid, LaunchDims block, int64_t shared, const cuda::KernelLaunchLimits& k = kPlain,
                    const char* what = "") {
  try {
    check_launch("test_kernel", grid, block, shared, kHopper, k, what);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("cuda launch limits: launches within Hopper's limits pass", "[backend][cuda_launch]") {
  CHECK_FALSE(check_launch("k", 1, 1, 0, kHopper, kPlain));
  CHECK_FALSE(check_launch("k", LaunchDims(2147483647), 1024, 0, kHopper, kPlain));
  CHECK_FALSE(check_launch("k", LaunchDims(1, 65535, 65535), LaunchDims(32, 32), 0, kHopper, kPlain));
  CHECK_FALSE(check_launch("k", 100, LaunchDims(16, 16, 4), 48 * 1024, kHopper, kPlain));  // 48 KiB: no opt-in
}

TEST_CASE("cuda launch limits: grid dimensions", "[backend][cuda_launch]") {
  // x beyond 2^31 - 1: the count that a cast to unsigned would have wrapped.
  const std::string x = refusal(LaunchDims(int64_t{1} << 32), 256, 0);
  CHECK(x.find("test_kernel") != std::string::npos);
  CHECK(x.find("grid.x = 4294967296") != std::string::npos);
  CHECK(x.find("1..2147483647") != std::string::npos);
  // y and z: 65535 (attention's B·H, the reduce's outer rows).
  CHECK(refusal(LaunchDims(10, 65536), 128, 0).find("grid.y = 65536 blocks, the GPU allows 1..65535") !=
        std::string::npos);
  CHECK(refusal(LaunchDims(10, 1, 70000), 128, 0).find("grid.z = 70000") != std::string::npos);
  // An empty grid is the caller's bug (it must skip the launch).
  CHECK(refusal(0, 128, 0).find("grid.x = 0") != std::string::npos);
  CHECK(refusal(LaunchDims(4, 0), 128, 0).find("grid.y = 0") != std::string::npos);
}

TEST_CASE("cuda launch limits: block dimensions and threads per block", "[backend][cuda_launch]") {
  CHECK(refusal(1, 1025, 0).find("block.x = 1025 threads, the GPU allows 1..1024") != std::string::npos);
  CHECK(refusal(1, LaunchDims(1, 1, 65), 0).find("block.z = 65") != std::string::npos);
  CHECK(refusal(1, 0, 0).find("block.x = 0") != std::string::npos);
  // Each dimension within its limit, the product beyond 1024.
  CHECK(refusal(1, LaunchDims(64, 32), 0).find("2048 threads per block, the GPU allows 1024") != std::string::npos);
  // A kernel whose registers allow only 512 threads.
  const cuda::KernelLaunchLimits heavy{512, 0};
  CHECK(refusal(1, 1024, 0, heavy).find("the compiled kernel allows 512") != std::string::npos);
  CHECK(refusal(1, 512, 0, heavy).empty());
}

TEST_CASE("cuda launch limits: shared memory and the opt-in", "[backend][cuda_launch]") {
  // Above 48 KiB (dynamic + static) the kernel must opt in; up to 227 KiB it may.
  CHECK(check_launch("k", 1, 128, 48 * 1024 + 1, kHopper, kPlain));
  CHECK(check_launch("k", 1, 128, 227 * 1024, kHopper, kPlain));
  // Static shared memory counts: 40 KiB dynamic + 16 KiB static exceeds the default.
  const cuda::KernelLaunchLimits with_static{1024, 16 * 1024};
  CHECK(check_launch("k", 1, 128, 40 * 1024, kHopper, with_static));
  CHECK_FALSE(check_launch("k", 1, 128, 32 * 1024, kHopper, with_static));
  // Beyond the opt-in limit: the error names the parts and ends with the caller's advice.
  const std::string big = refusal(1, 128, 227 * 1024 + 1, kPlain, "use smaller heads");
  CHECK(big.find("needs 232449 bytes of shared memory per block (232449 dynamic + 0 static), the GPU offers 232448; "
                 "use smaller heads") != std::string::npos);
  CHECK(refusal(1, 128, 220 * 1024, with_static).find("(225280 dynamic + 16384 static)") != std::string::npos);
  // A GPU without the opt-in (limit 48 KiB): the same request is refused.
  cuda::DeviceLaunchLimits old_gpu;
  CHECK_THROWS_WITH(check_launch("k", 1, 128, 64 * 1024, old_gpu, kPlain), Catch::Contains("the GPU offers 49152"));
}
