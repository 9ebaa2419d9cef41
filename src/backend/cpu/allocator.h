// Host memory for tensor storage. A training step allocates the same large
// buffers every step; returning them to the OS and touching fresh pages again
// costs a page fault per 4 KiB (12-16 µs each on these VMs: seconds per step).
// So blocks of 1 MiB and more are rounded up to 2 MiB, advised as transparent
// huge pages, and kept after free in exact-size free lists for reuse. The cache
// is capped (MOETRAIN_HOST_CACHE_MB, default half the machine's memory); an
// allocation that fails empties it and retries. Small blocks go to malloc, tuned
// (mallopt) to keep them in its heap rather than mmap/munmap each one.
#pragma once

#include <cstdint>

namespace moetrain::cpu {

// Returns 64-byte (small) or 2 MiB (large) aligned memory of at least nbytes;
// *capacity receives the block's real size, to pass back to host_free.
void* host_alloc(int64_t nbytes, int64_t* capacity);
void host_free(void* ptr, int64_t capacity);

struct HostAllocatorStats {
  int64_t in_use_bytes = 0;  // large blocks handed out
  int64_t cached_bytes = 0;  // large blocks kept for reuse
  int64_t hits = 0;          // large allocations served from the cache
  int64_t misses = 0;        // large allocations that went to the OS
};
HostAllocatorStats host_allocator_stats();
// Returns every cached block to the OS.
void host_empty_cache();

}  // namespace moetrain::cpu
