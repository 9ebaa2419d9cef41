// The CUDA caching allocator's logic over a fake device (runs without a GPU).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <set>

#include "backend/cuda/caching_allocator.h"
#include "core/error.h"
#include "testing.h"

using namespace moetrain;
using moetrain::cuda::CachingAllocator;

namespace {

// A device of `capacity` bytes that hands out malloc'd blocks and records calls.
class FakeDevice final : public cuda::RawMemory {
 public:
  explicit FakeDevice(int64_t capacity) : capacity_(capacity) {}
  ~FakeDevice() override { CHECK(live_.empty()); }
  void* allocate(int64_t nbytes) override {
    ++allocs;
    if (used_ + nbytes > capacity_) return nullptr;
    void* p = std::malloc(static_cast<size_t>(nbytes));
    used_ += nbytes;
    live_.insert({p, nbytes});
    return p;
  }
  void release(void* ptr) override {
    auto it = std::find_if(live_.begin(), live_.end(), [&](const auto& b) { return b.first == ptr; });
    REQUIRE(it != live_.end());
    used_ -= it->second;
    live_.erase(it);
    std::free(ptr);
    ++frees;
  }
  void memory_info(int64_t* free_bytes, int64_t* total_bytes) override {
    *free_bytes = capacity_ - used_;
    *total_bytes = capacity_;
  }
  int64_t used() const { return used_; }
  int allocs = 0, frees = 0;

 private:
  int64_t capacity_, used_ = 0;
  std::set<std::pair<void*, int64_t>> live_;
};

constexpr int64_t kMiB = int64_t{1} << 20;

}  // namespace

TEST_CASE("caching allocator: size classes round up by 512 B, then by 1/8 of the power of two",
          "[backend][cuda_allocator]") {
  CHECK(CachingAllocator::size_class(1) == 512);
  CHECK(CachingAllocator::size_class(512) == 512);
  CHECK(CachingAllocator::size_class(513) == 1024);
  CHECK(CachingAllocator::size_class(kMiB) == kMiB);
  CHECK(CachingAllocator::size_class(kMiB + 1) == kMiB + kMiB / 8);
  CHECK(CachingAllocator::size_class(3 * kMiB) == 3 * kMiB);
  CHECK(CachingAllocator::size_class(3 * kMiB + 1) == 3 * kMiB + 2 * kMiB / 8);
  // Waste stays within 12.5% above 1 MiB and 511 bytes below.
  for (int64_t n : {int64_t{1000}, int64_t{777777}, kMiB + 12345, 37 * kMiB + 5, int64_t{5} << 30}) {
    int64_t c = CachingAllocator::size_class(n);
    CHECK(c >= n);
    CHECK((n <= kMiB ? c - n < 512 : (c - n) * 8 <= n));
  }
}

TEST_CASE("caching allocator: a released block serves the next request of its class without the device",
          "[backend][cuda_allocator]") {
  FakeDevice dev(64 * kMiB);
  {
    CachingAllocator alloc(dev, "fake:0");
    void* a = alloc.allocate(1000, "attention");
    void* b = alloc.allocate(3 * kMiB, "moe");
    CHECK(dev.allocs == 2);
    alloc.release(a);
    alloc.release(b);
    // Same classes again (1000 -> 1024, 3 MiB - 7 -> 3 MiB): the cached blocks, no device call.
    void* a2 = alloc.allocate(1024, "attention");
    void* b2 = alloc.allocate(3 * kMiB - 7, "moe");
    CHECK(a2 == a);
    CHECK(b2 == b);
    CHECK(dev.allocs == 2);
    cuda::MemoryStats s = alloc.stats();
    CHECK(s.num_allocs == 4);
    CHECK(s.num_cache_hits == 2);
    CHECK(s.num_device_allocs == 2);
    CHECK(s.allocated_bytes == 1024 + 3 * kMiB);
    CHECK(s.requested_bytes == 1024 + 3 * kMiB - 7);
    CHECK(s.reserved_bytes == 1024 + 3 * kMiB);
    // Another class does go to the device.
    void* c = alloc.allocate(2048, "other");
    CHECK(dev.allocs == 3);
    alloc.release(a2);
    alloc.release(b2);
    alloc.release(c);
    s = alloc.stats();
    CHECK(s.allocated_bytes == 0);
    CHECK(s.peak_allocated_bytes == 1024 + 3 * kMiB + 2048);
    CHECK(s.reserved_bytes == 1024 + 3 * kMiB + 2048);
    alloc.empty_cache();
    CHECK(alloc.stats().reserved_bytes == 0);
    CHECK(dev.used() == 0);
    CHECK(dev.frees == 3);
  }
}

TEST_CASE("caching allocator: a refused request empties the cache and retries", "[backend][cuda_allocator]") {
  FakeDevice dev(10 * kMiB);
  CachingAllocator alloc(dev, "fake:0");
  void* a = alloc.allocate(6 * kMiB, "moe");
  alloc.release(a);  // cached: the device has 4 MiB free
  void* b = alloc.allocate(8 * kMiB, "moe");  // needs the cached 6 MiB back
  CHECK(b != nullptr);
  CHECK(alloc.stats().num_alloc_retries == 1);
  CHECK(alloc.stats().num_ooms == 0);
  CHECK(alloc.stats().reserved_bytes == 8 * kMiB);
  alloc.release(b);
}

TEST_CASE("caching allocator: out of memory names the request, the device and the largest holders",
          "[backend][cuda_allocator]") {
  FakeDevice dev(16 * kMiB);
  CachingAllocator alloc(dev, "cuda:3 (fake)");
  void* m1 = alloc.allocate(6 * kMiB, "moe");
  void* m2 = alloc.allocate(4 * kMiB, "moe");
  void* k = alloc.allocate(2 * kMiB, "kda");
  std::string msg;
  try {
    alloc.allocate(8 * kMiB, "attention");
  } catch (const OutOfMemoryError& e) {
    msg = e.what();
  }
  INFO(msg);
  CHECK_THAT(msg, Catch::Contains("CUDA out of memory on cuda:3 (fake)"));
  CHECK_THAT(msg, Catch::Contains("8388608 bytes"));        // the request
  CHECK_THAT(msg, Catch::Contains("4.0 MiB free of 16.0 MiB"));  // the device
  CHECK_THAT(msg, Catch::Contains("largest holders: moe 10.0 MiB, kda 2.0 MiB"));
  CHECK_THAT(msg, Catch::Contains("train.batch_size"));
  CHECK(alloc.stats().num_ooms == 1);
  // The failed request changed nothing.
  CHECK(alloc.stats().allocated_bytes == 12 * kMiB);
  for (void* p : {m1, m2, k}) alloc.release(p);
}

TEST_CASE("caching allocator: releasing a pointer it never gave out is an internal error",
          "[backend][cuda_allocator]") {
  FakeDevice dev(kMiB);
  CachingAllocator alloc(dev, "fake:0");
  int x = 0;
  CHECK_THROWS_WITH(alloc.release(&x), Catch::Contains("not a live block"));
}

TEST_CASE("caching allocator: a graph's pool keeps its blocks from every allocation outside it",
          "[backend][cuda_allocator]") {
  FakeDevice dev(64 * kMiB);
  CachingAllocator alloc(dev, "fake:0");
  void* shared = alloc.allocate(4096, "other");
  alloc.release(shared);  // a shared cached block of class 4096

  const int pool = alloc.begin_pool();
  CHECK(pool > 0);
  void* in1 = alloc.allocate(4096, "moe");  // the shared cache's block moves into the pool
  CHECK(in1 == shared);
  void* in2 = alloc.allocate(2 * kMiB, "attention");  // from the device
  alloc.release(in2);                               // waits in the pool ...
  void* in3 = alloc.allocate(2 * kMiB, "attention");  // ... and serves the capture again
  CHECK(in3 == in2);
  alloc.release(in3);
  CHECK_THROWS_WITH(alloc.begin_pool(), Catch::Contains("begin_pool"));  // no nesting
  alloc.end_pool();
  CHECK(alloc.pool_bytes(pool) == 4096 + 2 * kMiB);

  // Outside the pool: a request of a pool block's class goes to the device, not to
  // the block the graph writes; a released pool block returns to the pool.
  const int allocs_before = dev.allocs;
  void* out = alloc.allocate(2 * kMiB, "other");
  CHECK(out != in2);
  CHECK(dev.allocs == allocs_before + 1);
  alloc.release(in1);  // the graph's output released by its host handle
  void* out2 = alloc.allocate(4096, "other");
  CHECK(out2 != in1);
  CHECK(alloc.pool_bytes(pool) == 4096 + 2 * kMiB);
  // Emptying the cache leaves the pool alone.
  alloc.release(out);
  alloc.release(out2);
  alloc.empty_cache();
  CHECK(alloc.pool_bytes(pool) == 4096 + 2 * kMiB);
  CHECK(alloc.stats().reserved_bytes == 4096 + 2 * kMiB);

  // A second capture gets a pool of its own.
  const int pool2 = alloc.begin_pool();
  CHECK(pool2 != pool);
  void* other_graph = alloc.allocate(2 * kMiB, "moe");
  CHECK(other_graph != in2);
  alloc.end_pool();
  alloc.release(other_graph);

  // The graph gone, its blocks are shared again.
  alloc.release_pool(pool);
  CHECK(alloc.pool_bytes(pool) == 0);
  CHECK(alloc.allocate(2 * kMiB, "other") == in2);
  alloc.release(in2);
  alloc.release_pool(pool2);
  alloc.empty_cache();
  CHECK(dev.used() == 0);
}

TEST_CASE("caching allocator: a pool's live block released after the pool is gone is shared",
          "[backend][cuda_allocator]") {
  FakeDevice dev(16 * kMiB);
  {
    CachingAllocator alloc(dev, "fake:0");
    const int pool = alloc.begin_pool();
    void* held = alloc.allocate(1000, "moe");  // a graph output still held when the graph goes
    void* cached = alloc.allocate(3000, "moe");
    alloc.release(cached);
    alloc.end_pool();
    alloc.release_pool(pool);
    alloc.release(held);
    CHECK(alloc.allocate(1000, "other") == held);
    CHECK(alloc.allocate(3000, "other") == cached);
    alloc.release(held);
    alloc.release(cached);
    // While a pool is current, a refused request does not empty the cache (cudaFree
    // would end the capture): out of memory instead.
    void* big = alloc.allocate(10 * kMiB, "other");
    alloc.release(big);
    alloc.begin_pool();
    CHECK_THROWS_AS(alloc.allocate(12 * kMiB, "moe"), OutOfMemoryError);
    CHECK(alloc.stats().num_alloc_retries == 0);
    alloc.end_pool();
    void* pooled = alloc.allocate(12 * kMiB, "moe");  // outside: the retry frees the cached 10 MiB
    CHECK(alloc.stats().num_alloc_retries == 1);
    alloc.release(pooled);
  }  // the destructor returns every cached block, pools' included (FakeDevice checks)
}
