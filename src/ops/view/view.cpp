// Shape ops and their backward: reshape <-> reshape, permute <-> inverse
// permute, slice <-> zero-padded copy back, concat <-> slices, index_select <->
// index add.
#include "ops/view/view.h"

#include <numeric>

#include "autograd/node.h"
#include "core/dispatch.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/view/view_kernels.h"

namespace moetrain {

namespace {

Shape infer_shape(const Shape& in, std::vector<int64_t> requested) {
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < requested.size(); ++i) {
    if (requested[i] == -1) {
      MT_CHECK(infer < 0, "reshape: more than one -1 in [{}] (input {})", fmt::join(requested, ", "), in);
      infer = static_cast<int>(i);
    } else {
      MT_CHECK(requested[i] >= 0, "reshape: negative extent in [{}] (input {})", fmt::join(requested, ", "), in);
      known *= requested[i];
    }
  }
  if (infer >= 0) {
    MT_CHECK(known > 0 && in.numel() % known == 0, "reshape: cannot view {} ({} elements) as [{}]", in, in.numel(),
             fmt::join(requested, ", "));
    requested[static_cast<size_t>(infer)] = in.numel() / known;
  }
  Shape out(requested);
  MT_CHECK(out.numel() == in.numel(), "reshape: cannot view {} ({} elements) as {} ({} elements)", in, in.numel(),
           out, out.numel());
  return out;
}

// Shape ops accept any dtype of the CPU; gradients exist for floating tensors.
void check_defined(const char* op, const Tensor& x) { MT_CHECK(x.defined(), "{}: input is undefined", op); }

}  // namespace

Tensor reshape(const Tensor& x, std::initializer_list<int64_t> dims) {
  return reshape(x, std::vector<int64_t>(dims));
}

Tensor reshape(const Tensor& x, const Shape& shape) { return reshape(x, shape.vec()); }

Tensor reshape(const Tensor& x, const std::vector<int64_t>& dims) {
  check_defined("reshape", x);
  Shape out_shape = infer_shape(x.shape(), dims);
  if (out_shape == x.shape() && !autograd::needs_grad({x})) return x;
  Tensor y = alias(x, out_shape);
  Shape in_shape = x.shape();
  return record("reshape", y, {x}, [in_shape](const Tensor& g) { return Grads{reshape(g, in_shape)}; });
}

Tensor flatten(const Tensor& x, int64_t start_dim, int64_t end_dim) {
  check_defined("flatten", x);
  if (x.dim() == 0) return reshape(x, {1});
  int s = x.shape().normalize_dim(start_dim), e = x.shape().normalize_dim(end_dim);
  MT_CHECK(s <= e, "flatten: start_dim {} is after end_dim {} for {}", start_dim, end_dim, x.shape());
  std::vector<int64_t> dims;
  for (int i = 0; i < s; ++i) dims.push_back(x.size(i));
  dims.push_back(x.shape().numel(s, e + 1));
  for (int i = e + 1; i < x.dim(); ++i) dims.push_back(x.size(i));
  return reshape(x, dims);
}

Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) {
  check_defined("permute", x);
  MT_CHECK(static_cast<int>(dims.size()) == x.dim(), "permute: {} dims given for {} of rank {}", dims.size(),
           x.shape(), x.dim());
  std::vector<int64_t> perm(dims.size());
  std::vector<bool> seen(dims.size(), false);
  std::vector<int64_t> out_dims(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    int d = x.shape().normalize_dim(dims[i]);
    MT_CHECK(!seen[static_cast<size_t>(d)], "permute: dim {} repeated in [{}]", d, fmt::join(dims, ", "));
    seen[static_cast<size_t>(d)] = true;
    perm[i] = d;
    out_dims[i] = x.size(d);
  }
  Tensor y = empty(Shape(out_dims), x.dtype(), x.device());
  MT_ON_DEVICE(x, permute_copy, y, x, perm);
  std::vector<int64_t> inverse(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inverse[static_cast<size_t>(perm[i])] = static_cast<int64_t>(i);
  return record("permute", y, {x}, [inverse](const Tensor& g) { return Grads{permute(g, inverse)}; });
}

Tensor transpose(const Tensor& x, int64_t dim0, int64_t dim1) {
  check_defined("transpose", x);
  std::vector<int64_t> perm(static_cast<size_t>(x.dim()));
  std::iota(perm.begin(), perm.end(), 0);
  std::swap(perm[static_cast<size_t>(x.shape().normalize_dim(dim0))],
            perm[static_cast<size_t>(x.shape().normalize_dim(dim1))]);
  return permute(x, perm);
}

Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end) {
  check_defined("slice", x);
  int d = x.shape().normalize_dim(dim);
  int64_t n = x.size(d);
  int64_t s = start < 0 ? start + n : start, e = end < 0 ? end + n : end;
  MT_CHECK(0 <= s && s <= e && e <= n, "slice: range [{}, {}) is out of bounds for dim {} of size {} (tensor {})",
           start, end, d, n, x.shape());
  int64_t outer = x.shape().numel(0, d), inner = x.shape().numel(d + 1, x.dim());
  Shape out_shape = x.shape().with(d, e - s);
  Tensor y;
  if (outer == 1) {
    y = alias(x, out_shape, s * inner);  // a contiguous range: a view
  } else {
    y = empty(out_shape, x.dtype(), x.device());
    MT_ON_DEVICE(x, copy_from_mid, y, x, outer, inner, s);
  }
  Shape in_shape = x.shape();
  return record("slice", y, {x}, [in_shape, outer, inner, s](const Tensor& g) {
    Tensor gx = zeros(in_shape, g.dtype(), g.device());
    MT_ON_DEVICE(g, copy_into_mid, gx, g, outer, inner, s);
    return Grads{gx};
  });
}

Tensor concat(const Tensors& xs, int64_t dim) {
  MT_CHECK(!xs.empty(), "concat: no tensors given");
  const Tensor& first = xs[0];
  check_defined("concat", first);
  int d = first.shape().normalize_dim(dim);
  int64_t total = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    check_defined("concat", xs[i]);
    check_same_kind("concat", first, xs[i]);
    MT_CHECK(xs[i].dim() == first.dim() && xs[i].shape().with(d, 1) == first.shape().with(d, 1),
             "concat: tensor {} has shape {}, incompatible with {} along dim {}", i, xs[i].shape(), first.shape(), d);
    total += xs[i].size(d);
  }
  Tensor y = empty(first.shape().with(d, total), first.dtype(), first.device());
  int64_t outer = first.shape().numel(0, d), inner = first.shape().numel(d + 1, first.dim());
  std::vector<int64_t> starts;
  int64_t at = 0;
  for (const Tensor& x : xs) {
    MT_ON_DEVICE(y, copy_into_mid, y, x, outer, inner, at);
    starts.push_back(at);
    at += x.size(d);
  }
  std::vector<int64_t> sizes;
  for (const Tensor& x : xs) sizes.push_back(x.size(d));
  return record("concat", y, xs, [d, sizes, starts](const Tensor& g) {
    Grads grads;
    for (size_t i = 0; i < sizes.size(); ++i) grads.push_back(slice(g, d, starts[i], starts[i] + sizes[i]));
    return grads;
  });
}

Tensors split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  check_defined("split", x);
  int d = x.shape().normalize_dim(dim);
  int64_t sum = 0;
  for (int64_t s : sizes) {
    MT_CHECK(s >= 0, "split: negative size in [{}]", fmt::join(sizes, ", "));
    sum += s;
  }
  MT_CHECK(sum == x.size(d), "split: sizes [{}] sum to {} but dim {} of {} has {}", fmt::join(sizes, ", "), sum, d,
           x.shape(), x.size(d));
  Tensors parts;
  int64_t at = 0;
  for (int64_t s : sizes) {
    parts.push_back(slice(x, d, at, at + s));
    at += s;
  }
  return parts;
}

namespace {
// Reads the indices on the host (a copy, and a wait, for CUDA indices): an out of
// range index is a clear error here instead of a wild read in a kernel. Returns
// the host copy (the backward kernels take it).
Tensor check_indices(const char* op, const Tensor& index, int64_t limit) {
  Tensor host = index.to(kCpu);
  dispatch_index(index.dtype(), op, [&](auto tag) {
    using I = decltype(tag);
    const I* p = host.data<I>();
    for (int64_t i = 0; i < index.numel(); ++i)
      MT_CHECK(p[i] >= 0 && p[i] < limit, "{}: index {} at position {} is out of range [0, {})", op,
               static_cast<int64_t>(p[i]), i, limit);
  });
  return host;
}
}  // namespace

Tensor index_select(const Tensor& x, int64_t dim, const std::vector<int64_t>& index) {
  return index_select(x, dim, from_span<int64_t>(index, {static_cast<int64_t>(index.size())}));
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& ids) {
  check_defined("index_select", x);
  check_rank("index_select", "index", ids, 1);
  int d = x.shape().normalize_dim(dim);
  Tensor host_index = check_indices("index_select", ids, x.size(d));
  // The kernel reads the indices where x lives.
  Tensor index = ids.to(x.device());
  int64_t outer = x.shape().numel(0, d), inner = x.shape().numel(d + 1, x.dim());
  Tensor y = empty(x.shape().with(d, index.numel()), x.dtype(), x.device());
  MT_ON_DEVICE(x, index_select_forward, y, x, index, outer, inner);
  Shape in_shape = x.shape();
  return record("index_select", y, {x}, [in_shape, host_index, outer, inner](const Tensor& g) {
    Tensor gx = zeros(in_shape, g.dtype(), g.device());
    MT_ON_DEVICE(g, index_select_backward, gx, g, host_index, outer, inner);
    return Grads{gx};
  });
}

}  // namespace moetrain
