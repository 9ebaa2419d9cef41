#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "testing.h"
#include "train/metrics.h"

using namespace moetrain;

TEST_CASE("metrics: one JSON object per line, floats round-trip with %.9g", "[train][metrics]") {
  float loss = 4.12345648f;
  std::string line = MetricsWriter::to_json(
      {{"step", int64_t{37}}, {"loss", static_cast<double>(loss)}, {"note", std::string("a \"b\"\n")}, {"ok", true}});
  CHECK(line == "{\"step\":37,\"loss\":4.12345648,\"note\":\"a \\\"b\\\"\\n\",\"ok\":true}");
  CHECK(static_cast<float>(std::strtod("4.12345648", nullptr)) == loss);
  CHECK(MetricsWriter::to_json({{"x", 1.0 / 0.0}}) == "{\"x\":null}");

  std::string path = std::string(MOETRAIN_BINARY_DIR) + "/metrics_test.jsonl";
  std::remove(path.c_str());
  {
    MetricsWriter w(path);
    w.write({{"step", int64_t{1}}});
    w.write({{"step", int64_t{2}}});
  }
  { MetricsWriter w(path); w.write({{"event", std::string("resume")}}); }  // appends
  std::ifstream in(path);
  std::stringstream all;
  all << in.rdbuf();
  CHECK(all.str() == "{\"step\":1}\n{\"step\":2}\n{\"event\":\"resume\"}\n");
  std::remove(path.c_str());
  CHECK_THROWS_WITH(MetricsWriter("/nonexistent-dir/m.jsonl"), Catch::Contains("/nonexistent-dir/m.jsonl"));
}

TEST_CASE("metrics: repair drops records after the start step (aside when asked) and a torn last line",
          "[train][metrics]") {
  moetrain::testing::TempDir tmp;
  const std::string path = tmp / "metrics.jsonl", aside = tmp / "aside.jsonl";
  moetrain::testing::write_bytes(path, "{\"step\":1,\"loss\":3}\n{\"note\":\"kept\"}\n{\"step\":2,\"loss\":2}\n"
                                       "{\"step\":3,\"loss\":1}\n{\"step\":4,\"lo");
  const MetricsRepair r = repair_metrics(path, 2, aside);
  CHECK(r.records == 2);
  CHECK(r.dropped == 1);
  CHECK(r.torn_line);
  CHECK(moetrain::testing::read_bytes(path) == "{\"step\":1,\"loss\":3}\n{\"note\":\"kept\"}\n{\"step\":2,\"loss\":2}\n");
  CHECK(moetrain::testing::read_bytes(aside) == "{\"step\":3,\"loss\":1}\n");
  const MetricsRepair again = repair_metrics(path, 2);  // one history already: nothing to do
  CHECK(again.dropped == 0);
  CHECK(!again.torn_line);
  CHECK(repair_metrics(tmp / "missing.jsonl", 0).records == 0);
  {
    MetricsWriter w(path, "run-7");
    w.write({{"step", int64_t{3}}});
  }
  CHECK(moetrain::testing::read_bytes(path).ends_with("{\"step\":2,\"loss\":2}\n{\"step\":3,\"run\":\"run-7\"}\n"));
  CHECK(count_metrics_records(path) == 3);
}

TEST_CASE("metrics: a record the disk has no room for is an I/O error and leaves no part of itself",
          "[train][metrics]") {
  moetrain::testing::TempDir tmp;
  const std::string mnt = tmp / "small";
  std::filesystem::create_directories(mnt);
  if (moetrain::testing::run_command("mount -t tmpfs -o size=8k tmpfs " + mnt + " 2>/dev/null") != 0) {
    WARN("skipped: cannot mount a tmpfs here (needs root)");
    return;
  }
  struct Unmount {
    std::string path;
    ~Unmount() { moetrain::testing::run_command("umount " + path); }
  } unmount{mnt};
  const std::string path = mnt + "/metrics.jsonl";
  MetricsWriter w(path);
  const std::string note(1000, 'x');
  std::string message;
  int64_t written = 0;
  for (; written < 100; ++written) {
    try {
      w.write({{"step", written}, {"note", note}});
    } catch (const IoError& e) {
      message = e.what();
      break;
    }
  }
  CHECK(written < 100);
  CHECK(message.find(path + ": writing a record failed: No space left on device") != std::string::npos);
  const std::string text = moetrain::testing::read_bytes(path);
  CHECK(text.ends_with("}\n"));  // every line whole
  CHECK(count_metrics_records(path) == written);
}
