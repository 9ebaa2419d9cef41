// The bookkeeping of the pinned staging ring behind copy_host_to_device
// (runtime.cpp; docs/cuda.md, "Host synchronisation"). A copy from pageable host
// memory is first copied by the CPU into a region of a pinned ring, the GPU copy is
// queued from there, and the call returns: the caller may reuse its source at once,
// and the GPU's queue is not drained. The region stays in flight until a token
// queued behind the copy (a CUDA event) has passed. Regions are handed out in
// order around the ring, so the free space is the stretch from the newest region
// to the oldest: a request that needs space still in flight retires the oldest
// regions first (waiting for them), never a newer one.
// No CUDA here: tests/backend/staging_ring_test.cpp drives it with fake tokens.
#pragma once

#include <cstdint>
#include <deque>

#include "core/error.h"

namespace moetrain::cuda {

template <class Token>
class StagingRing {
 public:
  static constexpr int64_t kAlign = 64;  // every region starts on a 64-byte boundary

  explicit StagingRing(int64_t capacity) : capacity_(capacity) {
    MT_CHECK(capacity > 0 && capacity % kAlign == 0, "staging ring: capacity {} must be a positive multiple of {}",
             capacity, kAlign);
  }

  int64_t capacity() const { return capacity_; }
  size_t in_flight() const { return regions_.size(); }

  // The offset of `bytes` (1..capacity) free bytes: right after the newest region,
  // or at 0 when that would pass the end of the ring. In-flight regions that overlap
  // it are retired oldest first: retire(token) must return once the token has passed
  // (it may then reuse the token).
  template <class Retire>
  int64_t acquire(int64_t bytes, Retire&& retire) {
    MT_CHECK(bytes > 0 && bytes <= capacity_, "staging ring: a region of {} bytes in a ring of {}", bytes, capacity_);
    const int64_t start = head_ + bytes <= capacity_ ? head_ : 0;
    while (overlaps_any(start, start + bytes)) {
      retire(regions_.front().token);
      regions_.pop_front();
    }
    return start;
  }

  // The region [offset, offset + bytes) from acquire() is in flight until `token` passes.
  void push(int64_t offset, int64_t bytes, Token token) {
    regions_.push_back({offset, offset + bytes, token});
    head_ = (offset + bytes + kAlign - 1) / kAlign * kAlign;
    if (head_ >= capacity_) head_ = 0;
  }

  // Drops the oldest regions whose token has passed, without waiting: passed(token)
  // is asked oldest first until it says false (a token it says true for is dropped,
  // and the callback may reuse it).
  template <class Passed>
  void reap(Passed&& passed) {
    while (!regions_.empty() && passed(regions_.front().token)) regions_.pop_front();
  }

 private:
  struct Region {
    int64_t begin, end;
    Token token;
  };
  bool overlaps_any(int64_t begin, int64_t end) const {
    for (const Region& r : regions_)
      if (r.begin < end && begin < r.end) return true;
    return false;
  }

  int64_t capacity_;
  int64_t head_ = 0;
  std::deque<Region> regions_;
};

}  // namespace moetrain::cuda
