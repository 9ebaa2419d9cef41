#include "backend/cpu/allocator.h"

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"

namespace moetrain::cpu {

namespace {

constexpr int64_t kSmallAlign = 64;
constexpr int64_t kHugePage = int64_t{2} << 20;
constexpr int64_t kLargeThreshold = int64_t{1} << 20;

int64_t cache_limit_bytes() {
  if (const char* v = std::getenv("MOETRAIN_HOST_CACHE_MB")) {
    char* end = nullptr;
    long long mb = std::strtoll(v, &end, 10);
    MT_CHECK(*end == '\0' && mb >= 0, "MOETRAIN_HOST_CACHE_MB={} is not a non-negative integer", v);
    return static_cast<int64_t>(mb) << 20;
  }
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page / 2 : int64_t{4} << 30;
}

struct Cache {
  std::mutex mutex;
  std::map<int64_t, std::vector<void*>> free_blocks;  // capacity -> blocks
  HostAllocatorStats stats;
  int64_t limit = cache_limit_bytes();

  void release_all_locked() {
    for (auto& [cap, blocks] : free_blocks)
      for (void* p : blocks) std::free(p);
    free_blocks.clear();
    stats.cached_bytes = 0;
  }
};

Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: tensors may be freed during static destruction
  return *c;
}

void* os_alloc(int64_t align, int64_t bytes) {
  void* p = std::aligned_alloc(static_cast<size_t>(align), static_cast<size_t>(bytes));
  if (p && align == kHugePage) madvise(p, static_cast<size_t>(bytes), MADV_HUGEPAGE);  // a hint
  return p;
}

// Small blocks come from malloc. glibc serves blocks above its mmap threshold
// (128 KiB at first) with a fresh mmap and unmaps them on free, and trims the heap
// top after frees: the next step's blocks of the same sizes fault their pages in
// again. So keep everything below our large-block threshold in the heap and the
// heap's top resident (set once, before the first small block).
void tune_malloc() {
  static const bool once = [] {
    mallopt(M_MMAP_THRESHOLD, static_cast<int>(kLargeThreshold));
    mallopt(M_TRIM_THRESHOLD, 256 << 20);
    return true;
  }();
  (void)once;
}

}  // namespace

void* host_alloc(int64_t nbytes, int64_t* capacity) {
  if (nbytes < kLargeThreshold) {
    tune_malloc();
    int64_t rounded = (nbytes + kSmallAlign - 1) / kSmallAlign * kSmallAlign;
    *capacity = rounded;
    void* p = os_alloc(kSmallAlign, rounded);
    if (!p) throw OutOfMemoryError(fmt::format("out of host memory: failed to allocate {} bytes", nbytes));
    return p;
  }
  int64_t rounded = (nbytes + kHugePage - 1) / kHugePage * kHugePage;
  *capacity = rounded;
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    auto it = c.free_blocks.find(rounded);
    if (it != c.free_blocks.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      c.stats.cached_bytes -= rounded;
      c.stats.in_use_bytes += rounded;
      c.stats.hits += 1;
      return p;
    }
    c.stats.misses += 1;
  }
  void* p = os_alloc(kHugePage, rounded);
  if (!p) {
    std::lock_guard<std::mutex> lock(c.mutex);
    c.release_all_locked();
    p = os_alloc(kHugePage, rounded);
    if (!p)
      throw OutOfMemoryError(fmt::format("out of host memory: failed to allocate {} bytes ({:.1f} MiB; {:.1f} MiB in "
                                         "tensors); lower train.batch_size or train.seq_len, or use more ranks",
                                         nbytes, nbytes / 1048576.0, c.stats.in_use_bytes / 1048576.0));
  }
  std::lock_guard<std::mutex> lock(c.mutex);
  c.stats.in_use_bytes += rounded;
  return p;
}

void host_free(void* ptr, int64_t capacity) {
  if (!ptr) return;
  if (capacity < kLargeThreshold) {
    std::free(ptr);
    return;
  }
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.stats.in_use_bytes -= capacity;
  if (c.stats.cached_bytes + capacity > c.limit) {
    std::free(ptr);
    return;
  }
  c.free_blocks[capacity].push_back(ptr);
  c.stats.cached_bytes += capacity;
}

HostAllocatorStats host_allocator_stats() {
  std::lock_guard<std::mutex> lock(cache().mutex);
  return cache().stats;
}

void host_empty_cache() {
  std::lock_guard<std::mutex> lock(cache().mutex);
  cache().release_all_locked();
}

double host_memory_bytes() {
  double bytes = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  std::ifstream cgroup("/sys/fs/cgroup/memory.max");
  std::string limit;
  if (cgroup >> limit && !limit.empty() && std::all_of(limit.begin(), limit.end(), ::isdigit))
    bytes = std::min(bytes, std::stod(limit));
  return bytes;
}

}  // namespace moetrain::cpu
