#include "backend/cuda/caching_allocator.h"

#include <algorithm>
#include <bit>

#include "core/error.h"
#include "core/format.h"

namespace moetrain::cuda {

namespace {
constexpr int64_t kSmallLimit = int64_t{1} << 20;  // 1 MiB
constexpr int64_t kSmallGranule = 512;
}  // namespace

int64_t CachingAllocator::size_class(int64_t nbytes) {
  MT_ASSERT(nbytes > 0, "size_class of {} bytes", nbytes);
  if (nbytes <= kSmallLimit) return (nbytes + kSmallGranule - 1) / kSmallGranule * kSmallGranule;
  // 1/8 of the power of two at or below nbytes: 2^k <= n < 2^(k+1) gives steps of 2^(k-3).
  int64_t granule = std::bit_floor(static_cast<uint64_t>(nbytes)) / 8;
  return (nbytes + granule - 1) / granule * granule;
}

CachingAllocator::CachingAllocator(RawMemory& raw, std::string device) : raw_(raw), device_(std::move(device)) {}

CachingAllocator::~CachingAllocator() {
  current_pool_ = 0;
  for (auto& [id, blocks] : pool_free_) free_.insert(blocks.begin(), blocks.end());
  pool_free_.clear();
  empty_cache();
}

void* CachingAllocator::allocate(int64_t nbytes, const char* label) {
  MT_ASSERT(nbytes > 0, "allocate of {} bytes on {}", nbytes, device_);
  int64_t rounded = size_class(nbytes);
  void* ptr = nullptr;
  auto take = [&](std::multimap<int64_t, void*>& from) {
    auto it = from.find(rounded);
    if (it == from.end()) return false;
    ptr = it->second;
    from.erase(it);
    ++stats_.num_cache_hits;
    return true;
  };
  // A pool's own free blocks first, then the shared cache, then the device.
  if (!(current_pool_ && take(pool_free_[current_pool_])) && !take(free_)) {
    ptr = raw_.allocate(rounded);
    if (!ptr && !free_.empty() && !current_pool_) {
      // Cached blocks of other classes may be what the device lacks.
      ++stats_.num_alloc_retries;
      empty_cache();
      ptr = raw_.allocate(rounded);
    }
    if (!ptr) {
      ++stats_.num_ooms;
      throw OutOfMemoryError(out_of_memory_message(nbytes, rounded));
    }
    ++stats_.num_device_allocs;
    stats_.reserved_bytes += rounded;
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  }
  live_.emplace(ptr, Block{rounded, nbytes, label ? label : "other", current_pool_});
  ++stats_.num_allocs;
  stats_.allocated_bytes += rounded;
  stats_.requested_bytes += nbytes;
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  return ptr;
}

void CachingAllocator::release(void* ptr) {
  auto it = live_.find(ptr);
  MT_ASSERT(it != live_.end(), "release of {} on {}: not a live block of this allocator", ptr, device_);
  stats_.allocated_bytes -= it->second.size;
  stats_.requested_bytes -= it->second.requested;
  const int pool = it->second.pool;
  (pool ? pool_free_[pool] : free_).emplace(it->second.size, ptr);
  live_.erase(it);
}

int CachingAllocator::begin_pool() {
  MT_ASSERT(!current_pool_, "begin_pool on {} while pool {} is current", device_, current_pool_);
  current_pool_ = next_pool_++;
  pool_free_[current_pool_];
  return current_pool_;
}

void CachingAllocator::end_pool() { current_pool_ = 0; }

void CachingAllocator::release_pool(int id) {
  MT_ASSERT(id > 0 && id != current_pool_, "release_pool({}) on {} (current pool {})", id, device_, current_pool_);
  if (auto it = pool_free_.find(id); it != pool_free_.end()) {
    free_.insert(it->second.begin(), it->second.end());
    pool_free_.erase(it);
  }
  for (auto& [ptr, block] : live_)
    if (block.pool == id) block.pool = 0;
}

int64_t CachingAllocator::pool_bytes(int id) const {
  int64_t bytes = 0;
  if (auto it = pool_free_.find(id); it != pool_free_.end())
    for (const auto& [size, ptr] : it->second) bytes += size;
  for (const auto& [ptr, block] : live_)
    if (block.pool == id) bytes += block.size;
  return bytes;
}

void CachingAllocator::empty_cache() {
  if (current_pool_) return;  // a capture is under way: cudaFree would end it
  for (auto& [size, ptr] : free_) {
    raw_.release(ptr);
    stats_.reserved_bytes -= size;
    ++stats_.num_device_frees;
  }
  free_.clear();
}

std::vector<std::pair<std::string, int64_t>> CachingAllocator::holders() const {
  std::map<std::string, int64_t> by_label;
  for (const auto& [ptr, block] : live_) by_label[block.label] += block.size;
  std::vector<std::pair<std::string, int64_t>> out(by_label.begin(), by_label.end());
  std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  return out;
}

std::string CachingAllocator::out_of_memory_message(int64_t nbytes, int64_t rounded) {
  int64_t free_bytes = 0, total_bytes = 0;
  raw_.memory_info(&free_bytes, &total_bytes);
  std::string msg = fmt::format(
      "CUDA out of memory on {}: tried to allocate {} ({} bytes); the device has {} free of {}. "
      "This process holds {} in live tensors and {} cached",
      device_, human_bytes(static_cast<double>(rounded)), nbytes, human_bytes(static_cast<double>(free_bytes)),
      human_bytes(static_cast<double>(total_bytes)), human_bytes(static_cast<double>(stats_.allocated_bytes)),
      human_bytes(static_cast<double>(stats_.reserved_bytes - stats_.allocated_bytes)));
  auto top = holders();
  if (!top.empty()) {
    msg += "; largest holders:";
    for (size_t i = 0; i < std::min<size_t>(top.size(), 5); ++i)
      msg += fmt::format("{} {} {}", i ? "," : "", top[i].first, human_bytes(static_cast<double>(top[i].second)));
  }
  msg += ". Lower train.batch_size (raise train.grad_accum to keep the global batch) or train.seq_len, or use more GPUs";
  return msg;
}

}  // namespace moetrain::cuda
