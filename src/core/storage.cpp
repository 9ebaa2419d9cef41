#include "core/storage.h"

#include "core/error.h"
#include "core/memory.h"

namespace moetrain {

Storage::Storage(int64_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  MT_ASSERT(nbytes >= 0, "negative allocation of {} bytes", nbytes);
  if (nbytes == 0) return;
  if (device.is_cuda()) {
    data_ = cuda::device_malloc(nbytes, device.index);
    return;
  }
  data_ = cpu::host_alloc(nbytes, &capacity_);
}

Storage::~Storage() {
  if (!data_) return;
  if (device_.is_cuda()) cuda::device_free(data_, device_.index);
  else cpu::host_free(data_, capacity_);
}

}  // namespace moetrain
