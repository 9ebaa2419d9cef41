// device_fault_message (backend/cuda/launch_check.h): what the CUDA allocator reports
// when cudaMalloc or cudaMemGetInfo fails with a sticky error left by an earlier
// kernel. Plain C++: runs without a GPU.
#include <string>

#include <catch2/catch.hpp>

#include "backend/cuda/launch_check.h"

using moetrain::cuda::device_fault_message;

TEST_CASE("cuda device fault: a sticky error is named, with the last kernel, and not called out of memory",
          "[backend][cuda_launch]") {
  const std::string m = device_fault_message("cudaErrorIllegalAddress", "an illegal memory access was encountered",
                                             700, "allocating 4096 bytes on cuda:0", "softmax_forward_kernel");
  CHECK(m.find("cudaErrorIllegalAddress") != std::string::npos);
  CHECK(m.find("an illegal memory access was encountered") != std::string::npos);
  CHECK(m.find("code 700") != std::string::npos);
  CHECK(m.find("allocating 4096 bytes on cuda:0") != std::string::npos);
  CHECK(m.find("The last kernel launched: softmax_forward_kernel") != std::string::npos);
  CHECK(m.find("not out of memory") != std::string::npos);
  CHECK(m.find("CUDA out of memory") == std::string::npos);
  CHECK(m.find("launch/gpu-recheck.sh") != std::string::npos);
}

TEST_CASE("cuda device fault: before any launch through cuda::launch the message says so", "[backend][cuda_launch]") {
  const std::string m = device_fault_message("cudaErrorLaunchFailure", "unspecified launch failure", 719,
                                             "asking cuda:1 for its free memory", nullptr);
  CHECK(m.find("cudaErrorLaunchFailure") != std::string::npos);
  CHECK(m.find("asking cuda:1 for its free memory") != std::string::npos);
  CHECK(m.find("The last kernel launched: none through cuda::launch") != std::string::npos);
}
