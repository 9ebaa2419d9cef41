// The backward engine: seeding, order, accumulation, retain_graph and freeing of
// saved tensors, grad mode, and checkpoint() recomputation (bitwise the same
// gradients, random ops replayed).
#include <catch2/catch.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moetrain.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::bitwise_equal;
using moetrain::testing::check_gradients;

namespace {

// A test op: the sum of its inputs (same shapes), whose backward logs its name
// and passes the gradient to every input unchanged.
Tensor traced(const char* name, const Tensors& inputs, std::vector<std::string>& log) {
  Tensor y;
  {
    NoGradGuard no_grad;
    y = inputs[0].detach().clone();
    for (size_t i = 1; i < inputs.size(); ++i) y = add(y, inputs[i]);
  }
  size_t n = inputs.size();
  return record(name, y, inputs, [name, n, &log](const Tensor& g) {
    log.push_back(name);
    return Grads(n, g);
  });
}

Tensor leaf(const Shape& shape, uint64_t seed, DType dtype = DType::f64) {
  Tensor t = randn(shape, dtype, seed);
  t.set_requires_grad(true);
  return t;
}

}  // namespace

TEST_CASE("engine: backward from a scalar seeds gradient one", "[autograd][engine]") {
  Tensor x = leaf({3, 4}, 1);
  Tensor loss = sum(square(x));
  CHECK(loss.requires_grad());
  CHECK_FALSE(loss.is_leaf());
  loss.backward();
  REQUIRE(x.grad().defined());
  CHECK(x.grad().shape() == x.shape());
  CHECK(x.grad().dtype() == DType::f64);
  std::vector<double> v = x.to_vector(), g = x.grad().to_vector();
  for (size_t i = 0; i < v.size(); ++i) CHECK(g[i] == Approx(2 * v[i]).epsilon(1e-15));
}

TEST_CASE("engine: backward with an upstream gradient", "[autograd][engine]") {
  Tensor x = leaf({2, 5}, 2);
  Tensor up = randn({2, 5}, DType::f64, 3);
  Tensor y = mul_scalar(square(x), 3.0);
  y.backward(up);
  std::vector<double> v = x.to_vector(), u = up.to_vector(), g = x.grad().to_vector();
  for (size_t i = 0; i < v.size(); ++i) CHECK(g[i] == Approx(6 * v[i] * u[i]).epsilon(1e-14));
  // A one-element non-scalar root takes ones as well.
  Tensor z = leaf({1, 1}, 4);
  mul_scalar(z, 5.0).backward();
  CHECK(z.grad().to_vector() == std::vector<double>{5.0});
}

TEST_CASE("engine: backward of a leaf root accumulates into the leaf itself", "[autograd][engine]") {
  Tensor x = leaf({3}, 5);
  Tensor up = from_vector({1, 2, 3}, {3}, DType::f64);
  x.backward(up);
  CHECK(x.grad().to_vector() == std::vector<double>{1, 2, 3});
  CHECK_FALSE(x.grad().same_storage(up));  // the leaf owns its buffer
}

TEST_CASE("engine: diamond graph runs every node once, after all its consumers", "[autograd][engine]") {
  std::vector<std::string> log;
  Tensor x = leaf({2, 3}, 6);
  // x -> a -> c ------------> d
  //        \-> b -> b2 -----/
  // c is created before b, so a depth-first walk from d would reach a through b2
  // before c has run.
  Tensor a = traced("a", {x}, log);
  Tensor c = traced("c", {a}, log);
  Tensor b = traced("b", {a}, log);
  Tensor b2 = traced("b2", {b}, log);
  Tensor d = traced("d", {b2, c}, log);
  d.backward(ones({2, 3}, DType::f64));
  REQUIRE(log.size() == 5);
  // Ready nodes run newest first: d, b2, b, then c, and a only once both paths are in.
  CHECK(log == std::vector<std::string>{"d", "b2", "b", "c", "a"});
  for (double g : x.grad().to_vector()) CHECK(g == 2.0);
}

TEST_CASE("engine: gradients through a diamond match finite differences", "[autograd][engine]") {
  Tensor x = randn({3, 7}, DType::f64, 7);
  check_gradients(
      [](const Tensors& in) {
        Tensor h = tanh(in[0]);
        return add(mul(h, sigmoid(in[0])), mul(h, in[1]));
      },
      {x, randn({3, 7}, DType::f64, 8)});
}

TEST_CASE("engine: a tensor used twice gets the sum of both gradients", "[autograd][engine]") {
  Tensor x = leaf({4}, 9);
  Tensor w = leaf({4}, 10);
  sum(add(mul(x, x), mul(x, w))).backward();  // d/dx = 2x + w, d/dw = x
  std::vector<double> vx = x.to_vector(), vw = w.to_vector();
  std::vector<double> gx = x.grad().to_vector(), gw = w.grad().to_vector();
  for (size_t i = 0; i < vx.size(); ++i) {
    CHECK(gx[i] == Approx(2 * vx[i] + vw[i]).epsilon(1e-14));
    CHECK(gw[i] == Approx(vx[i]).epsilon(1e-14));
  }
  // The same intermediate used twice.
  Tensor y = leaf({4}, 11);
  Tensor h = mul_scalar(y, 3.0);
  sum(add(h, h)).backward();
  for (double g : y.grad().to_vector()) CHECK(g == 6.0);
}

TEST_CASE("engine: several roots, one an ancestor of another", "[autograd][engine]") {
  Tensor x = leaf({3}, 12);
  Tensor y = mul_scalar(x, 2.0);
  Tensor z = mul_scalar(y, 3.0);
  autograd::backward({y, z}, {ones({3}, DType::f64), ones({3}, DType::f64)});
  for (double g : x.grad().to_vector()) CHECK(g == 8.0);
  CHECK_THROWS_WITH(autograd::backward({y}, {}), Catch::Contains("1 roots but 0 gradients"));
}

TEST_CASE("engine: unused outputs of a multi-output op get zero gradients", "[autograd][engine]") {
  Tensor x = leaf({6, 2}, 13);
  Tensors parts = split(x, {2, 4}, 0);
  sum(parts[1]).backward();
  std::vector<double> g = x.grad().to_vector();
  for (size_t i = 0; i < g.size(); ++i) CHECK(g[i] == (i < 4 ? 0.0 : 1.0));
}

TEST_CASE("engine: gradients of bf16 tensors accumulate", "[autograd][engine][bf16]") {
  SECTION("a bf16 leaf used twice") {
    Tensor w = ones({3}, DType::bf16);
    w.set_requires_grad(true);
    sum(add(w.to(DType::f32), mul_scalar(w.to(DType::f32), 2.0))).backward();
    REQUIRE(w.grad().defined());
    CHECK(w.grad().dtype() == DType::bf16);
    CHECK(w.grad().to_vector() == std::vector<double>{3, 3, 3});
  }
  SECTION("a bf16 leaf over two backward calls") {
    Tensor w = ones({3}, DType::bf16);
    w.set_requires_grad(true);
    sum(w.to(DType::f32)).backward();
    sum(mul_scalar(w.to(DType::f32), 2.0)).backward();
    CHECK(w.grad().to_vector() == std::vector<double>{3, 3, 3});
  }
  SECTION("a bf16 intermediate used twice") {
    Tensor x = ones({3}, DType::f32);
    x.set_requires_grad(true);
    Tensor b = x.to(DType::bf16);
    sum(add(b.to(DType::f32), mul_scalar(b.to(DType::f32), 2.0))).backward();
    CHECK(x.grad().to_vector() == std::vector<double>{3, 3, 3});
  }
}

TEST_CASE("engine: gradient of a reshape of a slice view", "[autograd][engine]") {
  Tensor x = leaf({4, 6}, 14);
  Tensor s = slice(x, 0, 1, 3);  // rows 1, 2: a view
  REQUIRE(s.same_storage(x));
  Tensor r = reshape(s, {3, 4});
  REQUIRE(r.same_storage(x));
  Tensor w = randn({3, 4}, DType::f64, 15);
  sum(mul(r, w)).backward();
  std::vector<double> g = x.grad().to_vector(), vw = w.to_vector();
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 6; ++j) {
      double want = (i == 1 || i == 2) ? vw[static_cast<size_t>((i - 1) * 6 + j)] : 0.0;
      CHECK(g[static_cast<size_t>(i * 6 + j)] == want);
    }
  check_gradients([](const Tensors& in) { return reshape(slice(in[0], 0, 1, 3), {3, 4}); }, {x.detach()});
  check_gradients([](const Tensors& in) { return reshape(slice(in[0], 1, 2, 5), {2, 6}); }, {x.detach()});
}

TEST_CASE("engine: gradients accumulate into leaves across backward calls", "[autograd][engine]") {
  Tensor x = leaf({5}, 16);
  Tensor up1 = randn({5}, DType::f64, 17), up2 = randn({5}, DType::f64, 18);
  std::vector<double> u1 = up1.to_vector(), u2 = up2.to_vector();
  mul_scalar(x, 2.0).backward(up1);
  Tensor first = x.grad();
  mul_scalar(x, -3.0).backward(up2);
  std::vector<double> g = x.grad().to_vector();
  for (size_t i = 0; i < g.size(); ++i) CHECK(g[i] == Approx(2 * u1[i] - 3 * u2[i]).epsilon(1e-14));
  // The upstream gradients are never written to.
  CHECK(up1.to_vector() == u1);
  CHECK(up2.to_vector() == u2);
  // zero_grad starts over.
  x.zero_grad();
  mul_scalar(x, 4.0).backward(up1);
  std::vector<double> g2 = x.grad().to_vector();
  for (size_t i = 0; i < g2.size(); ++i) CHECK(g2[i] == Approx(4 * u1[i]).epsilon(1e-15));
}

TEST_CASE("engine: a gradient passed through unchanged is not aliased by the leaf", "[autograd][engine]") {
  Tensor x = leaf({3}, 19);
  Tensor up = from_vector({1, 1, 1}, {3}, DType::f64);
  x.clone().backward(up);  // clone's backward returns the upstream tensor itself
  x.clone().backward(up);  // the second accumulation adds in place into x.grad()
  CHECK(x.grad().to_vector() == std::vector<double>{2, 2, 2});
  CHECK(up.to_vector() == std::vector<double>{1, 1, 1});
}

TEST_CASE("engine: NoGradGuard records nothing", "[autograd][engine][grad_mode]") {
  Tensor x = leaf({3}, 20);
  CHECK(autograd::grad_enabled());
  {
    NoGradGuard guard;
    CHECK_FALSE(autograd::grad_enabled());
    Tensor y = mul(x, x);
    CHECK_FALSE(y.requires_grad());
    CHECK(y.is_leaf());
    Tensor z = sum(matmul(reshape(y, {1, 3}), reshape(x, {3, 1})));
    CHECK_FALSE(z.requires_grad());
    CHECK(z.is_leaf());
    CHECK_THROWS_WITH(z.backward(), Catch::Contains("does not require grad"));
    {
      NoGradGuard nested;
      CHECK_FALSE(autograd::grad_enabled());
    }
    CHECK_FALSE(autograd::grad_enabled());  // the nested guard restored "off", not "on"
    {
      EnableGradGuard enable;
      CHECK(autograd::grad_enabled());
      CHECK(mul(x, x).requires_grad());
    }
    CHECK_FALSE(autograd::grad_enabled());
  }
  CHECK(autograd::grad_enabled());
  CHECK(mul(x, x).requires_grad());
  // Inputs that need no grad record nothing either.
  Tensor c = randn({3}, DType::f64, 21);
  Tensor d = mul(c, c);
  CHECK_FALSE(d.requires_grad());
  CHECK(d.is_leaf());
}

TEST_CASE("engine: saved tensors are freed after backward", "[autograd][engine]") {
  Tensor x = leaf({3, 4}, 22);
  std::weak_ptr<TensorImpl> saved;
  Tensor loss;
  {
    Tensor h = mul_scalar(x, 2.0);  // saved by the mul below (both operands)
    saved = h.impl_ptr();
    loss = sum(mul(h, h));
  }
  REQUIRE_FALSE(saved.expired());  // held by the graph
  loss.backward();
  CHECK(saved.expired());
}

TEST_CASE("engine: retain_graph keeps saved tensors for a second backward", "[autograd][engine]") {
  Tensor x = leaf({3, 4}, 23);
  std::weak_ptr<TensorImpl> saved;
  Tensor loss;
  {
    Tensor h = mul_scalar(x, 2.0);
    saved = h.impl_ptr();
    loss = sum(mul(h, h));
  }
  loss.backward({}, /*retain_graph=*/true);
  CHECK_FALSE(saved.expired());
  std::vector<double> once = x.grad().to_vector();
  loss.backward();  // allowed: the graph was retained; this one frees it
  CHECK(saved.expired());
  std::vector<double> twice = x.grad().to_vector(), v = x.to_vector();
  for (size_t i = 0; i < v.size(); ++i) {
    CHECK(once[i] == Approx(8 * v[i]).epsilon(1e-14));
    CHECK(twice[i] == Approx(16 * v[i]).epsilon(1e-14));
  }
}

TEST_CASE("engine: a second backward without retain_graph throws", "[autograd][engine][errors]") {
  Tensor x = leaf({3}, 24);
  Tensor loss = sum(mul(x, x));
  loss.backward();
  CHECK_THROWS_AS(loss.backward(), Error);
  CHECK_THROWS_WITH(loss.backward(), Catch::Contains("retain_graph"));
  // Through a shared intermediate: the second graph reaches freed nodes.
  Tensor y = leaf({3}, 25);
  Tensor h = exp(y);
  sum(h).backward();
  CHECK_THROWS_WITH(sum(mul_scalar(h, 2.0)).backward(), Catch::Contains("retain_graph"));
}

TEST_CASE("engine: bad roots and gradients throw", "[autograd][engine][errors]") {
  Tensor x = leaf({2, 3}, 26);
  Tensor y = square(x);
  CHECK_THROWS_AS(y.backward(), Error);
  CHECK_THROWS_WITH(y.backward(), Catch::Contains("not a scalar") && Catch::Contains("[2, 3]"));
  CHECK_THROWS_WITH(y.backward(ones({3, 2}, DType::f64)), Catch::Contains("does not match"));
  CHECK_THROWS_WITH(y.backward(ones({2, 3}, DType::f32)), Catch::Contains("does not match"));
  Tensor c = randn({1}, DType::f64, 27);
  CHECK_THROWS_WITH(c.backward(), Catch::Contains("does not require grad"));
  CHECK_FALSE(x.grad().defined());  // nothing ran
}

TEST_CASE("engine: set_requires_grad on an integer tensor throws", "[autograd][engine][errors]") {
  Tensor i = arange(4, DType::i32);
  CHECK_THROWS_AS(i.set_requires_grad(true), Error);
  CHECK_THROWS_WITH(i.set_requires_grad(true), Catch::Contains("i32") && Catch::Contains("floating"));
  CHECK_FALSE(i.requires_grad());
  CHECK_THROWS_AS(zeros({2}, DType::u16).set_requires_grad(true), Error);
  CHECK_THROWS_AS(zeros({2}, DType::i64).set_requires_grad(), Error);
}

TEST_CASE("engine: integer outputs of a recorded op carry no gradient", "[autograd][engine]") {
  Tensor x = leaf({3, 5}, 28);
  Tensor idx = argmax(x, 1);
  CHECK(idx.dtype() == DType::i64);
  CHECK_FALSE(idx.requires_grad());
  Tensor i32 = x.to(DType::i32);
  CHECK_FALSE(i32.requires_grad());
  CHECK(i32.is_leaf());
}

namespace {

struct CheckpointRun {
  Tensor out, grad_x, grad_w, grad_b;
};

// loss = sum(fn(1.5 x) * noise_after), with fn = tanh(x W + b) * rand(..) drawn
// from the default generator, either checkpointed or not.
CheckpointRun run_block(bool use_checkpoint, bool input_is_leaf) {
  Tensor x = randn({5, 31}, DType::f32, 100);
  Tensor w = randn({31, 33}, DType::f32, 101), b = randn({33}, DType::f32, 102);
  x.set_requires_grad(true);
  w.set_requires_grad(true);
  b.set_requires_grad(true);
  auto fn = [w, b](const Tensors& in) -> Tensors {
    Tensor h = add(matmul(in[0], w), b);
    Tensor noise = rand(h.shape(), h.dtype(), default_generator());
    Tensor unused = mul_scalar(h, 2.0);  // a second output nobody uses
    return {mul(tanh(h), noise), unused};
  };
  default_generator().set_offset(5000);
  Tensor input = input_is_leaf ? x : mul_scalar(x, 1.5);
  Tensors outs = use_checkpoint ? checkpoint(fn, {input}) : fn({input});
  // A random op after the block moves the generator on; recomputation must rewind it.
  Tensor after = rand(outs[0].shape(), DType::f32, default_generator());
  Tensor loss = sum(mul(outs[0], after));
  uint64_t offset_before_backward = default_generator().offset();
  loss.backward();
  CHECK(default_generator().offset() == offset_before_backward);  // restored after the replay
  return {outs[0].detach(), x.grad(), w.grad(), b.grad()};
}

}  // namespace

TEST_CASE("engine: checkpoint gives bitwise the same gradients, random ops replayed", "[autograd][engine][recompute]") {
  for (bool input_is_leaf : {true, false}) {
    DYNAMIC_SECTION((input_is_leaf ? "leaf input" : "non-leaf input")) {
      CheckpointRun plain = run_block(false, input_is_leaf);
      CheckpointRun ckpt = run_block(true, input_is_leaf);
      REQUIRE(plain.grad_x.defined());
      REQUIRE(ckpt.grad_x.defined());
      REQUIRE(ckpt.grad_w.defined());
      REQUIRE(ckpt.grad_b.defined());
      CHECK(bitwise_equal(plain.out, ckpt.out));
      CHECK(bitwise_equal(plain.grad_x, ckpt.grad_x));
      CHECK(bitwise_equal(plain.grad_w, ckpt.grad_w));
      CHECK(bitwise_equal(plain.grad_b, ckpt.grad_b));
    }
  }
}

TEST_CASE("engine: checkpoint of an input without grad still trains captured parameters", "[autograd][engine][recompute]") {
  Tensor x = randn({4, 31}, DType::f32, 40);  // data: no gradient
  Tensor w = randn({31, 6}, DType::f32, 41);
  w.set_requires_grad(true);
  auto fn = [w](const Tensors& in) { return Tensors{silu(matmul(in[0], w))}; };
  Tensor up = randn({4, 6}, DType::f32, 42);
  fn({x})[0].backward(up);
  Tensor plain = w.grad();
  w.zero_grad();
  Tensors outs = checkpoint(fn, {x});
  CHECK(outs[0].requires_grad());
  outs[0].backward(up);
  REQUIRE(w.grad().defined());
  CHECK(bitwise_equal(plain, w.grad()));
  CHECK_FALSE(x.grad().defined());
}

TEST_CASE("engine: checkpoint records one node and nothing inside", "[autograd][engine][recompute]") {
  Tensor x = leaf({2, 3}, 30);
  int calls = 0;
  auto fn = [&calls](const Tensors& in) -> Tensors {
    ++calls;
    return {mul(in[0], in[0]), in[0]};  // also returns its input unchanged
  };
  Tensors outs = checkpoint(fn, {x});
  CHECK(calls == 1);
  REQUIRE(outs.size() == 2);
  CHECK(outs[0].requires_grad());
  CHECK(outs[0].impl().grad_fn != nullptr);
  CHECK(outs[0].impl().grad_fn == outs[1].impl().grad_fn);
  CHECK(std::string(outs[0].impl().grad_fn->name) == "checkpoint");
  CHECK(outs[0].impl().grad_fn->next.size() == 1);
  CHECK(outs[1].impl_ptr() != x.impl_ptr());  // a fresh handle, not the input
  sum(add(outs[0], outs[1])).backward();
  CHECK(calls == 2);  // recomputed once in backward
  std::vector<double> v = x.to_vector(), g = x.grad().to_vector();
  for (size_t i = 0; i < v.size(); ++i) CHECK(g[i] == Approx(2 * v[i] + 1).epsilon(1e-15));
}

TEST_CASE("engine: checkpoint under NoGradGuard just runs fn", "[autograd][engine][recompute]") {
  Tensor x = leaf({3}, 31);
  NoGradGuard guard;
  Tensors outs = checkpoint([](const Tensors& in) { return Tensors{exp(in[0])}; }, {x});
  CHECK_FALSE(outs[0].requires_grad());
  CHECK(outs[0].is_leaf());
}

TEST_CASE("engine: checkpoint gradients match finite differences", "[autograd][engine][recompute]") {
  Tensor w = randn({7, 4}, DType::f64, 32);
  w.set_requires_grad(true);
  check_gradients(
      [w](const Tensors& in) {
        return checkpoint([w](const Tensors& a) { return Tensors{tanh(matmul(mul(a[0], a[1]), w))}; },
                          {in[0], in[1]});
      },
      {randn({3, 7}, DType::f64, 33), randn({3, 7}, DType::f64, 34)});
}

namespace {

// What the grad-ready hook saw: each leaf (by name) with a copy of its grad then
// and the backward nodes run before it.
struct ReadyEvent {
  std::string name;
  Tensor grad;
  size_t nodes_run = 0;
};

autograd::GradReadyHook record_ready(const std::vector<std::pair<std::string, Tensor>>& named,
                                     std::vector<ReadyEvent>& events, const std::vector<std::string>& log) {
  return [named, &events, &log](const Tensor& t) {
    std::string name = "?";
    for (const auto& [n, leaf] : named)
      if (&leaf.impl() == &t.impl()) name = n;
    events.push_back({name, t.grad().defined() ? t.grad().clone() : Tensor(), log.size()});
  };
}

}  // namespace

TEST_CASE("engine: the grad-ready hook fires once per leaf, after its last gradient", "[autograd][engine][grad_ready]") {
  std::vector<std::string> log;
  Tensor a = leaf({3}, 50), b = leaf({3}, 51), c = leaf({3}, 52), unused = leaf({3}, 53);
  // Backward runs third, second, first: c is final after second, a only after first.
  Tensor y = traced("third", {traced("second", {traced("first", {a, b}, log), c}, log), a}, log);
  std::vector<ReadyEvent> events;
  {
    autograd::GradReadyHookGuard guard(record_ready({{"a", a}, {"b", b}, {"c", c}, {"unused", unused}}, events, log));
    sum(y).backward();
  }
  REQUIRE(log == std::vector<std::string>{"third", "second", "first"});
  REQUIRE(events.size() == 3);  // `unused` is not reached
  CHECK(events[0].name == "c");
  CHECK(events[0].nodes_run == 2);
  CHECK(events[1].name == "a");  // then b, the next input of first
  CHECK(events[1].nodes_run == 3);
  CHECK(events[2].name == "b");
  // The grad seen is the final one (a got two contributions).
  CHECK(bitwise_equal(events[0].grad, c.grad()));
  CHECK(bitwise_equal(events[1].grad, a.grad()));
  CHECK(bitwise_equal(events[2].grad, b.grad()));
  CHECK(a.grad().to_vector() == std::vector<double>{2, 2, 2});
  // Without the guard, nothing is reported.
  events.clear();
  sum(mul_scalar(a, 2.0)).backward();
  CHECK(events.empty());
}

TEST_CASE("engine: the grad-ready hook sees grads accumulated over earlier passes", "[autograd][engine][grad_ready]") {
  std::vector<std::string> log;
  Tensor w = leaf({4}, 54);
  sum(mul_scalar(w, 2.0)).backward();  // an earlier micro-batch
  std::vector<ReadyEvent> events;
  {
    autograd::GradReadyHookGuard guard(record_ready({{"w", w}}, events, log));
    sum(mul_scalar(w, 3.0)).backward();
  }
  REQUIRE(events.size() == 1);
  CHECK(events[0].grad.to_vector() == std::vector<double>{5, 5, 5, 5});
  CHECK_THAT(moetrain::testing::error_of([&] {
               autograd::GradReadyHookGuard outer([](const Tensor&) {});
               autograd::GradReadyHookGuard inner([](const Tensor&) {});
             }),
             Catch::Contains("already installed"));
}

TEST_CASE("engine: the grad-ready hook reports leaves of recomputed blocks once, after the block",
          "[autograd][engine][grad_ready][recompute]") {
  std::vector<std::string> log;
  Tensor x = leaf({2, 5}, 55), w = leaf({5, 5}, 56), v = leaf({5, 5}, 57);
  auto block = [w](const Tensors& in) { return Tensors{tanh(matmul(in[0], w))}; };
  // x and v are used before the block: their grads are final only after it.
  auto run = [&](bool with_hook, std::vector<ReadyEvent>& events) {
    for (Tensor* t : {&x, &w, &v}) t->zero_grad();
    Tensor h = matmul(x, v);
    Tensor out = traced("after", {checkpoint(block, {h})[0]}, log);
    Tensor loss = sum(mul(out, out));
    std::optional<autograd::GradReadyHookGuard> guard;
    if (with_hook) guard.emplace(record_ready({{"x", x}, {"w", w}, {"v", v}}, events, log));
    loss.backward();
    return Tensors{x.grad().clone(), w.grad().clone(), v.grad().clone()};
  };
  std::vector<ReadyEvent> events, none;
  Tensors plain = run(false, none), hooked = run(true, events);
  for (size_t i = 0; i < 3; ++i) CHECK(bitwise_equal(plain[i], hooked[i]));
  std::vector<std::string> order;
  for (const ReadyEvent& e : events)
    if (e.name != "?") order.push_back(e.name);  // "?": checkpoint's own detached inputs
  CHECK(order == std::vector<std::string>{"w", "x", "v"});
  for (const ReadyEvent& e : events) {
    if (e.name == "w") CHECK(bitwise_equal(e.grad, w.grad()));
    if (e.name == "v") CHECK(bitwise_equal(e.grad, v.grad()));
  }

  // A parameter used inside the block and again after it: its outer use finishes
  // first, so the block's later addition is refused rather than reported twice.
  auto reused = [w](const Tensors& in) { return Tensors{tanh(matmul(in[0], w))}; };
  Tensor h = checkpoint(reused, {x})[0];
  Tensor loss = sum(matmul(h, w));
  autograd::GradReadyHookGuard guard([](const Tensor&) {});
  CHECK_THAT(moetrain::testing::error_of([&] { loss.backward(); }),
             Catch::Contains("recomputed block") && Catch::Contains("train.overlap_grad_sync: false"));
}
