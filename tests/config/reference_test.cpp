// docs/configs.md is what the schema generates: a new or changed key without the
// regenerated file fails here, with the command that regenerates it.
#include <catch2/catch.hpp>

#include <sstream>
#include <string>

#include "config/reference.h"
#include "config/schema.h"
#include "testing.h"

using namespace moetrain;

TEST_CASE("config reference: docs/configs.md equals what the schema generates", "[config]") {
  const std::string want = config_reference_markdown();
  const std::string have = testing::read_bytes(std::string(MOETRAIN_SOURCE_DIR) + "/docs/configs.md");
  if (have != want) {
    std::istringstream a(have), b(want);
    std::string la, lb;
    int line = 1;
    while (std::getline(a, la) && std::getline(b, lb) && la == lb) ++line;
    FAIL("docs/configs.md differs from the schema from line " << line << ":\n  file:      " << la
         << "\n  generated: " << lb << "\nregenerate it: build/moetrain schema > docs/configs.md");
  }
}

TEST_CASE("config reference: every key appears once, in a table row with its type and default", "[config]") {
  const std::string doc = config_reference_markdown();
  for (const KeySpec& spec : config_schema()) {
    INFO(spec.key);
    const std::string leaf = spec.key.substr(spec.key.rfind('.') + 1);
    const std::string section = "\n## " + spec.key.substr(0, spec.key.rfind('.')) + "\n";
    const size_t at = doc.find(section);
    REQUIRE(at != std::string::npos);
    const size_t end = doc.find("\n## ", at + 1);
    const std::string table = doc.substr(at, end == std::string::npos ? std::string::npos : end - at);
    const std::string row = "| `" + leaf + "` | " + config_type_name(spec.type) + " | ";
    CHECK(table.find(row) != std::string::npos);
    CHECK(table.find(row, table.find(row) + 1) == std::string::npos);
  }
  CHECK(doc.find("| `n_layer` | integer | `12` | [1, 4096] | number of transformer blocks |") != std::string::npos);
  CHECK(doc.find("| `resume` | string | `none` |") != std::string::npos);
  CHECK(doc.find("| `kind` | choice | `none` | one of none, nan_grad, kill, stop, kill_during_ckpt, signal |") !=
        std::string::npos);
}
