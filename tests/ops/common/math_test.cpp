#include <catch2/catch.hpp>

#include <cmath>

#include "ops/common/math.h"

using moetrain::cpu::exp_approx;
using moetrain::cpu::sigmoid_of;
using moetrain::cpu::tanh_of;

TEST_CASE("math: exp_approx is within 2 ulp of exp over the float range", "[ops][math]") {
  double worst = 0;
  float worst_x = 0;
  for (float x = -87.3f; x < 88.7f; x += 0.000731f) {
    double ref = std::exp(static_cast<double>(x));
    double rel = std::abs(exp_approx(x) - ref) / ref;
    if (rel > worst) worst = rel, worst_x = x;
  }
  INFO("worst at x = " << worst_x);
  CHECK(worst < 2.4e-7);  // 2 ulp of float
  CHECK(exp_approx(0.0f) == 1.0f);
  CHECK(exp_approx(-88.0f) == 0.0f);
  CHECK(exp_approx(-INFINITY) == 0.0f);
  CHECK(std::isinf(exp_approx(89.0f)));
}

TEST_CASE("math: tanh_of<float> is within 2 ulp of tanh", "[ops][math]") {
  double worst = 0;
  for (float x = -12.f; x < 12.f; x += 0.00037f) {
    double ref = std::tanh(static_cast<double>(x));
    worst = std::max(worst, std::abs(tanh_of(x) - ref) / std::max(std::abs(ref), 1e-30));
  }
  CHECK(worst < 2.4e-7);
}

TEST_CASE("math: sigmoid_of<float> is within 3 ulp of the logistic function", "[ops][math]") {
  double worst = 0;
  for (float x = -100.f; x < 100.f; x += 0.00071f) {
    double ref = 1.0 / (1.0 + std::exp(-static_cast<double>(x)));
    if (ref < 1e-37) continue;  // below the normal float range
    worst = std::max(worst, std::abs(sigmoid_of(x) - ref) / ref);
  }
  CHECK(worst < 3.6e-7);
  CHECK(sigmoid_of(-200.0f) == 0.0f);
  CHECK(sigmoid_of(200.0f) == 1.0f);
  CHECK(sigmoid_of(0.0f) == 0.5f);
}
