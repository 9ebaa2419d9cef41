// The configuration schema: every key a config file may set, with its type,
// default, allowed range and a one-line doc. It is the single source for
// validation (config.cpp), for the resolved config (Config::to_yaml) and for
// docs/configs.md, so a new option is one new entry in config_schema().
//
// Conventions: keys are dotted snake_case paths ("model.n_layer"); the part
// before the last dot is the section (a YAML map in the file). Defaults are
// YAML scalar text, parsed by the same code as a file value, so a default that
// fails its own range is caught (config tests load every default).
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace moetrain {

enum class ConfigType { integer, number, boolean, string, choice };

struct KeySpec {
  std::string key;            // dotted path, e.g. "model.n_layer"
  ConfigType type;
  std::string default_yaml;   // YAML scalar text, e.g. "12", "1e-5", "'\n'", "gpt2"
  std::optional<double> min, max;  // integer and number keys; unset = unbounded
  bool min_exclusive = false;      // (min, ...] instead of [min, ...]
  bool max_exclusive = false;      // [..., max) instead of [..., max]
  std::vector<std::string> choices;  // choice keys: the allowed values
  std::string doc;            // one line, for docs/configs.md and error messages
};

// Every key, grouped by section, in the order to_yaml() prints them.
const std::vector<KeySpec>& config_schema();

// The spec of a dotted key, or nullptr when the schema has no such key.
const KeySpec* find_key_spec(const std::string& key);

// "integer", "number", "boolean", "string" or "choice".
const char* config_type_name(ConfigType type);

// What values a key allows, for errors and docs: ">= 1", "[1, 4096]", "[0, 1)",
// "> 0", "one of gpt2, byte"; empty when any value of the type is allowed.
std::string allowed_values_text(const KeySpec& spec);

}  // namespace moetrain
