// Config options for CLI11 subcommands; see cli_options.h.
#include "config/cli_options.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <string_view>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

namespace moetrain {

std::shared_ptr<ConfigOptions> add_config_options(CLI::App* cmd, bool require_config) {
  // The callbacks own a reference, so the struct lives as long as the app even
  // if the caller drops the returned pointer.
  auto opts = std::make_shared<ConfigOptions>();
  CLI::Option* config = cmd->add_option_function<std::string>(
      "-c,--config", [opts](const std::string& path) { opts->config_path = path; },
      "YAML config file (its include: files are read first)");
  if (require_config) config->required();
  // One KEY=VALUE per --set, so a positional argument after it is not swallowed.
  cmd->add_option_function<std::vector<std::string>>(
         "--set", [opts](const std::vector<std::string>& overrides) { opts->overrides = overrides; },
         "Override one config key, e.g. --set model.n_layer=4 (repeatable; later wins)")
      ->allow_extra_args(false)
      ->take_all();
  cmd->add_flag_function(
      "--print-config", [opts](int64_t count) { opts->print_config = count > 0; },
      "Print the resolved config as YAML and exit");
  return opts;
}

Config load_from(const ConfigOptions& options) {
  if (!options.config_path.empty()) return Config::load(options.config_path, options.overrides);
  Config config = Config::defaults();
  config.apply_overrides(options.overrides);
  return config;
}

namespace {

// Rewrites `text` as plain decimal digits (what CLI11 then converts), or returns why not.
std::string strict_integer(std::string& text, bool is_unsigned) {
  std::string_view t = text;
  if (!t.empty() && t[0] == '+') t.remove_prefix(1);
  const bool negative = !t.empty() && t[0] == '-';
  const std::string_view digits = negative ? t.substr(1) : t;
  const bool decimal = !digits.empty() && std::all_of(digits.begin(), digits.end(), [](char c) {
    return c >= '0' && c <= '9';
  });
  if (!decimal) return fmt::format("expected a whole number in decimal digits, got '{}'", text);
  if (is_unsigned) {
    if (negative) return fmt::format("must be >= 0, got {}", text);
    uint64_t v = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
    if (ec != std::errc() || end != digits.data() + digits.size())
      return fmt::format("{} is beyond the largest value, {}", text, std::numeric_limits<uint64_t>::max());
    text = std::to_string(v);
    return {};
  }
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (ec != std::errc() || end != t.data() + t.size())
    return fmt::format("{} is outside the 64-bit range [{}, {}]", text, std::numeric_limits<int64_t>::min(),
                       std::numeric_limits<int64_t>::max());
  text = std::to_string(v);
  return {};
}

std::string strict_number(const std::string& text) {
  std::string_view t = text;
  if (!t.empty() && t[0] == '+') t.remove_prefix(1);
  double v = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (t.empty() || end != t.data() + t.size() || (ec != std::errc() && ec != std::errc::result_out_of_range))
    return fmt::format("expected a number, got '{}'", text);
  if (ec == std::errc() && !std::isfinite(v)) return fmt::format("expected a finite number, got '{}'", text);
  if (ec != std::errc() || !f32_holds(v))
    return fmt::format("{} is outside what f32 can hold; must be 0 or of magnitude in [1.1754944e-38, "
                       "3.4028235e38]", text);
  return {};
}

}  // namespace

void check_numeric_options(CLI::App& app) {
  for (CLI::Option* option : app.get_options()) {
    if (option->get_type_size_max() == 0) continue;  // a flag
    const std::string full = option->get_type_name();  // "INT:>= 1": the type, then the checks' descriptions
    const std::string type = full.substr(0, full.find(':'));
    if (type == "INT" || type == "UINT") {
      const bool is_unsigned = type == "UINT";
      option->transform(CLI::Validator([is_unsigned](std::string& text) { return strict_integer(text, is_unsigned); },
                                       ""));
    } else if (type == "FLOAT") {
      option->transform(CLI::Validator([](std::string& text) { return strict_number(text); }, ""));
    }
  }
  for (CLI::App* sub : app.get_subcommands({})) check_numeric_options(*sub);
}

}  // namespace moetrain
