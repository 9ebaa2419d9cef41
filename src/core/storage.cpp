#include "core/storage.h"

#include <sys/mman.h>

#include <cstdlib>

#include "backend/cuda/runtime.h"
#include "core/error.h"

namespace moetrain {

namespace {
constexpr int64_t kAlign = 64;                   // cache line / AVX-512 vector
constexpr int64_t kHugePage = 2 << 20;           // transparent huge page
constexpr int64_t kHugeThreshold = 4 * kHugePage;  // large buffers: fewer page faults
}  // namespace

Storage::Storage(int64_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  MT_ASSERT(nbytes >= 0, "negative allocation of {} bytes", nbytes);
  if (nbytes == 0) return;
  if (device.is_cuda()) {
    data_ = cuda::device_malloc(nbytes, device.index);
    return;
  }
  int64_t align = nbytes >= kHugeThreshold ? kHugePage : kAlign;
  int64_t rounded = (nbytes + align - 1) / align * align;
  data_ = std::aligned_alloc(static_cast<size_t>(align), static_cast<size_t>(rounded));
  MT_CHECK(data_ != nullptr, "out of host memory: failed to allocate {} bytes ({:.1f} MiB)", nbytes,
           nbytes / 1048576.0);
  if (align == kHugePage) madvise(data_, static_cast<size_t>(rounded), MADV_HUGEPAGE);  // a hint; failure is harmless
}

Storage::~Storage() {
  if (!data_) return;
  if (device_.is_cuda()) cuda::device_free(data_, device_.index);
  else std::free(data_);
}

}  // namespace moetrain
