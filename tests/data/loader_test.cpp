// DataLoader: windows and targets, epoch permutations, determinism, the
// data-parallel split, exact resume, sequential (eval) order and bad inputs.
//
// The corpus: shard 0 holds tokens 0..999 and shard 1 tokens 1000..1536, so a
// token's value is its position in the corpus and a window is known by its
// first token. With T = 10: floor(999 / 10) = 99 + floor(536 / 10) = 53
// windows = 152.
#include <catch2/catch.hpp>

#include <set>

#include "core/error.h"
#include "core/rng.h"
#include "data/loader.h"
#include "data/shard.h"
#include "data_testing.h"

using namespace moetrain;
using namespace moetrain::data;
using namespace moetrain::data_testing;

namespace {

constexpr int64_t kT = 10;
constexpr int64_t kNumWindows = 152;

struct Corpus {
  TempDir dir;
  std::string pattern;
  Corpus() {
    std::vector<uint16_t> a(1000), b(537);
    for (int i = 0; i < 1000; ++i) a[i] = static_cast<uint16_t>(i);
    for (int i = 0; i < 537; ++i) b[i] = static_cast<uint16_t>(1000 + i);
    write_shard(dir / "train_000001.bin", b);  // written first: order comes from the names
    write_shard(dir / "train_000000.bin", a);
    write_shard(dir / "val_000000.bin", std::vector<uint16_t>(100, 3));
    pattern = dir / "train_*.bin";
  }
};

DataLoaderOptions opts(int64_t batch, uint64_t seed = 1, int rank = 0, int world = 1,
                       LoaderOrder order = LoaderOrder::shuffled) {
  DataLoaderOptions o;
  o.batch_size = batch;
  o.seq_len = kT;
  o.vocab_size = 2000;
  o.seed = seed;
  o.rank = rank;
  o.world_size = world;
  o.order = order;
  return o;
}

// The windows of a batch, as the corpus position of their first token; checks
// each row against the corpus: inputs consecutive, targets shifted by one.
std::vector<int64_t> rows(const Batch& batch) {
  REQUIRE(batch.inputs.shape() == Shape{batch.inputs.size(0), kT});
  REQUIRE(batch.targets.shape() == batch.inputs.shape());
  REQUIRE(batch.inputs.dtype() == DType::i32);
  REQUIRE(batch.targets.dtype() == DType::i32);
  const int32_t* in = batch.inputs.data<int32_t>();
  const int32_t* tg = batch.targets.data<int32_t>();
  std::vector<int64_t> firsts;
  for (int64_t r = 0; r < batch.inputs.size(0); ++r) {
    const int32_t first = in[r * kT];
    // Windows start at shard-relative multiples of T and stay inside their shard.
    const int32_t shard_start = first < 1000 ? 0 : 1000, shard_end = first < 1000 ? 1000 : 1537;
    REQUIRE((first - shard_start) % kT == 0);
    REQUIRE(first + kT + 1 <= shard_end);
    for (int64_t t = 0; t < kT; ++t) {
      REQUIRE(in[r * kT + t] == first + t);
      REQUIRE(tg[r * kT + t] == first + t + 1);
    }
    firsts.push_back(first);
  }
  return firsts;
}

std::vector<int64_t> take(DataLoader& loader, int64_t num_batches) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < num_batches; ++i) {
    std::vector<int64_t> r = rows(loader.next());
    out.insert(out.end(), r.begin(), r.end());
  }
  return out;
}

std::set<int64_t> all_window_starts() {
  std::set<int64_t> s;
  for (int64_t k = 0; k < 99; ++k) s.insert(k * kT);
  for (int64_t k = 0; k < 53; ++k) s.insert(1000 + k * kT);
  return s;
}

std::vector<int64_t> window_starts_in_order() {
  const std::set<int64_t> s = all_window_starts();
  return {s.begin(), s.end()};
}

}  // namespace

TEST_CASE("loader: files from a glob, sorted; windows as documented", "[data][loader]") {
  Corpus c;
  DataLoader loader(c.pattern, opts(8));
  REQUIRE(loader.files().size() == 2);
  CHECK(loader.files()[0] == c.dir / "train_000000.bin");
  CHECK(loader.files()[1] == c.dir / "train_000001.bin");
  CHECK(loader.num_tokens() == 1537);
  CHECK(loader.num_windows() == kNumWindows);
  CHECK(loader.num_windows_per_rank() == kNumWindows);
  // Window 98 is the last of shard 0 (tokens 980..990), 99 the first of shard 1.
  std::vector<uint32_t> window(kT + 1);
  loader.window_tokens(98, window.data());
  CHECK(window.front() == 980);
  CHECK(window.back() == 980 + kT);
  loader.window_tokens(99, window.data());
  CHECK(window.front() == 1000);
  loader.window_tokens(151, window.data());
  CHECK(window.back() == 1000 + 52 * kT + kT);
}

TEST_CASE("loader: every window exactly once per epoch, targets shifted by one", "[data][loader]") {
  Corpus c;
  DataLoader loader(c.pattern, opts(8));  // 152 = 19 batches of 8
  const std::vector<int64_t> e0 = take(loader, 19), e1 = take(loader, 19);
  CHECK(std::set<int64_t>(e0.begin(), e0.end()) == all_window_starts());
  CHECK(std::set<int64_t>(e1.begin(), e1.end()) == all_window_starts());
  CHECK(e0.size() == kNumWindows);
  CHECK(e0 != e1);  // a new permutation each epoch
  CHECK(loader.state() == LoaderState{2, 0});
  CHECK(e0 != window_starts_in_order());  // shuffled
}

TEST_CASE("loader: same seed same batches, different seed different order", "[data][loader]") {
  Corpus c;
  DataLoader a(c.pattern, opts(5, 7)), b(c.pattern, opts(5, 7)), d(c.pattern, opts(5, 8));
  const std::vector<int64_t> ra = take(a, 70), rb = take(b, 70), rd = take(d, 70);
  CHECK(ra == rb);
  CHECK(ra != rd);
  for (uint64_t epoch : {0, 1, 5})
    for (int64_t k = 0; k < kNumWindows; k += 13) CHECK(a.window_at(epoch, k) == b.window_at(epoch, k));
}

TEST_CASE("loader: the order is a pure function of (seed, epoch)", "[data][loader]") {
  Corpus c;
  DataLoader loader(c.pattern, opts(4, 99));
  // Fisher-Yates as loader.cpp documents it, on Philox counters epoch * N + i.
  for (uint64_t epoch : {0, 3}) {
    std::vector<int64_t> perm(kNumWindows);
    for (int64_t i = 0; i < kNumWindows; ++i) perm[i] = i;
    Generator gen(99);
    for (uint64_t i = kNumWindows - 1; i >= 1; --i) {
      auto r = gen.bits(epoch * kNumWindows + i);
      uint64_t x = (static_cast<uint64_t>(r[0]) << 32) | r[1];
      auto j = static_cast<uint64_t>((static_cast<unsigned __int128>(x) * (i + 1)) >> 64);
      std::swap(perm[i], perm[j]);
    }
    for (int64_t k = 0; k < kNumWindows; ++k) CHECK(loader.window_at(epoch, k) == perm[k]);
  }
}

TEST_CASE("loader: ranks take disjoint strided windows that cover the epoch", "[data][loader]") {
  Corpus c;
  for (int world : {2, 3, 4}) {
    DYNAMIC_SECTION("world size " << world) {
      const int64_t per_rank = kNumWindows / world;
      std::vector<int64_t> seen;
      DataLoader whole(c.pattern, opts(1, 5));
      for (int r = 0; r < world; ++r) {
        DataLoader loader(c.pattern, opts(2, 5, r, world));
        REQUIRE(loader.num_windows_per_rank() == per_rank);
        // Rank r takes entries r, r + W, ... of the one global order.
        for (int64_t k = 0; k < per_rank; ++k)
          CHECK(loader.window_at(0, k) == whole.window_at(0, k * world + r));
        const std::vector<int64_t> got = take(loader, per_rank / 2);
        seen.insert(seen.end(), got.begin(), got.end());
        if (per_rank % 2) seen.push_back(rows(loader.next())[0]);
      }
      const std::set<int64_t> unique(seen.begin(), seen.end());
      CHECK(unique.size() == seen.size());  // disjoint
      CHECK(static_cast<int64_t>(seen.size()) == per_rank * world);
      if (kNumWindows % world == 0) CHECK(unique == all_window_starts());  // a partition
    }
  }
}

TEST_CASE("loader: state() and set_state() resume exactly, across epochs", "[data][loader]") {
  Corpus c;
  for (int64_t skip : {0, 7, 30, 31, 61}) {
    DataLoader a(c.pattern, opts(5, 3, 1, 2));  // 76 windows per rank: batches straddle epochs
    take(a, skip);
    const LoaderState saved = a.state();
    const std::vector<int64_t> expected = take(a, 40);
    DataLoader b(c.pattern, opts(5, 3, 1, 2));
    b.set_state(saved);
    CHECK(b.state() == saved);
    CHECK(take(b, 40) == expected);
  }
  DataLoader a(c.pattern, opts(5));
  CHECK_THROWS_WITH(a.set_state({0, kNumWindows}), Catch::Contains("resume position 152"));
  CHECK_THROWS_AS(a.set_state({0, -1}), Error);
}

TEST_CASE("loader: sequential order is window order, the eval definition", "[data][loader]") {
  Corpus c;
  DataLoader loader(c.pattern, opts(4, 1, 0, 1, LoaderOrder::sequential));
  const std::vector<int64_t> got = take(loader, 38);  // all 152 windows
  // Window i of shard s: tokens iT..iT+T of the shard; the target of position t is token t+1.
  CHECK(got == window_starts_in_order());
  CHECK(loader.state() == LoaderState{1, 0});
  CHECK(take(loader, 1) == std::vector<int64_t>{0, 10, 20, 30});  // the next epoch starts over
  // Ranks split the window order strided, here too.
  DataLoader r1(c.pattern, opts(2, 1, 1, 2, LoaderOrder::sequential));
  CHECK(take(r1, 2) == std::vector<int64_t>{10, 30, 50, 70});
  // The seed does not matter.
  DataLoader other(c.pattern, opts(4, 12345, 0, 1, LoaderOrder::sequential));
  CHECK(take(other, 38) == got);
}

TEST_CASE("loader: bad inputs are errors naming the file, pattern or option", "[data][loader][errors]") {
  Corpus c;
  SECTION("a pattern that matches nothing") {
    const std::string pattern = c.dir / "nothing_*.bin";
    CHECK_THROWS_WITH(DataLoader(pattern, opts(1)), Catch::Contains(pattern) && Catch::Contains("no files match"));
    CHECK_THROWS_WITH(expand_shard_pattern(pattern), Catch::Contains(pattern));
  }
  SECTION("a token id outside the vocabulary") {
    std::vector<uint16_t> tokens(500, 7);
    tokens[123] = 50257;
    tokens[400] = 60000;
    const std::string bad = c.dir / "bad.bin";
    write_shard(bad, tokens);
    DataLoaderOptions o = opts(1);
    o.vocab_size = 50257;
    CHECK_THROWS_WITH(DataLoader(std::vector<std::string>{c.dir / "train_000000.bin", bad}, o),
                      Catch::Contains(bad) && Catch::Contains("token id 50257") &&
                          Catch::Contains("token offset 123") && Catch::Contains("byte offset 1270") &&
                          Catch::Contains("[0, 50257)"));
    o.vocab_size = 65536;
    CHECK(DataLoader(std::vector<std::string>{bad}, o).num_windows() == 49);
  }
  SECTION("a malformed shard among good ones") {
    write_bytes(c.dir / "train_000002.bin", "not a shard");
    CHECK_THROWS_WITH(DataLoader(c.pattern, opts(1)),
                      Catch::Contains(c.dir / "train_000002.bin") && Catch::Contains("truncated header"));
  }
  SECTION("too few windows for a batch") {
    CHECK_THROWS_WITH(DataLoader(c.dir / "val_000000.bin", opts(10)),
                      Catch::Contains("9 windows") && Catch::Contains("batch_size = 10"));
    CHECK_THROWS_WITH(DataLoader(c.pattern, opts(40, 1, 0, 4)), Catch::Contains("38 per rank"));
  }
  SECTION("bad options") {
    CHECK_THROWS_WITH(DataLoader(c.pattern, opts(1, 1, 2, 2)), Catch::Contains("rank 2"));
    CHECK_THROWS_AS(DataLoader(c.pattern, opts(0)), Error);
    CHECK_THROWS_AS(DataLoader(std::vector<std::string>{}, opts(1)), Error);
  }
}
