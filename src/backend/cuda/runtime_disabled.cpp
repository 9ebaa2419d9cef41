// The CUDA runtime entry points of a build without the CUDA backend
// (MOETRAIN_CUDA=OFF or no nvcc found): asking for a GPU is a user error.
#include "backend/cuda/cublas.h"
#include "backend/cuda/cublaslt.h"
#include "backend/cuda/graph.h"
#include "backend/cuda/pending_copy.h"
#include "backend/cuda/runtime.h"

#include "core/error.h"

namespace moetrain::cuda {

void no_cuda(const char* what) {
  MT_THROW("{}: this moetrain was built without CUDA; rebuild with the CUDA toolkit installed "
           "(cmake -DMOETRAIN_CUDA=ON) to use cuda devices", what);
}

bool built_with_cuda() { return false; }
int device_count() { return 0; }
std::string device_name(int) { no_cuda("device_name"); }
int select_device(int) { no_cuda("select_device"); }
void set_device(int) { no_cuda("set_device"); }
CUstream_st* stream(int) { no_cuda("stream"); }
profile::DeviceClock* event_clock(int) { no_cuda("event_clock"); }
void synchronize(int) { no_cuda("synchronize"); }
void* device_malloc(int64_t, int) { no_cuda("allocating a cuda tensor"); }
void device_free(void*, int) {}
MemoryStats memory_stats(int) { return {}; }
void empty_cache(int) {}
void copy_host_to_device(void*, const void*, int64_t, int) { no_cuda("copy to cuda"); }
void copy_device_to_host(void*, const void*, int64_t, int) { no_cuda("copy from cuda"); }
void copy_device_to_device(void*, const void*, int64_t, int) { no_cuda("copy on cuda"); }
void memset_zero(void*, int64_t, int) { no_cuda("memset on cuda"); }
void fill(void*, DType, int64_t, double, int) { no_cuda("fill on cuda"); }
void write_pointers(void* const*, const void* const*, int64_t, int) { no_cuda("write_pointers on cuda"); }
void convert(void*, DType, const void*, DType, int64_t, int) { no_cuda("dtype conversion on cuda"); }
// cuBLAS settings: nothing to set without cuBLAS (GEMM calls never get here: no
// cuda tensors exist).
void set_allow_tf32(bool) {}
bool allow_tf32() { return false; }
bool lt_matmul(const LtGemm&, int) { no_cuda("cuBLASLt matmul"); }
GeluForm lt_gelu_form(int) { no_cuda("cuBLASLt GELU probe"); }
LtStats lt_stats() { return {}; }  // no cuBLASLt call happens without CUDA
PendingCopy::PendingCopy(const void*, int64_t, int) { no_cuda("copy from cuda"); }
PendingCopy::~PendingCopy() = default;
PendingCopy::PendingCopy(PendingCopy&&) noexcept {}
const void* PendingCopy::wait() { no_cuda("copy from cuda"); }
Graph::Graph(int, const std::function<void()>&) { no_cuda("CUDA graph capture"); }
Graph::~Graph() = default;
void Graph::replay() { no_cuda("CUDA graph replay"); }
int64_t Graph::pool_bytes() const { return 0; }
EventTimer::EventTimer(int device) : device_(device) { no_cuda("EventTimer"); }
EventTimer::~EventTimer() = default;
void EventTimer::start() { no_cuda("EventTimer"); }
double EventTimer::stop_ms() { no_cuda("EventTimer"); }

}  // namespace moetrain::cuda
