#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>

#include "moetrain.h"
#include "comm/grad_sync.h"
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

// train.zero 1's optimizer on one process: two "ranks", each an AdamW over its own
// copy of the parameters owning the element ranges make_flat_shards gives it,
// their owned elements exchanged after each step (what all_gather_params does),
// against one AdamW over every element. AdamW is elementwise: bit for bit.
TEST_CASE("adamw: shards of the elements update them as the whole optimizer does, bit for bit (f64, f32, bf16 "
          "masters)", "[optim][adamw][bf16]") {
  for (DType dtype : {DType::f64, DType::f32, DType::bf16}) {
    DYNAMIC_SECTION("dtype " << dtype_name(dtype)) {
      const DType base = dtype == DType::bf16 ? DType::f32 : dtype;  // bf16: converted from f32, as the trainer does
      const std::vector<Shape> shapes = {Shape{33, 65}, Shape{7}, Shape{5, 3}};
      const char* const kNames[] = {"p0", "p1", "p2"};
      auto make = [&] {
        ParameterList ps;
        for (size_t i = 0; i < shapes.size(); ++i) {
          Tensor t = randn(shapes[i], base, 10 + i);
          t.set_requires_grad(true);
          ps.push_back({kNames[i], t, i != 1, "x"});
        }
        return ps;
      };
      ParameterList whole = make(), rank0 = make(), rank1 = make();
      std::vector<int64_t> numels;
      for (const Shape& s : shapes) numels.push_back(s.numel());
      const comm::FlatShards shards = comm::make_flat_shards(numels, 2);  // p0 split, p1 and p2 on rank 1
      auto shard_of = [&](int r) {
        std::vector<ElementRange> out;
        for (size_t i = 0; i < shapes.size(); ++i) {
          const auto [a, b] = shards.owned(i, r);
          out.push_back({a, b});
        }
        return out;
      };
      const AdamWOptions o{0.9, 0.95, 1e-8, 0.1};
      AdamW ref(whole, o), opt0(rank0, o, shard_of(0)), opt1(rank1, o, shard_of(1));
      CHECK(opt0.sharded());
      CHECK(!ref.sharded());
      CHECK(opt0.state_bytes() + opt1.state_bytes() == ref.state_bytes());
      if (dtype == DType::bf16)
        for (AdamW* a : {&ref, &opt0, &opt1})
          a->convert_to_bf16([](const NamedParameter& p) { return p.name != "p1"; });
      for (int step = 0; step < 4; ++step) {
        for (size_t i = 0; i < shapes.size(); ++i) {
          Tensor g = randn(shapes[i], DType::f32, 100 * step + i).to(whole[i].tensor.dtype());
          for (ParameterList* ps : {&whole, &rank0, &rank1}) (*ps)[i].tensor.set_grad(g.clone());
        }
        for (AdamW* a : {&ref, &opt0, &opt1}) CHECK(!a->non_finite_update(3e-2));
        ref.step(3e-2);
        opt0.step(3e-2);
        opt1.step(3e-2);
        // The exchange: each copy takes the other's owned elements.
        for (size_t i = 0; i < shapes.size(); ++i) {
          copy_(opt1.owned_part(i, rank0[i].tensor.detach()), opt1.owned_part(i, rank1[i].tensor.detach()));
          copy_(opt0.owned_part(i, rank1[i].tensor.detach()), opt0.owned_part(i, rank0[i].tensor.detach()));
        }
      }
      for (size_t i = 0; i < shapes.size(); ++i) {
        INFO("parameter " << whole[i].name);
        CHECK(moetrain::testing::bitwise_equal(rank0[i].tensor.detach(), whole[i].tensor.detach()));
        CHECK(moetrain::testing::bitwise_equal(rank1[i].tensor.detach(), whole[i].tensor.detach()));
        for (AdamW* a : {&opt0, &opt1}) {
          const ElementRange r = a->owned(i);
          auto part = [&](const Tensor& t) { return alias(t, Shape{r.size()}, r.begin); };
          CHECK(a->exp_avg()[i].shape() == Shape{r.size()});
          CHECK(moetrain::testing::bitwise_equal(a->exp_avg()[i], part(ref.exp_avg()[i])));
          CHECK(moetrain::testing::bitwise_equal(a->exp_avg_sq()[i], part(ref.exp_avg_sq()[i])));
          CHECK(a->master_weights()[i].defined() == ref.master_weights()[i].defined());
          if (ref.master_weights()[i].defined())
            CHECK(moetrain::testing::bitwise_equal(a->master_weights()[i], part(ref.master_weights()[i])));
        }
      }
    }
  }
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

// --- non_finite_update: the check that the next step keeps every value finite ---

namespace {

using moetrain::testing::bitwise_equal;

// A leaf parameter of `dtype` holding `values`.
Tensor make_leaf(const std::vector<double>& values, DType dtype = DType::f32) {
  Tensor t = from_vector(values, {static_cast<int64_t>(values.size())}, dtype);
  t.set_requires_grad(true);
  return t;
}

// Elements j at which any of `tensors` (same numel) is NaN or infinite, counted
// here element by element from the values (not with the library's counters).
int64_t non_finite_elements(const std::vector<Tensor>& tensors) {
  std::vector<std::vector<double>> values;
  for (const Tensor& t : tensors) values.push_back(t.detach().to(kCpu).to(DType::f64).to_vector());
  int64_t bad = 0;
  for (size_t j = 0; j < values[0].size(); ++j) {
    bool finite = true;
    for (const auto& v : values) finite = finite && std::isfinite(v[j]);
    bad += !finite;
  }
  return bad;
}

// What a step of `opt` really produced for parameter i: its elements whose
// value, moments or (mixed precision) master are NaN or infinite.
int64_t non_finite_after_step(const AdamW& opt, const ParameterList& params, size_t i) {
  std::vector<Tensor> ts = {params[i].tensor, opt.exp_avg()[i], opt.exp_avg_sq()[i]};
  if (opt.master_weights()[i].defined()) ts.push_back(opt.master_weights()[i]);
  return non_finite_elements(ts);
}

// Everything a step may change, copied: parameters, gradients, moments, masters.
std::vector<Tensor> optimizer_state(const AdamW& opt, const ParameterList& params) {
  std::vector<Tensor> state;
  for (size_t i = 0; i < params.size(); ++i) {
    state.push_back(params[i].tensor.detach().clone());
    Tensor g = params[i].tensor.grad();
    state.push_back(g.defined() ? g.clone() : Tensor());
    state.push_back(opt.exp_avg()[i].clone());
    state.push_back(opt.exp_avg_sq()[i].clone());
    state.push_back(opt.master_weights()[i].defined() ? opt.master_weights()[i].clone() : Tensor());
  }
  return state;
}

bool same_state(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined()) return false;
    if (a[i].defined() && !bitwise_equal(a[i].to(kCpu), b[i].to(kCpu))) return false;
  }
  return true;
}

// The three ways to train: f32, f64, and bf16 parameters with f32 masters.
enum class Path { f32, f64, bf16_master };
const char* path_name(Path p) { return p == Path::f32 ? "f32" : p == Path::f64 ? "f64" : "bf16 master"; }
DType param_dtype(Path p) { return p == Path::f64 ? DType::f64 : DType::f32; }
DType grad_dtype(Path p) { return p == Path::f64 ? DType::f64 : p == Path::f32 ? DType::f32 : DType::bf16; }

// Parameters near the edge of what the path can hold, with a learning rate that
// takes about half of them over it: lr = 1000 and weight_decay = 1 make the
// decay factor 1 - lr wd = -999, the parameters are +-X/999 within 64 ulps, the
// first moments give steps of about 64 ulps of X, and every 16th element has a
// second moment just below the dtype's largest value and a gradient near its
// square root (v = 0.95 v + 0.05 g^2 just at the largest value). X is the
// largest value of the dtype, or for bf16 masters the smallest f32 whose bf16
// rounding is infinite (2^127 * 1.99609375, halfway between bf16's largest
// value and 2^128, rounded up). So w * decay - step lands on both sides of the
// overflow, many elements within an ulp of it, where a multiply-add fused or
// not decides. Parameter order: "ordinary" (finite), "edge_a", "edge_b", "bias".
struct NearOverflowOptions {
  Device device = kCpu;
  bool edge_a_has_grad = true;
  // false: zero gradients and first moments, so the new w is w * decay rounded
  // once and v is 0.95 v rounded once, the same bits on any backend.
  bool step_term = true;
};
struct NearOverflow {
  static constexpr double kLr = 1000.0;
  ParameterList params;
  std::unique_ptr<AdamW> opt;

  NearOverflow(Path path, uint64_t seed, NearOverflowOptions o = {}) {
    const Device device = o.device;
    const bool f64 = path == Path::f64;
    const double largest = f64 ? std::numeric_limits<double>::max() : std::numeric_limits<float>::max();
    const double edge = path == Path::bf16_master ? std::ldexp(1.99609375, 127) : largest;
    const double ulp = f64 ? std::ldexp(1.0, -52) : std::ldexp(1.0, -23);
    const double spread = 64 * ulp;
    // t = 6 below: step_size = lr / (1 - 0.9^6) ~ 2134, sqrt(1 - 0.95^6) ~ 0.515.
    const double m_scale = edge * spread / 2000;
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(-1.0, 1.0), pos(0.0, 1.0);
    std::normal_distribution<double> n01;
    struct Values {
      std::vector<double> w, g, m, v;
    };
    auto edge_values = [&](int64_t count) {
      Values x;
      for (int64_t j = 0; j < count; ++j) {
        const double sign = u(rng) < 0 ? -1.0 : 1.0;
        x.w.push_back(sign * edge / 999 * (1 + spread * u(rng)));
        x.m.push_back(m_scale * n01(rng));
        x.v.push_back(pos(rng));
        x.g.push_back(n01(rng));
        if (j % 16 == 5) {
          x.v.back() = largest * (1 - spread * pos(rng));
          x.g.back() = std::sqrt(largest) * (1 + spread * u(rng));
        }
      }
      return x;
    };
    auto ordinary_values = [&](int64_t count) {
      Values x;
      for (int64_t j = 0; j < count; ++j) {
        x.w.push_back(n01(rng));
        x.m.push_back(0.1 * n01(rng));
        x.v.push_back(0.1 * pos(rng));
        x.g.push_back(n01(rng));
      }
      return x;
    };
    // Sizes off the vector width and, for edge_a, two parallel chunks (grain 2^14).
    const std::vector<std::pair<std::string, Values>> made = {
        {"ordinary", ordinary_values(7)}, {"edge_a", edge_values(33 * 1025)}, {"edge_b", edge_values(4099)},
        {"bias", ordinary_values(5)}};
    for (const auto& [name, x] : made) {
      Tensor t = from_vector(x.w, {static_cast<int64_t>(x.w.size())}, param_dtype(path)).to(device);
      t.set_requires_grad(true);
      params.push_back({name, t, name != "bias", "x"});
    }
    opt = std::make_unique<AdamW>(params, AdamWOptions{0.9, 0.95, 1e-8, 1.0});
    if (path == Path::bf16_master) opt->convert_to_bf16([](const NamedParameter&) { return true; });
    for (size_t i = 0; i < made.size(); ++i) {
      const Values& x = made[i].second;
      const Shape s{static_cast<int64_t>(x.w.size())};
      copy_(opt->exp_avg()[i], from_vector(x.m, s, param_dtype(path)));
      copy_(opt->exp_avg_sq()[i], from_vector(x.v, s, param_dtype(path)));
      if (!o.step_term) fill_(opt->exp_avg()[i], 0.0);
      if (made[i].first == "edge_a" && !o.edge_a_has_grad) continue;
      params[i].tensor.set_grad(o.step_term ? from_vector(x.g, s, grad_dtype(path)).to(device)
                                            : zeros(s, grad_dtype(path), device));
    }
    opt->set_steps(5);
  }
};

const std::vector<Path> kPaths = {Path::f32, Path::f64, Path::bf16_master};

}  // namespace

TEST_CASE("adamw: non_finite_update is nullopt for ordinary steps", "[optim][adamw]") {
  for (Path path : kPaths) {
    DYNAMIC_SECTION(path_name(path)) {
      ParameterList params;
      for (int i = 0; i < 3; ++i) {
        Tensor t = randn(i == 0 ? Shape{33, 65} : Shape{i == 1 ? 4099 : 3}, param_dtype(path), 40 + i);
        params.push_back({fmt::format("p{}", i), t.set_requires_grad(), i != 2, "x"});
      }
      AdamW opt(params, {});
      if (path == Path::bf16_master) opt.convert_to_bf16([](const NamedParameter&) { return true; });
      for (int step = 0; step < 4; ++step) {
        for (size_t i = 0; i < 2; ++i)  // p2 has no gradient: skipped
          params[i].tensor.set_grad(
              mul_scalar(randn(params[i].tensor.shape(), DType::f64, 50 + step * 3 + i), 10.0).to(grad_dtype(path)));
        CHECK(!opt.non_finite_update(1e-2).has_value());
        opt.step(1e-2);
      }
      for (size_t i = 0; i < params.size(); ++i) CHECK(non_finite_after_step(opt, params, i) == 0);
    }
  }
}

TEST_CASE("adamw: non_finite_update names the parameter whose decay would overflow, and counts its elements",
          "[optim][adamw]") {
  // beta1 = 0 keeps step_size = lr = 1e38 within f32; the decay factor is
  // 1 - 1e38 * 0.1 = -1e37, so w * decay overflows (|w| 1e37 > 3.4028e38) for
  // |w| > 34.03 only. Zero gradients: m = v = 0 and the step term is 0.
  Tensor a = make_leaf({100, -100, 1e3}), b = make_leaf({1, -2, 30, 40, -50, 0.5, 1e3, -34}), c = make_leaf({1e3, 2e3});
  ParameterList params = {{"a", a, false, "x"}, {"b", b, true, "x"}, {"c", c, true, "x"}};
  AdamW opt(params, {0.0, 0.95, 1e-8, 0.1});
  for (const NamedParameter& p : params) p.tensor.set_grad(zeros(p.tensor.shape()));
  const std::optional<NonFiniteTensor> bad = opt.non_finite_update(1e38);
  REQUIRE(bad.has_value());
  CHECK(bad->name == "b");  // a has no decay; c overflows too but comes later
  CHECK(bad->shape == Shape{8});
  CHECK(bad->count == 3);  // 40, -50, 1e3
  // What the step really does: b's three and both of c's become infinite.
  opt.step(1e38);
  CHECK(non_finite_after_step(opt, params, 0) == 0);
  CHECK(count_non_finite(b.detach()) == 3);
  CHECK(count_non_finite(c.detach()) == 2);
}

TEST_CASE("adamw: non_finite_update counts a second moment that overflows from a finite gradient",
          "[optim][adamw]") {
  // g = 1e20: g^2 = 1e40 is beyond f32 (3.4e38), so v = inf, while m = 1e19 and
  // the step m / sqrt(v) = 0 keep the parameter finite; g = 1e19: v = 5e36 fits.
  const std::vector<double> g = {1, 1e20, -1e20, 0.5, 1e19};
  Tensor w32 = make_leaf({1, 2, 3, 4, 5}), w64 = make_leaf({1, 2, 3, 4, 5}, DType::f64);
  ParameterList p32 = {{"w", w32, true, "x"}}, p64 = {{"w", w64, true, "x"}};
  AdamW opt32(p32, {}), opt64(p64, {});
  w32.set_grad(from_vector(g, {5}));
  w64.set_grad(from_vector(g, {5}, DType::f64));
  const std::optional<NonFiniteTensor> bad = opt32.non_finite_update(1e-3);
  REQUIRE(bad.has_value());
  CHECK(bad->name == "w");
  CHECK(bad->count == 2);
  CHECK(!opt64.non_finite_update(1e-3).has_value());  // f64 holds 1e40
  opt32.step(1e-3);
  CHECK(count_non_finite(opt32.exp_avg_sq()[0]) == 2);
  CHECK(count_non_finite(opt32.exp_avg()[0]) == 0);
  CHECK(count_non_finite(w32.detach()) == 0);
}

TEST_CASE("adamw: non_finite_update counts a step that overflows only through the moments", "[optim][adamw]") {
  // Finite gradients (1e-3) and finite moments (as a resume loads them), lr = 1:
  // at t = 1, step_size = 1 / (1 - 0.9) = 10, v = 0.05 * 1e-6 so
  // sqrt(v) / sqrt(1 - 0.95) = 1e-3, and the step is about 10 * 0.9 m / 1e-3 =
  // 9e3 m: infinite for m = +-1e35, 9e37 for m = 1e34.
  Tensor w = make_leaf({0, 0, 0, 0});
  ParameterList params = {{"w", w, false, "x"}};
  AdamW opt(params, {});
  copy_(opt.exp_avg()[0], from_vector({1, 1e35, -1e35, 1e34}, {4}));
  w.set_grad(full({4}, 1e-3));
  const std::optional<NonFiniteTensor> bad = opt.non_finite_update(1.0);
  REQUIRE(bad.has_value());
  CHECK(bad->count == 2);
  opt.step(1.0);
  CHECK(count_non_finite(w.detach()) == 2);
  CHECK(count_non_finite(opt.exp_avg()[0]) + count_non_finite(opt.exp_avg_sq()[0]) == 0);
}

TEST_CASE("adamw: non_finite_update counts values that are NaN or infinite already", "[optim][adamw]") {
  // A corrupt resume or an unchecked gradient: one bad input at element 3 of an
  // otherwise ordinary parameter, and that element's update is not finite.
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  struct Bad {
    const char* what;
    int input;  // 0 w, 1 m, 2 v, 3 g
    double value;
  };
  const std::vector<Bad> cases = {{"w = inf", 0, inf},   {"w = NaN", 0, nan},  {"m = -inf", 1, -inf},
                                  {"m = NaN", 1, nan},   {"v = inf", 2, inf},  {"v = NaN", 2, nan},
                                  {"v = -1 (sqrt NaN)", 2, -1}, {"g = -inf", 3, -inf}, {"g = NaN", 3, nan}};
  for (Path path : {Path::f32, Path::f64}) {
    for (const Bad& c : cases) {
      DYNAMIC_SECTION(path_name(path) << ", " << c.what) {
        const DType dt = param_dtype(path);
        std::vector<std::vector<double>> in = {std::vector<double>(10, 1.0), std::vector<double>(10, 0.1),
                                               std::vector<double>(10, 0.01), std::vector<double>(10, 0.5)};
        in[static_cast<size_t>(c.input)][3] = c.value;
        Tensor w = make_leaf(in[0], dt);
        ParameterList params = {{"w", w, true, "x"}};
        AdamW opt(params, {});
        copy_(opt.exp_avg()[0], from_vector(in[1], {10}, dt));
        copy_(opt.exp_avg_sq()[0], from_vector(in[2], {10}, dt));
        w.set_grad(from_vector(in[3], {10}, dt));
        const std::optional<NonFiniteTensor> bad = opt.non_finite_update(1e-3);
        REQUIRE(bad.has_value());
        CHECK(bad->count == 1);
        opt.step(1e-3);
        CHECK(non_finite_after_step(opt, params, 0) == 1);
      }
    }
  }
}

TEST_CASE("adamw: non_finite_update counts a finite master whose bf16 rounding is infinite", "[optim][adamw][bf16]") {
  // bf16's largest value is 3.3895e38; f32 values from 3.3961776e38 (halfway to
  // 2^128) round to infinity. Zero gradients and no decay leave the masters as
  // they are: 3.399e38 is a finite master with an infinite bf16 parameter.
  Tensor w = make_leaf({1, 2, 3, 4, 5});
  ParameterList params = {{"w", w, false, "x"}};
  AdamW opt(params, {});
  opt.convert_to_bf16([](const NamedParameter&) { return true; });
  copy_(opt.master_weights()[0], from_vector({3.0e38, 3.399e38, -3.399e38, 3.39e38, 1}, {5}));
  w.set_grad(zeros({5}, DType::bf16));
  const std::optional<NonFiniteTensor> bad = opt.non_finite_update(1e-3);
  REQUIRE(bad.has_value());
  CHECK(bad->count == 2);
  opt.step(1e-3);
  CHECK(count_non_finite(opt.master_weights()[0]) == 0);
  CHECK(count_non_finite(w.detach()) == 2);
}

TEST_CASE("adamw: non_finite_update modifies nothing", "[optim][adamw]") {
  for (Path path : kPaths) {
    DYNAMIC_SECTION(path_name(path)) {
      NearOverflow c(path, 7);
      c.opt->set_steps(3);
      const std::vector<Tensor> before = optimizer_state(*c.opt, c.params);
      const std::optional<NonFiniteTensor> bad = c.opt->non_finite_update(NearOverflow::kLr);
      CHECK(bad.has_value());  // the check ran through to an overflow
      c.opt->non_finite_update(1e-6);  // (the second moments near the edge still overflow)
      CHECK(c.opt->steps() == 3);
      CHECK(same_state(optimizer_state(*c.opt, c.params), before));
      c.opt->step(1e-6);  // the snapshot can see a change
      CHECK(!same_state(optimizer_state(*c.opt, c.params), before));
    }
  }
}

TEST_CASE("adamw: non_finite_update's verdict is what step() then produces, near the overflow",
          "[optim][adamw][bf16]") {
  for (Path path : kPaths) {
    for (uint64_t seed : {1, 2, 3}) {
      for (int variant = 0; variant < 3; ++variant) {
        const bool edge_a_has_grad = variant != 1, step_term = variant != 2;
        DYNAMIC_SECTION(path_name(path) << " seed " << seed << (edge_a_has_grad ? "" : ", edge_a without gradient")
                                        << (step_term ? "" : ", no step term")) {
          const NearOverflowOptions o{kCpu, edge_a_has_grad, step_term};
          NearOverflow checked(path, seed, o), stepped(path, seed, o);
          const std::optional<NonFiniteTensor> verdict = checked.opt->non_finite_update(NearOverflow::kLr);
          stepped.opt->step(NearOverflow::kLr);
          std::vector<int64_t> bad;
          for (size_t i = 0; i < stepped.params.size(); ++i)
            bad.push_back(non_finite_after_step(*stepped.opt, stepped.params, i));
          // The case is near the edge: both edge parameters part over, part not.
          CHECK(bad[0] == 0);
          CHECK(bad[3] == 0);
          if (edge_a_has_grad) {
            CHECK(bad[1] > 0);
            CHECK(bad[1] < stepped.params[1].tensor.numel());
          } else {
            CHECK(bad[1] == 0);  // skipped: unchanged
          }
          CHECK(bad[2] > 0);
          CHECK(bad[2] < stepped.params[2].tensor.numel());
          const size_t first = edge_a_has_grad ? 1 : 2;
          REQUIRE(verdict.has_value());
          CHECK(verdict->name == stepped.params[first].name);
          CHECK(verdict->shape == stepped.params[first].tensor.shape());
          CHECK(verdict->count == bad[first]);
        }
      }
    }
  }
}

TEST_CASE("adamw: the CUDA non_finite_update agrees with its own step and with the CPU's verdict",
          "[optim][adamw][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  for (Path path : kPaths) {
    for (bool edge_a_has_grad : {true, false}) {
      DYNAMIC_SECTION(path_name(path) << (edge_a_has_grad ? "" : ", edge_a without gradient")) {
        const size_t first = edge_a_has_grad ? 1 : 2;
        // Near the edge with the full step: the verdict is what the CUDA step does.
        // (The CPU's multiply-adds may be fused where the GPU's are not, and an
        // intermediate w * decay beyond the largest value then decides: no bound
        // on the difference to the CPU's count here.)
        const NearOverflowOptions gpu_full{kCuda, edge_a_has_grad};
        NearOverflow checked(path, 11, gpu_full), stepped(path, 11, gpu_full);
        REQUIRE(checked.params[1].tensor.is_cuda());
        const std::vector<Tensor> before = optimizer_state(*checked.opt, checked.params);
        const std::optional<NonFiniteTensor> gpu = checked.opt->non_finite_update(NearOverflow::kLr);
        CHECK(same_state(optimizer_state(*checked.opt, checked.params), before));
        stepped.opt->step(NearOverflow::kLr);
        REQUIRE(gpu.has_value());
        CHECK(gpu->name == stepped.params[first].name);
        CHECK(gpu->count == non_finite_after_step(*stepped.opt, stepped.params, first));
        // Near the edge with rounded-once values (no step term): the CPU's verdict, exactly.
        NearOverflow quiet_gpu(path, 12, {kCuda, edge_a_has_grad, false}),
            quiet_cpu(path, 12, {kCpu, edge_a_has_grad, false});
        const std::optional<NonFiniteTensor> g = quiet_gpu.opt->non_finite_update(NearOverflow::kLr);
        const std::optional<NonFiniteTensor> c = quiet_cpu.opt->non_finite_update(NearOverflow::kLr);
        REQUIRE(g.has_value());
        REQUIRE(c.has_value());
        CHECK(g->name == c->name);
        CHECK(g->count == c->count);
        CHECK(c->count < quiet_cpu.params[first].tensor.numel());  // near the edge: not all over
      }
    }
  }
  // Far from the edge both say the same: nothing, or the decay overflow of b.
  for (bool overflow : {false, true}) {
    Tensor b = make_leaf({1, -2, 30, 40, -50, 0.5, 1e3, -34}).detach().to(kCuda).set_requires_grad();
    ParameterList params = {{"b", b, true, "x"}};
    AdamW opt(params, {0.0, 0.95, 1e-8, 0.1});
    b.set_grad(zeros({8}, DType::f32, kCuda));
    const std::optional<NonFiniteTensor> bad = opt.non_finite_update(overflow ? 1e38 : 1e-3);
    CHECK(bad.has_value() == overflow);
    if (bad) CHECK(bad->count == 3);
  }
}
