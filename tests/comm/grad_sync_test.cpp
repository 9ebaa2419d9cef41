// all_reduce_grads: bucketed sums equal per-parameter all-reduces and the sums
// each rank computes itself; missing grads count as zeros; scale applies.
// Values are small integers times powers of two, so every sum is exact whatever
// order MPI adds in.
#include <catch2/catch.hpp>

#include "comm/grad_sync.h"
#include "moetrain.h"
#include "testing.h"

using namespace moetrain;
using namespace moetrain::comm;
using moetrain::testing::error_of;

namespace {

// Which parameters have a grad on which rank.
enum class Has { all, none, first_rank };

struct Spec {
  const char* name;
  Shape shape;
  DType dtype;
  Has has;
};

const std::vector<Spec>& specs() {
  static const std::vector<Spec> s = {
      {"a", Shape{5, 7}, DType::f32, Has::all},      {"b", Shape{3}, DType::f64, Has::all},
      {"c", Shape{40}, DType::f32, Has::all},        {"unused", Shape{4}, DType::f32, Has::none},
      {"d", Shape{6}, DType::f64, Has::first_rank},  {"e", Shape{8}, DType::bf16, Has::all},
      {"f", Shape{2}, DType::f32, Has::all},         {"g", Shape{3}, DType::f32, Has::first_rank},
  };
  return s;
}

// Grad element i of parameter p on rank r.
double grad_value(size_t p, int r, int64_t i) { return static_cast<double>((r + 1) * (i % 5 + 1) + p) * 0.25; }

bool has_grad(const Spec& s, int r) {
  return s.has == Has::all || (s.has == Has::first_rank && r == 0);
}

ParameterList make_params(int r) {
  ParameterList params;
  for (size_t p = 0; p < specs().size(); ++p) {
    const Spec& s = specs()[p];
    Tensor t = zeros(s.shape, s.dtype);
    t.set_requires_grad(true);
    if (has_grad(s, r)) {
      std::vector<double> g;
      for (int64_t i = 0; i < s.shape.numel(); ++i) g.push_back(grad_value(p, r, i));
      t.set_grad(from_vector(g, s.shape, s.dtype));
    }
    params.push_back({s.name, t, true, "test"});
  }
  return params;
}

void check_grad_sync(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  const double scale = 0.5;

  // Reference 1: one all_reduce_sum per parameter (zeros where a grad is missing).
  ParameterList reference = make_params(r);
  std::vector<Tensor> per_param;
  for (size_t p = 0; p < reference.size(); ++p) {
    Tensor g = reference[p].tensor.grad();
    Tensor sum = g.defined() ? g.to(DType::f64) : zeros(specs()[p].shape, DType::f64);
    comm.all_reduce_sum(sum);
    per_param.push_back(sum);
  }

  for (int64_t bucket_bytes : {int64_t{64}, int64_t{32} << 20}) {
    DYNAMIC_SECTION("bucket_bytes " << bucket_bytes) {
      ParameterList params = make_params(r);
      GradSyncStats stats = all_reduce_grads(comm, params, {.scale = scale, .bucket_bytes = bucket_bytes});
      if (bucket_bytes == 64) {
        // f32 (16 per bucket): a (35) alone, c (40) alone, unused skipped, then
        // e (bf16, summed as f32) + f + g (13): 3 buckets; f64 (8 per bucket):
        // b (3) + d (6) do not fit one: 2 buckets.
        CHECK(stats.num_buckets == 5);
      } else {
        CHECK(stats.num_buckets == 2);  // one f32, one f64
      }
      CHECK(stats.bytes == (35 + 40 + 8 + 2 + 3) * 4 + (3 + 6) * 8);
      for (size_t p = 0; p < params.size(); ++p) {
        const Spec& s = specs()[p];
        INFO("parameter " << s.name);
        Tensor g = params[p].tensor.grad();
        if (s.has == Has::none) {
          CHECK(!g.defined());  // no rank had one: still none, as with one process
          continue;
        }
        REQUIRE(g.defined());
        CHECK(g.dtype() == s.dtype);
        CHECK(g.shape() == s.shape);
        std::vector<double> got = g.to_vector(), ref = per_param[p].to_vector();
        for (int64_t i = 0; i < s.shape.numel(); ++i) {
          double expected = 0;
          for (int q = 0; q < n; ++q)
            if (has_grad(s, q)) expected += grad_value(p, q, i);
          CHECK(got[static_cast<size_t>(i)] == expected * scale);
          CHECK(got[static_cast<size_t>(i)] == ref[static_cast<size_t>(i)] * scale);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("comm: all_reduce_grads in buckets equals per-parameter sums (one process)", "[comm]") {
  std::unique_ptr<Communicator> one = single_process();
  check_grad_sync(*one);
}

TEST_CASE("comm: all_reduce_grads in buckets equals per-parameter sums", "[comm][mpi]") { check_grad_sync(world()); }

TEST_CASE("comm: all_reduce_grads refuses what it cannot sum", "[comm]") {
  std::unique_ptr<Communicator> one = single_process();
  Tensor ids = zeros(Shape{3}, DType::i64);
  CHECK_THAT(error_of([&] { all_reduce_grads(*one, {{"ids", ids, true, "test"}}); }),
             Catch::Contains("'ids'") && Catch::Contains("f32, bf16 and f64"));
  Tensor w = zeros(Shape{3}, DType::f32);
  w.set_requires_grad(true);
  w.set_grad(zeros(Shape{4}, DType::f32));
  CHECK_THAT(error_of([&] { all_reduce_grads(*one, {{"w", w, true, "test"}}); }),
             Catch::Contains("grad of 'w'") && Catch::Contains("f32[4]"));
  CHECK_THAT(error_of([&] { all_reduce_grads(*one, {}, {.bucket_bytes = 0}); }), Catch::Contains("bucket_bytes"));
  w.set_grad(zeros(Shape{3}, DType::f32));
  CHECK_THAT(error_of([&] { all_reduce_grads(*one, {{"tied", w, true, "test"}, {"w", w, true, "test"}}); }),
             Catch::Contains("'w' is listed twice"));
}

TEST_CASE("all_reduce_grads: CUDA gradients are packed and scaled on the device as on the CPU", "[comm][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  auto comm = single_process();
  auto make = [](Device d) {
    ParameterList ps;
    ps.push_back({"a", randn({33, 7}, DType::f32, 1).to(d).set_requires_grad(), true, "t"});
    ps.push_back({"b", randn({5}, DType::f32, 2).to(d).set_requires_grad(), true, "t"});  // no grad
    ps.push_back({"c", randn({9}, DType::f64, 3).to(d).set_requires_grad(), true, "t"});
    ps[0].tensor.set_grad(randn({33, 7}, DType::f32, 4).to(d));
    ps[2].tensor.set_grad(randn({9}, DType::f64, 5).to(d));
    return ps;
  };
  ParameterList cpu = make(kCpu), gpu = make(kCuda);
  GradSyncOptions o;
  o.scale = 0.5;
  o.bucket_bytes = 64;  // several buckets
  all_reduce_grads(*comm, cpu, o);
  all_reduce_grads(*comm, gpu, o);
  for (size_t i = 0; i < cpu.size(); ++i) {
    INFO(cpu[i].name);
    REQUIRE(gpu[i].tensor.grad().defined() == cpu[i].tensor.grad().defined());
    if (cpu[i].tensor.grad().defined())
      CHECK(moetrain::testing::bitwise_equal(gpu[i].tensor.grad().to(kCpu), cpu[i].tensor.grad()));
  }
}
