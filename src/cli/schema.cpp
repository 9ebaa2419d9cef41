// `moetrain schema`: every config key (type, default, allowed values, meaning) as
// Markdown, the text of docs/configs.md (config/reference.h).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "cli/commands.h"
#include "config/reference.h"

namespace moetrain::cli {

void add_schema_command(CLI::App& app, Commands& commands) {
  CLI::App* cmd = app.add_subcommand(
      "schema", "Print every config key (type, default, allowed values, meaning) as Markdown (docs/configs.md)");
  commands.push_back({cmd, [] {
    fmt::print("{}", config_reference_markdown());
    return 0;
  }});
}

}  // namespace moetrain::cli
