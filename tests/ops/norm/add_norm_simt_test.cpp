// The bodies of the fused residual add + norm CUDA kernels (ops/norm/norm_simt.h),
// run on the host block by block (simt::HostBlock) in the natural, reversed and
// shuffled thread orders, against the unfused CPU ops: add, then layer_norm or
// rms_norm, and their gradients through autograd. f64 and f32 inputs, and bf16
// (moetrain::bf16 storage, f32 arithmetic) against the CPU's f32 ops on the same
// rounded values; widths off the block sizes. The [cuda] case of norm_test.cpp
// runs the kernels themselves.
#include <catch2/catch.hpp>

#include <vector>

#include "moetrain.h"
#include "ops/norm/norm_simt.h"
#include "ops/simt_orders.h"
#include "testing.h"

using namespace moetrain;

namespace {

// Storage vector of a tensor (f32/f64 as they are; bf16 from f32 values).
template <class T>
std::vector<T> storage_of(const Tensor& t) {
  std::vector<double> v = t.to(DType::f64).to_vector();
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) simt::acc_store(out[i], static_cast<simt::norm_acc_t<T>>(v[i]));
  return out;
}
template <class T>
Tensor tensor_of(const std::vector<T>& v, const Shape& shape) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = static_cast<double>(simt::acc_load(v[i]));
  return from_vector(d, shape, DType::f64);
}

struct BodyOut {
  Tensor h, y, stats, grad_x;  // stats: mean (LayerNorm) then rstd, [2, rows]
};
bool same_bits(const BodyOut& a, const BodyOut& b) {
  return testing::same_bits({&a.h, &a.y, &a.stats, &a.grad_x}, {&b.h, &b.y, &b.stats, &b.grad_x});
}

// Forward then backward bodies over every row, storage type T.
template <class T>
BodyOut run_bodies(bool centre, const Tensor& x, const Tensor& d, const Tensor& w, const Tensor& b,
                   const Tensor& grad_h, const Tensor& grad_y, int threads, simt::HostOrder order) {
  using A = simt::norm_acc_t<T>;
  const int64_t n = x.size(-1), rows = x.numel() / n;
  std::vector<T> vx = storage_of<T>(x), vd = storage_of<T>(d), vw = storage_of<T>(w), vb = storage_of<T>(b);
  std::vector<T> vgh = storage_of<T>(grad_h), vgy = storage_of<T>(grad_y);
  std::vector<T> h(vx.size()), y(vx.size()), gx(vx.size());
  std::vector<A> mean(static_cast<size_t>(rows), A(-7)), rstd(static_cast<size_t>(rows), A(-7));
  simt::AddNormArgs<T> a;
  a.x = vx.data();
  a.d = vd.data();
  a.w = vw.data();
  a.b = centre ? vb.data() : nullptr;
  a.h = h.data();
  a.y = y.data();
  a.mean = mean.data();
  a.rstd = rstd.data();
  a.grad_h = vgh.data();
  a.grad_y = vgy.data();
  a.grad_x = gx.data();
  a.rows = rows;
  a.n = n;
  a.centre = centre;
  a.scale = 1.0 / static_cast<double>(n);
  a.eps = 1e-5;
  std::vector<A> sh(static_cast<size_t>(simt::add_norm_shared_elements(threads)));
  const simt::HostBlock blk = testing::host_block(threads, order);
  for (int64_t r = 0; r < rows; ++r) simt::add_norm_forward_row(blk, a, r, sh.data());
  for (int64_t r = 0; r < rows; ++r) simt::add_norm_backward_row(blk, a, r, sh.data());
  std::vector<double> stats(static_cast<size_t>(2 * rows));
  for (int64_t r = 0; r < rows; ++r) {
    stats[static_cast<size_t>(r)] = centre ? static_cast<double>(mean[static_cast<size_t>(r)]) : 0.0;
    stats[static_cast<size_t>(rows + r)] = static_cast<double>(rstd[static_cast<size_t>(r)]);
  }
  return {tensor_of(h, x.shape()), tensor_of(y, x.shape()), from_vector(stats, {2, rows}, DType::f64),
          tensor_of(gx, x.shape())};
}

// The unfused CPU ops in `dt` (f32 or f64) on the inputs: h, y and the gradient of x
// (that of d is the same) for upstream gradients grad_h, grad_y.
struct Reference {
  Tensor h, y, grad_x;
};
Reference unfused(bool centre, DType dt, const Tensor& x0, const Tensor& d0, const Tensor& w, const Tensor& b,
                  const Tensor& grad_h, const Tensor& grad_y) {
  Tensor x = x0.to(dt).detach(), d = d0.to(dt).detach();
  x.set_requires_grad(true);
  d.set_requires_grad(true);
  Tensor h = add(x, d);
  Tensor y = centre ? layer_norm(h, w.to(dt), b.to(dt), 1e-5) : rms_norm(h, w.to(dt), 1e-5);
  autograd::backward({h, y}, {grad_h.to(dt), grad_y.to(dt)});
  return {h.detach(), y.detach(), x.grad()};
}

// x rounded to bf16 and back (the values a bf16 run holds), as f64.
Tensor bf16_values(const Tensor& x) { return x.to(DType::bf16).to(DType::f64); }

}  // namespace

TEST_CASE("add_norm: the CUDA bodies, run on the host, match add then the norm on the CPU",
          "[ops][norm][add_norm][simt]") {
  for (int64_t cols : {1, 31, 33, 130, 768})
    for (int threads : {1, 32, 128})
      for (bool centre : {true, false})
        DYNAMIC_SECTION((centre ? "layer" : "rms") << " cols " << cols << " threads " << threads) {
          const Shape shape{2, 3, cols};
          const uint64_t s = static_cast<uint64_t>(cols) * 10;
          Tensor x = mul_scalar(randn(shape, DType::f64, s), 3.0), d = randn(shape, DType::f64, s + 1);
          Tensor w = randn({cols}, DType::f64, s + 2), b = randn({cols}, DType::f64, s + 3);
          Tensor gh = randn(shape, DType::f64, s + 4), gy = randn(shape, DType::f64, s + 5);
          auto check = [&](const BodyOut& got, const Reference& want, double tol_h, double tol_y, double tol_g) {
            CHECK(testing::rel_error(got.h, want.h.to(DType::f64)) <= tol_h);
            CHECK(testing::rel_error(got.y, want.y.to(DType::f64)) <= tol_y);
            CHECK(testing::rel_error(got.grad_x, want.grad_x.to(DType::f64)) <= tol_g);
          };
          {
            INFO("f64");
            BodyOut got = testing::run_in_all_orders(
                [&](simt::HostOrder o) { return run_bodies<double>(centre, x, d, w, b, gh, gy, threads, o); });
            check(got, unfused(centre, DType::f64, x, d, w, b, gh, gy), 0, 1e-13, 1e-12);
          }
          {
            INFO("f32");
            BodyOut got = testing::run_in_all_orders(
                [&](simt::HostOrder o) { return run_bodies<float>(centre, x, d, w, b, gh, gy, threads, o); });
            // h = x + d is one f32 addition on both sides: equal.
            check(got, unfused(centre, DType::f32, x, d, w, b, gh, gy), 0, 2e-6, 2e-5);
          }
          {
            INFO("bf16");
            const Tensor xb = bf16_values(x), db = bf16_values(d), wb = bf16_values(w), bb = bf16_values(b);
            const Tensor ghb = bf16_values(gh), gyb = bf16_values(gy);
            BodyOut got = testing::run_in_all_orders([&](simt::HostOrder o) {
              return run_bodies<moetrain::bf16>(centre, xb, db, wb, bb, ghb, gyb, threads, o);
            });
            // h is the f32 sum rounded once to bf16, exactly; y and grad_x are bf16
            // stores of f32 arithmetic on the rounded h.
            const Reference want = unfused(centre, DType::f32, xb, db, wb, bb, ghb, gyb);
            CHECK(testing::same_bits(got.h, bf16_values(want.h)));
            const Reference at_h = unfused(centre, DType::f32, got.h, zeros(shape, DType::f64), wb, bb, ghb, gyb);
            check(got, at_h, 0, 8e-3, 8e-3);
            check(got, want, 8e-3, 3e-2, 3e-2);
          }
        }
}
