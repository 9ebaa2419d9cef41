// The [simt] tests' order check: a kernel body run on the host (simt::HostBlock)
// in the natural, reversed and shuffled orders of its threads and warps must give
// the same bits in all three, as it must on the GPU whatever the schedule. A body
// that reads in a phase what another thread writes in the same phase (a missing
// barrier) fails it: tests/ops/common/simt_test.cpp plants one.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include <catch2/catch.hpp>

#include "core/tensor.h"
#include "ops/common/simt.h"

namespace moetrain::testing {

// The shuffled order's seed: fixed, so that a failure repeats.
inline constexpr uint64_t kSimtShuffleSeed = 0x5eed1234abcdULL;

inline const char* order_name(simt::HostOrder o) {
  switch (o) {
    case simt::HostOrder::natural:
      return "natural";
    case simt::HostOrder::reversed:
      return "reversed";
    case simt::HostOrder::shuffled:
      return "shuffled";
  }
  return "?";
}

// A block of `threads` running its phases in `order`.
inline simt::HostBlock host_block(int threads, simt::HostOrder order) {
  return simt::HostBlock{threads, order, kSimtShuffleSeed};
}

// Same shape, dtype and bytes (both undefined counts as the same).
inline bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.raw_data(), cb.raw_data(), static_cast<size_t>(ca.nbytes())) == 0;
}
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}
inline bool same_bits(std::initializer_list<const Tensor*> a, std::initializer_list<const Tensor*> b) {
  if (a.size() != b.size()) return false;
  for (auto i = a.begin(), j = b.begin(); i != a.end(); ++i, ++j)
    if (!same_bits(**i, **j)) return false;
  return true;
}

// run(order) in the three orders; CHECKs that the reversed and shuffled runs give
// the natural run's bits (same_bits, found for the result type by overloading or
// in its namespace); returns the natural run's result.
template <class Run>
auto run_in_all_orders(Run&& run) {
  auto natural = run(simt::HostOrder::natural);
  for (simt::HostOrder order : {simt::HostOrder::reversed, simt::HostOrder::shuffled}) {
    auto other = run(order);
    INFO("the " << order_name(order)
                << " order of threads and warps changed the result: a phase reads what "
                   "another thread writes in it (a missing barrier)");
    CHECK(same_bits(natural, other));
  }
  return natural;
}

}  // namespace moetrain::testing
