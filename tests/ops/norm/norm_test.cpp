#include <catch2/catch.hpp>

#include <cmath>

#include "backend/cpu/parallel.h"
#include "backend/cpu/isa.h"
#include "moetrain.h"
#include "testing.h"
#include "ops/cuda_vs_cpu.h"

using namespace moetrain;
using moetrain::testing::check_gradients;

TEST_CASE("layer_norm: forward matches a plain loop", "[ops][norm]") {
  Tensor x = randn({3, 33}, DType::f64, 1), w = randn({33}, DType::f64, 2), b = randn({33}, DType::f64, 3);
  std::vector<double> vx = x.to_vector(), vw = w.to_vector(), vb = b.to_vector(), y = layer_norm(x, w, b, 1e-5).to_vector();
  for (int r = 0; r < 3; ++r) {
    double mu = 0, var = 0;
    for (int j = 0; j < 33; ++j) mu += vx[r * 33 + j] / 33;
    for (int j = 0; j < 33; ++j) var += (vx[r * 33 + j] - mu) * (vx[r * 33 + j] - mu) / 33;
    for (int j = 0; j < 33; ++j)
      REQUIRE(y[r * 33 + j] == Approx((vx[r * 33 + j] - mu) / std::sqrt(var + 1e-5) * vw[j] + vb[j]).epsilon(1e-12));
  }
}

TEST_CASE("rms_norm and l2_norm: forward matches a plain loop", "[ops][norm]") {
  Tensor x = randn({4, 31}, DType::f64, 4), w = randn({31}, DType::f64, 5);
  std::vector<double> vx = x.to_vector(), vw = w.to_vector();
  std::vector<double> y = rms_norm(x, w, 1e-5).to_vector(), y2 = l2_norm(x, 1e-6).to_vector(),
                      y3 = rms_norm(x, Tensor(), 1e-5).to_vector();
  for (int r = 0; r < 4; ++r) {
    double ss = 0;
    for (int j = 0; j < 31; ++j) ss += vx[r * 31 + j] * vx[r * 31 + j];
    for (int j = 0; j < 31; ++j) {
      REQUIRE(y[r * 31 + j] == Approx(vw[j] * vx[r * 31 + j] / std::sqrt(ss / 31 + 1e-5)).epsilon(1e-12));
      REQUIRE(y3[r * 31 + j] == Approx(vx[r * 31 + j] / std::sqrt(ss / 31 + 1e-5)).epsilon(1e-12));
      REQUIRE(y2[r * 31 + j] == Approx(vx[r * 31 + j] / std::sqrt(ss + 1e-6)).epsilon(1e-12));
    }
  }
}

TEST_CASE("gated_rms_norm: forward matches rms_norm times sigmoid, and a plain loop", "[ops][norm]") {
  Tensor x = randn({2, 3, 17}, DType::f64, 21), w = randn({17}, DType::f64, 22), z = randn({2, 3, 17}, DType::f64, 23);
  z = mul_scalar(z, 4.0);  // gates near 0 and 1
  std::vector<double> vx = x.to_vector(), vw = w.to_vector(), vz = z.to_vector();
  std::vector<double> y = gated_rms_norm(x, w, z, 1e-5).to_vector();
  for (int r = 0; r < 6; ++r) {
    double ss = 0;
    for (int j = 0; j < 17; ++j) ss += vx[r * 17 + j] * vx[r * 17 + j];
    for (int j = 0; j < 17; ++j) {
      double gate = 1.0 / (1.0 + std::exp(-vz[r * 17 + j]));
      REQUIRE(y[r * 17 + j] == Approx(vw[j] * vx[r * 17 + j] / std::sqrt(ss / 17 + 1e-5) * gate).epsilon(1e-12));
    }
  }
  CHECK(moetrain::testing::max_abs_diff(gated_rms_norm(x, w, z), mul(rms_norm(x, w), sigmoid(z))) < 1e-14);
}

TEST_CASE("norms: gradients match finite differences", "[ops][norm]") {
  Tensor x = randn({2, 3, 33}, DType::f64, 7), w = randn({33}, DType::f64, 8), b = randn({33}, DType::f64, 9);
  check_gradients([](const Tensors& in) { return layer_norm(in[0], in[1], in[2], 1e-5); }, {x, w, b});
  check_gradients([](const Tensors& in) { return rms_norm(in[0], in[1], 1e-5); }, {x, w});
  check_gradients([](const Tensors& in) { return rms_norm(in[0], Tensor(), 1e-5); }, {x});
  check_gradients([](const Tensors& in) { return l2_norm(in[0], 1e-6); }, {x});
  Tensor z = mul_scalar(randn({2, 3, 33}, DType::f64, 10), 2.0);
  check_gradients([](const Tensors& in) { return gated_rms_norm(in[0], in[1], in[2], 1e-5); }, {x, w, z});
  check_gradients([](const Tensors& in) { return gated_rms_norm(in[0], Tensor(), in[1], 1e-5); }, {x, z});
}

TEST_CASE("norms: weight gradient does not depend on the thread count", "[ops][norm]") {
  Tensor x = randn({257, 37}, DType::f32, 1), w = randn({37}, DType::f32, 2);
  auto grad_w = [&](int threads) {
    cpu::set_num_threads(threads);
    Tensor wl = w.detach().clone();
    wl.set_requires_grad(true);
    sum(rms_norm(x, wl, 1e-5)).backward();
    return wl.grad();
  };
  int restore = cpu::num_threads();
  Tensor g1 = grad_w(1), g2 = grad_w(2);
  cpu::set_num_threads(restore);
  CHECK(moetrain::testing::bitwise_equal(g1, g2));
}

TEST_CASE("layer_norm: f32 forward and gradients match double loops", "[ops][norm]") {
  // The vectorised f32 kernels (statistics in double, elementwise in f32) against the
  // formulas in double, written here; rows off the vector widths.
  for (int64_t n : {31, 33, 770}) {
    DYNAMIC_SECTION("n=" << n) {
      const int64_t rows = 19;
      Tensor x = add_scalar(randn({rows, n}, DType::f32, n), 0.5), w = randn({n}, DType::f32, n + 1),
             b = randn({n}, DType::f32, n + 2), gy = randn({rows, n}, DType::f32, n + 3);
      Tensor xl = x.detach().clone(), wl = w.detach().clone(), bl = b.detach().clone();
      xl.set_requires_grad(true);
      wl.set_requires_grad(true);
      bl.set_requires_grad(true);
      Tensor y = layer_norm(xl, wl, bl, 1e-5);
      y.backward(gy);
      std::vector<double> vx = x.to_vector(), vw = w.to_vector(), vb = b.to_vector(), vg = gy.to_vector(),
                          vy = y.to_vector(), dx = xl.grad().to_vector(), dw = wl.grad().to_vector(),
                          db = bl.grad().to_vector();
      std::vector<double> rdw(static_cast<size_t>(n), 0.0), rdb(static_cast<size_t>(n), 0.0);
      double worst_y = 0, worst_dx = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const double* xr = vx.data() + r * n;
        const double* gr = vg.data() + r * n;
        double mu = 0, var = 0, mg = 0, mgx = 0;
        for (int64_t j = 0; j < n; ++j) mu += xr[j] / static_cast<double>(n);
        for (int64_t j = 0; j < n; ++j) var += (xr[j] - mu) * (xr[j] - mu) / static_cast<double>(n);
        const double rs = 1 / std::sqrt(var + 1e-5);
        for (int64_t j = 0; j < n; ++j) {
          const double h = (xr[j] - mu) * rs;
          worst_y = std::max(worst_y, std::abs(vy[static_cast<size_t>(r * n + j)] - (h * vw[j] + vb[j])));
          mg += gr[j] * vw[j] / static_cast<double>(n);
          mgx += gr[j] * vw[j] * h / static_cast<double>(n);
          rdw[static_cast<size_t>(j)] += gr[j] * h;
          rdb[static_cast<size_t>(j)] += gr[j];
        }
        for (int64_t j = 0; j < n; ++j) {
          const double ref = rs * (gr[j] * vw[j] - mg - (xr[j] - mu) * rs * mgx);
          worst_dx = std::max(worst_dx, std::abs(dx[static_cast<size_t>(r * n + j)] - ref));
        }
      }
      CHECK(worst_y < 5e-6);
      CHECK(worst_dx < 2e-5);
      for (int64_t j = 0; j < n; ++j) {
        REQUIRE(dw[static_cast<size_t>(j)] == Approx(rdw[static_cast<size_t>(j)]).margin(1e-5));
        REQUIRE(db[static_cast<size_t>(j)] == Approx(rdb[static_cast<size_t>(j)]).margin(1e-5));
      }
    }
  }
}

TEST_CASE("layer_norm: forward and all gradients do not depend on the thread count", "[ops][norm]") {
  Tensor x = randn({257, 771}, DType::f32, 1), w = randn({771}, DType::f32, 2), b = randn({771}, DType::f32, 3);
  Tensor gy = randn({257, 771}, DType::f32, 4);
  auto run = [&](int threads) {
    cpu::set_num_threads(threads);
    Tensor xl = x.detach().clone(), wl = w.detach().clone(), bl = b.detach().clone();
    xl.set_requires_grad(true);
    wl.set_requires_grad(true);
    bl.set_requires_grad(true);
    Tensor y = layer_norm(xl, wl, bl, 1e-5);
    y.backward(gy);
    return Tensors{y.detach(), xl.grad(), wl.grad(), bl.grad()};
  };
  int restore = cpu::num_threads();
  Tensors one = run(1), two = run(2);
  cpu::set_num_threads(restore);
  for (size_t i = 0; i < one.size(); ++i) CHECK(moetrain::testing::bitwise_equal(one[i], two[i]));
}

TEST_CASE("layer_norm: every vector copy agrees with f64; the FMA copies give the same bits", "[ops][norm]") {
  Tensor x = add_scalar(randn({37, 771}, DType::f64, 31), 0.5), w = randn({771}, DType::f64, 32),
         b = randn({771}, DType::f64, 33), dy = randn({37, 771}, DType::f64, 34);
  auto run = [&](DType dt) {
    Tensor xl = x.to(dt).detach().set_requires_grad(), wl = w.to(dt).detach().set_requires_grad(),
           bl = b.to(dt).detach().set_requires_grad();
    Tensor y = layer_norm(xl, wl, bl, 1e-5);
    y.backward(dy.to(dt));
    return std::vector<Tensor>{y, xl.grad(), wl.grad(), bl.grad()};
  };
  moetrain::testing::check_vector_copies(run, 1e-5);
}

TEST_CASE("norms: bad weight shape names the op and shapes", "[ops][norm][errors]") {
  Tensor x = randn({3, 8}, DType::f32, 1), w = randn({7}, DType::f32, 2);
  CHECK_THROWS_WITH(rms_norm(x, w), Catch::Contains("rms_norm") && Catch::Contains("[7]") && Catch::Contains("[3, 8]"));
  CHECK_THROWS_WITH(layer_norm(x, w, Tensor()), Catch::Contains("layer_norm"));
  CHECK_THROWS_WITH(gated_rms_norm(x, Tensor(), randn({3, 7}, DType::f32, 3)),
                    Catch::Contains("gated_rms_norm") && Catch::Contains("[3, 7]") && Catch::Contains("[3, 8]"));
}

// CUDA twins: forward and every gradient against the CPU kernels, widths off the
// block and tile sizes (1, 31, 33, 257, 4099 columns).
TEST_CASE("norms: CUDA matches CPU", "[ops][norm][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (int64_t cols : {1, 31, 33, 257, 4099}) {
      DYNAMIC_SECTION(fmt::format("{} cols={}", dt, cols)) {
        Tensor x = randn({7, cols}, DType::f64, static_cast<uint64_t>(cols)), w = randn({cols}, DType::f64, 2),
               b = randn({cols}, DType::f64, 3);
        x = mul_scalar(x, 3.0);  // rows with a spread of scales
        CudaCompare tol = tolerance_for(dt);
        check_cuda_matches_cpu([](const Tensors& in) { return layer_norm(in[0], in[1], in[2], 1e-5); }, {x, w, b},
                               {true, true, true}, dt, tol);
        check_cuda_matches_cpu([](const Tensors& in) { return layer_norm(in[0], Tensor(), Tensor(), 1e-5); }, {x},
                               {true}, dt, tol);
        check_cuda_matches_cpu([](const Tensors& in) { return rms_norm(in[0], in[1], 1e-5); }, {x, w}, {true, true},
                               dt, tol);
        check_cuda_matches_cpu([](const Tensors& in) { return rms_norm(in[0], Tensor(), 1e-5); }, {x}, {true}, dt, tol);
        check_cuda_matches_cpu([](const Tensors& in) { return l2_norm(in[0], 1e-6); }, {x}, {true}, dt, tol);
        Tensor z = mul_scalar(randn({7, cols}, DType::f64, 4), 2.0);
        check_cuda_matches_cpu([](const Tensors& in) { return gated_rms_norm(in[0], in[1], in[2], 1e-5); },
                               {x, w, z}, {true, true, true}, dt, tol);
      }
    }
}

TEST_CASE("norms: CUDA handles 3-d inputs, many rows and a weight without grad", "[ops][norm][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  Tensor x = randn({3, 700, 65}, DType::f64, 11), w = randn({65}, DType::f64, 12), b = randn({65}, DType::f64, 13);
  CudaCompare tol = tolerance_for(DType::f32);
  check_cuda_matches_cpu([](const Tensors& in) { return layer_norm(in[0], in[1], in[2], 1e-5); }, {x, w, b},
                         {true, false, true}, DType::f32, tol);
  check_cuda_matches_cpu([](const Tensors& in) { return rms_norm(in[0], in[1], 1e-5); }, {x, w}, {false, true},
                         DType::f32, tol);
  Tensor z = randn({3, 700, 65}, DType::f64, 17);
  check_cuda_matches_cpu([](const Tensors& in) { return gated_rms_norm(in[0], in[1], in[2], 1e-5); }, {x, w, z},
                         {true, false, true}, DType::f32, tol);
  // Enough rows for the most row chunks of the weight gradient (1024 chunks of 293 rows).
  Tensor xl = randn({300001, 5}, DType::f64, 14), wl = randn({5}, DType::f64, 15), bl = randn({5}, DType::f64, 16);
  check_cuda_matches_cpu([](const Tensors& in) { return layer_norm(in[0], in[1], in[2], 1e-5); }, {xl, wl, bl},
                         {true, true, true}, DType::f32, tol);
}

// The fused residual add + norm against the unfused ops it replaces.
namespace {
struct AddNormRun {
  Tensors out;    // h, y
  Tensors grads;  // x, d, w (, b)
};

// add_layer_norm (rms = false) or add_rms_norm, fused or as add then the norm, with
// gradients from dh and dy (h is used by a later op too, as in a residual stream).
AddNormRun run_add_norm(bool rms, bool fused, const Tensor& x0, const Tensor& d0, const Tensor& w0,
                        const Tensor& b0, const Tensor& dh, const Tensor& dy) {
  Tensor x = x0.detach().clone(), d = d0.detach().clone(), w = w0.detach().clone(), b = b0.detach().clone();
  for (Tensor* t : {&x, &d, &w, &b}) t->set_requires_grad(true);
  Tensor h, y;
  if (fused) {
    ResidualNorm r = rms ? add_rms_norm(x, d, w, 1e-5) : add_layer_norm(x, d, w, b, 1e-5);
    h = r.sum;
    y = r.normed;
  } else {
    h = add(x, d);
    y = rms ? rms_norm(h, w, 1e-5) : layer_norm(h, w, b, 1e-5);
  }
  autograd::backward({h, y}, {dh, dy});
  return {{h, y}, rms ? Tensors{x.grad(), d.grad(), w.grad()} : Tensors{x.grad(), d.grad(), w.grad(), b.grad()}};
}
}  // namespace

TEST_CASE("add_layer_norm, add_rms_norm: the same bits as add then the norm on the CPU, every vector copy",
          "[ops][norm][add_norm]") {
  // f32 and f64; widths off the 8 lanes; a tiny residual next to a large x (rounding in the add).
  for (DType dt : {DType::f32, DType::f64})
    for (int64_t cols : {1, 7, 33, 768}) {
      Tensor x = mul_scalar(randn({2, 5, cols}, dt, 40 + static_cast<uint64_t>(cols)), 3.0);
      Tensor d = mul_scalar(randn({2, 5, cols}, dt, 41), 1e-3), w = randn({cols}, dt, 42), b = randn({cols}, dt, 43);
      Tensor dh = randn({2, 5, cols}, dt, 44), dy = randn({2, 5, cols}, dt, 45);
      for (bool rms : {false, true})
        for (cpu::VectorIsa isa : moetrain::testing::runnable_isas()) {
          INFO(fmt::format("{} cols={} {} copy {}", dt, cols, rms ? "rms" : "layer", cpu::vector_isa_name(isa)));
          cpu::cap_vector_isa_for_testing(isa);
          AddNormRun fused = run_add_norm(rms, true, x, d, w, b, dh, dy);
          AddNormRun plain = run_add_norm(rms, false, x, d, w, b, dh, dy);
          cpu::cap_vector_isa_for_testing(std::nullopt);
          for (size_t i = 0; i < plain.out.size(); ++i) CHECK(moetrain::testing::bitwise_equal(fused.out[i], plain.out[i]));
          for (size_t i = 0; i < plain.grads.size(); ++i) {
            INFO("gradient " << i);
            CHECK(moetrain::testing::bitwise_equal(fused.grads[i], plain.grads[i]));
          }
        }
    }
}

TEST_CASE("add_layer_norm, add_rms_norm: gradients of both outputs match finite differences",
          "[ops][norm][add_norm]") {
  Tensor x = randn({2, 3, 33}, DType::f64, 50), d = randn({2, 3, 33}, DType::f64, 51);
  Tensor w = randn({33}, DType::f64, 52), b = randn({33}, DType::f64, 53);
  auto both = [](const ResidualNorm& r) { return Tensors{r.sum, r.normed}; };
  check_gradients([&](const Tensors& in) { return both(add_layer_norm(in[0], in[1], in[2], in[3], 1e-5)); },
                  {x, d, w, b});
  check_gradients([&](const Tensors& in) { return both(add_layer_norm(in[0], in[1], Tensor(), Tensor(), 1e-5)); },
                  {x, d});
  check_gradients([&](const Tensors& in) { return both(add_rms_norm(in[0], in[1], in[2], 1e-5)); }, {x, d, w});
  check_gradients([&](const Tensors& in) { return both(add_rms_norm(in[0], in[1], Tensor(), 1e-5)); }, {x, d});
  // Only the normed output used: grad_x is the norm's input gradient alone.
  check_gradients([&](const Tensors& in) { return add_layer_norm(in[0], in[1], in[2], in[3], 1e-5).normed; },
                  {x, d, w, b});
}

TEST_CASE("add_layer_norm, add_rms_norm: errors name the shapes", "[ops][norm][add_norm][errors]") {
  Tensor x = randn({3, 8}, DType::f32, 1), w = randn({8}, DType::f32, 2);
  CHECK_THROWS_WITH(add_layer_norm(x, randn({3, 7}, DType::f32, 3), w, w),
                    Catch::Contains("add_layer_norm") && Catch::Contains("[3, 7]") && Catch::Contains("[3, 8]"));
  CHECK_THROWS_WITH(add_rms_norm(x, randn({8}, DType::f32, 3), w),
                    Catch::Contains("add_rms_norm") && Catch::Contains("[8]") && Catch::Contains("[3, 8]"));
  CHECK_THROWS_WITH(add_rms_norm(x, x, randn({7}, DType::f32, 4)),
                    Catch::Contains("add_rms_norm") && Catch::Contains("[7]") && Catch::Contains("[3, 8]"));
  CHECK_THROWS_WITH(add_layer_norm(x, x.to(DType::f64), w, w), Catch::Contains("add_layer_norm"));
  CHECK_THROWS_WITH(add_layer_norm(x, Tensor(), w, w), Catch::Contains("add_layer_norm") && Catch::Contains("[3, 8]"));
}

// The CUDA kernels (the bodies of ops/norm/norm_simt.h) against the unfused CPU ops.
TEST_CASE("add_layer_norm, add_rms_norm: CUDA matches add then the norm on the CPU", "[ops][norm][add_norm][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (int64_t cols : {1, 31, 33, 257, 768, 4099}) {
      DYNAMIC_SECTION(fmt::format("{} cols={}", dt, cols)) {
        Tensor x = mul_scalar(randn({3, 7, cols}, DType::f64, static_cast<uint64_t>(cols)), 3.0);
        Tensor d = randn({3, 7, cols}, DType::f64, 5), w = randn({cols}, DType::f64, 2),
               b = randn({cols}, DType::f64, 3);
        CudaCompare tol = tolerance_for(dt);
        // The CUDA side runs the fused op, the CPU side add + norm (the same function of
        // the inputs; check_cuda_matches_cpu tells the two apart by device).
        auto layer = [](const Tensors& in) {
          if (in[0].is_cuda()) {
            ResidualNorm r = add_layer_norm(in[0], in[1], in[2], in[3], 1e-5);
            return Tensors{r.sum, r.normed};
          }
          Tensor h = add(in[0], in[1]);
          return Tensors{h, layer_norm(h, in[2], in[3], 1e-5)};
        };
        auto rms = [](const Tensors& in) {
          if (in[0].is_cuda()) {
            ResidualNorm r = add_rms_norm(in[0], in[1], in[2], 1e-5);
            return Tensors{r.sum, r.normed};
          }
          Tensor h = add(in[0], in[1]);
          return Tensors{h, rms_norm(h, in[2], 1e-5)};
        };
        check_cuda_matches_cpu(layer, {x, d, w, b}, {true, true, true, true}, dt, tol);
        check_cuda_matches_cpu(rms, {x, d, w}, {true, true, false}, dt, tol);
      }
    }
}
