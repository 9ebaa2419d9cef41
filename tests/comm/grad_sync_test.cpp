// all_reduce_grads: bucketed sums equal per-parameter all-reduces and the sums
// each rank computes itself; missing grads count as zeros; scale applies.
// Values are small integers times powers of two, so every sum is exact whatever
// order MPI adds in. GradReducer (overlapped with backward) gives the blocking
// sums bit for bit: fed by hand in any order, and fed by a real backward through
// the grad-ready hook with two groups and a parameter unused on some ranks.
// reduce_scatter_grads (train.zero 1) gives each rank those sums on the elements
// it owns, and all_gather_params spreads owned elements to every rank.
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

GradTensors make_params(int r) {
  GradTensors params;
  for (size_t p = 0; p < specs().size(); ++p) {
    const Spec& s = specs()[p];
    Tensor t = zeros(s.shape, s.dtype);
    t.set_requires_grad(true);
    if (has_grad(s, r)) {
      std::vector<double> g;
      for (int64_t i = 0; i < s.shape.numel(); ++i) g.push_back(grad_value(p, r, i));
      t.set_grad(from_vector(g, s.shape, s.dtype));
    }
    params.push_back({s.name, t});
  }
  return params;
}

void check_grad_sync(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  const double scale = 0.5;

  // Reference 1: one all_reduce_sum per parameter (zeros where a grad is missing).
  GradTensors reference = make_params(r);
  std::vector<Tensor> per_param;
  for (size_t p = 0; p < reference.size(); ++p) {
    Tensor g = reference[p].tensor.grad();
    Tensor sum = g.defined() ? g.to(DType::f64) : zeros(specs()[p].shape, DType::f64);
    comm.all_reduce_sum(sum);
    per_param.push_back(sum);
  }

  for (int64_t bucket_bytes : {int64_t{64}, int64_t{32} << 20}) {
    DYNAMIC_SECTION("bucket_bytes " << bucket_bytes) {
      GradTensors params = make_params(r);
      GradSyncStats stats = all_reduce_grads(comm, params, {.scale = scale, .bucket_bytes = bucket_bytes});
      if (n == 1) {
        // A group of one scales each grad where it is: no bucket, no copy (the values are checked below).
        CHECK(stats.num_buckets == 0);
        CHECK(stats.bytes == 0);
      } else if (bucket_bytes == 64) {
        // f32 (16 per bucket): a (35) alone, c (40) alone, unused skipped, then
        // e (bf16, summed as f32) + f + g (13): 3 buckets; f64 (8 per bucket):
        // b (3) + d (6) do not fit one: 2 buckets.
        CHECK(stats.num_buckets == 5);
      } else {
        CHECK(stats.num_buckets == 2);  // one f32, one f64
      }
      if (n > 1) CHECK(stats.bytes == (35 + 40 + 8 + 2 + 3) * 4 + (3 + 6) * 8);
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

// reduce_scatter_grads (train.zero 1): each rank's owned elements hold what
// all_reduce_grads gives there, its other elements its own unsummed grad; then
// all_gather_params spreads each rank's owned elements to every rank. Buckets of
// 64 bytes cut parameters apart; the element ranges cut them too.
void check_reduce_scatter_grads(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  std::vector<int64_t> numels;
  for (const Spec& s : specs()) numels.push_back(s.shape.numel());
  const FlatShards shards = make_flat_shards(numels, n);
  CHECK(shards.bounds.front() == 0);
  CHECK(shards.bounds.back() == shards.offsets.back());
  for (int q = 0; q < n; ++q) {  // balanced to one element
    const int64_t size = shards.bounds[static_cast<size_t>(q) + 1] - shards.bounds[static_cast<size_t>(q)];
    CHECK(std::abs(static_cast<double>(size) - static_cast<double>(shards.offsets.back()) / n) < 1);
  }
  for (int64_t bucket_bytes : {int64_t{64}, int64_t{32} << 20}) {
    DYNAMIC_SECTION("bucket_bytes " << bucket_bytes) {
      GradTensors want = make_params(r), got = make_params(r);
      all_reduce_grads(comm, want, {.scale = 0.5, .bucket_bytes = bucket_bytes});
      reduce_scatter_grads(comm, got, shards, {.scale = 0.5, .bucket_bytes = bucket_bytes});
      const GradTensors own = make_params(r);
      for (size_t p = 0; p < got.size(); ++p) {
        INFO("parameter " << specs()[p].name);
        if (specs()[p].has == Has::none) {
          CHECK(!got[p].tensor.grad().defined());
          continue;
        }
        REQUIRE(got[p].tensor.grad().defined());
        const auto [a, b] = shards.owned(p, r);
        const std::vector<double> g = got[p].tensor.grad().to_vector(), w = want[p].tensor.grad().to_vector();
        const Tensor mine = own[p].tensor.grad();
        const std::vector<double> m = mine.defined() ? mine.to_vector() : std::vector<double>(g.size(), 0.0);
        for (size_t i = 0; i < g.size(); ++i) {
          const bool owned = static_cast<int64_t>(i) >= a && static_cast<int64_t>(i) < b;
          CHECK(g[i] == (owned ? w[i] : m[i]));
        }
      }
      // Parameters stamped with the rank that owns each element, then gathered.
      std::vector<Tensor> values;
      for (size_t p = 0; p < specs().size(); ++p) {
        const auto [a, b] = shards.owned(p, r);
        std::vector<double> v(static_cast<size_t>(numels[p]), -1.0);
        for (int64_t i = a; i < b; ++i)  // below 256: exact in bf16
          v[static_cast<size_t>(i)] = r * 50 + static_cast<double>(i);
        values.push_back(from_vector(v, specs()[p].shape, specs()[p].dtype));
      }
      all_gather_params(comm, values, shards, bucket_bytes);
      for (size_t p = 0; p < specs().size(); ++p) {
        const std::vector<double> v = values[p].to_vector();
        for (int q = 0; q < n; ++q) {
          const auto [a, b] = shards.owned(p, q);
          for (int64_t i = a; i < b; ++i) CHECK(v[static_cast<size_t>(i)] == q * 50 + static_cast<double>(i));
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("comm: reduce_scatter_grads gives each rank all_reduce_grads' sums of its elements; all_gather_params "
          "spreads them (one process)", "[comm]") {
  std::unique_ptr<Communicator> one = single_process();
  check_reduce_scatter_grads(*one);
}

TEST_CASE("comm: reduce_scatter_grads gives each rank all_reduce_grads' sums of its elements; all_gather_params "
          "spreads them", "[comm][mpi]") {
  check_reduce_scatter_grads(world());
}

TEST_CASE("comm: all_reduce_grads in buckets equals per-parameter sums (one process)", "[comm]") {
  std::unique_ptr<Communicator> one = single_process();
  check_grad_sync(*one);
}

TEST_CASE("comm: all_reduce_grads in buckets equals per-parameter sums", "[comm][mpi]") { check_grad_sync(world()); }

TEST_CASE("comm: all_reduce_grads refuses what it cannot sum", "[comm]") {
  std::unique_ptr<Communicator> one = single_process();
  Tensor ids = zeros(Shape{3}, DType::i64);
  CHECK_THAT(error_of([&] { all_reduce_grads(*one, {{"ids", ids}}); }),
             Catch::Contains("'ids'") && Catch::Contains("f32, bf16 and f64"));
  Tensor w = zeros(Shape{3}, DType::f32);
  w.set_requires_grad(true);
  w.set_grad(zeros(Shape{4}, DType::f32));
  CHECK_THAT(error_of([&] { all_reduce_grads(*one, {{"w", w}}); }),
             Catch::Contains("grad of 'w'") && Catch::Contains("f32[4]"));
  CHECK_THAT(error_of([&] { all_reduce_grads(*one, {}, {.bucket_bytes = 0}); }), Catch::Contains("bucket_bytes"));
  w.set_grad(zeros(Shape{3}, DType::f32));
  CHECK_THAT(error_of([&] { all_reduce_grads(*one, {{"tied", w}, {"w", w}}); }),
             Catch::Contains("'w' is listed twice"));
}

namespace {

// GradReducer over `comm`, fed each rank's grads in its own order (rank r starts
// at a different parameter and skips those it has no grad for, as backward
// would), equals all_reduce_grads on the same grads.
void check_reducer_fed_by_hand(Communicator& comm) {
  const int r = comm.rank();
  for (int64_t bucket_bytes : {int64_t{64}, int64_t{32} << 20}) {
    DYNAMIC_SECTION("bucket_bytes " << bucket_bytes) {
      const GradSyncOptions options{.scale = 0.5, .bucket_bytes = bucket_bytes};
      GradTensors want = make_params(r), got = make_params(r);
      all_reduce_grads(comm, want, options);
      std::vector<ReducedParameter> list;
      for (const GradTensor& p : got) list.push_back({p, &comm});
      GradReducer reducer(list, options);
      if (bucket_bytes == 64) {
        // Reverse list order, one open bucket per dtype (16 f32 or 8 f64 elements):
        // g + f + e (13) until unused (4) would overflow it; d alone in f64 until b;
        // unused, c (40) and a (35) each alone.
        CHECK(reducer.bucket_members() == std::vector<std::vector<size_t>>{{7, 6, 5}, {4}, {3}, {2}, {1}, {0}});
      } else {
        CHECK(reducer.bucket_members() == std::vector<std::vector<size_t>>{{7, 6, 5, 3, 2, 0}, {4, 1}});
      }
      for (int round = 0; round < 2; ++round) {  // twice: buffers are reused
        for (GradTensor& p : got) p.tensor.zero_grad();
        GradTensors fresh = make_params(r);
        for (size_t i = 0; i < got.size(); ++i)
          if (fresh[i].tensor.grad().defined()) got[i].tensor.set_grad(fresh[i].tensor.grad());
        reducer.begin();
        const size_t n = got.size();
        for (size_t k = 0; k < n; ++k) {
          const size_t i = (k + static_cast<size_t>(r) * 3) % n;
          if (got[i].tensor.grad().defined()) reducer.grad_ready(got[i].tensor);
        }
        reducer.grad_ready(zeros(Shape{2}, DType::f32));  // not in the list: ignored
        GradSyncStats stats = reducer.finish();
        CHECK(stats.bytes == (35 + 40 + 4 + 8 + 2 + 3) * 4 + (3 + 6) * 8);  // `unused` is summed too
        for (size_t i = 0; i < n; ++i) {
          INFO("parameter " << specs()[i].name << ", round " << round);
          Tensor a = want[i].tensor.grad(), b = got[i].tensor.grad();
          REQUIRE(a.defined() == b.defined());
          if (a.defined()) CHECK(moetrain::testing::bitwise_equal(a, b));
        }
      }
    }
  }
}

// A small model with a real backward: parameters summed over the world, and
// "expert" ones over a split group (the expert layer recomputed: checkpoint);
// `rare` gets a grad on rank 0 only, `never` on no rank. Losses and grads differ per rank (the data depends on the rank).
struct TinyModel {
  GradTensors params;
  std::vector<bool> expert;  // summed over the split group
  explicit TinyModel(DType dtype) {
    auto add = [&](const char* name, Shape shape, uint64_t seed, const char* group) {
      Tensor t = mul_scalar(randn(shape, dtype, seed), 0.3);
      t.set_requires_grad(true);
      params.push_back({name, t});
      expert.push_back(std::string(group) == "experts");
    };
    add("never", Shape{3}, 6, "dense");  // first: its bucket is the last to start
    add("embed", Shape{7, 6}, 1, "dense");
    add("w1", Shape{6, 9}, 2, "dense");
    add("expert", Shape{9, 9}, 3, "experts");
    add("rare", Shape{9, 9}, 4, "experts");
    add("w2", Shape{9, 5}, 5, "dense");
  }
  void backward(int rank) {
    Tensor x = randn(Shape{4, 7}, params[1].tensor.dtype(), 100 + static_cast<uint64_t>(rank));
    Tensor h = tanh(matmul(matmul(x, params[1].tensor), params[2].tensor));
    // The expert layer recomputed in backward: its parameter is reported after the nested pass.
    h = checkpoint([w = params[3].tensor](const Tensors& in) { return Tensors{tanh(matmul(in[0], w))}; }, {h})[0];
    if (rank == 0) h = add(h, tanh(matmul(h, params[4].tensor)));
    sum(mul(matmul(h, params[5].tensor), matmul(h, params[5].tensor))).backward();
  }
};

void check_reducer_in_backward(Communicator& world_comm) {
  const int r = world_comm.rank();
  std::unique_ptr<Communicator> group = world_comm.split(r % 2, r);
  for (DType dtype : {DType::f32, DType::f64}) {
    DYNAMIC_SECTION("dtype " << (dtype == DType::f32 ? "f32" : "f64")) {
      const GradSyncOptions options{.scale = 1.0 / world_comm.size(), .bucket_bytes = 128};  // a bucket per parameter
      TinyModel want(dtype), got(dtype);
      want.backward(r);
      GradTensors dense, experts;
      for (size_t i = 0; i < want.params.size(); ++i) (want.expert[i] ? experts : dense).push_back(want.params[i]);
      all_reduce_grads(world_comm, dense, options);
      all_reduce_grads(*group, experts, options);

      std::vector<ReducedParameter> list;
      for (size_t i = 0; i < got.params.size(); ++i)
        list.push_back({got.params[i], got.expert[i] ? group.get() : &world_comm});
      GradReducer reducer(list, options);
      reducer.begin();
      {
        autograd::GradReadyHookGuard guard([&](const Tensor& leaf) { reducer.grad_ready(leaf); });
        got.backward(r);
      }
      const GradSyncStats stats = reducer.finish();
      // Buckets in start order: w2, rare, expert, w1, embed, never. w2 starts during
      // backward everywhere; on rank 0, which has a grad for `rare`, all but `never`.
      CHECK(stats.num_buckets == 6);
      CHECK(stats.num_started_early == (r == 0 ? 5 : 1));
      for (size_t i = 0; i < got.params.size(); ++i) {
        INFO("parameter " << got.params[i].name);
        Tensor a = want.params[i].tensor.grad(), b = got.params[i].tensor.grad();
        REQUIRE(a.defined() == b.defined());
        if (!a.defined()) continue;
        if (world_comm.size() <= 2) CHECK(moetrain::testing::bitwise_equal(a, b));
        else CHECK(moetrain::testing::max_abs_diff(a, b) <= (dtype == DType::f32 ? 1e-5 : 1e-12));
      }
      CHECK_FALSE(got.params[0].tensor.grad().defined());  // `never`: no rank has a grad
      CHECK(got.params[4].tensor.grad().defined() == (r % 2 == 0));  // `rare`: in rank 0's group only
    }
  }
}

}  // namespace

TEST_CASE("comm: GradReducer equals all_reduce_grads, grads ready in any order (one process)", "[comm]") {
  std::unique_ptr<Communicator> one = single_process();
  check_reducer_fed_by_hand(*one);
}

TEST_CASE("comm: GradReducer equals all_reduce_grads, grads ready in any order", "[comm][mpi]") {
  check_reducer_fed_by_hand(world());
}

TEST_CASE("comm: GradReducer during backward equals the blocking sums (one process)", "[comm]") {
  std::unique_ptr<Communicator> one = single_process();
  check_reducer_in_backward(*one);
}

TEST_CASE("comm: GradReducer during backward equals the blocking sums, two groups, grads missing on some ranks",
          "[comm][mpi]") {
  check_reducer_in_backward(world());
}

TEST_CASE("comm: GradReducer refuses what it cannot sum and misuse", "[comm]") {
  std::unique_ptr<Communicator> one = single_process();
  Tensor ids = zeros(Shape{3}, DType::i64);
  CHECK_THAT(error_of([&] { GradReducer({{{"ids", ids}, one.get()}}); }),
             Catch::Contains("'ids'") && Catch::Contains("f32, bf16 and f64"));
  Tensor w = zeros(Shape{3}, DType::f32);
  w.set_requires_grad(true);
  GradReducer reducer({{{"w", w}, one.get()}});
  CHECK_THAT(error_of([&] { reducer.finish(); }), Catch::Contains("begin()"));
  reducer.begin();
  CHECK_THAT(error_of([&] { reducer.begin(); }), Catch::Contains("not finished"));
  w.set_grad(zeros(Shape{4}, DType::f32));
  CHECK_THAT(error_of([&] { reducer.grad_ready(w); }), Catch::Contains("grad of 'w'") && Catch::Contains("f32[4]"));
}

TEST_CASE("all_reduce_grads: CUDA gradients are packed and scaled on the device as on the CPU", "[comm][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  auto comm = single_process();
  auto make = [](Device d) {
    GradTensors ps;
    ps.push_back({"a", randn({33, 7}, DType::f32, 1).to(d).set_requires_grad()});
    ps.push_back({"b", randn({5}, DType::f32, 2).to(d).set_requires_grad()});  // no grad
    ps.push_back({"c", randn({9}, DType::f64, 3).to(d).set_requires_grad()});
    ps[0].tensor.set_grad(randn({33, 7}, DType::f32, 4).to(d));
    ps[2].tensor.set_grad(randn({9}, DType::f64, 5).to(d));
    return ps;
  };
  GradTensors cpu = make(kCpu), gpu = make(kCuda);
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

TEST_CASE("reduce_scatter_grads and all_gather_params: CUDA tensors are packed, scaled and spread on the device as "
          "on the CPU", "[comm][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  auto comm = single_process();
  auto make = [](Device d) {
    GradTensors ps;
    ps.push_back({"a", randn({33, 7}, DType::f32, 1).to(d).set_requires_grad()});
    ps.push_back({"b", randn({5}, DType::f32, 2).to(d).set_requires_grad()});  // no grad
    ps.push_back({"c", randn({9}, DType::f64, 3).to(d).set_requires_grad()});
    ps.push_back({"e", randn({6}, DType::f32, 6).to(DType::bf16).to(d).set_requires_grad()});
    ps[0].tensor.set_grad(randn({33, 7}, DType::f32, 4).to(d));
    ps[2].tensor.set_grad(randn({9}, DType::f64, 5).to(d));
    ps[3].tensor.set_grad(randn({6}, DType::f32, 7).to(DType::bf16).to(d));
    return ps;
  };
  GradTensors cpu = make(kCpu), gpu = make(kCuda);
  const FlatShards shards = make_flat_shards({33 * 7, 5, 9, 6}, 1);
  GradSyncOptions o;
  o.scale = 0.5;
  o.bucket_bytes = 64;  // several buckets, parameters cut apart
  reduce_scatter_grads(*comm, cpu, shards, o);
  reduce_scatter_grads(*comm, gpu, shards, o);
  std::vector<Tensor> cpu_values, gpu_values;
  for (size_t i = 0; i < cpu.size(); ++i) {
    INFO(cpu[i].name);
    REQUIRE(gpu[i].tensor.grad().defined() == cpu[i].tensor.grad().defined());
    if (cpu[i].tensor.grad().defined())
      CHECK(moetrain::testing::bitwise_equal(gpu[i].tensor.grad().to(kCpu), cpu[i].tensor.grad()));
    cpu_values.push_back(cpu[i].tensor.detach());
    gpu_values.push_back(gpu[i].tensor.detach());
  }
  all_gather_params(*comm, gpu_values, shards, 64);  // one rank: nothing moves
  for (size_t i = 0; i < cpu.size(); ++i)
    CHECK(moetrain::testing::bitwise_equal(gpu_values[i].to(kCpu), cpu_values[i]));
}

TEST_CASE("comm: GradReducer on CUDA gradients equals the CPU one", "[comm][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  auto comm = single_process();
  const Device gpu = kCuda;
  // Grads ready in a shuffled order, one missing (zeros, stays undefined), bf16 included.
  for (int64_t bucket_bytes : {int64_t{64}, int64_t{32} << 20}) {
    GradTensors cpu = make_params(0), cuda_params;
    for (const GradTensor& p : cpu) {
      Tensor t = p.tensor.detach().to(gpu);
      t.set_requires_grad(true);
      if (p.tensor.grad().defined()) t.set_grad(p.tensor.grad().to(gpu));
      cuda_params.push_back({p.name, t});
    }
    const GradSyncOptions options{.scale = 0.25, .bucket_bytes = bucket_bytes};
    std::vector<ReducedParameter> cpu_list, cuda_list;
    for (const GradTensor& p : cpu) cpu_list.push_back({p, comm.get()});
    for (const GradTensor& p : cuda_params) cuda_list.push_back({p, comm.get()});
    GradReducer on_cpu(cpu_list, options), on_cuda(cuda_list, options);
    for (GradReducer* reducer : {&on_cpu, &on_cuda}) {
      GradTensors& ps = reducer == &on_cpu ? cpu : cuda_params;
      reducer->begin();
      for (size_t k = 0; k < ps.size(); ++k) {
        const size_t i = (k * 5 + 2) % ps.size();
        if (ps[i].tensor.grad().defined()) reducer->grad_ready(ps[i].tensor);
      }
      reducer->finish();
    }
    for (size_t i = 0; i < cpu.size(); ++i) {
      INFO("parameter " << cpu[i].name << ", bucket_bytes " << bucket_bytes);
      Tensor a = cpu[i].tensor.grad(), b = cuda_params[i].tensor.grad();
      REQUIRE(a.defined() == b.defined());
      if (a.defined()) CHECK(moetrain::testing::bitwise_equal(a, b.to(kCpu)));
    }
  }
}
