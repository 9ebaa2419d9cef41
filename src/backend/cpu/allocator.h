// Host memory for tensor storage. A training step allocates the same large
// buffers every step; returning them to the OS and touching fresh pages again
// costs a page fault per 4 KiB (12-16 µs each on these VMs: seconds per step).
// So blocks of 1 MiB and more are rounded up to 2 MiB, advised as transparent
// huge pages, and kept after free in exact-size free lists for reuse. The cache
// is capped (MOETRAIN_HOST_CACHE_MB, default half the machine's memory); an
// allocation that fails empties it and retries. Small blocks go to malloc, tuned
// (mallopt) to keep them in its heap rather than mmap/munmap each one.
// host_alloc and host_free, what tensor storage calls, are declared in
// core/memory.h (the interface core allocates through) and defined here.
#pragma once

#include <cstdint>

#include "core/memory.h"

namespace moetrain::cpu {

struct HostAllocatorStats {
  int64_t in_use_bytes = 0;  // large blocks handed out
  int64_t cached_bytes = 0;  // large blocks kept for reuse
  int64_t hits = 0;          // large allocations served from the cache
  int64_t misses = 0;        // large allocations that went to the OS
};
HostAllocatorStats host_allocator_stats();
// This machine's memory in bytes: the physical pages, or the cgroup (v2) limit
// when that is lower. What the pre-allocation checks compare against.
double host_memory_bytes();
// Returns every cached block to the OS.
void host_empty_cache();

}  // namespace moetrain::cpu
