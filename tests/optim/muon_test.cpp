// Muon and QK-Clip (src/optim/muon.h, qk_clip.h; docs/model.md#muon, #qk-clip).
// Expected values come from tests/reference/muon_reference.py (an independent NumPy
// f64 transcription, run once per process with /usr/bin/python3; those cases are
// skipped with one line when it cannot import numpy and h5py) or are written out in
// the test: the 1×2 and 2×1 hand-worked steps (Newton-Schulz on one singular value
// is the scalar map φ), the Givens-built matrices with known singular values, and
// the QK-Clip weights typed in by hand.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "io/hdf5.h"
#include "moetrain.h"
#include "optim/muon.h"
#include "optim/qk_clip.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::bitwise_equal;
using moetrain::testing::rel_error;
using std::string;

namespace {

constexpr double kTolerance = 1e-10;  // f64 against the f64 reference
// f32 inputs (rounded from the f64 ones) computed in f32, against the f64 reference.
constexpr double kTolerance32 = 1e-5;  // measured <= 1.5e-6 (X), 1.8e-7 (param)

// φ(s) = a s + b s³ + c s⁵: what one Newton-Schulz step does to one singular value.
double phi(double s) { return 3.4445 * s - 4.7750 * s * s * s + 2.0315 * s * s * s * s * s; }
double phi_n(double s, int n) {
  for (int i = 0; i < n; ++i) s = phi(s);
  return s;
}

// Runs the reference script once per process; "" when /usr/bin/python3 lacks numpy
// or h5py (the caller WARNs and returns). A failing script fails the test.
string reference_dir() {
  static string dir;
  static bool done = false;
  if (done) return dir;
  if (testing::run_command("/usr/bin/python3 -c 'import numpy, h5py' >/dev/null 2>&1") != 0) {
    done = true;
    return dir;
  }
  const string out = string(MOETRAIN_BINARY_DIR) + "/reference/muon";
  testing::CommandOutput r = testing::capture_command("/usr/bin/python3 " + string(MOETRAIN_SOURCE_DIR) +
                                                      "/tests/reference/muon_reference.py " + out);
  INFO(r.output);
  REQUIRE(r.code == 0);
  dir = out;
  done = true;
  return dir;
}

#define MT_REFERENCE_OR_SKIP(dir)                                                                   \
  const string dir = reference_dir();                                                               \
  if (dir.empty()) {                                                                                \
    WARN("skipped: /usr/bin/python3 cannot import numpy and h5py (Debian python3-numpy, python3-h5py)"); \
    return;                                                                                         \
  }

MuonOptions options_of(const hdf5::Reader& in, const string& c) {
  MuonOptions o;
  o.momentum = *in.attr_double(c, "momentum");
  o.nesterov = *in.attr_bool(c, "nesterov");
  o.ns_steps = *in.attr_int(c, "ns_steps");
  o.weight_decay = *in.attr_double(c, "weight_decay");
  return o;
}

std::vector<string> cases_with_prefix(const hdf5::Reader& r, const string& prefix) {
  std::vector<string> out;
  for (const string& g : r.groups("/"))
    if (g.rfind(prefix, 0) == 0) out.push_back(g);
  return out;
}

// A host f64 [m, n] matrix from a row-major vector.
Tensor matrix(const std::vector<double>& v, int64_t m, int64_t n) { return from_vector(v, {m, n}, DType::f64); }

// An n×n orthogonal matrix: the product of Givens rotations over every pair (i, j)
// with angles from `seed` (orthogonal to rounding).
std::vector<double> givens_orthogonal(int n, double seed) {
  std::vector<double> q(static_cast<size_t>(n * n), 0.0);
  for (int i = 0; i < n; ++i) q[i * n + i] = 1.0;
  for (int i = 0; i < n; ++i)
    for (int j = i + 1; j < n; ++j) {
      const double t = seed + 0.37 * i + 0.91 * j, c = std::cos(t), s = std::sin(t);
      for (int r = 0; r < n; ++r) {  // q = q G(i, j, t): columns i and j rotate
        const double a = q[r * n + i], b = q[r * n + j];
        q[r * n + i] = c * a - s * b;
        q[r * n + j] = s * a + c * b;
      }
    }
  return q;
}

// U [diag(s) 0] Vᵀ (m×n, U m×m, V n×n, s of length min(m, n)), row-major.
std::vector<double> compose(const std::vector<double>& u, const std::vector<double>& s, const std::vector<double>& v,
                            int m, int n) {
  std::vector<double> x(static_cast<size_t>(m * n), 0.0);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j)
      for (size_t k = 0; k < s.size(); ++k) x[i * n + j] += u[i * m + k] * s[k] * v[j * n + k];
  return x;
}

// Whether the symmetric k×k matrix a is positive definite (Cholesky succeeds).
bool positive_definite(std::vector<double> a, int k) {
  for (int j = 0; j < k; ++j) {
    double d = a[j * k + j];
    for (int p = 0; p < j; ++p) d -= a[j * k + p] * a[j * k + p];
    if (!(d > 0)) return false;
    d = std::sqrt(d);
    a[j * k + j] = d;
    for (int i = j + 1; i < k; ++i) {
      double v = a[i * k + j];
      for (int p = 0; p < j; ++p) v -= a[i * k + p] * a[j * k + p];
      a[i * k + j] = v / d;
    }
  }
  return true;
}

// Whether every singular value of x [m, n] (row-major) lies strictly inside (lo, hi):
// with G the smaller Gram matrix, G − lo² I and hi² I − G are positive definite.
bool singular_values_within(const std::vector<double>& x, int m, int n, double lo, double hi) {
  const int k = std::min(m, n);
  std::vector<double> g(static_cast<size_t>(k * k), 0.0);
  for (int i = 0; i < k; ++i)
    for (int j = 0; j < k; ++j)
      for (int p = 0; p < std::max(m, n); ++p)
        g[i * k + j] += m <= n ? x[i * n + p] * x[j * n + p] : x[p * n + i] * x[p * n + j];
  std::vector<double> below = g, above = g;
  for (int i = 0; i < k * k; ++i) above[i] = -g[i];
  for (int i = 0; i < k; ++i) {
    below[i * k + i] -= lo * lo;
    above[i * k + i] += hi * hi;
  }
  return positive_definite(below, k) && positive_definite(above, k);
}

}  // namespace

TEST_CASE("muon: one step matches the NumPy reference for [A,B] wide, tall, square and [E,A,B]", "[optim][muon]") {
  MT_REFERENCE_OR_SKIP(dir);
  hdf5::Reader in(dir + "/inputs.h5"), want(dir + "/expected.h5");
  std::vector<string> cases = cases_with_prefix(in, "muon_");
  REQUIRE(cases.size() >= 10);
  for (const string& c : cases) {
    if (c == "muon_two_steps") continue;  // its own test case
    INFO("case " << c);
    const MuonOptions o = options_of(in, c);
    const double lr = *in.attr_double(c, "lr");
    const Tensor param = in.read(c, "param"), grad = in.read(c, "grad");
    const Tensor m0 = in.has_dataset(c, "momentum") ? in.read(c, "momentum") : zeros_like(param);
    for (DType dt : {DType::f64, DType::f32}) {
      INFO("dtype " << dtype_name(dt));
      const double tol = dt == DType::f64 ? kTolerance : kTolerance32;
      Tensor w = param.to(dt).clone(), m = m0.to(dt).clone();
      const Tensor g = grad.to(dt);
      // The orthogonalised input, as the step forms it.
      const Tensor n = o.nesterov ? add(g, mul_scalar(add(mul_scalar(m, o.momentum), g), o.momentum))
                                  : add(mul_scalar(m, o.momentum), g);
      const double e_x = rel_error(newton_schulz(n, o.ns_steps), want.read(c, "orthogonalized"));
      CHECK(e_x < tol);
      muon_update(w, g, m, lr, o);
      const double e_w = rel_error(w, want.read(c, "param")), e_m = rel_error(m, want.read(c, "momentum"));
      CHECK(e_w < tol);
      CHECK(e_m < tol);
      // The update itself (W' − W(1 − ηλ)), not only W', to the same tolerance.
      const Tensor decayed = mul_scalar(param.to(dt), 1.0 - lr * o.weight_decay);
      const Tensor want_delta = sub(want.read(c, "param"), mul_scalar(param, 1.0 - lr * o.weight_decay));
      if (dt == DType::f64) CHECK(rel_error(sub(w, decayed), want_delta) < 1e-9);

      // The class takes the same step, bit for bit.
      Tensor p = param.to(dt).clone().set_requires_grad();
      Muon opt({{"w", p, true, "test"}}, o);
      copy_(opt.momentum_buffers()[0], m0.to(dt));
      p.set_grad(g);
      opt.step(lr);
      CHECK(bitwise_equal(p.detach(), w));
      CHECK(bitwise_equal(opt.momentum("w"), m));
      std::printf("muon reference %s: %-32s X %.2e param %.2e momentum %.2e\n", dt == DType::f64 ? "f64" : "f32",
                  c.c_str(), e_x, e_w, e_m);
    }
  }
}

TEST_CASE("muon: two consecutive steps carry the momentum (NumPy reference)", "[optim][muon]") {
  MT_REFERENCE_OR_SKIP(dir);
  hdf5::Reader in(dir + "/inputs.h5"), want(dir + "/expected.h5");
  const string c = "muon_two_steps";
  const double lr = *in.attr_double(c, "lr");
  Tensor p = in.read(c, "param").clone().set_requires_grad();
  Muon opt({{"w", p, true, "test"}}, options_of(in, c));
  p.set_grad(in.read(c, "grad"));
  opt.step(lr);
  CHECK(rel_error(p.detach(), want.read(c, "param_1")) < kTolerance);
  CHECK(rel_error(opt.momentum_buffers()[0], want.read(c, "momentum_1")) < kTolerance);
  opt.zero_grad();
  CHECK(!p.grad().defined());
  p.set_grad(in.read(c, "grad_2"));
  opt.step(lr);
  CHECK(opt.steps() == 2);
  CHECK(rel_error(p.detach(), want.read(c, "param")) < kTolerance);
  CHECK(rel_error(opt.momentum_buffers()[0], want.read(c, "momentum")) < kTolerance);
}

TEST_CASE("muon: 1x2 and 2x1 steps match the update worked out by hand", "[optim][muon]") {
  // On a single row (or column) g, Newton-Schulz sees one singular value:
  // X = φ⁵(‖N‖ / (‖N‖ + 1e-7)) · N / ‖N‖.
  const double lr = 0.1, wd = 0.1, mu = 0.95, scale = 0.2 * std::sqrt(2.0);
  for (bool tall : {false, true}) {
    for (bool nesterov : {true, false}) {
      DYNAMIC_SECTION((tall ? "2x1" : "1x2") << (nesterov ? " nesterov" : " plain")) {
        const Shape shape = tall ? Shape{2, 1} : Shape{1, 2};
        Tensor p = from_vector({0.5, -0.25}, shape, DType::f64).set_requires_grad();
        MuonOptions o;
        o.nesterov = nesterov;
        o.weight_decay = wd;
        Muon opt({{"w", p, true, "test"}}, o);
        std::vector<double> w = {0.5, -0.25}, m = {0, 0};
        for (const std::vector<double>& g : {std::vector<double>{3, 4}, std::vector<double>{1, -2}}) {
          p.set_grad(from_vector(g, shape, DType::f64));
          opt.step(lr);
          for (int i = 0; i < 2; ++i) m[i] = mu * m[i] + g[i];
          std::vector<double> n = m;
          if (nesterov)
            for (int i = 0; i < 2; ++i) n[i] = g[i] + mu * m[i];
          const double norm = std::sqrt(n[0] * n[0] + n[1] * n[1]);
          const double s = phi_n(norm / (norm + 1e-7), 5);
          for (int i = 0; i < 2; ++i) w[i] = w[i] * (1 - lr * wd) - lr * scale * s * n[i] / norm;
          const std::vector<double> got = p.to_vector(), got_m = opt.momentum_buffers()[0].to_vector();
          for (int i = 0; i < 2; ++i) {
            CHECK(got[i] == Approx(w[i]).epsilon(1e-13));
            CHECK(got_m[i] == Approx(m[i]).epsilon(1e-15));
          }
        }
      }
    }
  }
}

TEST_CASE("newton_schulz: singular values are phi^5 of the normalised input's, within [0.681, 1.203]",
          "[optim][muon]") {
  // The band documented in docs/model.md#muon: for normalised singular values in
  // [0.003, 1], five steps of φ land in [0.6818, 1.2024].
  double lo = 2, hi = 0;
  for (int i = 0; i <= 100000; ++i) {
    const double s = 0.003 * std::pow(1 / 0.003, i / 100000.0), y = phi_n(s, 5);
    lo = std::min(lo, y);
    hi = std::max(hi, y);
  }
  CHECK(lo > 0.681);
  CHECK(hi < 1.203);
  CHECK(phi_n(0.001, 5) < 0.5);  // far enough below 0.003 the band does not hold

  // x = U [diag(s) 0] Vᵀ with known s; NS(x) must be U [diag(φ⁵(s / ‖s‖)) 0] Vᵀ.
  const std::vector<double> s = {1.0, 0.6, 0.2, 0.05, 0.004};
  double norm = 0;
  for (double v : s) norm += v * v;
  norm = std::sqrt(norm);
  std::vector<double> out, out_1000;  // the second for 1000 x (eps weighs less)
  for (double v : s) {
    out.push_back(phi_n(v / (norm + 1e-7), 5));
    out_1000.push_back(phi_n(1000 * v / (1000 * norm + 1e-7), 5));
  }
  for (auto [m, n] : {std::pair{5, 8}, std::pair{8, 5}, std::pair{5, 5}}) {
    DYNAMIC_SECTION(m << "x" << n) {
      const std::vector<double> u = givens_orthogonal(m, 0.3), v = givens_orthogonal(n, 1.1);
      const Tensor x = matrix(compose(u, s, v, m, n), m, n);
      const Tensor want = matrix(compose(u, out, v, m, n), m, n);
      const Tensor got = newton_schulz(x, 5);
      CHECK(testing::max_abs_diff(got, want) < 1e-12);
      CHECK(singular_values_within(got.to_vector(), m, n, 0.681, 1.203));
      // A batch of two, the second matrix 1000 x: each is normalised by its own norm.
      const Tensor batch = concat({reshape(x, {1, m, n}), reshape(mul_scalar(x, 1000.0), {1, m, n})}, 0);
      const Tensor both = newton_schulz(batch, 5);
      const Tensor want_1000 = matrix(compose(u, out_1000, v, m, n), m, n);
      CHECK(testing::max_abs_diff(slice(both, 0, 0, 1), reshape(want, {1, m, n})) < 1e-12);
      CHECK(testing::max_abs_diff(slice(both, 0, 1, 2), reshape(want_1000, {1, m, n})) < 1e-12);
    }
  }
}

TEST_CASE("newton_schulz: random matrices come out with singular values in the band", "[optim][muon]") {
  for (DType dt : {DType::f64, DType::f32}) {
    for (const Shape& shape : {Shape{5, 7}, Shape{7, 5}, Shape{6, 6}, Shape{3, 5, 7}, Shape{33, 31}}) {
      DYNAMIC_SECTION(shape.str() << " " << dtype_name(dt)) {
        const Tensor x = newton_schulz(randn(shape, dt, 7), 5);
        CHECK(x.dtype() == dt);
        CHECK(x.shape() == shape);
        const int64_t E = shape.ndim() == 3 ? shape[0] : 1, m = shape[shape.ndim() - 2], n = shape[shape.ndim() - 1];
        const std::vector<double> all = x.to_vector();
        for (int64_t e = 0; e < E; ++e) {
          const std::vector<double> one(all.begin() + e * m * n, all.begin() + (e + 1) * m * n);
          CHECK(singular_values_within(one, static_cast<int>(m), static_cast<int>(n), 0.681, 1.203));
        }
      }
    }
  }
  // A zero matrix stays zero (no 0/0).
  CHECK(newton_schulz(zeros({4, 3}, DType::f64), 5).to_vector() == std::vector<double>(12, 0.0));
}

TEST_CASE("muon: weight decay, learning rate and the update's RMS", "[optim][muon]") {
  const Tensor w0 = mul_scalar(randn({5, 7}, DType::f64, 3), 0.1), g = randn({5, 7}, DType::f64, 4);
  const double lr = 0.02, wd = 0.1;
  MuonOptions o;
  o.weight_decay = wd;

  SECTION("a zero gradient decays the weights only") {
    Tensor w = w0.clone(), m = zeros_like(w0);
    muon_update(w, zeros_like(w0), m, lr, o);
    std::vector<double> want = w0.to_vector();
    for (double& v : want) v *= 1 - lr * wd;
    CHECK(w.to_vector() == want);  // one product per element, as written here
    CHECK(m.to_vector() == std::vector<double>(35, 0.0));
  }
  SECTION("decay false: the same update without the decay") {
    Tensor a = w0.clone().set_requires_grad(), b = w0.clone().set_requires_grad();
    Muon opt({{"a", a, true, "test"}, {"b", b, false, "test"}}, o);
    a.set_grad(g);
    b.set_grad(g);
    opt.step(lr);
    // a = w0 (1 − ηλ) + Δ, b = w0 + Δ.
    const Tensor da = sub(a.detach(), mul_scalar(w0, 1 - lr * wd)), db = sub(b.detach(), w0);
    CHECK(rel_error(da, db) < 1e-12);
    CHECK(testing::max_abs_diff(da, zeros_like(da)) > 0);
  }
  SECTION("the update is linear in lr and has an RMS near 0.2 lr") {
    o.weight_decay = 0;
    Tensor w1 = w0.clone(), m1 = zeros_like(w0), w3 = w0.clone(), m3 = zeros_like(w0);
    muon_update(w1, g, m1, lr, o);
    muon_update(w3, g, m3, 3 * lr, o);
    const Tensor d1 = sub(w1, w0), d3 = sub(w3, w0);
    CHECK(rel_error(d3, mul_scalar(d1, 3.0)) < 1e-12);
    // Δ = −η · 0.2 √7 · X with X's 5 singular values in [0.681, 1.203]:
    // RMS(Δ) / η = 0.2 √7 ‖X‖_F / √35 = 0.2 ‖X‖_F / √5, in 0.2 · [0.681, 1.203].
    const std::vector<double> d = d1.to_vector();
    double ss = 0;
    for (double v : d) ss += v * v;
    const double rms = std::sqrt(ss / 35) / lr;
    CHECK(rms > 0.2 * 0.681);
    CHECK(rms < 0.2 * 1.203);
  }
  SECTION("lr 0 changes nothing but the momentum") {
    Tensor w = w0.clone(), m = zeros_like(w0);
    muon_update(w, g, m, 0.0, o);
    CHECK(bitwise_equal(w, w0));
    CHECK(bitwise_equal(m, g));
  }
}

TEST_CASE("muon: each expert of [E, A, B] is its own matrix", "[optim][muon]") {
  // Experts with gradients of very different scale: one (E·A)×B matrix would
  // orthogonalise them together and give other numbers.
  const Tensor w0 = randn({3, 5, 7}, DType::f64, 11);
  const Tensor g = mul(randn({3, 5, 7}, DType::f64, 12), from_vector({1, 1000, 0.001}, {3, 1, 1}, DType::f64));
  MuonOptions o;
  Tensor w = w0.clone(), m = zeros_like(w0);
  muon_update(w, g, m, 0.05, o);
  for (int64_t e = 0; e < 3; ++e) {
    Tensor we = reshape(slice(w0, 0, e, e + 1), {5, 7}).clone(), me = zeros({5, 7}, DType::f64);
    muon_update(we, reshape(slice(g, 0, e, e + 1), {5, 7}), me, 0.05, o);
    CHECK(rel_error(reshape(slice(w, 0, e, e + 1), {5, 7}), we) < 1e-13);
  }
}

TEST_CASE("muon: options and inputs are validated, naming the field", "[optim][muon]") {
  const Tensor w = randn({3, 4}, DType::f64, 1);
  auto refused = [&](MuonOptions o, const string& field) {
    INFO(field);
    CHECK_THROWS_WITH(validate(o), Catch::Contains(field));
    CHECK_THROWS_AS(Muon({{"w", w.clone().set_requires_grad(), true, "test"}}, o), Error);
    Tensor p = w.clone(), m = zeros_like(w);
    CHECK_THROWS_WITH(muon_update(p, w, m, 0.1, o), Catch::Contains(field));
    CHECK(bitwise_equal(p, w));
  };
  MuonOptions o;
  CHECK_NOTHROW(validate(o));
  o.momentum = 1.0;
  refused(o, "momentum");
  o.momentum = -0.1;
  refused(o, "momentum");
  o.momentum = std::nan("");
  refused(o, "momentum");
  o = {};
  o.ns_steps = 0;
  refused(o, "ns_steps");
  o = {};
  o.weight_decay = -1e-3;
  refused(o, "weight_decay");
  o = {};
  o.eps = 0;
  refused(o, "eps");
  o = {};
  o.eps = std::numeric_limits<double>::infinity();
  refused(o, "eps");
  o = {};
  o.momentum = 0;  // the edges of the ranges are allowed
  o.weight_decay = 0;
  o.ns_steps = 1;
  CHECK_NOTHROW(validate(o));

  // Parameters Muon does not take, named.
  CHECK_THROWS_WITH(Muon({{"ln_f.weight", ones({4}, DType::f32).set_requires_grad(), false, "norm"}}, {}),
                    Catch::Contains("ln_f.weight") && Catch::Contains("AdamW"));
  CHECK_THROWS_WITH(Muon({{"x", zeros({2, 2, 2, 2}, DType::f32).set_requires_grad(), true, "t"}}, {}),
                    Catch::Contains("[E, A, B]"));
  CHECK_THROWS_WITH(Muon({{"i", zeros({2, 2}, DType::i64), true, "t"}}, {}), Catch::Contains("i64"));

  Tensor p = w.clone(), m = zeros_like(w);
  CHECK_THROWS_WITH(muon_update(p, randn({4, 3}, DType::f64, 2), m, 0.1, {}), Catch::Contains("gradient"));
  CHECK_THROWS_WITH(muon_update(p, w, zeros({3, 4}, DType::f32), 0.1, {}), Catch::Contains("momentum"));
  CHECK_THROWS_WITH(muon_update(p, w, m, std::nan(""), {}), Catch::Contains("lr"));
  CHECK_THROWS_WITH(muon_update(p, w, m, -0.1, {}), Catch::Contains("lr"));
  CHECK_THROWS_WITH(newton_schulz(zeros({3}, DType::f64), 5), Catch::Contains("[A, B]"));
  CHECK(bitwise_equal(p, w));
  CHECK(bitwise_equal(m, zeros_like(w)));
}

TEST_CASE("muon: a refused step writes nothing; skipped parameters keep their state", "[optim][muon]") {
  Tensor a = randn({3, 4}, DType::f64, 1).set_requires_grad(), b = randn({4, 3}, DType::f64, 2).set_requires_grad();
  Tensor c = randn({2, 2}, DType::f64, 3).set_requires_grad();
  const Tensor a0 = a.detach().clone(), b0 = b.detach().clone(), c0 = c.detach().clone();
  Muon opt({{"a", a, true, "t"}, {"b", b, true, "t"}, {"c", c, true, "t"}}, {});
  CHECK(opt.state_bytes() == (12 + 12 + 4) * 8);
  CHECK(opt.momentum("b").shape() == Shape{4, 3});
  CHECK_THROWS_WITH(opt.momentum("nope"), Catch::Contains("nope"));
  a.set_grad(randn({3, 4}, DType::f64, 4));
  b.set_grad(randn({4, 3}, DType::f32, 5));  // wrong dtype: refused before anything is written
  CHECK_THROWS_WITH(opt.step(0.1), Catch::Contains("b") && Catch::Contains("gradient"));
  CHECK(opt.steps() == 0);
  CHECK(bitwise_equal(a.detach(), a0));
  CHECK(bitwise_equal(opt.momentum("a"), zeros_like(a0)));
  CHECK_THROWS_WITH(opt.step(std::nan("")), Catch::Contains("lr"));

  b.set_grad(randn({4, 3}, DType::f64, 5));  // c has no gradient: skipped
  opt.step(0.1);
  CHECK(opt.steps() == 1);
  CHECK(!bitwise_equal(a.detach(), a0));
  CHECK(!bitwise_equal(b.detach(), b0));
  CHECK(bitwise_equal(c.detach(), c0));
  CHECK(bitwise_equal(opt.momentum("c"), zeros_like(c0)));
}

TEST_CASE("muon: a bf16 parameter follows its f32 master as an f32 parameter would", "[optim][muon]") {
  const Tensor w0 = mul_scalar(randn({6, 4}, DType::f32, 21), 0.1);
  const Tensor g16 = randn({6, 4}, DType::f32, 22).to(DType::bf16);
  Tensor ref = w0.clone().set_requires_grad(), mixed = w0.clone().set_requires_grad();
  Muon opt_ref({{"w", ref, true, "t"}}, {}), opt_mixed({{"w", mixed, true, "t"}}, {});
  opt_mixed.convert_to_bf16([](const NamedParameter&) { return true; });
  CHECK(mixed.dtype() == DType::bf16);
  CHECK(opt_mixed.state_bytes() == 24 * 4 * 2);  // f32 momentum and master
  for (int step = 0; step < 2; ++step) {
    ref.set_grad(g16.to(DType::f32));
    mixed.set_grad(g16);
    opt_ref.step(0.05);
    opt_mixed.step(0.05);
    CHECK(bitwise_equal(opt_mixed.master_weights()[0], ref.detach()));
    CHECK(bitwise_equal(opt_mixed.momentum_buffers()[0], opt_ref.momentum_buffers()[0]));
    CHECK(bitwise_equal(mixed.detach(), ref.detach().to(DType::bf16)));
  }
  // A bf16 gradient is required.
  mixed.set_grad(g16.to(DType::f32));
  CHECK_THROWS_WITH(opt_mixed.step(0.05), Catch::Contains("bf16"));
}

TEST_CASE("muon: CUDA matches the CPU", "[optim][muon][cuda]") {
  if (!testing::gpu_available()) return;
  for (DType dt : {DType::f64, DType::f32}) {
    for (const Shape& shape : {Shape{5, 7}, Shape{7, 5}, Shape{3, 5, 7}, Shape{4, 33, 31}, Shape{256, 96}}) {
      DYNAMIC_SECTION(shape.str() << " " << dtype_name(dt)) {
        const Tensor w0 = mul_scalar(randn(shape, dt, 31), 0.1), g = randn(shape, dt, 32);
        Tensor w = w0.clone(), m = zeros_like(w0);
        Tensor wc = w0.to(kCuda), mc = zeros_like(wc);
        for (int step = 0; step < 2; ++step) {
          muon_update(w, g, m, 0.05, {});
          muon_update(wc, g.to(kCuda), mc, 0.05, {});
        }
        const double tol = dt == DType::f64 ? 1e-12 : 2e-5;
        CHECK(rel_error(wc.to(kCpu), w) < tol);
        CHECK(rel_error(mc.to(kCpu), m) < tol);
      }
    }
  }
  // Mixed precision on the device: the master follows the CPU f32 run.
  const Tensor w0 = mul_scalar(randn({64, 48}, DType::f32, 41), 0.1);
  const Tensor g16 = randn({64, 48}, DType::f32, 42).to(DType::bf16);
  Tensor cpu = w0.clone().set_requires_grad(), gpu = w0.to(kCuda).set_requires_grad();
  Muon opt_cpu({{"w", cpu, true, "t"}}, {}), opt_gpu({{"w", gpu, true, "t"}}, {});
  opt_gpu.convert_to_bf16([](const NamedParameter&) { return true; });
  cpu.set_grad(g16.to(DType::f32));
  gpu.set_grad(g16.to(kCuda));
  opt_cpu.step(0.05);
  opt_gpu.step(0.05);
  CHECK(rel_error(opt_gpu.master_weights()[0].to(kCpu), cpu.detach()) < 2e-5);
  CHECK(gpu.dtype() == DType::bf16);

  // QK-Clip on the device scales the same rows by the same factors.
  Tensor q = randn({12, 5}, DType::f32, 51), kv = randn({10, 6}, DType::f32, 52);
  Tensor qc = q.to(kCuda), kvc = kv.to(kCuda);
  const std::vector<double> gamma = {0.25, 1.0};
  const MlaHeadDims d{2, 4, 2, 1};
  CHECK(qk_clip_mla_(q, kv, gamma, d) == 1);
  CHECK(qk_clip_mla_(qc, kvc, gamma, d) == 1);
  CHECK(bitwise_equal(qc.to(kCpu), q));
  CHECK(bitwise_equal(kvc.to(kCpu), kv));
}

// ---------------------------------------------------------------- QK-Clip

TEST_CASE("qk_clip: MLA rows scaled as worked out by hand", "[optim][qk_clip]") {
  // H = 2, dn = 2, dr = 1, dv = 1, in = 2. q rows per head: [nope, nope, rot];
  // kv_b rows per head: [k_nope, k_nope, v].
  const MlaHeadDims d{2, 2, 1, 1};
  const std::vector<double> q0 = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const std::vector<double> kv0 = {1, -1, 2, -2, 3, -3, 4, -4, 5, -5, 6, -6};
  SECTION("head 0 at 4τ: γ = 1/4, √γ = 1/2; head 1 at τ untouched") {
    const std::vector<double> gamma = qk_clip_factors(from_vector({400, 100}, {2}, DType::f32), 100);
    CHECK(gamma == std::vector<double>{0.25, 1.0});
    Tensor q = matrix(q0, 6, 2), kv = matrix(kv0, 6, 2);
    CHECK(qk_clip_mla_(q, kv, gamma, d) == 1);
    CHECK(q.to_vector() == std::vector<double>{0.5, 1, 1.5, 2, 1.25, 1.5, 7, 8, 9, 10, 11, 12});
    CHECK(kv.to_vector() == std::vector<double>{0.5, -0.5, 1, -1, 3, -3, 4, -4, 5, -5, 6, -6});
  }
  SECTION("head 1 at 2τ: γ = 1/2, √γ = 0.7071067811865476") {
    const std::vector<double> gamma = qk_clip_factors(from_vector({-7, 200}, {2}, DType::f64), 100);
    CHECK(gamma == std::vector<double>{1.0, 0.5});
    Tensor q = matrix(q0, 6, 2), kv = matrix(kv0, 6, 2);
    CHECK(qk_clip_mla_(q, kv, gamma, d) == 1);
    const double r = 0.7071067811865476;
    const std::vector<double> want_q = {1, 2, 3, 4, 5, 6, 7 * r, 8 * r, 9 * r, 10 * r, 5.5, 6};
    const std::vector<double> want_kv = {1, -1, 2, -2, 3, -3, 4 * r, -4 * r, 5 * r, -5 * r, 6, -6};
    const std::vector<double> got_q = q.to_vector(), got_kv = kv.to_vector();
    for (int i = 0; i < 12; ++i) {
      CHECK(got_q[i] == Approx(want_q[i]).epsilon(1e-15));
      CHECK(got_kv[i] == Approx(want_kv[i]).epsilon(1e-15));
    }
  }
}

TEST_CASE("qk_clip: plain attention rows scaled as worked out by hand", "[optim][qk_clip]") {
  SECTION("GPT-2's fused c_attn [3D, in] and its bias: D = 4, H = 2, hd = 2") {
    std::vector<double> w0(12), b0(12);
    for (int i = 0; i < 12; ++i) {
      w0[i] = i + 1;
      b0[i] = -(i + 1);
    }
    Tensor w = matrix(w0, 12, 1), b = from_vector(b0, {12}, DType::f64);
    // head 0 below τ, head 1 at 4τ: its q rows 2, 3 and k rows 6, 7 halved.
    const std::vector<double> gamma = qk_clip_factors(from_vector({50, 400}, {2}, DType::f64), 100);
    CHECK(qk_clip_fused_qkv_(w, b, gamma, 2) == 1);
    CHECK(w.to_vector() == std::vector<double>{1, 2, 1.5, 2, 5, 6, 3.5, 4, 9, 10, 11, 12});
    CHECK(b.to_vector() == std::vector<double>{-1, -2, -1.5, -2, -5, -6, -3.5, -4, -9, -10, -11, -12});
  }
  SECTION("separate q_proj and k_proj: D = 2, H = 2, hd = 1") {
    Tensor q = matrix({1, 2, 3, 4}, 2, 2), k = matrix({5, 6, 7, 8}, 2, 2);
    const std::vector<double> gamma = qk_clip_factors(from_vector({1000, 10}, {2}, DType::f64), 100);
    CHECK(gamma[0] == Approx(0.1).epsilon(1e-15));
    CHECK(gamma[1] == 1.0);
    CHECK(qk_clip_mha_(q, k, gamma, 2) == 1);
    const double r = 0.31622776601683794;  // √0.1
    const std::vector<double> want_q = {r, 2 * r, 3, 4}, want_k = {5 * r, 6 * r, 7, 8};
    const std::vector<double> got_q = q.to_vector(), got_k = k.to_vector();
    for (int i = 0; i < 4; ++i) {
      CHECK(got_q[i] == Approx(want_q[i]).epsilon(1e-15));
      CHECK(got_k[i] == Approx(want_k[i]).epsilon(1e-15));
    }
  }
}

TEST_CASE("qk_clip: heads at or below tau are unchanged bit for bit", "[optim][qk_clip]") {
  const MlaHeadDims d{4, 3, 2, 5};
  const Tensor q0 = randn({4 * 5, 7}, DType::f32, 1), kv0 = randn({4 * 8, 6}, DType::f32, 2);
  SECTION("no head above tau") {
    const std::vector<double> gamma = qk_clip_factors(
        from_vector({100, 99.99, -3, -std::numeric_limits<double>::infinity()}, {4}, DType::f64), 100);
    CHECK(gamma == std::vector<double>(4, 1.0));
    Tensor q = q0.clone(), kv = kv0.clone();
    CHECK(qk_clip_mla_(q, kv, gamma, d) == 0);
    CHECK(bitwise_equal(q, q0));
    CHECK(bitwise_equal(kv, kv0));
  }
  SECTION("heads 1 and 3 above tau: heads 0 and 2 keep their bits, 1 and 3 change") {
    const std::vector<double> gamma = qk_clip_factors(from_vector({100, 1e4, 50, 100.5}, {4}, DType::f64), 100);
    Tensor q = q0.clone(), kv = kv0.clone();
    CHECK(qk_clip_mla_(q, kv, gamma, d) == 2);
    for (int64_t h = 0; h < 4; ++h) {
      INFO("head " << h);
      const bool clipped = h == 1 || h == 3;
      CHECK(bitwise_equal(slice(q, 0, h * 5, h * 5 + 5), slice(q0, 0, h * 5, h * 5 + 5)) == !clipped);
      CHECK(bitwise_equal(slice(kv, 0, h * 8, h * 8 + 3), slice(kv0, 0, h * 8, h * 8 + 3)) == !clipped);
      CHECK(bitwise_equal(slice(kv, 0, h * 8 + 3, h * 8 + 8), slice(kv0, 0, h * 8 + 3, h * 8 + 8)));  // values
    }
  }
}

TEST_CASE("qk_clip: matches the NumPy reference (MLA with and without query LoRA, attention, GPT-2)",
          "[optim][qk_clip]") {
  MT_REFERENCE_OR_SKIP(dir);
  hdf5::Reader in(dir + "/inputs.h5"), want(dir + "/expected.h5");
  const std::vector<string> cases = cases_with_prefix(in, "qk_clip_");
  REQUIRE(cases.size() == 4);
  for (const string& c : cases) {
    INFO("case " << c);
    const string kind = *in.attr_string(c, "kind");
    const int64_t H = *in.attr_int(c, "H");
    const std::vector<double> gamma = qk_clip_factors(in.read(c, "max_logit"), *in.attr_double(c, "tau"));
    CHECK(rel_error(from_vector(gamma, {H}, DType::f64), want.read(c, "gamma")) < 1e-15);
    const string g = c + "/params";
    std::vector<std::pair<string, Tensor>> weights;
    for (const string& name : in.datasets(g)) weights.emplace_back(name, in.read(g, name));
    auto weight = [&](const string& name) {
      for (auto& [n, t] : weights)
        if (n == name) return t;
      FAIL("no " << name << " in " << g);
      return Tensor();
    };
    if (kind == "mla") {
      const MlaHeadDims d{H, *in.attr_int(c, "qk_nope_head_dim"), *in.attr_int(c, "qk_rope_head_dim"),
                          *in.attr_int(c, "v_head_dim")};
      const bool lora = in.has_dataset(g, "q_b_proj.weight");
      qk_clip_mla_(weight(lora ? "q_b_proj.weight" : "q_proj.weight"), weight("kv_b_proj.weight"), gamma, d);
    } else if (kind == "attention") {
      qk_clip_mha_(weight("self_attn.q_proj.weight"), weight("self_attn.k_proj.weight"), gamma, H);
    } else {
      REQUIRE(kind == "gpt2");
      qk_clip_fused_qkv_(weight("attn.c_attn.weight"), weight("attn.c_attn.bias"), gamma, H);
    }
    CHECK(want.datasets(g).size() == weights.size());
    for (auto& [name, t] : weights) {
      INFO(name);
      CHECK(rel_error(t, want.read(g, name)) < 1e-15);
    }
  }
}

TEST_CASE("qk_clip: bad thresholds, logits, factors and shapes are refused by name", "[optim][qk_clip]") {
  const Tensor s = from_vector({150, 20}, {2}, DType::f64);
  CHECK_THROWS_WITH(qk_clip_factors(s, 0), Catch::Contains("tau"));
  CHECK_THROWS_WITH(qk_clip_factors(s, -1), Catch::Contains("tau"));
  CHECK_THROWS_WITH(qk_clip_factors(s, std::nan("")), Catch::Contains("tau"));
  CHECK_THROWS_WITH(qk_clip_factors(from_vector({1, 2, 3, 4}, {2, 2}, DType::f64), 100), Catch::Contains("[H]"));
  CHECK_THROWS_AS(qk_clip_factors(from_vector({1, std::nan("")}, {2}, DType::f64), 100), NumericalError);
  CHECK_THROWS_WITH(qk_clip_factors(from_vector({1, INFINITY}, {2}, DType::f64), 100), Catch::Contains("head 1"));

  const MlaHeadDims d{2, 2, 1, 1};
  Tensor q = zeros({6, 3}, DType::f32), kv = zeros({6, 3}, DType::f32);
  CHECK_THROWS_WITH(qk_clip_mla_(zeros({5, 3}, DType::f32), kv, {0.5, 1}, d), Catch::Contains("q_b_proj.weight"));
  CHECK_THROWS_WITH(qk_clip_mla_(q, zeros({4, 3}, DType::f32), {0.5, 1}, d), Catch::Contains("kv_b_proj.weight"));
  CHECK_THROWS_WITH(qk_clip_mla_(q, kv, {0.5}, d), Catch::Contains("n_head"));
  CHECK_THROWS_WITH(qk_clip_mla_(q, kv, {0.0, 1}, d), Catch::Contains("gamma of head 0"));
  CHECK_THROWS_WITH(qk_clip_mla_(q, kv, {1.0, 1.5}, d), Catch::Contains("gamma of head 1"));
  CHECK_THROWS_WITH(qk_clip_fused_qkv_(zeros({10, 3}, DType::f32), Tensor(), {1, 1}, 2),
                    Catch::Contains("attn.c_attn.weight"));
  CHECK_THROWS_WITH(qk_clip_fused_qkv_(zeros({12, 3}, DType::f32), zeros({11}, DType::f32), {1, 1}, 2),
                    Catch::Contains("attn.c_attn.bias"));
  CHECK_THROWS_WITH(qk_clip_mha_(zeros({4, 4}, DType::f32), zeros({2, 4}, DType::f32), {1, 1}, 2),
                    Catch::Contains("k_proj.weight"));
}
