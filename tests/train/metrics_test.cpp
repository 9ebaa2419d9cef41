#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

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
