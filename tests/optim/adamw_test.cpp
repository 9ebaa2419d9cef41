#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>

#include "moetrain.h"
#include "optim/adamw.h"
#include "optim/schedule.h"
#include "testing.h"

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

namespace {

// bf16 bits of a finite float, rounded to nearest even (written out here, not the
// library's bf16::from_float).
uint16_t nearest_even_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace

TEST_CASE("adamw: a bf16 parameter's f32 master follows an f32 run bit for bit, the parameter is it rounded",
          "[optim][adamw][bf16]") {
  // Two parameters of each run: one converted to bf16 (decayed), one kept f32.
  Tensor a32 = randn({33, 65}, DType::f32, 1), k32 = randn({7}, DType::f32, 2);
  Tensor a = a32.clone(), k = k32.clone();
  for (Tensor* t : {&a32, &k32, &a, &k}) t->set_requires_grad(true);
  ParameterList ref_params = {{"a", a32, true, "x"}, {"k", k32, false, "x"}};
  ParameterList params = {{"a", a, true, "x"}, {"k", k, false, "x"}};
  AdamW ref(ref_params, {0.9, 0.95, 1e-8, 0.1}), opt(params, {0.9, 0.95, 1e-8, 0.1});
  a.set_grad(ones({33, 65}, DType::f32));
  opt.convert_to_bf16([](const NamedParameter& p) { return p.name == "a"; });
  CHECK(a.dtype() == DType::bf16);
  CHECK(!a.grad().defined());  // dropped with the old dtype
  CHECK(k.dtype() == DType::f32);
  REQUIRE(opt.master_weights()[0].defined());
  CHECK(!opt.master_weights()[1].defined());
  CHECK(moetrain::testing::bitwise_equal(opt.master_weights()[0], a32));  // the f32 values, exactly
  CHECK(opt.exp_avg()[0].dtype() == DType::f32);
  for (int step = 0; step < 4; ++step) {
    Tensor g = randn(a.shape(), DType::f32, 100 + step).to(DType::bf16);  // a bf16 gradient
    Tensor gk = randn(k.shape(), DType::f32, 200 + step);
    a.set_grad(g);
    k.set_grad(gk);
    a32.set_grad(g.to(DType::f32));  // the same values, widened
    k32.set_grad(gk.clone());
    ref.step(3e-2);
    opt.step(3e-2);
  }
  CHECK(moetrain::testing::bitwise_equal(opt.master_weights()[0], a32.detach()));
  CHECK(moetrain::testing::bitwise_equal(opt.master_or_parameter(0), a32.detach()));
  CHECK(moetrain::testing::bitwise_equal(k.detach(), k32.detach()));
  for (size_t i = 0; i < 2; ++i) {
    CHECK(moetrain::testing::bitwise_equal(opt.exp_avg()[i], ref.exp_avg()[i]));
    CHECK(moetrain::testing::bitwise_equal(opt.exp_avg_sq()[i], ref.exp_avg_sq()[i]));
  }
  REQUIRE(a.dtype() == DType::bf16);
  const float* master = opt.master_weights()[0].data<float>();
  const bf16* stored = a.data<bf16>();
  int64_t wrong = 0, moved = 0;
  for (int64_t j = 0; j < a.numel(); ++j) {
    wrong += stored[j].bits != nearest_even_bf16_bits(master[j]);
    moved += master[j] != stored[j].to_float();  // the master keeps what bf16 cannot hold
  }
  CHECK(wrong == 0);
  CHECK(moved > a.numel() / 2);

  // A load (checkpoint) writes new masters; the parameter is rounded from them again.
  fill_(opt.master_weights()[0], 1.00390625 + 0.001);  // between two bf16 values, nearer the upper
  opt.round_parameters_from_master();
  CHECK(a.data<bf16>()[5].bits == nearest_even_bf16_bits(static_cast<float>(1.00390625 + 0.001)));
  CHECK(a.data<bf16>()[5].to_float() == 1.0078125f);
}

TEST_CASE("adamw: a parameter created in bf16 gets an f32 master of its own values", "[optim][adamw][bf16]") {
  Tensor p = from_vector({1.5, -0.25, 3.0}, {3}, DType::bf16);
  p.set_requires_grad(true);
  AdamW opt({{"p", p, false, "x"}}, {});
  REQUIRE(opt.master_weights()[0].defined());
  CHECK(opt.master_weights()[0].to_vector() == std::vector<double>{1.5, -0.25, 3.0});
  CHECK(opt.exp_avg()[0].dtype() == DType::f32);
  p.set_grad(from_vector({1, 1, 1}, {3}, DType::f32));  // an f32 gradient for a bf16 parameter: refused
  CHECK_THAT(moetrain::testing::error_of([&] { opt.step(0.1); }),
             Catch::Contains("p is bf16[3] cpu") && Catch::Contains("expected a bf16 gradient"));
}

TEST_CASE("clip_grad_norm: bf16 gradients are summed widened, in double", "[optim][clip][bf16]") {
  Tensor a = zeros({3}, DType::bf16);
  a.set_requires_grad(true);
  a.set_grad(from_vector({3, 0, 4}, {3}, DType::bf16));
  ParameterList params = {{"a", a, true, "x"}};
  CHECK(clip_grad_norm(params, 10.0) == 5.0);
  CHECK(clip_grad_norm(params, 1.0) == 5.0);
  // 3 / (5 + 1e-6) = 0.59999988, in bf16 0.6015625 (the nearest of ..., 0.59765625, 0.6015625).
  CHECK(a.grad().to_vector() == std::vector<double>{0.6015625, 0.0, 0.80078125});
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

TEST_CASE("adamw: the CUDA mixed-precision update matches the CPU's", "[optim][cuda][bf16]") {
  if (!moetrain::testing::gpu_available()) return;
  Tensor p = randn({33, 65}, DType::f32, 3);
  Tensor on_cpu = p.clone().set_requires_grad(), on_gpu = p.to(kCuda).set_requires_grad();
  ParameterList cpu_params = {{"p", on_cpu, true, "x"}}, gpu_params = {{"p", on_gpu, true, "x"}};
  AdamW cpu_opt(cpu_params, {}), gpu_opt(gpu_params, {});
  cpu_opt.convert_to_bf16([](const NamedParameter&) { return true; });
  gpu_opt.convert_to_bf16([](const NamedParameter&) { return true; });
  REQUIRE(on_gpu.dtype() == DType::bf16);
  REQUIRE(gpu_opt.master_weights()[0].is_cuda());
  CHECK(moetrain::testing::bitwise_equal(on_gpu.detach().to(kCpu), on_cpu.detach()));  // the same rounding
  for (int step = 0; step < 5; ++step) {
    Tensor g = randn(p.shape(), DType::f32, 300 + step).to(DType::bf16);
    on_cpu.set_grad(g);
    on_gpu.set_grad(g.to(kCuda));
    double n_cpu = clip_grad_norm(cpu_params, 1.0), n_gpu = clip_grad_norm(gpu_params, 1.0);
    CHECK(n_gpu == Approx(n_cpu).epsilon(1e-12));
    cpu_opt.step(1e-2);
    gpu_opt.step(1e-2);
  }
  CHECK(moetrain::testing::rel_error(gpu_opt.master_weights()[0].to(kCpu), cpu_opt.master_weights()[0]) < 1e-5);
  CHECK(moetrain::testing::rel_error(gpu_opt.exp_avg_sq()[0].to(kCpu), cpu_opt.exp_avg_sq()[0]) < 1e-5);
  // The parameters: the masters rounded; a last-bit master difference may flip a rounding.
  CHECK(moetrain::testing::rel_error(on_gpu.detach().to(kCpu).to(DType::f32), on_cpu.detach().to(DType::f32)) <=
        1.0 / 128);
}
