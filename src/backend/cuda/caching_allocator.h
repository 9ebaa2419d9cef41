// The caching allocator behind CUDA tensor storage (one per device). cudaMalloc
// and cudaFree synchronise the device and cost tens of microseconds to
// milliseconds; a training step allocates the same sizes every step. So blocks
// are kept after release, in free lists by size class, and handed out again:
// after the first step no step calls cudaMalloc.
//
// Size classes: up to 1 MiB, multiples of 512 B; above, multiples of 1/8 of the
// power of two below the size (waste <= 12.5%, and few classes). A request takes
// a free block of exactly its class (no splitting: no fragmentation bookkeeping,
// and training's sizes repeat). When the driver refuses, the cache is emptied
// and the request retried once; if it still fails, OutOfMemoryError names the
// request, the device's free/total memory, what this process holds (live and
// cached) and the largest holders by label (the profile region that allocated,
// e.g. "moe", "attention", "optimizer").
//
// Private pools, for CUDA graphs (backend/cuda/graph.h): a replay writes the same
// blocks the capture was given, so those blocks must never go to anyone else while
// the graph lives. Between begin_pool() and end_pool() allocations belong to the new
// pool (taken from its own free blocks, else the shared cache, else the device);
// a pool's block, when released, waits in the pool, never handed to an allocation
// outside it; release_pool() gives the pool's free blocks to the shared cache, and
// its live ones become shared blocks. empty_cache() leaves pools alone, and no
// cache is emptied while a pool is current (cudaFree would end a capture).
//
// This file is plain C++ over a RawMemory interface (cudaMalloc in runtime.cpp,
// a fake in the tests), so its logic is tested on machines without a GPU.
// Not thread-safe by itself: runtime.cpp holds a mutex around each call.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

namespace moetrain::cuda {

// What the allocator asks of the device.
class RawMemory {
 public:
  virtual ~RawMemory() = default;
  // nullptr when the device has no room (not an exception).
  virtual void* allocate(int64_t nbytes) = 0;
  virtual void release(void* ptr) = 0;
  // Bytes free and total on the device.
  virtual void memory_info(int64_t* free_bytes, int64_t* total_bytes) = 0;
};

struct MemoryStats {
  int64_t allocated_bytes = 0;       // in live blocks (rounded sizes)
  int64_t requested_bytes = 0;       // as asked for by the live blocks' owners
  int64_t reserved_bytes = 0;        // from the driver: live + cached
  int64_t peak_allocated_bytes = 0;
  int64_t peak_reserved_bytes = 0;
  int64_t num_allocs = 0;            // allocate() calls that returned a block
  int64_t num_cache_hits = 0;        // ... served from the cache
  int64_t num_device_allocs = 0;     // RawMemory::allocate calls that succeeded
  int64_t num_device_frees = 0;
  int64_t num_alloc_retries = 0;     // cache emptied after a refusal
  int64_t num_ooms = 0;              // OutOfMemoryError thrown
};

class CachingAllocator {
 public:
  // `device` names the device in errors ("cuda:0").
  CachingAllocator(RawMemory& raw, std::string device);
  ~CachingAllocator();  // returns cached blocks (pools' too); live blocks are the owners' to free
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least nbytes (> 0); `label` says who holds it (kept by pointer:
  // a string literal or other static string).
  void* allocate(int64_t nbytes, const char* label);
  // Back to the cache (not to the device). ptr must come from allocate().
  void release(void* ptr);
  // Cached blocks go back to the device.
  void empty_cache();

  // A new pool (id > 0), current until end_pool().
  int begin_pool();
  void end_pool();
  void release_pool(int id);
  // Bytes of the pool's blocks, live and free.
  int64_t pool_bytes(int id) const;

  MemoryStats stats() const { return stats_; }
  // Live bytes by label, largest first.
  std::vector<std::pair<std::string, int64_t>> holders() const;

  static int64_t size_class(int64_t nbytes);

 private:
  struct Block {
    int64_t size;       // its class
    int64_t requested;
    const char* label;
    int pool;  // 0: shared
  };
  std::string out_of_memory_message(int64_t nbytes, int64_t rounded);

  RawMemory& raw_;
  std::string device_;
  std::multimap<int64_t, void*> free_;        // class -> cached block (shared)
  std::map<int, std::multimap<int64_t, void*>> pool_free_;  // pool -> its free blocks
  int current_pool_ = 0;
  int next_pool_ = 1;
  std::unordered_map<void*, Block> live_;
  MemoryStats stats_;
};

}  // namespace moetrain::cuda
