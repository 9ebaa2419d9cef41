#include <catch2/catch.hpp>

#include <cmath>

#include "backend/cpu/parallel.h"
#include "backend/cpu/isa.h"
#include "moetrain.h"
#include "ops/attention/attention_kernels.h"
#include "testing.h"
#include "ops/cuda_vs_cpu.h"

using namespace moetrain;
using moetrain::testing::check_gradients;

namespace {
// Direct O(T^2) reference with explicit masking.
std::vector<double> reference(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  int64_t B = q.size(0), T = q.size(1), H = q.size(2), Dk = q.size(3), Dv = v.size(3);
  std::vector<double> vq = q.to_vector(), vk = k.to_vector(), vv = v.to_vector(), out(B * T * H * Dv, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> s(t + 1);
        double m = -1e300;
        for (int64_t j = 0; j <= t; ++j) {
          double acc = 0;
          for (int64_t d = 0; d < Dk; ++d) acc += vq[((b * T + t) * H + h) * Dk + d] * vk[((b * T + j) * H + h) * Dk + d];
          s[j] = acc * scale;
          m = std::max(m, s[j]);
        }
        double z = 0;
        for (double& e : s) z += (e = std::exp(e - m));
        for (int64_t j = 0; j <= t; ++j)
          for (int64_t d = 0; d < Dv; ++d)
            out[((b * T + t) * H + h) * Dv + d] += s[j] / z * vv[((b * T + j) * H + h) * Dv + d];
      }
  return out;
}
}  // namespace

TEST_CASE("causal_attention: forward matches the direct softmax, T across tiles", "[ops][attention]") {
  for (int64_t T : {1, 31, 64, 65, 131}) {
    DYNAMIC_SECTION("T=" << T) {
      Tensor q = randn({2, T, 3, 8}, DType::f64, 1), k = randn({2, T, 3, 8}, DType::f64, 2),
             v = randn({2, T, 3, 5}, DType::f64, 3);
      std::vector<double> ref = reference(q, k, v, 0.35), out = causal_attention(q, k, v, 0.35).to_vector();
      for (size_t i = 0; i < ref.size(); ++i) REQUIRE(out[i] == Approx(ref[i]).epsilon(1e-11).margin(1e-13));
    }
  }
}

TEST_CASE("causal_attention: f32 agrees with f64", "[ops][attention]") {
  Tensor q = randn({1, 70, 2, 16}, DType::f32, 4), k = randn({1, 70, 2, 16}, DType::f32, 5),
         v = randn({1, 70, 2, 16}, DType::f32, 6);
  Tensor o32 = causal_attention(q, k, v, 0.25);
  Tensor o64 = causal_attention(q.to(DType::f64), k.to(DType::f64), v.to(DType::f64), 0.25);
  CHECK(moetrain::testing::max_abs_diff(o32.to(DType::f64), o64) < 1e-5);
}

TEST_CASE("causal_attention: f32 gradients agree with f64 and do not depend on the thread count", "[ops][attention]") {
  // The f32 path runs the vectorised softmax rows (forward and backward's recomputation).
  Tensor q = randn({2, 70, 3, 16}, DType::f32, 14), k = randn({2, 70, 3, 16}, DType::f32, 15),
         v = randn({2, 70, 3, 16}, DType::f32, 16), go = randn({2, 70, 3, 16}, DType::f32, 17);
  auto run = [&](DType dt, int threads) {
    cpu::set_num_threads(threads);
    Tensors in = {q.to(dt).detach().clone(), k.to(dt).detach().clone(), v.to(dt).detach().clone()};
    for (Tensor& t : in) t.set_requires_grad(true);
    Tensor o = causal_attention(in[0], in[1], in[2], 0.25);
    o.backward(go.to(dt));
    return Tensors{o.detach(), in[0].grad(), in[1].grad(), in[2].grad()};
  };
  int restore = cpu::num_threads();
  Tensors one = run(DType::f32, 1), two = run(DType::f32, 2), ref = run(DType::f64, 1);
  cpu::set_num_threads(restore);
  for (size_t i = 0; i < one.size(); ++i) {
    CHECK(moetrain::testing::bitwise_equal(one[i], two[i]));
    CHECK(moetrain::testing::max_abs_diff(one[i].to(DType::f64), ref[i]) < 2e-5);
  }
}

TEST_CASE("causal_attention: every vector copy agrees with f64; the FMA copies give the same bits", "[ops][attention]") {
  Tensor q = randn({2, 70, 3, 16}, DType::f64, 51), k = randn({2, 70, 3, 16}, DType::f64, 52),
         v = randn({2, 70, 3, 16}, DType::f64, 53), go = randn({2, 70, 3, 16}, DType::f64, 54);
  auto run = [&](DType dt) {
    Tensor ql = q.to(dt).detach().set_requires_grad(), kl = k.to(dt).detach().set_requires_grad(),
           vl = v.to(dt).detach().set_requires_grad();
    Tensor o = causal_attention(ql, kl, vl, 0.25);
    o.backward(go.to(dt));
    return std::vector<Tensor>{o, ql.grad(), kl.grad(), vl.grad()};
  };
  moetrain::testing::check_vector_copies(run, 2e-5);
}

TEST_CASE("causal_attention: gradients match finite differences", "[ops][attention]") {
  // T = 67 crosses a 64-row tile boundary, so dK/dV accumulate over two tiles.
  Tensor q = randn({1, 67, 2, 3}, DType::f64, 7), k = randn({1, 67, 2, 3}, DType::f64, 8),
         v = randn({1, 67, 2, 2}, DType::f64, 9);
  check_gradients([](const Tensors& in) { return causal_attention(in[0], in[1], in[2], 0.5); }, {q, k, v});
  Tensor q2 = randn({2, 5, 3, 4}, DType::f64, 10), k2 = randn({2, 5, 3, 4}, DType::f64, 11),
         v2 = randn({2, 5, 3, 6}, DType::f64, 12);
  check_gradients([](const Tensors& in) { return causal_attention(in[0], in[1], in[2], 0.5); }, {q2, k2, v2});
}

TEST_CASE("causal_attention: bad shapes are reported", "[ops][attention][errors]") {
  Tensor q = randn({1, 4, 2, 8}, DType::f32, 1);
  CHECK_THROWS_WITH(causal_attention(q, randn({1, 4, 2, 7}, DType::f32, 2), q, 1.0),
                    Catch::Contains("causal_attention") && Catch::Contains("[1, 4, 2, 7]"));
  CHECK_THROWS_WITH(causal_attention(q, q, randn({1, 5, 2, 8}, DType::f32, 2), 1.0),
                    Catch::Contains("[1, 5, 2, 8]"));
}

TEST_CASE("causal_attention: queries after a cache equal the last rows of full attention", "[ops][attention]") {
  // Decoding: the last T rows of attention over Tk keys, computed from those T queries alone.
  for (int64_t T : {1, 3, 70}) {
    DYNAMIC_SECTION("T=" << T) {
      const int64_t Tk = 75;
      Tensor q = randn({2, Tk, 3, 8}, DType::f64, 1), k = randn({2, Tk, 3, 8}, DType::f64, 2),
             v = randn({2, Tk, 3, 5}, DType::f64, 3);
      Tensor full_o = slice(causal_attention(q, k, v, 0.3), 1, Tk - T, Tk);
      Tensor last = causal_attention(slice(q, 1, Tk - T, Tk), k, v, 0.3);
      CHECK(moetrain::testing::max_abs_diff(full_o, last) < 1e-13);
    }
  }
  Tensor q = randn({1, 4, 2, 3}, DType::f64, 4), k = randn({1, 9, 2, 3}, DType::f64, 5),
         v = randn({1, 9, 2, 2}, DType::f64, 6);
  check_gradients([](const Tensors& in) { return causal_attention(in[0], in[1], in[2], 0.7); }, {q, k, v});
}

// The FlashAttention-style CUDA kernels against the CPU kernel: T around the
// 32-row tiles, the usual head dims, Dk != Dv, and a key cache longer than the
// queries (decoding: Tk > T).
TEST_CASE("causal_attention: CUDA matches CPU", "[ops][attention][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  struct Case {
    int64_t T, Tk, Dk, Dv;
  };
  std::vector<Case> cases;
  for (int64_t T : {1, 17, 64, 129})
    for (int64_t D : {32, 64, 128}) cases.push_back({T, T, D, D});
  cases.push_back({33, 33, 96, 48});    // head dims off the 32-lane steps, Dk != Dv
  cases.push_back({17, 50, 64, 64});    // 33 cached keys before the queries
  cases.push_back({1, 129, 128, 128});  // one decoding step
  cases.push_back({40, 40, 192, 128});  // MLA-like Dk > Dv
  // bf16 runs twice: on the tensor cores (every case here has head dims that are
  // multiples of 16) and on the scalar kernels.
  struct Variant {
    DType dt;
    bool tensor_cores;
  };
  for (Variant var : {Variant{DType::f32, false}, Variant{DType::bf16, true}, Variant{DType::bf16, false},
                      Variant{DType::f64, false}})
    for (const Case& c : cases) {
      const DType dt = var.dt;
      DYNAMIC_SECTION(fmt::format("{}{} T={} Tk={} Dk={} Dv={}", dt, var.tensor_cores ? " (tensor cores)" : "", c.T,
                                  c.Tk, c.Dk, c.Dv)) {
        cuda::set_attention_tensor_cores(var.tensor_cores);
        const int64_t B = 2, H = 3;
        Tensor q = randn({B, c.T, H, c.Dk}, DType::f64, 1), k = randn({B, c.Tk, H, c.Dk}, DType::f64, 2),
               v = randn({B, c.Tk, H, c.Dv}, DType::f64, 3);
        double scale = 1.5 / std::sqrt(static_cast<double>(c.Dk));  // peaked rows as well as flat ones
        CudaCompare tol = tolerance_for(dt);
        if (dt == DType::bf16) tol.backward_tol = 3e-2;  // dS = P (dP - rowsum(dO O)) with O stored in bf16
        const Tensor probe = randn({1, 1, 1, c.Dk}, DType::f64, 5).to(DType::bf16).to(kCuda);
        CHECK(cuda::attention_tensor_cores_apply(probe, c.Dk, c.Dv) == var.tensor_cores);
        check_cuda_matches_cpu([scale](const Tensors& in) { return causal_attention(in[0], in[1], in[2], scale); },
                               {q, k, v}, {true, true, true}, dt, tol);
        cuda::set_attention_tensor_cores(true);
      }
    }
}
