// Config: loading (yaml-cpp), includes, overrides, validation against
// config_schema(), the resolved YAML and its hash. Conventions are in config.h.
//
// A file is read into a list of Assignments (key index, parsed value, origin
// "file:line:col"), includes first, then applied in order onto the defaults:
// applying a flat list key by key is the deep merge of the nested maps, since
// every schema leaf is a scalar. Error messages are built here, one line each:
// "<where>: <key>: <problem>" or "<where>: <key> = <value>: <problem>".
#include "config/config.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include <openssl/evp.h>
#include <yaml-cpp/yaml.h>

#include "io/paths.h"

namespace moetrain {

namespace fs = std::filesystem;

struct Config::Assignment {
  size_t index;        // into config_schema()
  Value value;
  std::string origin;  // see Config::where()
};

namespace {

// --- the schema's shape ----------------------------------------------------------

size_t index_of(const KeySpec& spec) { return static_cast<size_t>(&spec - config_schema().data()); }

std::string parent_of(const std::string& key) {
  size_t dot = key.rfind('.');
  return dot == std::string::npos ? "" : key.substr(0, dot);
}
std::string leaf_of(const std::string& key) {
  size_t dot = key.rfind('.');
  return dot == std::string::npos ? key : key.substr(dot + 1);
}

// Every section ("model", and "model.moe" should a key be nested deeper), in
// schema order of first appearance.
const std::vector<std::string>& sections() {
  static const std::vector<std::string> all = [] {
    std::vector<std::string> out;
    for (const KeySpec& s : config_schema())
      for (size_t dot = s.key.find('.'); dot != std::string::npos; dot = s.key.find('.', dot + 1)) {
        std::string section = s.key.substr(0, dot);
        if (std::find(out.begin(), out.end(), section) == out.end()) out.push_back(section);
      }
    return out;
  }();
  return all;
}
bool is_section(const std::string& path) {
  const auto& all = sections();
  return std::find(all.begin(), all.end(), path) != all.end();
}
std::vector<std::string> children_of(const std::string& section) {
  std::vector<std::string> out;
  for (const KeySpec& s : config_schema())
    if (parent_of(s.key) == section) out.push_back(leaf_of(s.key));
  for (const std::string& sec : sections())
    if (parent_of(sec) == section) out.push_back(leaf_of(sec));
  return out;
}

// --- did you mean ------------------------------------------------------------------

// Optimal string alignment distance: Levenshtein plus swaps of adjacent
// characters, the most common typo ("n_layre").
size_t edit_distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i)
    for (size_t j = 1; j <= m; ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[n][m];
}

// The closest schema key (or section) to `unknown`: a typo of the whole path,
// a typo of the last part within the same section, or the right name in the
// wrong section ("n_layer" at the top level, "train.n_layer"). Empty when
// nothing is close.
std::string suggest(const std::string& unknown, bool want_section) {
  std::vector<std::string> candidates;
  if (want_section) candidates = sections();
  else
    for (const KeySpec& s : config_schema()) candidates.push_back(s.key);
  const std::string leaf = leaf_of(unknown), parent = parent_of(unknown);
  const size_t threshold = std::clamp<size_t>(leaf.size() / 3, 1, 3);
  std::string best;
  size_t best_score = threshold + 1;
  for (const std::string& c : candidates) {
    size_t moved = parent_of(c) == parent ? 0 : 1;
    size_t score = std::min(edit_distance(unknown, c), edit_distance(leaf, leaf_of(c)) + moved);
    // "warmup" for "warmup_steps": a prefix of a name in the same section.
    if (score > threshold && moved == 0 && leaf.size() >= 4 && leaf_of(c).rfind(leaf + "_", 0) == 0)
      score = threshold;
    if (score < best_score) best_score = score, best = c;
  }
  return best;
}

// "unknown key 'model.n_layre' (did you mean 'model.n_layer'?)"; without a
// close match, the names that exist there.
std::string unknown_key_message(const std::string& path, bool is_map) {
  std::string guess = suggest(path, is_map);
  const char* what = is_map ? "section" : "key";
  if (!guess.empty()) return fmt::format("unknown {} '{}' (did you mean '{}'?)", what, path, guess);
  std::string parent = parent_of(path);
  if (is_section(parent))
    return fmt::format("unknown {} '{}'; section '{}' has: {}", what, path, parent,
                       fmt::join(children_of(parent), ", "));
  return fmt::format("unknown {} '{}'; the sections are: {}", what, path, fmt::join(children_of(""), ", "));
}

// --- scalars and values ------------------------------------------------------------

// A YAML value as the validator sees it.
struct Scalar {
  std::string text;
  bool quoted = false;     // '...', "..." or !!str: meant as a string
  bool null = false;       // empty, ~ or null
  std::string structure;   // "a map" or "a list" when not a scalar
};

Scalar scalar_of(const YAML::Node& node) {
  Scalar s;
  switch (node.Type()) {
    case YAML::NodeType::Scalar:
      s.text = node.Scalar();
      s.quoted = node.Tag() == "!" || node.Tag() == "tag:yaml.org,2002:str";
      break;
    case YAML::NodeType::Sequence: s.structure = "a list"; break;
    case YAML::NodeType::Map: s.structure = "a map"; break;
    default: s.null = true; break;
  }
  return s;
}

// How a value shows in "got ...".
std::string shown(const Scalar& s) {
  if (!s.structure.empty()) return s.structure;
  if (s.null) return "an empty value";
  return fmt::format("'{}'", s.text);
}

std::optional<int64_t> parse_int(std::string_view t, bool* overflow) {
  if (!t.empty() && t[0] == '+') t.remove_prefix(1);
  int64_t v = 0;
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  *overflow = ec == std::errc::result_out_of_range;
  if (t.empty() || ec != std::errc() || end != t.data() + t.size()) return std::nullopt;
  return v;
}

// A number; nullopt when t is not one, or (*out_of_range set) when it is one
// beyond what a double holds (1e400, 1e-400).
std::optional<double> parse_double(std::string_view t, bool* out_of_range) {
  if (!t.empty() && t[0] == '+') t.remove_prefix(1);
  double v = 0;
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  *out_of_range = !t.empty() && ec == std::errc::result_out_of_range && end == t.data() + t.size();
  if (t.empty() || ec != std::errc() || end != t.data() + t.size()) return std::nullopt;
  return v;
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Shortest text that reads back as the same double, always with a '.' so that
// YAML 1.1 readers (PyYAML) also see a float: 1e-05 -> 1.0e-05, 1 -> 1.0.
std::string format_number(double v) {
  std::string t = fmt::format("{}", v);
  if (t.find_first_of(".ni") != std::string::npos) return t;  // has a point, or inf/nan
  size_t e = t.find('e');
  if (e == std::string::npos) return t + ".0";
  return t.insert(e, ".0");
}

// A string goes out plain only when no YAML reader could take it for anything
// else (a number, a bool, null, an alias, a comment); otherwise double-quoted.
std::string format_string(const std::string& s) {
  static const std::set<std::string> kSpecial = {"true", "false", "yes", "no", "on", "off", "y", "n", "null", "~"};
  bool plain = !s.empty() && (std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_' || s[0] == '/') &&
               !kSpecial.count(lower(s));
  for (char c : s)
    plain = plain && (std::isalnum(static_cast<unsigned char>(c)) || (c != '\0' && std::strchr("_./-*", c)));
  if (plain) return s;
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
        else out += c;  // printable ASCII and UTF-8 bytes as they are
    }
  }
  return out + "\"";
}

std::string format_value(const Config::Value& v) {
  struct {
    std::string operator()(int64_t x) const { return fmt::format("{}", x); }
    std::string operator()(double x) const { return format_number(x); }
    std::string operator()(bool x) const { return x ? "true" : "false"; }
    std::string operator()(const std::string& x) const { return format_string(x); }
  } visitor;
  return std::visit(visitor, v);
}

const char* expected_text(ConfigType t) {
  switch (t) {
    case ConfigType::integer: return "an integer";
    case ConfigType::number: return "a number";
    case ConfigType::boolean: return "true or false";
    case ConfigType::string: return "a string";
    case ConfigType::choice: return "";  // the choices, see parse_value
  }
  return "";
}

// "must be >= 1", "must be in [0, 1)" when v is outside the spec's range.
std::optional<std::string> range_error(const KeySpec& spec, double v) {
  bool below = spec.min && (spec.min_exclusive ? v <= *spec.min : v < *spec.min);
  bool above = spec.max && (spec.max_exclusive ? v >= *spec.max : v > *spec.max);
  if (!below && !above) return std::nullopt;
  return (spec.min && spec.max ? "must be in " : "must be ") + allowed_values_text(spec);
}

constexpr const char* kF32Range =
    "outside what f32 can hold; must be 0 or of magnitude in [1.1754944e-38, 3.4028235e38]";

// String keys name paths (run.dir, data.train, model.init_from, ...), globs, mixer
// lists or checkpoints: a control character there is a mistake (a YAML "\0" or
// "\n" escape), and a NUL would cut the path the system sees. Only text keys
// (the sample prompt) may hold them.
std::optional<std::string> control_character_error(const KeySpec& spec, const std::string& text) {
  if (spec.key == "train.sample_prompt") return std::nullopt;
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 || c == 0x7f)
      return fmt::format("{} = {}: holds the control character \\x{:02x} at offset {}; a path or name cannot hold "
                         "control characters (a NUL would cut it): remove it",
                         spec.key, format_string(text), c, i);
  }
  return std::nullopt;
}

// Parses and validates one value for `spec`. On error returns the message
// after the location: "model.n_layer: expected an integer, got 'twelve'" or
// "model.n_layer = 0: must be in [1, 4096]".
std::optional<std::string> parse_value(const KeySpec& spec, const Scalar& s, Config::Value& out) {
  const std::string& key = spec.key;
  std::string expected = spec.type == ConfigType::choice
                             ? fmt::format("one of {}", fmt::join(spec.choices, ", "))
                             : expected_text(spec.type);
  if (!s.structure.empty() || s.null) {
    std::string hint = s.null && spec.type == ConfigType::string ? " (write '' for an empty string)" : "";
    return fmt::format("{}: expected {}, got {}{}", key, expected, shown(s), hint);
  }
  bool is_text = spec.type == ConfigType::string || spec.type == ConfigType::choice;
  if (s.quoted && !is_text)
    return fmt::format("{}: expected {}, got the quoted string '{}' (remove the quotes)", key, expected, s.text);
  switch (spec.type) {
    case ConfigType::integer: {
      bool overflow = false;
      std::optional<int64_t> v = parse_int(s.text, &overflow);
      if (!v)
        return fmt::format("{}: expected an integer, got '{}'{}", key, s.text,
                           overflow ? " (outside the 64-bit range)" : "");
      if (auto e = range_error(spec, static_cast<double>(*v))) return fmt::format("{} = {}: {}", key, *v, *e);
      out = *v;
      return std::nullopt;
    }
    case ConfigType::number: {
      bool out_of_range = false;
      std::optional<double> v = parse_double(s.text, &out_of_range);
      if (out_of_range) return fmt::format("{} = {}: {}", key, s.text, kF32Range);
      if (!v) return fmt::format("{}: expected a number, got '{}'", key, s.text);
      if (!std::isfinite(*v)) return fmt::format("{}: expected a finite number, got '{}'", key, s.text);
      if (auto e = range_error(spec, *v)) return fmt::format("{} = {}: {}", key, s.text, *e);
      if (!f32_holds(*v)) return fmt::format("{} = {}: {}", key, s.text, kF32Range);
      out = *v;
      return std::nullopt;
    }
    case ConfigType::boolean: {
      std::string t = lower(s.text);
      if (t != "true" && t != "false") return fmt::format("{}: expected true or false, got '{}'", key, s.text);
      out = t == "true";
      return std::nullopt;
    }
    case ConfigType::string:
      if (std::optional<std::string> e = control_character_error(spec, s.text)) return e;
      out = s.text;
      return std::nullopt;
    case ConfigType::choice: {
      if (std::find(spec.choices.begin(), spec.choices.end(), s.text) != spec.choices.end()) {
        out = s.text;
        return std::nullopt;
      }
      std::string guess;
      for (const std::string& c : spec.choices)
        if (edit_distance(lower(s.text), c) <= 1) guess = fmt::format(" (did you mean '{}'?)", c);
      return fmt::format("{}: expected {}, got '{}'{}", key, expected, s.text, guess);
    }
  }
  return std::nullopt;
}

std::string location(const std::string& file, const YAML::Mark& mark) {
  if (mark.is_null()) return file;
  return fmt::format("{}:{}:{}", file, mark.line + 1, mark.column + 1);
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// A config is a few KiB of YAML; this bounds what a wrong path (a log, a dataset,
// /proc/kcore) costs to read before the YAML parser refuses it.
constexpr int64_t kMaxConfigFileBytes = int64_t{4} << 20;

// The text of a config file, refused (ConfigError, exit 2) when it is not a regular
// file (a FIFO would block for ever, /dev/zero never end) or holds more than
// kMaxConfigFileBytes. `site` ("base.yaml:2:10", empty for -c) prefixes the message.
std::string read_text_file(const std::string& path, const std::string& site) {
  try {
    return read_regular_file(path, "a YAML config file", kMaxConfigFileBytes);
  } catch (const IoError&) {
    throw;
  } catch (const Error& e) {
    throw ConfigError(site.empty() ? e.what() : fmt::format("{}: include: {}", site, e.what()));
  }
}

// Defaults parsed once; a default that fails its own spec is our bug.
const std::vector<Config::Value>& default_values() {
  static const std::vector<Config::Value> values = [] {
    std::vector<Config::Value> out;
    for (const KeySpec& spec : config_schema()) {
      Config::Value v;
      YAML::Node node = YAML::Load(spec.default_yaml);
      std::optional<std::string> error = parse_value(spec, scalar_of(node), v);
      MT_ASSERT(!error, "schema default of {} is invalid: {}", spec.key, *error);
      out.push_back(std::move(v));
    }
    return out;
  }();
  return values;
}

}  // namespace

// --- reading files -------------------------------------------------------------------

// Reads a file and, first, its includes into assignments. Keeps the chain of
// files being read to report include cycles.
class Config::Loader {
 public:
  std::vector<Assignment> load_file(const std::string& path, const std::string& include_site) {
    std::error_code ec;
    if (!fs::exists(path, ec)) {
      if (include_site.empty())
        throw ConfigError(fmt::format("config file '{}' not found (relative paths start at the current directory, {})",
                                      path, fs::current_path(ec).string()));
      throw ConfigError(fmt::format("{}: include file '{}' not found (include paths are relative to the including file)",
                                    include_site, path));
    }
    return load_text(read_text_file(path, include_site), path);
  }

  std::vector<Assignment> load_text(const std::string& text, const std::string& file) {
    std::error_code ec;
    fs::path canonical = fs::weakly_canonical(fs::absolute(file, ec), ec);
    chain_.push_back({file, canonical});

    YAML::Node root;
    try {
      // Every document, so a second one (after `---`) is refused rather than dropped.
      const std::vector<YAML::Node> docs = YAML::LoadAll(text);
      for (size_t i = 1; i < docs.size(); ++i)
        if (!docs[i].IsNull())
          throw ConfigError(fmt::format("{}: a second YAML document (after '---'); a config is one document: merge "
                                        "them, or put the shared part in a file named by include:",
                                        location(file, docs[i].Mark())));
      if (!docs.empty()) root = docs[0];
    } catch (const YAML::Exception& e) {
      throw ConfigError(fmt::format("{}: invalid YAML: {}", location(file, e.mark), e.msg));
    }
    std::vector<Assignment> out;
    if (root.IsNull()) {  // an empty file, or only comments
      chain_.pop_back();
      return out;
    }
    if (!root.IsMap())
      throw ConfigError(fmt::format("{}: expected a map of sections ({}) at the top of the file, got {}",
                                    location(file, root.Mark()), fmt::join(children_of(""), ", "),
                                    shown(scalar_of(root))));

    // Includes first, wherever `include:` stands: the file's own keys win.
    for (auto it = root.begin(); it != root.end(); ++it)
      if (it->first.IsScalar() && it->first.Scalar() == "include") read_includes(it->first, it->second, file, out);

    std::map<std::string, std::string> seen;  // path -> where, to catch keys set twice
    read_map(root, "", file, seen, out);
    chain_.pop_back();
    return out;
  }

  // A value given as YAML text outside a file (--set, set()): its assignment,
  // or a ConfigError that starts with `origin`.
  static Assignment from_text(const std::string& key, const std::string& value_yaml, const std::string& origin) {
    const KeySpec* spec = find_key_spec(key);
    if (!spec) {
      if (is_section(key))
        throw ConfigError(fmt::format("{}: {} is a section; set one of its keys, e.g. {}.{}", origin, key, key,
                                      children_of(key).front()));
      throw ConfigError(fmt::format("{}: {}", origin, unknown_key_message(key, false)));
    }
    Scalar s;
    if (trim(value_yaml).empty() && spec->type == ConfigType::string) {
      s.quoted = true;  // "data.val=" clears a string
    } else {
      try {
        // Every document, so a second one ("4\n---\n5") is refused rather than dropped.
        const std::vector<YAML::Node> docs = YAML::LoadAll(value_yaml);
        if (docs.size() > 1)
          throw ConfigError(fmt::format("{}: {}: the value holds {} YAML documents (a line '---' or '...' starts "
                                        "another); a value is one scalar: quote it, or set one value per --set",
                                        origin, key, docs.size()));
        s = scalar_of(docs.empty() ? YAML::Node() : docs[0]);
      } catch (const YAML::Exception& e) {
        throw ConfigError(fmt::format("{}: {}: cannot read '{}' as a YAML value ({}); quote it", origin, key,
                                      value_yaml, e.msg));
      }
      if (!s.structure.empty())
        throw ConfigError(fmt::format("{}: {}: expected a single value, got {} (quote the value to make it a string)",
                                      origin, key, s.structure));
    }
    Value value;
    if (std::optional<std::string> error = parse_value(*spec, s, value))
      throw ConfigError(fmt::format("{}: {}", origin, *error));
    return {index_of(*spec), std::move(value), origin};
  }

 private:
  struct Link {
    std::string display;  // as given or joined, for messages
    fs::path canonical;   // for cycle detection
  };
  std::vector<Link> chain_;

  void read_includes(const YAML::Node& key, const YAML::Node& value, const std::string& file,
                     std::vector<Assignment>& out) {
    std::vector<YAML::Node> items;  // `include: a.yaml` or `include: [a.yaml, b.yaml]`
    bool ok = value.IsScalar() || value.IsSequence();
    if (value.IsScalar()) items.push_back(value);
    if (value.IsSequence())
      for (const YAML::Node& item : value) items.push_back(item);
    for (const YAML::Node& item : items) ok = ok && item.IsScalar() && !item.Scalar().empty();
    if (!ok)
      throw ConfigError(fmt::format("{}: include: expected a file name or a list of file names, got {}",
                                    location(file, key.Mark()), shown(scalar_of(value))));
    for (const YAML::Node& item : items) {
      for (unsigned char c : item.Scalar())
        if (c < 0x20 || c == 0x7f)  // a NUL would cut the name the system sees: another file would be read
          throw ConfigError(fmt::format("{}: include: {} holds the control character \\x{:02x}; a file name cannot "
                                        "hold control characters: remove it",
                                        location(file, item.Mark()), format_string(item.Scalar()), c));
      fs::path name(item.Scalar());
      std::string path = name.is_absolute() ? name.string() : (fs::path(file).parent_path() / name).lexically_normal().string();
      std::string site = location(file, item.Mark());
      std::error_code ec;
      fs::path canonical = fs::weakly_canonical(fs::absolute(path, ec), ec);
      for (size_t i = 0; i < chain_.size(); ++i)
        if (chain_[i].canonical == canonical) {
          std::vector<std::string> cycle;
          for (size_t j = i; j < chain_.size(); ++j) cycle.push_back(chain_[j].display);
          cycle.push_back(path);
          throw ConfigError(fmt::format("{}: include cycle: {}; remove one of these includes", site,
                                        fmt::join(cycle, " -> ")));
        }
      std::vector<Assignment> included = load_file(path, site);
      out.insert(out.end(), std::make_move_iterator(included.begin()), std::make_move_iterator(included.end()));
    }
  }

  void read_map(const YAML::Node& map, const std::string& prefix, const std::string& file,
                std::map<std::string, std::string>& seen, std::vector<Assignment>& out) {
    for (auto it = map.begin(); it != map.end(); ++it) {
      const YAML::Node k = it->first;  // copies: `it->` yields a temporary pair
      const YAML::Node v = it->second;
      std::string loc = location(file, k.Mark());
      if (!k.IsScalar() || k.Scalar().empty())
        throw ConfigError(fmt::format("{}: expected a key name, got {}", loc, shown(scalar_of(k))));
      if (prefix.empty() && k.Scalar() == "include") continue;  // read by read_includes
      std::string path = prefix.empty() ? k.Scalar() : prefix + "." + k.Scalar();

      auto [previous, first_time] = seen.emplace(path, loc);
      if (!first_time)
        throw ConfigError(fmt::format("{}: {} appears twice in this file (first at {}); keep one", loc, path,
                                      previous->second));

      if (const KeySpec* spec = find_key_spec(path)) {
        Value value;
        if (std::optional<std::string> error = parse_value(*spec, scalar_of(v), value))
          throw ConfigError(fmt::format("{}: {}", loc, *error));
        out.push_back({index_of(*spec), std::move(value), loc});
      } else if (is_section(path)) {
        if (v.IsMap()) read_map(v, path, file, seen, out);
        else if (!v.IsNull())  // `train:` with every key commented out is fine
          throw ConfigError(fmt::format("{}: {} is a section and needs its keys indented below it "
                                        "(e.g. '  {}: ...'), got {}",
                                        loc, path, children_of(path).front(), shown(scalar_of(v))));
      } else {
        throw ConfigError(fmt::format("{}: {}", loc, unknown_key_message(path, v.IsMap())));
      }
    }
  }
};

// --- Config --------------------------------------------------------------------------

Config::Config() {
  const std::vector<Value>& values = default_values();
  entries_.reserve(values.size());
  for (const Value& v : values) entries_.push_back({v, "default", false});
}

Config Config::defaults() { return Config(); }

Config Config::load(const std::string& path, const std::vector<std::string>& overrides) {
  Loader loader;
  std::vector<Assignment> from_files = loader.load_file(path, "");
  Config config;
  config.apply(from_files);
  config.apply(parse_overrides(overrides));
  config.check_consistency();
  return config;
}

Config Config::load_string(const std::string& yaml, const std::string& name,
                           const std::vector<std::string>& overrides) {
  Loader loader;
  std::vector<Assignment> from_yaml = loader.load_text(yaml, name);
  Config config;
  config.apply(from_yaml);
  config.apply(parse_overrides(overrides));
  config.check_consistency();
  return config;
}

std::vector<Config::Assignment> Config::parse_overrides(const std::vector<std::string>& overrides) {
  std::vector<Assignment> out;
  for (const std::string& o : overrides) {
    size_t eq = o.find('=');
    if (eq == std::string::npos || trim(o.substr(0, eq)).empty())
      throw ConfigError(fmt::format("--set expects key=value, got '{}' (e.g. --set model.n_layer=4)", o));
    out.push_back(Loader::from_text(trim(o.substr(0, eq)), o.substr(eq + 1), "--set " + o));
  }
  return out;
}

void Config::apply(const std::vector<Assignment>& assignments) {
  for (const Assignment& a : assignments) entries_[a.index] = {a.value, a.origin, true};
}

void Config::set(const std::string& key, const std::string& value_yaml, const std::string& origin) {
  set(std::vector<std::pair<std::string, std::string>>{{key, value_yaml}}, origin);
}

void Config::set(const std::vector<std::pair<std::string, std::string>>& values, const std::string& origin) {
  std::vector<Assignment> assignments;
  for (const auto& [key, value] : values) assignments.push_back(Loader::from_text(key, value, origin));
  Config next = *this;
  next.apply(assignments);
  next.check_consistency();
  *this = std::move(next);
}

void Config::apply_overrides(const std::vector<std::string>& overrides) {
  Config next = *this;
  next.apply(parse_overrides(overrides));
  next.check_consistency();
  *this = std::move(next);
}

// The cross-key rules every config obeys. Reported at the key to change.
void Config::check_consistency() const {
  auto described = [this](const std::string& key) {
    const Entry& e = entries_[index_of(*find_key_spec(key))];
    return fmt::format("{} = {} ({})", key, value_yaml(key), e.origin);
  };
  int64_t d_model = get_int("model.d_model"), n_head = get_int("model.n_head");
  // model.n_head splits d_model in GPT-2 and in the hybrid's plain attention mixer.
  bool uses_n_head = get_string("model.arch") == "gpt2" || get_string("model.mixer") == "attention" ||
                     get_string("model.attn_mixer") == "attention" ||
                     get_string("model.layer_mixers").find("attention") != std::string::npos;
  if (uses_n_head && d_model % n_head != 0) {
    int64_t below = d_model / n_head * n_head, above = below + n_head;
    std::string examples = below > 0 ? fmt::format("{} or {}", below, above) : fmt::format("{}", above);
    fail("model.d_model", fmt::format("must be a multiple of {}; use e.g. {}, or change model.n_head",
                                      described("model.n_head"), examples));
  }
  if (get_int("train.seq_len") > get_int("model.n_ctx"))
    fail("train.seq_len", fmt::format("must be <= {}; lower train.seq_len or raise model.n_ctx",
                                      described("model.n_ctx")));
  if (get_number("train.min_lr") > get_number("train.lr"))
    fail("train.min_lr", fmt::format("must be <= {}; lower train.min_lr or raise train.lr", described("train.lr")));
}

const Config::Entry& Config::entry(const std::string& key, ConfigType wanted, const char* getter) const {
  const KeySpec* spec = find_key_spec(key);
  MT_ASSERT(spec, "{}(\"{}\"): no such config key; add it to config_schema() in src/config/schema.cpp", getter, key);
  bool ok = spec->type == wanted || (wanted == ConfigType::string && spec->type == ConfigType::choice);
  MT_ASSERT(ok, "{}(\"{}\"): the key is of type {}, use its getter", getter, key, config_type_name(spec->type));
  return entries_[index_of(*spec)];
}

int64_t Config::get_int(const std::string& key) const {
  return std::get<int64_t>(entry(key, ConfigType::integer, "get_int").value);
}
double Config::get_number(const std::string& key) const {
  return std::get<double>(entry(key, ConfigType::number, "get_number").value);
}
bool Config::get_bool(const std::string& key) const {
  return std::get<bool>(entry(key, ConfigType::boolean, "get_bool").value);
}
std::string Config::get_string(const std::string& key) const {
  return std::get<std::string>(entry(key, ConfigType::string, "get_string").value);
}

bool Config::is_set_explicitly(const std::string& key) const {
  const KeySpec* spec = find_key_spec(key);
  MT_ASSERT(spec, "is_set_explicitly(\"{}\"): no such config key", key);
  return entries_[index_of(*spec)].is_explicit;
}

std::string Config::where(const std::string& key) const {
  const KeySpec* spec = find_key_spec(key);
  MT_ASSERT(spec, "where(\"{}\"): no such config key", key);
  return entries_[index_of(*spec)].origin;
}

std::string Config::value_yaml(const std::string& key) const {
  const KeySpec* spec = find_key_spec(key);
  MT_ASSERT(spec, "value_yaml(\"{}\"): no such config key", key);
  return format_value(entries_[index_of(*spec)].value);
}

void Config::fail(const std::string& key, const std::string& message) const {
  const KeySpec* spec = find_key_spec(key);
  MT_ASSERT(spec, "fail(\"{}\"): no such config key", key);
  const Entry& e = entries_[index_of(*spec)];
  std::string head = fmt::format("{} = {}", key, format_value(e.value));
  if (!e.is_explicit) throw ConfigError(fmt::format("{} (default): {}", head, message));
  throw ConfigError(fmt::format("{}: {}: {}", e.origin, head, message));
}

std::string Config::to_yaml() const {
  // Sections nest as their dotted paths say, in order of first appearance in
  // the schema; top-level sections are separated by a blank line.
  std::string out;
  std::vector<std::string> open;  // the sections the current line is inside
  for (const KeySpec& spec : config_schema()) {
    std::vector<std::string> parts;
    for (size_t b = 0, dot; b <= spec.key.size(); b = dot + 1) {
      dot = spec.key.find('.', b);
      if (dot == std::string::npos) dot = spec.key.size();
      parts.push_back(spec.key.substr(b, dot - b));
    }
    size_t common = 0;
    while (common < open.size() && common + 1 < parts.size() && open[common] == parts[common]) ++common;
    open.resize(common);
    for (size_t depth = common; depth + 1 < parts.size(); ++depth) {
      if (depth == 0 && !out.empty()) out += "\n";
      out += fmt::format("{:{}}{}:\n", "", 2 * depth, parts[depth]);
      open.push_back(parts[depth]);
    }
    out += fmt::format("{:{}}{}: {}\n", "", 2 * open.size(), parts.back(), format_value(entries_[index_of(spec)].value));
  }
  return out;
}

std::string Config::sha256() const {
  std::string yaml = to_yaml();
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  MT_ASSERT(EVP_Digest(yaml.data(), yaml.size(), digest, &size, EVP_sha256(), nullptr) == 1,
            "OpenSSL EVP_Digest(sha256) failed");
  std::string hex;
  for (unsigned int i = 0; i < size; ++i) hex += fmt::format("{:02x}", digest[i]);
  return hex;
}

void Config::save(const std::string& path) const {
  const std::string yaml = to_yaml();
  check_output_file(path, "cannot save the config to");  // never renamed over a device, FIFO or directory
  fs::path target(path);
  fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  static std::atomic<unsigned> counter{0};
  fs::path tmp = dir / fmt::format(".{}.tmp.{}.{}", target.filename().string(), ::getpid(), counter++);

  // Every failure here is the system's (disk full, read-only, permission, no such
  // directory): IoError, exit 5, naming the path, the step and strerror.
  auto failure = [&](const std::string& step) {
    int err = errno;
    ::unlink(tmp.c_str());
    return IoError(fmt::format("cannot save the config to '{}': {} the temp file '{}': {}{}", path, step,
                               tmp.string(), std::strerror(err), err == ENOENT ? " (create the directory first)" : ""));
  };
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw failure("cannot create");
  for (size_t done = 0; done < yaml.size();) {
    ssize_t n = ::write(fd, yaml.data() + done, yaml.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      IoError e = failure("cannot write");
      ::close(fd);
      throw e;
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    IoError e = failure("cannot flush");
    ::close(fd);
    throw e;
  }
  if (::close(fd) != 0) throw failure("cannot close");
  if (::rename(tmp.c_str(), target.c_str()) != 0) throw failure("cannot rename into place");
  // Make the rename itself durable (EINVAL: the file system cannot sync directories).
  int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0 || (::fsync(dir_fd) != 0 && errno != EINVAL)) {
    const int err = errno;
    if (dir_fd >= 0) ::close(dir_fd);
    throw IoError(fmt::format("saved the config to '{}', but syncing its directory '{}' failed: {}", path,
                              dir.string(), std::strerror(err)));
  }
  ::close(dir_fd);
}

// Number keys reach f32 code (learning rates, epsilons, init scales): a value
// f32 cannot hold would become infinite or, below the smallest normal f32
// (FLT_MIN), lose its precision on the way to zero, so either is an error. The
// test is on the value rounded to f32 (to nearest, as a cast rounds), so the
// limits as printed (3.4028235e38 for FLT_MAX, 1.1754944e-38 for FLT_MIN) pass:
// |v| below 2^128 - 2^103 (halfway to 2^128) and, unless 0, from halfway
// between FLT_MIN and the largest subnormal up. 0 is f32's too; whether a key
// allows it is its range's business.
bool f32_holds(double v) {
  const double a = std::fabs(v);
  const double overflow = std::ldexp(2.0 - std::ldexp(1.0, -24), 127);  // rounds to infinity from here
  const double normal = std::ldexp(1.0 - std::ldexp(1.0, -24), -126);   // rounds to FLT_MIN from here
  return a == 0 || (a >= normal && a < overflow);
}

std::vector<std::string> split_comma_list(const std::string& value) {
  std::vector<std::string> items;
  if (value.empty()) return items;
  for (size_t start = 0;;) {
    const size_t comma = value.find(',', start);
    std::string item = value.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    items.push_back(std::move(item));
    if (comma == std::string::npos) return items;
    start = comma + 1;
  }
}

}  // namespace moetrain
