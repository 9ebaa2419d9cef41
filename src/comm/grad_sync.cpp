// Bucketed gradient all-reduce; see grad_sync.h. Sums are taken in the bucket
// dtype (f32 for f32 and bf16 grads, f64 for f64) and scaled there, so a bf16
// grad is rounded once.
#include "comm/grad_sync.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>
#include <vector>

#include "core/dispatch.h"
#include "core/grad_mode.h"
#include "ops/elementwise/elementwise.h"
#include "ops/view/view.h"

namespace moetrain::comm {

namespace {

DType bucket_dtype(const GradTensor& p) {
  switch (p.tensor.dtype()) {
    case DType::f32:
    case DType::bf16: return DType::f32;
    case DType::f64: return DType::f64;
    default:
      MT_THROW("all_reduce_grads: parameter '{}' is {}; gradients are synchronised for f32, bf16 and f64 parameters",
               p.name, describe(p.tensor));
  }
}

// Copies the grad of p (zeros when it has none) into dst, converting bf16.
template <class T>
void pack(T* dst, const GradTensor& p) {
  Tensor g = p.tensor.grad();
  const int64_t n = p.tensor.numel();
  if (!g.defined()) {
    std::fill(dst, dst + n, T(0));
  } else if (g.dtype() == DType::bf16) {
    const bf16* s = g.data<bf16>();
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(s[i].to_float());
  } else {
    std::memcpy(dst, g.data<T>(), static_cast<size_t>(n) * sizeof(T));
  }
}

// Writes scale * src back into the grad of p (creating it when absent).
template <class T>
void unpack(const T* src, const GradTensor& p, double scale) {
  Tensor g = p.tensor.grad();
  if (!g.defined()) {
    g = empty(p.tensor.shape(), p.tensor.dtype());
    p.tensor.set_grad(g);
  }
  const int64_t n = p.tensor.numel();
  const T s = static_cast<T>(scale);
  if (g.dtype() == DType::bf16) {
    bf16* d = g.data<bf16>();
    for (int64_t i = 0; i < n; ++i) d[i] = bf16::from_float(static_cast<float>(src[i] * s));
  } else {
    T* d = g.data<T>();
    for (int64_t i = 0; i < n; ++i) d[i] = src[i] * s;
  }
}

// Device buckets: pack (converting bf16 to the bucket's f32) into view, and
// write scale * view back into the grads, all on the device.
void device_pack(Tensor& view, const GradTensor* const* members, size_t count) {
  int64_t at = 0;
  for (size_t k = 0; k < count; ++k) {
    const Tensor& w = members[k]->tensor;
    Tensor slot = alias(view, w.shape(), at);
    Tensor g = w.grad();
    if (!g.defined()) fill_(slot, 0.0);
    else copy_(slot, g.dtype() == view.dtype() ? g : g.to(view.dtype()));
    at += w.numel();
  }
}

void device_unpack(const Tensor& view, const GradTensor& p, int64_t at, double scale) {
  const Tensor& w = p.tensor;
  Tensor summed = mul_scalar(alias(view, w.shape(), at), scale);
  if (summed.dtype() != w.dtype()) summed = summed.to(w.dtype());
  Tensor g = w.grad();
  if (g.defined()) copy_(g, summed);
  else w.set_grad(summed);
}

void device_bucket(Communicator& comm, Tensor& view, const GradTensors& params, const std::vector<size_t>& members,
                   double scale) {
  std::vector<const GradTensor*> list;
  for (size_t i : members) list.push_back(&params[i]);
  device_pack(view, list.data(), list.size());
  comm.all_reduce_sum(view);
  int64_t at = 0;
  for (size_t i : members) {
    device_unpack(view, params[i], at, scale);
    at += params[i].tensor.numel();
  }
}

// The checks of both entry points, before any communication.
void check_parameter(const char* op, const GradTensor& p, const GradTensor& first,
                     std::unordered_set<const TensorImpl*>& seen) {
  MT_CHECK(p.tensor.defined(), "{}: parameter '{}' is undefined", op, p.name);
  MT_CHECK(seen.insert(&p.tensor.impl()).second,
           "{}: parameter '{}' is listed twice (tied weights belong in the list once)", op, p.name);
  MT_CHECK(p.tensor.device() == first.tensor.device(),
           "{}: parameter '{}' is on {} but '{}' on {}; one device per process", op, p.name, p.tensor.device(),
           first.name, first.tensor.device());
  bucket_dtype(p);
}

void check_param_grad(const char* op, const GradTensor& p) {
  Tensor g = p.tensor.grad();
  MT_CHECK(!g.defined() || (g.device() == p.tensor.device() && g.dtype() == p.tensor.dtype() &&
                            g.shape() == p.tensor.shape()),
           "{}: the grad of '{}' is {} but the parameter is {}; expected a grad of the same shape, dtype and device",
           op, p.name, describe(g), describe(p.tensor));
}

// A group of one rank on the CPU: the sum is the rank's own grad, so each grad is
// scaled where it is, as unpack(pack(grad)) would (same products, bf16 through
// f32), without a bucket's copy (the expert shards at ep = world: their dp group).
bool scaled_alone(const Communicator& comm, const GradTensors& params, double scale) {
  if (comm.size() != 1 || params.empty() || params.front().tensor.is_cuda()) return false;
  for (const GradTensor& p : params) {
    Tensor g = p.tensor.grad();
    if (!g.defined() || scale == 1.0) continue;
    const int64_t n = g.numel();
    if (g.dtype() == DType::bf16) {
      bf16* d = g.data<bf16>();
      const float s = static_cast<float>(scale);
      for (int64_t i = 0; i < n; ++i) d[i] = bf16::from_float(d[i].to_float() * s);
    } else {
      dispatch_float(g.dtype(), "all_reduce_grads", [&](auto tag) {
        using T = decltype(tag);
        T* d = g.data<T>();
        const T s = static_cast<T>(scale);
        for (int64_t i = 0; i < n; ++i) d[i] = d[i] * s;
      });
    }
  }
  return true;
}

}  // namespace

GradSyncStats all_reduce_grads(Communicator& comm, const GradTensors& params, const GradSyncOptions& options) {
  MT_CHECK(options.bucket_bytes > 0, "all_reduce_grads: bucket_bytes must be positive, got {}", options.bucket_bytes);
  NoGradGuard no_grad;
  std::unordered_set<const TensorImpl*> seen;  // a tensor listed twice would be summed twice
  for (const GradTensor& p : params) {
    check_parameter("all_reduce_grads", p, params.front(), seen);
    check_param_grad("all_reduce_grads", p);
  }

  // Which parameters have a grad on some rank.
  Tensor has_grad = zeros(Shape{static_cast<int64_t>(params.size())}, DType::i32);
  for (size_t i = 0; i < params.size(); ++i) has_grad.data<int32_t>()[i] = params[i].tensor.grad().defined() ? 1 : 0;
  comm.all_reduce_sum(has_grad);
  if (scaled_alone(comm, params, options.scale)) return {};

  GradSyncStats stats;
  const Device device = params.empty() ? kCpu : params.front().tensor.device();
  for (DType dtype : {DType::f32, DType::f64}) {
    dispatch_float(dtype, "all_reduce_grads", [&](auto tag) {
      using T = decltype(tag);
      const int64_t capacity = std::max<int64_t>(1, options.bucket_bytes / static_cast<int64_t>(sizeof(T)));
      std::vector<size_t> members;  // indices into params of the current bucket
      int64_t filled = 0;           // elements
      Tensor buffer;
      auto flush = [&] {
        if (members.empty()) return;
        if (!buffer.defined() || buffer.numel() < filled) buffer = empty(Shape{filled}, dtype, device);
        Tensor view = alias(buffer, Shape{filled});
        if (device.is_cuda()) {  // the same steps with device copies; the sum goes through NCCL
          device_bucket(comm, view, params, members, options.scale);
          ++stats.num_buckets;
          stats.bytes += filled * static_cast<int64_t>(sizeof(T));
          members.clear();
          filled = 0;
          return;
        }
        T* data = view.data<T>();
        int64_t at = 0;
        for (size_t i : members) {
          pack(data + at, params[i]);
          at += params[i].tensor.numel();
        }
        comm.all_reduce_sum(view);
        at = 0;
        for (size_t i : members) {
          unpack(data + at, params[i], options.scale);
          at += params[i].tensor.numel();
        }
        ++stats.num_buckets;
        stats.bytes += filled * static_cast<int64_t>(sizeof(T));
        members.clear();
        filled = 0;
      };
      for (size_t i = 0; i < params.size(); ++i) {
        if (has_grad.data<int32_t>()[i] == 0 || bucket_dtype(params[i]) != dtype) continue;
        const int64_t n = params[i].tensor.numel();
        if (filled > 0 && filled + n > capacity) flush();
        members.push_back(i);
        filled += n;
      }
      flush();
    });
  }
  return stats;
}

FlatShards make_flat_shards(const std::vector<int64_t>& numels, int size) {
  MT_CHECK(size >= 1, "make_flat_shards: a group of {} ranks", size);
  FlatShards s;
  s.offsets.assign(numels.size() + 1, 0);
  for (size_t i = 0; i < numels.size(); ++i) s.offsets[i + 1] = s.offsets[i] + numels[i];
  const int64_t total = s.offsets.back();
  s.bounds.resize(static_cast<size_t>(size) + 1);
  for (int r = 0; r <= size; ++r)  // total * r / size without overflow for any int64 total below 2^62
    s.bounds[static_cast<size_t>(r)] = total / size * r + total % size * r / size;
  return s;
}

FlatShards make_flat_shards(const std::vector<int64_t>& numels, int size, const std::vector<int64_t>& units,
                            const std::vector<double>& costs) {
  MT_CHECK(size >= 1, "make_flat_shards: a group of {} ranks", size);
  MT_CHECK(units.size() == numels.size() && costs.size() == numels.size(),
           "make_flat_shards: {} parameters, {} units, {} costs", numels.size(), units.size(), costs.size());
  FlatShards s = make_flat_shards(numels, 1);
  std::vector<double> cost_before(numels.size() + 1, 0.0);
  for (size_t i = 0; i < numels.size(); ++i) {
    MT_CHECK(units[i] >= 1 && numels[i] % units[i] == 0 && (costs[i] > 0 || (numels[i] == 0 && costs[i] == 0)),
             "make_flat_shards: parameter {} of {} elements, unit {}, cost {}", i, numels[i], units[i], costs[i]);
    cost_before[i + 1] = cost_before[i] + costs[i];
  }
  const double total = cost_before.back();
  s.bounds.assign(static_cast<size_t>(size) + 1, s.offsets.back());
  s.bounds[0] = 0;
  size_t i = 0;  // the parameter the cut falls in
  for (int r = 1; r < size; ++r) {
    const double target = total * r / size;
    while (i < numels.size() && cost_before[i + 1] <= target) ++i;
    int64_t cut = s.offsets.back();
    if (i < numels.size() && numels[i] > 0) {
      // In parameter i: the element where the cost reaches the target, then the nearer allowed cut.
      const double per_element = costs[i] / static_cast<double>(numels[i]);
      const double at = std::min(static_cast<double>(numels[i]), (target - cost_before[i]) / per_element);
      const int64_t unit = units[i];
      const int64_t below = std::min(numels[i], static_cast<int64_t>(at / static_cast<double>(unit)) * unit);
      const int64_t above = std::min(numels[i], below + unit);
      cut = s.offsets[i] + (at - static_cast<double>(below) <= static_cast<double>(above) - at ? below : above);
    }
    s.bounds[static_cast<size_t>(r)] = std::max(cut, s.bounds[static_cast<size_t>(r) - 1]);
  }
  return s;
}

std::pair<int64_t, int64_t> FlatShards::owned(size_t i, int rank) const {
  const int64_t lo = std::max(offsets[i], bounds[static_cast<size_t>(rank)]);
  const int64_t hi = std::min(offsets[i + 1], bounds[static_cast<size_t>(rank) + 1]);
  return hi > lo ? std::pair{lo - offsets[i], hi - offsets[i]} : std::pair<int64_t, int64_t>{0, 0};
}

namespace {

// A piece of one parameter in a bucket: its elements [begin, begin + count).
struct Segment {
  size_t param;
  int64_t begin, count;
};

// The buckets of the flat sequence of the parameters `take` selects (in list
// order), cut every `capacity` elements.
template <class Take>
std::vector<std::vector<Segment>> flat_buckets(size_t num_params, const std::vector<int64_t>& numels,
                                               int64_t capacity, Take take) {
  std::vector<std::vector<Segment>> buckets(1);
  int64_t filled = 0;
  for (size_t i = 0; i < num_params; ++i) {
    if (!take(i)) continue;
    for (int64_t at = 0; at < numels[i];) {
      if (filled == capacity) {
        buckets.emplace_back();
        filled = 0;
      }
      const int64_t n = std::min(numels[i] - at, capacity - filled);
      buckets.back().push_back({i, at, n});
      filled += n;
      at += n;
    }
  }
  if (buckets.back().empty()) buckets.pop_back();
  return buckets;
}

// How many elements of the bucket each rank owns (they lie in rank order).
std::vector<int64_t> owner_counts(const std::vector<Segment>& bucket, const FlatShards& shards) {
  std::vector<int64_t> counts(static_cast<size_t>(shards.size()), 0);
  for (const Segment& g : bucket) {
    const int64_t lo = shards.offsets[g.param] + g.begin, hi = lo + g.count;
    for (int r = 0; r < shards.size(); ++r) {
      const int64_t a = std::max(lo, shards.bounds[static_cast<size_t>(r)]);
      const int64_t b = std::min(hi, shards.bounds[static_cast<size_t>(r) + 1]);
      if (b > a) counts[static_cast<size_t>(r)] += b - a;
    }
  }
  return counts;
}

// The part of segment g that `rank` owns, as [begin, end) in the parameter's elements.
std::pair<int64_t, int64_t> owned_part(const Segment& g, const FlatShards& shards, int rank) {
  const int64_t base = shards.offsets[g.param];
  const int64_t a = std::max(g.begin, shards.bounds[static_cast<size_t>(rank)] - base);
  const int64_t b = std::min(g.begin + g.count, shards.bounds[static_cast<size_t>(rank) + 1] - base);
  return {a, std::max(a, b)};
}

Tensor flat(const Tensor& t, int64_t begin, int64_t count) { return alias(t, Shape{count}, begin); }

}  // namespace

GradSyncStats reduce_scatter_grads(Communicator& comm, const GradTensors& params, const FlatShards& shards,
                                   const GradSyncOptions& options) {
  MT_CHECK(options.bucket_bytes > 0, "reduce_scatter_grads: bucket_bytes must be positive, got {}",
           options.bucket_bytes);
  MT_CHECK(shards.size() == comm.size() && shards.offsets.size() == params.size() + 1,
           "reduce_scatter_grads: shards for {} ranks and {} parameters, the group has {} and the list {}",
           shards.size(), shards.offsets.size() - 1, comm.size(), params.size());
  NoGradGuard no_grad;
  std::unordered_set<const TensorImpl*> seen;
  std::vector<int64_t> numels;
  for (const GradTensor& p : params) {
    check_parameter("reduce_scatter_grads", p, params.front(), seen);
    check_param_grad("reduce_scatter_grads", p);
    numels.push_back(p.tensor.numel());
  }
  Tensor has_grad = zeros(Shape{static_cast<int64_t>(params.size())}, DType::i32);
  for (size_t i = 0; i < params.size(); ++i) has_grad.data<int32_t>()[i] = params[i].tensor.grad().defined() ? 1 : 0;
  comm.all_reduce_sum(has_grad);
  // A rank without a grad where others have one gets one (zeros, then its owned sums).
  for (size_t i = 0; i < params.size(); ++i)
    if (has_grad.data<int32_t>()[i] > 0 && !params[i].tensor.grad().defined())
      params[i].tensor.set_grad(zeros_like(params[i].tensor.detach()));
  if (scaled_alone(comm, params, options.scale)) return {};

  GradSyncStats stats;
  const Device device = params.empty() ? kCpu : params.front().tensor.device();
  const int me = comm.rank();
  for (DType dtype : {DType::f32, DType::f64}) {
    dispatch_float(dtype, "reduce_scatter_grads", [&](auto tag) {
      using T = decltype(tag);
      const int64_t capacity = std::max<int64_t>(1, options.bucket_bytes / static_cast<int64_t>(sizeof(T)));
      const auto buckets = flat_buckets(params.size(), numels, capacity, [&](size_t i) {
        return has_grad.data<int32_t>()[i] > 0 && bucket_dtype(params[i]) == dtype;
      });
      Tensor buffer;
      for (const std::vector<Segment>& bucket : buckets) {
        int64_t filled = 0;
        for (const Segment& g : bucket) filled += g.count;
        if (!buffer.defined() || buffer.numel() < filled) buffer = empty(Shape{filled}, dtype, device);
        Tensor view = alias(buffer, Shape{filled});
        int64_t at = 0;
        for (const Segment& g : bucket) {  // pack (every grad exists now)
          const Tensor src = flat(params[g.param].tensor.grad(), g.begin, g.count);
          if (device.is_cuda()) {
            copy_(flat(view, at, g.count), src.dtype() == dtype ? src : src.to(dtype));
          } else if (src.dtype() == DType::bf16) {
            const bf16* s = src.data<bf16>();
            T* d = view.data<T>() + at;
            for (int64_t j = 0; j < g.count; ++j) d[j] = static_cast<T>(s[j].to_float());
          } else {
            std::memcpy(view.data<T>() + at, src.data<T>(), static_cast<size_t>(g.count) * sizeof(T));
          }
          at += g.count;
        }
        const Tensor mine = comm.reduce_scatter_sum_v(view, owner_counts(bucket, shards));
        at = 0;
        for (const Segment& g : bucket) {  // unpack what this rank owns: scale * sum, as all_reduce_grads
          const auto [a, b] = owned_part(g, shards, me);
          if (b == a) continue;
          Tensor dst = flat(params[g.param].tensor.grad(), a, b - a);
          if (device.is_cuda()) {
            Tensor summed = mul_scalar(flat(mine, at, b - a), options.scale);
            copy_(dst, summed.dtype() == dst.dtype() ? summed : summed.to(dst.dtype()));
          } else {
            const T* src = mine.data<T>() + at;
            const T sc = static_cast<T>(options.scale);
            if (dst.dtype() == DType::bf16) {
              bf16* d = dst.data<bf16>();
              for (int64_t j = 0; j < b - a; ++j) d[j] = bf16::from_float(static_cast<float>(src[j] * sc));
            } else {
              T* d = dst.data<T>();
              for (int64_t j = 0; j < b - a; ++j) d[j] = src[j] * sc;
            }
          }
          at += b - a;
        }
        MT_ASSERT(at == mine.numel(), "reduce_scatter_grads: unpacked {} of the {} owned sums", at, mine.numel());
        ++stats.num_buckets;
        stats.bytes += filled * static_cast<int64_t>(sizeof(T));
      }
    });
  }
  return stats;
}

void all_gather_params(Communicator& comm, const std::vector<Tensor>& params, const FlatShards& shards,
                       int64_t bucket_bytes) {
  MT_CHECK(shards.size() == comm.size() && shards.offsets.size() == params.size() + 1,
           "all_gather_params: shards for {} ranks and {} parameters, the group has {} and the list {}",
           shards.size(), shards.offsets.size() - 1, comm.size(), params.size());
  if (comm.size() == 1) return;
  NoGradGuard no_grad;
  std::vector<int64_t> numels;
  std::vector<DType> dtypes;  // in first-seen order: every rank walks them alike
  for (const Tensor& t : params) {
    numels.push_back(t.numel());
    if (std::find(dtypes.begin(), dtypes.end(), t.dtype()) == dtypes.end()) dtypes.push_back(t.dtype());
  }
  const int me = comm.rank();
  for (DType dtype : dtypes) {
    const int64_t capacity = std::max<int64_t>(1, bucket_bytes / dtype_size(dtype));
    const auto buckets =
        flat_buckets(params.size(), numels, capacity, [&](size_t i) { return params[i].dtype() == dtype; });
    for (const std::vector<Segment>& bucket : buckets) {
      const std::vector<int64_t> counts = owner_counts(bucket, shards);
      Tensor mine = empty(Shape{counts[static_cast<size_t>(me)]}, dtype, params.front().device());
      int64_t at = 0;
      for (const Segment& g : bucket) {
        const auto [a, b] = owned_part(g, shards, me);
        if (b == a) continue;
        copy_(flat(mine, at, b - a), flat(params[g.param], a, b - a));
        at += b - a;
      }
      const Tensor all = comm.all_gather_v(mine, counts);
      at = 0;
      for (const Segment& g : bucket) {
        copy_(flat(params[g.param], g.begin, g.count), flat(all, at, g.count));
        at += g.count;
      }
    }
  }
}

Tensor all_gather_owned(Communicator& comm, const Tensor& own) {
  Tensor count = empty({1, 1}, DType::i64);
  count.data<int64_t>()[0] = own.numel();
  const Tensor all = comm.all_gather(count);  // [size, 1]
  const std::vector<int64_t> counts(all.data<int64_t>(), all.data<int64_t>() + comm.size());
  return comm.all_gather_v(alias(own, Shape{own.numel()}), counts);
}

struct GradReducer::Bucket {
  Communicator* comm = nullptr;
  DType dtype = DType::f32;     // of the sums: f32 (f32 and bf16 grads) or f64
  std::vector<size_t> members;  // indices into params_, in reverse list order
  int64_t numel = 0;
  size_t num_ready = 0;
  Tensor buffer;  // [numel] on the parameters' device, kept between steps
  Tensor flags;   // [members] i32 on the CPU: 1 where this rank has a grad
  std::unique_ptr<PendingCollective> sum, flag_sum;
  bool done = false;  // both sums tested done (wait() still ends them)
};

GradReducer::GradReducer(std::vector<ReducedParameter> params, const GradSyncOptions& options)
    : params_(std::move(params)), options_(options) {
  MT_CHECK(options.bucket_bytes > 0, "GradReducer: bucket_bytes must be positive, got {}", options.bucket_bytes);
  std::unordered_set<const TensorImpl*> seen;
  for (const ReducedParameter& r : params_) {
    MT_CHECK(r.comm != nullptr, "GradReducer: parameter '{}' has no communicator", r.param.name);
    check_parameter("GradReducer", r.param, params_.front().param, seen);
  }
  bucket_of_.resize(params_.size());
  ready_.resize(params_.size());
  std::vector<Bucket*> open;  // at most one per (communicator, dtype)
  for (size_t i = params_.size(); i-- > 0;) {
    const ReducedParameter& r = params_[i];
    index_[&r.param.tensor.impl()] = i;
    const DType dtype = bucket_dtype(r.param);
    const int64_t capacity = std::max<int64_t>(1, options.bucket_bytes / dtype_size(dtype));
    const int64_t n = r.param.tensor.numel();
    auto it = std::find_if(open.begin(), open.end(), [&](Bucket* b) { return b->comm == r.comm && b->dtype == dtype; });
    if (it != open.end() && (*it)->numel + n > capacity) {
      open.erase(it);
      it = open.end();
    }
    if (it == open.end()) {
      buckets_.push_back(std::make_unique<Bucket>());
      buckets_.back()->comm = r.comm;
      buckets_.back()->dtype = dtype;
      open.push_back(buckets_.back().get());
      it = open.end() - 1;
    }
    (*it)->members.push_back(i);
    (*it)->numel += n;
    bucket_of_[i] = static_cast<size_t>(std::find_if(buckets_.begin(), buckets_.end(),
                                                     [&](const auto& b) { return b.get() == *it; }) -
                                        buckets_.begin());
  }
}

GradReducer::~GradReducer() = default;

std::vector<std::vector<size_t>> GradReducer::bucket_members() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : buckets_) out.push_back(b->members);
  return out;
}

void GradReducer::begin() {
  MT_CHECK(!in_step_, "GradReducer::begin: the previous step was not finished (call finish())");
  for (auto& b : buckets_) {
    b->num_ready = 0;
    b->done = false;
    b->sum.reset();
    b->flag_sum.reset();
  }
  std::fill(ready_.begin(), ready_.end(), false);
  next_to_start_ = 0;
  if (!groups_ready_ && !params_.empty() && params_.front().param.tensor.is_cuda()) {
    // A group's NCCL communicator is made by its first CUDA collective, which
    // blocks until every rank of the group makes it: here, where every rank
    // is, not in backward, where a rank could wait in it for a peer that waits
    // in an expert all-to-all for this rank. Groups in bucket order, the same
    // on every rank.
    NoGradGuard no_grad;
    std::vector<Communicator*> done;
    for (const auto& b : buckets_) {
      if (std::find(done.begin(), done.end(), b->comm) != done.end()) continue;
      done.push_back(b->comm);
      Tensor one = zeros(Shape{1}, DType::f32, params_.front().param.tensor.device());
      b->comm->all_reduce_sum(one);
    }
  }
  groups_ready_ = true;
  in_step_ = true;
}

void GradReducer::grad_ready(const Tensor& leaf) {
  if (!in_step_) return;
  auto it = index_.find(&leaf.impl());
  if (it == index_.end() || ready_[it->second]) return;
  ready_[it->second] = true;
  Bucket& b = *buckets_[bucket_of_[it->second]];
  if (++b.num_ready == b.members.size()) start_ready_buckets();
  // MPI progresses started sums only inside MPI calls: give it one per grad.
  for (size_t k = 0; k < next_to_start_; ++k) {
    Bucket& started = *buckets_[k];
    if (started.sum && !started.done) started.done = started.sum->test() && started.flag_sum->test();
  }
}

void GradReducer::start_ready_buckets() {
  while (next_to_start_ < buckets_.size() &&
         buckets_[next_to_start_]->num_ready == buckets_[next_to_start_]->members.size())
    start(*buckets_[next_to_start_++]);
}

// Packs the bucket's grads (zeros where none) and starts both sums.
void GradReducer::start(Bucket& b) {
  NoGradGuard no_grad;
  const Device device = params_.front().param.tensor.device();
  if (!b.buffer.defined()) b.buffer = empty(Shape{b.numel}, b.dtype, device);
  b.flags = empty(Shape{static_cast<int64_t>(b.members.size())}, DType::i32);
  for (size_t k = 0; k < b.members.size(); ++k) {
    const GradTensor& p = params_[b.members[k]].param;
    check_param_grad("GradReducer", p);
    b.flags.data<int32_t>()[k] = p.tensor.grad().defined() ? 1 : 0;
  }
  if (device.is_cuda()) {
    std::vector<const GradTensor*> list;
    for (size_t i : b.members) list.push_back(&params_[i].param);
    device_pack(b.buffer, list.data(), list.size());
  } else {
    dispatch_float(b.dtype, "GradReducer", [&](auto tag) {
      using T = decltype(tag);
      T* data = b.buffer.data<T>();
      for (size_t i : b.members) {
        pack(data, params_[i].param);
        data += params_[i].param.tensor.numel();
      }
    });
  }
  b.sum = b.comm->start_all_reduce_sum(b.buffer);
  b.flag_sum = b.comm->start_all_reduce_sum(b.flags);
}

GradSyncStats GradReducer::finish() {
  MT_CHECK(in_step_, "GradReducer::finish: no step in progress (call begin() before backward)");
  in_step_ = false;
  NoGradGuard no_grad;
  GradSyncStats stats;
  stats.num_started_early = static_cast<int>(next_to_start_);
  // What backward did not complete here, in the same order as every rank.
  for (; next_to_start_ < buckets_.size(); ++next_to_start_) start(*buckets_[next_to_start_]);
  for (auto& bp : buckets_) {
    Bucket& b = *bp;
    b.sum->wait();
    b.flag_sum->wait();
    b.sum.reset();
    b.flag_sum.reset();
    const bool cuda = b.buffer.is_cuda();
    int64_t at = 0;
    for (size_t k = 0; k < b.members.size(); ++k) {
      const GradTensor& p = params_[b.members[k]].param;
      const int64_t n = p.tensor.numel();
      if (b.flags.data<int32_t>()[k] > 0) {  // some rank has a grad
        if (cuda) {
          device_unpack(b.buffer, p, at, options_.scale);
        } else {
          dispatch_float(b.dtype, "GradReducer", [&](auto tag) {
            using T = decltype(tag);
            unpack(b.buffer.data<T>() + at, p, options_.scale);
          });
        }
      }
      at += n;
    }
    ++stats.num_buckets;
    stats.bytes += b.numel * dtype_size(b.dtype);
  }
  return stats;
}

}  // namespace moetrain::comm
