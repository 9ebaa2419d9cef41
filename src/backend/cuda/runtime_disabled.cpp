// The CUDA runtime entry points of a build without the CUDA backend
// (MOETRAIN_CUDA=OFF or no nvcc found): asking for a GPU is a user error.
#include "backend/cuda/runtime.h"

#include "core/error.h"

namespace moetrain::cuda {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  MT_THROW("{}: this moetrain was built without CUDA; rebuild with the CUDA toolkit installed "
           "(cmake -DMOETRAIN_CUDA=ON) to use cuda devices", what);
}
}  // namespace

bool built_with_cuda() { return false; }
int device_count() { return 0; }
std::string device_name(int) { no_cuda("device_name"); }
void* device_malloc(int64_t, int) { no_cuda("allocating a cuda tensor"); }
void device_free(void*, int) {}
void copy_host_to_device(void*, const void*, int64_t, int) { no_cuda("copy to cuda"); }
void copy_device_to_host(void*, const void*, int64_t, int) { no_cuda("copy from cuda"); }
void copy_device_to_device(void*, const void*, int64_t, int) { no_cuda("copy on cuda"); }

}  // namespace moetrain::cuda
