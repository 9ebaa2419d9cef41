// The resolved configuration of a run: every key of config_schema() with its
// value and where that value came from.
//
// Precedence, lowest first: schema defaults < included files < the file <
// --set overrides (then programmatic set() calls). A file is a YAML map of
// sections (model:, data:, train:, run:); a key may also be written dotted
// ("model.n_layer: 4" at the top level). `include: base.yaml` or
// `include: [a.yaml, b.yaml]` at the top level of a file loads those files
// first (paths relative to the including file, recursively, in order, later
// wins key by key, i.e. a deep merge of maps), wherever it appears in the file.
//
// Every value is validated when read (so a bad value in a base file is an
// error even if a later file overrides it); the cross-key checks (d_model %
// n_head, seq_len <= n_ctx, min_lr <= lr) run on the final values. Errors are
// ConfigError, one line: "configs/x.yaml:3:5: model.n_layer: expected an
// integer, got 'twelve'". Line and column are 1-based and point at the key.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "config/schema.h"
#include "core/error.h"

namespace moetrain {

// A user error in a config file, an override or a value set from another source.
class ConfigError : public Error {
 public:
  explicit ConfigError(const std::string& what) : Error(what) {}
};

class Config {
 public:
  // Reads the YAML file at `path` (and its includes), applies `overrides`
  // ("model.n_layer=4", the value parsed as a YAML scalar), validates and
  // fills the keys nobody set with their defaults. Locations in messages and
  // where() use `path` as given, joined with include paths.
  static Config load(const std::string& path, const std::vector<std::string>& overrides = {});
  // Like load(), from YAML text; `name` stands for the file in messages, and
  // includes resolve relative to its directory.
  static Config load_string(const std::string& yaml, const std::string& name,
                            const std::vector<std::string>& overrides = {});
  // Every key at its schema default.
  static Config defaults();

  // Sets one key from YAML scalar text, validated like an override; `origin`
  // is what where() reports, e.g. "huggingface config.json". An empty
  // value_yaml means the empty string. The cross-key checks run afterwards; on
  // any error the config is left unchanged.
  void set(const std::string& key, const std::string& value_yaml, const std::string& origin);
  // Sets several keys, then runs the cross-key checks once, so values that
  // only agree together (d_model and n_head) can be changed. All or nothing.
  void set(const std::vector<std::pair<std::string, std::string>>& values, const std::string& origin);
  // Applies "key=value" overrides as load() does; where() reports
  // "--set key=value". All or nothing.
  void apply_overrides(const std::vector<std::string>& overrides);

  // True when the value came from a file, an override or set(), not the default.
  bool is_set_explicitly(const std::string& key) const;

  // Typed access. Asking for a key outside the schema, or with the getter of
  // another type, is a bug in the caller (an internal error, not a ConfigError).
  // get_string serves string and choice keys.
  int64_t get_int(const std::string& key) const;
  double get_number(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  std::string get_string(const std::string& key) const;

  // Where the value of `key` came from: "configs/gpt2-small.yaml:12:5",
  // "--set model.n_layer=4", "default", or the origin given to set().
  std::string where(const std::string& key) const;
  // The value of `key` as YAML scalar text, as to_yaml() writes it.
  std::string value_yaml(const std::string& key) const;

  // Throws ConfigError "configs/x.yaml:12:5: model.d_model = 100: <message>"
  // ("model.d_model = 100 (default): <message>" for a default): for the
  // consistency checks of model and trainer code. Say what to do in `message`.
  [[noreturn]] void fail(const std::string& key, const std::string& message) const;

  // The resolved config: every schema key, nested maps in schema order, numbers
  // written so they read back bit for bit, strings quoted when YAML would
  // otherwise read them as something else. load() of it gives the same values.
  std::string to_yaml() const;
  // Lowercase hex SHA-256 of to_yaml(): identifies the resolved config (stored
  // in checkpoints).
  std::string sha256() const;
  // Writes to_yaml() to `path` atomically: a temp file in the same directory,
  // flushed to disk, then renamed over `path`. Throws IoError (exit code 5) naming
  // `path` and the system's message when the directory does not exist or a create,
  // write, sync or rename fails; never leaves a partial file at `path`.
  void save(const std::string& path) const;

  using Value = std::variant<int64_t, double, bool, std::string>;

 private:
  struct Entry {
    Value value;
    std::string origin;    // see where()
    bool is_explicit = false;
  };
  struct Assignment;       // a validated value for one key, with its origin
  class Loader;

  Config();
  const Entry& entry(const std::string& key, ConfigType wanted, const char* getter) const;
  void apply(const std::vector<Assignment>& assignments);
  void check_consistency() const;
  static std::vector<Assignment> parse_overrides(const std::vector<std::string>& overrides);

  std::vector<Entry> entries_;  // parallel to config_schema()
};

// Whether v survives the trip to f32: 0, or a magnitude that rounds to a normal
// f32 (from halfway below FLT_MIN to halfway above FLT_MAX). The rule of every
// number key (the schema) and of every number option on the command line.
bool f32_holds(double v);

// The items of a comma-list value (model.layer_mixers, train.recompute_modules):
// split at every comma, blanks around each item dropped, empty items kept (the
// reader names them as wrong); none for an empty value.
std::vector<std::string> split_comma_list(const std::string& value);

}  // namespace moetrain
