#include <catch2/catch.hpp>

#include <cmath>

#include "moetrain.h"
#include "optim/adamw.h"
#include "optim/schedule.h"

using namespace moetrain;

TEST_CASE("adamw: three steps match the textbook update written out in the test", "[optim][adamw]") {
  Tensor w = from_vector({0.5, -1.0, 2.0}, {3}, DType::f64), b = from_vector({0.1}, {1}, DType::f64);
  w.set_requires_grad(true);
  b.set_requires_grad(true);
  ParameterList params = {{"w", w, true, "x"}, {"b", b, false, "x"}};
  AdamWOptions o{0.9, 0.99, 1e-8, 0.1};
  AdamW opt(params, o);
  // Reference state: p, m, v for each of the 4 scalars (decay for w only).
  std::vector<double> p = {0.5, -1.0, 2.0, 0.1}, m(4, 0.0), v(4, 0.0);
  const double lr = 0.01;
  for (int t = 1; t <= 3; ++t) {
    std::vector<double> g = {0.3 * t, -0.2, 1.5 / t, 0.7};
    w.set_grad(from_vector({g[0], g[1], g[2]}, {3}, DType::f64));
    b.set_grad(from_vector({g[3]}, {1}, DType::f64));
    opt.step(lr);
    for (int i = 0; i < 4; ++i) {
      if (i < 3) p[i] -= lr * 0.1 * p[i];
      m[i] = 0.9 * m[i] + 0.1 * g[i];
      v[i] = 0.99 * v[i] + 0.01 * g[i] * g[i];
      double mhat = m[i] / (1 - std::pow(0.9, t)), vhat = v[i] / (1 - std::pow(0.99, t));
      p[i] -= lr * mhat / (std::sqrt(vhat) + 1e-8);
    }
    std::vector<double> got = w.to_vector();
    got.push_back(b.to_vector()[0]);
    for (int i = 0; i < 4; ++i) CHECK(got[i] == Approx(p[i]).epsilon(1e-12));
  }
  CHECK(opt.steps() == 3);
}

TEST_CASE("adamw: parameters without gradients are left alone", "[optim][adamw]") {
  Tensor w = ones({4}, DType::f32);
  w.set_requires_grad(true);
  AdamW opt({{"w", w, true, "x"}}, {});
  opt.step(0.1);
  CHECK(w.to_vector() == std::vector<double>(4, 1.0));
}

TEST_CASE("clip_grad_norm: returns the global norm and rescales above max_norm", "[optim][clip]") {
  Tensor a = zeros({2}, DType::f64), b = zeros({1}, DType::f64);
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  a.set_grad(from_vector({3, 0}, {2}, DType::f64));
  b.set_grad(from_vector({4}, {1}, DType::f64));
  ParameterList params = {{"a", a, true, "x"}, {"b", b, true, "x"}};
  CHECK(clip_grad_norm(params, 10.0) == Approx(5.0));
  CHECK(a.grad().to_vector()[0] == 3.0);  // below max_norm: untouched
  CHECK(clip_grad_norm(params, 1.0) == Approx(5.0));
  CHECK(a.grad().to_vector()[0] == Approx(3.0 / (5.0 + 1e-6)));
  CHECK(b.grad().to_vector()[0] == Approx(4.0 / (5.0 + 1e-6)));
}

TEST_CASE("schedules: warmup, cosine, linear, constant and wsd at known points", "[optim][schedule]") {
  LrSchedule s{ScheduleKind::cosine, 1.0, 0.1, 10, 110, 0.2};
  CHECK(s.at(0) == Approx(0.1));
  CHECK(s.at(9) == Approx(1.0));
  CHECK(s.at(10) == Approx(1.0));
  CHECK(s.at(60) == Approx(0.55));   // half way: the mean of lr and min_lr
  CHECK(s.at(110) == Approx(0.1));
  CHECK(s.at(500) == Approx(0.1));
  s.kind = ScheduleKind::linear;
  CHECK(s.at(35) == Approx(1.0 - 0.9 * 0.25));
  s.kind = ScheduleKind::constant;
  CHECK(s.at(100) == Approx(1.0));
  s.kind = ScheduleKind::wsd;  // decay over the last 22 of 110 steps: from step 88
  CHECK(s.at(50) == Approx(1.0));
  CHECK(s.at(88) == Approx(1.0));
  CHECK(s.at(99) == Approx(1.0 - 0.9 * 0.5));
  CHECK(s.at(110) == Approx(0.1));
  CHECK(parse_schedule("wsd") == ScheduleKind::wsd);
  CHECK_THROWS_WITH(parse_schedule("step"), Catch::Contains("cosine"));
}

TEST_CASE("adamw: the fused CUDA update and gradient clipping match the CPU", "[optim][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  ParameterList cpu_params, gpu_params;
  for (int i = 0; i < 3; ++i) {
    Shape s = i == 0 ? Shape{33, 65} : (i == 1 ? Shape{4099} : Shape{1});
    Tensor p = randn(s, DType::f32, 10 + i);
    cpu_params.push_back({fmt::format("p{}", i), p.clone().set_requires_grad(), i != 1, "test"});
    gpu_params.push_back({fmt::format("p{}", i), p.to(kCuda).set_requires_grad(), i != 1, "test"});
  }
  AdamW cpu_opt(cpu_params, {}), gpu_opt(gpu_params, {});
  for (int step = 0; step < 5; ++step) {
    for (size_t i = 0; i < cpu_params.size(); ++i) {
      Tensor g = randn(cpu_params[i].tensor.shape(), DType::f32, 100 * step + i);
      cpu_params[i].tensor.set_grad(g);
      gpu_params[i].tensor.set_grad(g.to(kCuda));
    }
    double n_cpu = clip_grad_norm(cpu_params, 1.0), n_gpu = clip_grad_norm(gpu_params, 1.0);
    CHECK(n_gpu == Approx(n_cpu).epsilon(1e-12));
    cpu_opt.step(1e-2);
    gpu_opt.step(1e-2);
  }
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    CHECK(moetrain::testing::rel_error(gpu_params[i].tensor.detach().to(kCpu), cpu_params[i].tensor.detach()) < 1e-5);
    CHECK(moetrain::testing::rel_error(gpu_opt.exp_avg_sq()[i].to(kCpu), cpu_opt.exp_avg_sq()[i]) < 1e-5);
  }
}
