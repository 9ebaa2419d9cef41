#include "checkpoint/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <thread>
#include <tuple>

#include <nlohmann/json.hpp>
#include <openssl/evp.h>
#include <spdlog/spdlog.h>

#include "comm/communicator.h"
#include "comm/distributed.h"
#include "comm/watchdog.h"
#include "core/format.h"
#include "core/grad_mode.h"
#include "core/rng.h"
#include "core/signals.h"
#include "data/progress.h"
#include "io/durable.h"
#include "io/hdf5.h"
#include "io/paths.h"
#include "nn/language_model.h"
#include "nn/model_family.h"
#include "ops/reduce/reduce.h"
#include "optim/optimizer.h"

namespace moetrain {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Named rather than anonymous: CheckpointSaver::Job holds these types.
namespace checkpoint_impl {

constexpr const char* kFormat = "moetrain-checkpoint";
constexpr const char* kManifest = "manifest.json";
constexpr const char* kCommit = "COMMIT";
constexpr const char* kConfig = "config.resolved.yaml";

std::string rank_file(int rank) { return fmt::format("rank_{:05d}.h5", rank); }

// ---------------------------------------------------------------- files

// What `path` is when it is not a regular file ("a directory", "a character
// device" for /dev/zero, "a FIFO", io/paths.h's names; "a link to nothing" for a
// dangling link; links to regular files are followed), or "". A checkpoint's files
// are read whole and hashed: anything else would fail deep inside the read (exit 1)
// or never end (a device, a FIFO).
std::string not_regular_file(const fs::path& path) {
  struct stat target {}, entry {};
  if (::lstat(path.c_str(), &entry) != 0) return "missing";
  if (::stat(path.c_str(), &target) != 0) return "a link to nothing";
  if (S_ISREG(target.st_mode)) return "";
  const std::string what = file_kind_name(target.st_mode);
  return S_ISLNK(entry.st_mode) ? what + " (through a symbolic link)" : what;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  MT_CHECK(in, "cannot read {}: {}", path.string(), std::strerror(errno));
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Lowercase hex SHA-256 of a file, read in 4 MiB blocks.
std::string sha256_file(const fs::path& path, data::Progress* progress = nullptr) {
  std::ifstream in(path, std::ios::binary);
  MT_CHECK(in, "cannot read {}: {}", path.string(), std::strerror(errno));
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  MT_ASSERT(ctx && EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) == 1, "OpenSSL sha256 init failed");
  std::vector<char> buf(4 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    if (in.gcount() > 0) MT_ASSERT(EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(in.gcount())) == 1,
                                   "OpenSSL sha256 update failed");
    if (progress) progress->update(in.gcount());
  }
  MT_CHECK(in.eof(), "reading {} failed: {}", path.string(), std::strerror(errno));
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  MT_ASSERT(EVP_DigestFinal_ex(ctx.get(), digest, &size) == 1, "OpenSSL sha256 final failed");
  std::string hex;
  for (unsigned int i = 0; i < size; ++i) hex += fmt::format("{:02x}", digest[i]);
  return hex;
}

// Progress of one rank's side of a save or load (rank 0 reports): bytes, rate and
// ETA, as a bar on a terminal or lines in logs; silent for what takes under 2 s.
data::ProgressOptions progress_options(bool report) { return data::ProgressOptions::bytes(report, 2.0); }

// ---------------------------------------------------------------- what a rank holds

bool is_expert(const NamedParameter& p) { return p.group == "experts"; }

int64_t global_experts(const Config& config) {
  return model_family(config).routed_experts(config);
}

// This rank's global expert rows [lo, hi).
std::pair<int64_t, int64_t> expert_range(const Distributed& d, int64_t experts) {
  const int64_t per = experts / d.grid.ep;
  return {d.grid.ep_index * per, (d.grid.ep_index + 1) * per};
}

// A group of optimizer state (its slots, named by the optimizer: optim/optimizer.h).
bool is_state_group(const std::string& group) {
  return group != "params" && group != "buffers" && group != "experts" && group != "zero_range";
}

// The tensors of one group of the file: parameters, buffers or an optimizer slot.
struct Slot {
  std::string group;  // "params", "buffers", or an optimizer slot ("exp_avg", "exp_avg_sq", "momentum", ...)
  const NamedParameter* param;
  Tensor tensor;      // what is saved / loaded into (a sharded optimizer's state: its owned elements)
  size_t index = 0;   // in the parameter (or buffer) list
  bool moment() const { return is_state_group(group); }
};

// buffers: model.buffers(), kept alive by the caller while the slots are used.
// Under mixed precision a bf16 parameter is saved and loaded as its f32 master
// copy (so the file is an f32 checkpoint, whatever train.dtype wrote it).
// The optimizer's slots: one group per slot name, holding the parameters whose
// rule keeps it (a sharded rank that owns none of a parameter: an empty tensor).
std::vector<Slot> slots(const LanguageModel& model, const ParameterList& buffers, const Optimizer* opt) {
  std::vector<Slot> out;
  const ParameterList& params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i)
    out.push_back({"params", &params[i], opt ? opt->master_or_parameter(i) : params[i].tensor, i});
  for (size_t i = 0; i < buffers.size(); ++i) out.push_back({"buffers", &buffers[i], buffers[i].tensor, i});
  if (opt)
    for (const std::string& name : opt->slot_names())
      for (size_t i = 0; i < params.size(); ++i) {
        if (!opt->has_slot(name, i)) continue;
        const Tensor t = opt->slot(name, i);
        MT_ASSERT(t.defined() || (opt->sharded() && opt->owned(i).size() == 0),
                  "checkpoint: the optimizer has no {} tensor for {}, whose rule keeps one", name, params[i].name);
        out.push_back({name, &params[i], t.defined() ? t : empty({0}, DType::f32), i});
      }
  return out;
}

std::string shape_text(const Shape& s) { return fmt::format("{}", s); }

// Elements below zero (NaN is not; the non-finite check names those) of a CPU tensor.
int64_t count_negative(const Tensor& t) {
  const Tensor f = t.dtype() == DType::f32 || t.dtype() == DType::f64 ? t : t.to(DType::f32);
  int64_t n = 0;
  if (f.dtype() == DType::f64) {
    const double* p = f.data<double>();
    for (int64_t i = 0; i < f.numel(); ++i) n += p[i] < 0;
  } else {
    const float* p = f.data<float>();
    for (int64_t i = 0; i < f.numel(); ++i) n += p[i] < 0;
  }
  return n;
}

// ---------------------------------------------------------------- manifest

struct FileInfo {
  std::string name;
  int rank = 0, pp_index = 0, dp_index = 0, ep_index = 0;
  bool replicated = false;
  int64_t expert_begin = 0, expert_end = 0;  // global rows held; empty when equal
  int64_t bytes = 0;
  std::string sha256;
  // Version 2 (train.zero 1): the moments' pieces this file holds, as
  // [begin, end) of each global tensor's flattened elements, by parameter name.
  std::vector<std::tuple<std::string, int64_t, int64_t>> pieces;
};

struct Manifest {
  int64_t version = 0, step = 0, tokens = -1, world = 0, pp = 1, dp = 0, ep = 0, num_experts = 0, zero = 0;
  std::string dtype;  // "" in checkpoints that do not record it
  std::string config_sha256;
  std::string run_id, lineage;  // "" in checkpoints written before lineages
  std::vector<FileInfo> files;
  FileInfo config;  // config.resolved.yaml
};

Manifest read_manifest(const fs::path& dir) {
  const fs::path path = dir / kManifest;
  MT_CHECK(fs::exists(fs::symlink_status(path)), "checkpoint {}: {} is missing (a checkpoint directory has {}, {} "
           "and rank files)", dir.string(), kManifest, kManifest, kCommit);
  if (const std::string what = not_regular_file(path); !what.empty())
    MT_THROW("checkpoint {}: {} is {}, not a file; the checkpoint is damaged: resume from another one (ckpt.resume: "
             "step_...)", dir.string(), path.string(), what);
  Manifest m;
  try {
    const json j = json::parse(read_text(path));
    MT_CHECK(j.is_object(), "expected a JSON object, found {}", j.type_name());
    // Integers as integers: nlohmann would read 1.9 as 1 and -1 as a huge unsigned.
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    auto as_integer = [](const json& v, const std::string& key, int64_t lo, int64_t hi) {
      MT_CHECK(v.is_number_integer(), "field \"{}\" is {}, expected an integer", key, v.dump());
      MT_CHECK(!v.is_number_unsigned() || v.get<uint64_t>() <= static_cast<uint64_t>(kMax),
               "field \"{}\" = {} is outside [{}, {}]", key, v.dump(), lo, hi);
      const int64_t x = v.get<int64_t>();
      MT_CHECK(x >= lo && x <= hi, "field \"{}\" = {} is outside [{}, {}]", key, x, lo, hi);
      return x;
    };
    auto integer = [&](const json& o, const std::string& key, int64_t lo, int64_t hi) {
      return as_integer(o.at(key), key, lo, hi);
    };
    auto optional_integer = [&](const json& o, const std::string& key, int64_t fallback, int64_t lo, int64_t hi) {
      return o.contains(key) ? integer(o, key, lo, hi) : fallback;
    };
    auto text = [](const json& o, const std::string& key) {
      const json& v = o.at(key);
      MT_CHECK(v.is_string(), "field \"{}\" is {}, expected a string", key, v.dump());
      return v.get<std::string>();
    };
    const std::string format = text(j, "format");
    MT_CHECK(format == kFormat, "field \"format\" is '{}', expected '{}'", format, kFormat);
    const json& version = j.at("version");
    MT_CHECK(version.is_number_integer() &&
                 (version == kCheckpointVersion || version == kCheckpointVersionSharded),
             "field \"version\" is {}, not one this build reads ({} or {})", version.dump(), kCheckpointVersion,
             kCheckpointVersionSharded);
    m.version = version.get<int64_t>();
    m.zero = optional_integer(j, "zero", 0, 0, kMax);
    MT_CHECK((m.zero > 0) == (m.version == kCheckpointVersionSharded), "version {} with zero = {}: version {} is "
             "the sharded optimizer's (zero 1)", m.version, m.zero, kCheckpointVersionSharded);
    m.step = integer(j, "step", 0, kMax);
    m.tokens = optional_integer(j, "tokens", -1, 0, kMax);  // -1: not recorded
    m.world = integer(j, "world", 1, 1 << 24);
    m.dp = integer(j, "dp", 1, m.world);
    m.ep = integer(j, "ep", 1, m.world);
    m.pp = optional_integer(j, "pp", 1, 1, m.world);  // checkpoints written before pipeline parallelism: 1
    MT_CHECK(m.pp * m.dp * m.ep == m.world, "pp {} x dp {} x ep {} is not the world of {}", m.pp, m.dp, m.ep,
             m.world);
    m.num_experts = integer(j, "num_experts", 0, kMax);
    m.dtype = j.contains("dtype") ? text(j, "dtype") : std::string();
    m.config_sha256 = text(j, "config_sha256");
    m.run_id = j.value("run_id", std::string());
    m.lineage = j.value("lineage", std::string());
    const int64_t experts = m.num_experts, world = m.world, pp = m.pp, dp = m.dp, ep = m.ep;
    auto file = [&](const json& f, const std::string& where) {
      try {
        MT_CHECK(f.is_object(), "expected an object, found {}", f.dump());
        FileInfo i;
        i.name = text(f, "name");
        i.bytes = integer(f, "bytes", 0, kMax);
        i.sha256 = text(f, "sha256");
        MT_CHECK(i.sha256.size() == 64 && i.sha256.find_first_not_of("0123456789abcdef") == std::string::npos,
                 "field \"sha256\" is '{}', not 64 lowercase hex digits", i.sha256);
        if (f.contains("rank")) {
          i.rank = static_cast<int>(integer(f, "rank", 0, world - 1));
          i.pp_index = static_cast<int>(optional_integer(f, "pp_index", 0, 0, pp - 1));
          i.dp_index = static_cast<int>(integer(f, "dp_index", 0, dp - 1));
          i.ep_index = static_cast<int>(integer(f, "ep_index", 0, ep - 1));
          MT_CHECK(f.at("replicated").is_boolean(), "field \"replicated\" is {}, expected true or false",
                   f.at("replicated").dump());
          i.replicated = f.at("replicated").get<bool>();
          const json& range = f.at("experts");
          MT_CHECK(range.is_array() && range.size() == 2, "field \"experts\" is {}, expected [begin, end)",
                   range.dump());
          i.expert_begin = as_integer(range.at(0), "experts[0]", 0, experts);
          i.expert_end = as_integer(range.at(1), "experts[1]", i.expert_begin, experts);
          if (f.contains("optimizer_pieces"))
            for (const auto& [name, r] : f.at("optimizer_pieces").items()) {
              MT_CHECK(r.is_array() && r.size() == 2, "field \"optimizer_pieces\" of {} is {}, expected [begin, end)",
                       name, r.dump());
              const int64_t b = as_integer(r.at(0), "optimizer_pieces." + name + "[0]", 0, kMax);
              const int64_t e = as_integer(r.at(1), "optimizer_pieces." + name + "[1]", b, kMax);
              i.pieces.emplace_back(name, b, e);
            }
        }
        MT_CHECK(i.name.find('/') == std::string::npos && i.name != "." && i.name != "..", "bad file name '{}'",
                 i.name);
        return i;
      } catch (const Error& e) {
        MT_THROW("{}: {}", where, e.what());
      }
    };
    MT_CHECK(j.at("files").is_array(), "field \"files\" is not an array");
    for (const json& f : j.at("files")) m.files.push_back(file(f, fmt::format("files[{}]", m.files.size())));
    m.config = file(j.at("config"), "config");
    MT_CHECK(static_cast<int64_t>(m.files.size()) == m.world, "lists {} rank files for a world of {}", m.files.size(),
             m.world);
    // Rank r's file is files[r]: a load of the same layout takes its own by index.
    for (size_t r = 0; r < m.files.size(); ++r)
      MT_CHECK(m.files[r].rank == static_cast<int>(r) && m.files[r].name == rank_file(static_cast<int>(r)),
               "files[{}] is {} of rank {}, expected {} of rank {}", r, m.files[r].name, m.files[r].rank,
               rank_file(static_cast<int>(r)), r);
  } catch (const json::exception& e) {
    MT_THROW("checkpoint {}: {} is not a valid manifest: {}", dir.string(), path.string(), e.what());
  } catch (const Error& e) {
    MT_THROW("checkpoint {}: {}: {}", dir.string(), path.string(), e.what());
  }
  return m;
}

json file_json(const FileInfo& f, bool rank_file) {
  json j = {{"name", f.name}, {"bytes", f.bytes}, {"sha256", f.sha256}};
  if (rank_file) {
    j["rank"] = f.rank;
    j["pp_index"] = f.pp_index;
    j["dp_index"] = f.dp_index;
    j["ep_index"] = f.ep_index;
    j["replicated"] = f.replicated;
    j["experts"] = {f.expert_begin, f.expert_end};
    if (!f.pieces.empty()) {
      json pieces = json::object();
      for (const auto& [name, begin, end] : f.pieces) pieces[name] = {begin, end};
      j["optimizer_pieces"] = pieces;
    }
  }
  return j;
}

// ---------------------------------------------------------------- verification

// The first dataset of the file that cannot be read (Fletcher32 mismatch,
// truncation), as " dataset /params/x: <why>", or "".
std::string first_bad_dataset(const fs::path& path) {
  try {
    hdf5::Reader r(path.string());
    for (const std::string& g : r.groups("/"))
      for (const std::string& name : r.datasets(g)) {
        try {
          (void)r.read(g, name);
        } catch (const Error& e) {
          return fmt::format("; dataset /{}/{} fails to read: {}", g, name, e.what());
        }
      }
    return "; every dataset still reads, so the damage is in metadata or padding";
  } catch (const Error& e) {
    return fmt::format("; HDF5 cannot open it: {}", e.what());
  }
}

// Size and SHA-256 against the manifest; throws naming the file (and dataset).
void verify_file(const fs::path& dir, const FileInfo& f, data::Progress* progress = nullptr) {
  const fs::path path = dir / f.name;
  MT_CHECK(fs::exists(fs::symlink_status(path)), "checkpoint {}: {} is missing (listed in {}); the checkpoint is "
           "damaged, resume from another one (ckpt.resume: step_...)", dir.string(), f.name, kManifest);
  if (const std::string what = not_regular_file(path); !what.empty())
    MT_THROW("checkpoint {}: {} (listed in {}) is {}, not a file; the checkpoint is damaged, resume from another one "
             "(ckpt.resume: step_...)", dir.string(), path.string(), kManifest, what);
  const auto bytes = static_cast<int64_t>(fs::file_size(path));
  if (bytes != f.bytes)
    MT_THROW("checkpoint {}: {} has {} bytes, {} says {} (truncated or overwritten){}; the checkpoint is damaged, "
             "resume from another one (ckpt.resume: step_...)", dir.string(), path.string(), bytes, kManifest, f.bytes,
             f.name.ends_with(".h5") ? first_bad_dataset(path) : "");
  const std::string sha = sha256_file(path, progress);
  if (sha != f.sha256)
    MT_THROW("checkpoint {}: {} is corrupt: its SHA-256 {} differs from {} in {}{}; resume from another checkpoint "
             "(ckpt.resume: step_...)", dir.string(), path.string(), sha.substr(0, 16), f.sha256.substr(0, 16),
             kManifest, f.name.ends_with(".h5") ? first_bad_dataset(path) : "");
}

// A step directory name -> step, or -1.
int64_t step_of(const std::string& name) {
  static const std::regex re(R"(step_(\d{8}))");
  std::smatch m;
  return std::regex_match(name, m, re) ? std::stoll(m[1].str()) : -1;
}

// Committed step directories, oldest first.
std::vector<std::pair<int64_t, fs::path>> committed(const fs::path& root, bool log) {
  std::vector<std::pair<int64_t, fs::path>> out;
  if (!fs::is_directory(root)) return out;
  static const std::regex tmp_re(R"(step_\d{8}\.(tmp|old)\..*)");
  for (const fs::directory_entry& e : fs::directory_iterator(root)) {
    if (!e.is_directory()) continue;
    const std::string name = e.path().filename().string();
    const int64_t step = step_of(name);
    if (step >= 0 && fs::exists(e.path() / kCommit)) {
      out.emplace_back(step, e.path());
    } else if (log && (step >= 0 || std::regex_match(name, tmp_re))) {
      spdlog::info("ignoring incomplete checkpoint {} (no COMMIT: a save that did not finish)", e.path().string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The run and lineage a checkpoint's manifest names ("" when it has none: written
// before lineages), or why the manifest cannot be read (then both ""): missing, not
// a regular file, not a JSON object, or fields that contradict the checkpoint
// (format, version, step against the directory's name, run_id and lineage not
// strings). The rest of the manifest is checked when the checkpoint is loaded.
struct ManifestIds {
  std::string run_id, lineage, problem;
};
ManifestIds manifest_ids(const fs::path& dir) {
  const fs::path path = dir / kManifest;
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) return {"", "", fmt::format("{} is missing", path.string())};
  if (const std::string what = not_regular_file(path); !what.empty())
    return {"", "", fmt::format("{} is {}, not a file", path.string(), what)};
  try {
    const json j = json::parse(read_text(path));
    MT_CHECK(j.is_object(), "not a JSON object");
    if (j.contains("format"))
      MT_CHECK(j["format"] == kFormat, "field \"format\" is {}, expected \"{}\"", j["format"].dump(), kFormat);
    if (j.contains("version"))
      MT_CHECK(j["version"].is_number_integer() &&
                   (j["version"] == kCheckpointVersion || j["version"] == kCheckpointVersionSharded),
               "field \"version\" is {}, not one this build reads", j["version"].dump());
    if (j.contains("step"))
      MT_CHECK(j["step"].is_number_integer() && j["step"] == step_of(dir.filename().string()),
               "field \"step\" is {}, the directory's name says {}", j["step"].dump(),
               step_of(dir.filename().string()));
    for (const char* key : {"run_id", "lineage"})
      MT_CHECK(!j.contains(key) || j[key].is_string(), "field \"{}\" is {}, expected a string", key, j[key].dump());
    return {j.value("run_id", std::string()), j.value("lineage", std::string()), ""};
  } catch (const std::exception& e) {
    return {"", "", fmt::format("{}: {}", path.string(), e.what())};
  }
}

void remove_all_logged(const fs::path& p, const char* why) {
  std::error_code ec;
  fs::remove_all(p, ec);
  if (ec) spdlog::warn("could not delete {} ({}): {}", p.string(), why, ec.message());
}

// After a commit: keep the newest keep_last committed checkpoints; delete leftovers of
// saves that did not finish (only this job writes checkpoints into the run).
void purge(const fs::path& root, int64_t keep_last, const fs::path& newest) {
  auto all = committed(root, false);
  const int64_t drop = static_cast<int64_t>(all.size()) - std::max<int64_t>(keep_last, 1);
  for (int64_t i = 0; i < drop; ++i)
    if (all[i].second != newest) {
      spdlog::info("deleting checkpoint {} (ckpt.keep_last = {})", all[i].second.string(), keep_last);
      remove_all_logged(all[i].second, "ckpt.keep_last");
    }
  static const std::regex tmp_re(R"(step_\d{8}\.(tmp|old)\..*)");
  for (const fs::directory_entry& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && std::regex_match(name, tmp_re)) {
      spdlog::info("deleting {} (left by a save that did not finish)", e.path().string());
      remove_all_logged(e.path(), "unfinished save");
    }
  }
}

[[noreturn]] void kill_self(const char* where) {
  spdlog::warn("fault injection (a testing aid): SIGKILL {}", where);
  spdlog::default_logger()->flush();
  std::raise(SIGKILL);
  std::abort();
}

}  // namespace checkpoint_impl

using namespace checkpoint_impl;

std::string checkpoint_name(int64_t step) { return fmt::format("step_{:08d}", step); }

std::string checkpoints_dir(const std::string& run_dir) { return (fs::path(run_dir) / "checkpoints").string(); }

std::string checkpoint_config_path(const std::string& dir) { return (fs::path(dir) / kConfig).string(); }

namespace checkpoint_impl {

// One save in flight: its directories, and this rank's file once written.
struct PendingSave {
  std::string name;  // step_00000030
  fs::path root, tmp;
  int64_t nonce = 0, step = 0, tokens = 0, experts = 0;
  std::string dtype, config_sha256;
  FileInfo mine;
  std::chrono::steady_clock::time_point start;
};

// Collective: rank 0 creates the .tmp directory under a name every rank agrees on.
PendingSave begin_save(Distributed& d, const std::string& run_dir, const LanguageModel& model,
                       const TrainProgress& progress, const Config& config) {
  comm::WatchdogLabel label("checkpoint save");
  PendingSave p;
  p.start = std::chrono::steady_clock::now();
  p.root = checkpoints_dir(run_dir);
  p.name = checkpoint_name(progress.step);
  p.step = progress.step;
  p.tokens = progress.tokens;
  p.experts = global_experts(config);
  p.dtype = fmt::format("{}", model.dtype());
  p.config_sha256 = config.sha256();
  Tensor nonce = zeros({1}, DType::i64);
  if (d.root()) {
    std::error_code ec;
    fs::create_directories(p.root, ec);
    if (ec) throw IoError(fmt::format("cannot create {}: {}", p.root.string(), ec.message()));
    std::random_device rd;
    nonce.data<int64_t>()[0] = static_cast<int64_t>((static_cast<uint64_t>(rd()) << 31) ^ rd() ^ ::getpid()) &
                               0x7fffffffffffffff;
  }
  if (d.size() > 1) d.world->broadcast(nonce, 0);
  p.nonce = nonce.data<int64_t>()[0];
  p.tmp = p.root / fmt::format("{}.tmp.{:x}", p.name, p.nonce);
  if (d.root()) {
    std::error_code ec;
    fs::create_directory(p.tmp, ec);
    if (ec) throw IoError(fmt::format("cannot create {}: {}", p.tmp.string(), ec.message()));
  }
  if (d.size() > 1) d.world->barrier();
  return p;
}

// What this rank writes: attributes and datasets (tensors copied when `copy`, for
// a background write while training goes on).
struct RankFileContent {
  std::vector<std::pair<std::string, int64_t>> ints;
  std::vector<std::pair<std::string, std::string>> strings;
  std::vector<std::tuple<std::string, std::string, Tensor>> datasets;  // group, name, tensor
};

// train.zero 1: the group parameter i is sharded over (the zero group listing it).
comm::Communicator& zero_comm(const Distributed& d, size_t i) {
  for (const comm::ZeroGroup& g : d.zero_groups)
    if (std::find(g.params.begin(), g.params.end(), i) != g.params.end()) return *g.comm;
  MT_THROW("checkpoint: parameter {} is in no train.zero group", i);
}

RankFileContent rank_file_content(const Distributed& d, const LanguageModel& model, const Optimizer& opt,
                                  const TrainProgress& progress, const Config& config, PendingSave& p, bool copy) {
  const auto [lo, hi] = expert_range(d, p.experts);
  // Replicated tensors: the first rank of each pipeline stage (rank 0 at pp = 1)
  // writes its stage's; the last stage's copy of a tied table is not written.
  const bool holds_replicated = d.grid.local_index() == 0, holds_experts = p.experts > 0 && d.grid.dp_index == 0;
  auto tied_copy = [&](const NamedParameter& q) {
    return d.tied_pipeline && d.grid.last_stage() && q.group == "embedding";
  };
  const bool zero = d.zero > 0 && opt.sharded();
  FileInfo& mine = p.mine;
  mine.name = rank_file(d.rank());
  mine.rank = d.rank();
  mine.pp_index = d.grid.pp_index;
  mine.dp_index = d.grid.dp_index;
  mine.ep_index = d.grid.ep_index;
  mine.replicated = holds_replicated;
  mine.pieces.clear();
  if (holds_experts) std::tie(mine.expert_begin, mine.expert_end) = std::pair{lo, hi};
  RankFileContent c;
  c.ints = {{"version", zero ? kCheckpointVersionSharded : kCheckpointVersion}, {"rank", d.rank()},
            {"world", d.size()},             {"pp", d.grid.pp},           {"pp_index", d.grid.pp_index},
            {"dp", d.grid.dp},               {"ep", d.grid.ep},
            {"dp_index", d.grid.dp_index},   {"ep_index", d.grid.ep_index}, {"step", progress.step},
            {"tokens", progress.tokens},     {"skipped", progress.skipped},
            {"consecutive_skips", progress.consecutive_skips},
            {"loader_epoch", static_cast<int64_t>(progress.loader.epoch)},
            {"loader_position", progress.loader.position},
            {"adam_step", opt.steps()},
            {"rng_seed", static_cast<int64_t>(default_generator().seed())},
            {"rng_offset", static_cast<int64_t>(default_generator().offset())},
            {"num_experts", p.experts},      {"expert_begin", mine.expert_begin}, {"expert_end", mine.expert_end}};
  if (zero) c.ints.emplace_back("zero", d.zero);  // zero 0 files stay version 1, as before
  c.strings = {{"format", kFormat}, {"config_sha256", config.sha256()}};
  if (holds_experts) {
    Tensor index = empty({hi - lo}, DType::i64);
    for (int64_t e = lo; e < hi; ++e) index.data<int64_t>()[e - lo] = e;
    c.datasets.emplace_back("experts", "global_index", index);
  }
  // An async save snapshots on the host: a GPU tensor's copy frees no device
  // memory and the writer thread never touches the GPU.
  auto snapshot = [&](const Tensor& t) {
    return !copy ? t : t.is_cpu() ? t.detach().clone() : t.detach().to(kCpu);
  };
  const ParameterList buffers = model.buffers();
  std::set<std::string> recorded;  // parameters whose owned range is in zero_range already
  for (const Slot& s : slots(model, buffers, &opt)) {
    const bool expert = p.experts > 0 && is_expert(*s.param);
    if (zero && s.moment()) {  // this rank's owned elements, flat, where it owns any
      const ElementRange r = opt.owned(s.index);
      if (r.size() == 0) continue;
      const int64_t base = expert ? lo * (s.param->tensor.numel() / (hi - lo)) : 0;  // global flat offset
      c.datasets.emplace_back(s.group, s.param->name, snapshot(s.tensor));
      if (recorded.insert(s.param->name).second) {  // the range once per parameter, with its first slot
        Tensor range = empty({2}, DType::i64);
        range.data<int64_t>()[0] = base + r.begin;
        range.data<int64_t>()[1] = base + r.end;
        c.datasets.emplace_back("zero_range", s.param->name, range);
        mine.pieces.emplace_back(s.param->name, base + r.begin, base + r.end);
      }
      continue;
    }
    Tensor t = s.tensor;
    // Mixed precision at zero 1: the f32 master is sharded too; the file holds it
    // whole (gathered over its replica group, every rank taking part).
    // (The same decision on every rank: a bf16 parameter; a rank owning none of a
    // Muon matrix adds nothing.)
    if (zero && s.group == "params" && s.param->tensor.dtype() == DType::bf16) {
      const Tensor master = opt.master(s.index);
      const Tensor own = master.defined() ? master.detach() : empty({0}, DType::f32);
      t = alias(comm::all_gather_owned(zero_comm(d, s.index), own), s.param->tensor.shape());
    }
    if (expert ? holds_experts : holds_replicated && !tied_copy(*s.param))
      c.datasets.emplace_back(s.group, s.param->name, snapshot(t));
  }
  return c;
}

// This rank's file: written, fsync'd and renamed into the .tmp directory, then its
// size and SHA-256. No collective: runs on the background thread of an async save.
void write_rank_file(PendingSave& p, const RankFileContent& c, CheckpointKillPoint kill_at, bool report) {
  const fs::path file = p.tmp / p.mine.name;
  int64_t total = 0;
  for (const auto& [group, name, tensor] : c.datasets) total += tensor.nbytes();
  data::Progress progress(fmt::format("checkpoint {}: save {}", p.name, p.mine.name), total, progress_options(report));
  {
    hdf5::Writer w(file.string());
    for (const auto& [key, value] : c.ints) w.set_attribute("/", key, value);
    for (const auto& [key, value] : c.strings) w.set_attribute("/", key, value);
    for (const auto& [group, name, tensor] : c.datasets) {
      w.write(group, name, tensor, true);
      progress.update(tensor.nbytes());
    }
    w.commit();
  }
  progress.finish();
  p.mine.bytes = static_cast<int64_t>(fs::file_size(file));
  p.mine.sha256 = sha256_file(file);
  if (kill_at == CheckpointKillPoint::before_commit) kill_self("after writing its rank file, before COMMIT");
}

// Nothing non-finite is ever saved: the first such tensor is named before a byte is written.
void check_finite(const RankFileContent& c, const std::string& name) {
  for (const auto& [group, tensor_name, tensor] : c.datasets)
    if (const int64_t bad = count_non_finite(tensor); bad > 0)
      throw NumericalError(fmt::format("checkpoint {}: refusing to save {}/{} {}: {} of {} values are NaN or "
                                       "infinite; the committed checkpoints are untouched", name, group, tensor_name,
                                       tensor.shape(), bad, tensor.numel()));
}

// Collective: the file descriptions go to rank 0, which writes the manifest and
// COMMIT and renames the directory into place; then a barrier.
SaveResult commit_save(Distributed& d, const PendingSave& p, const Config& config, const SaveOptions& options) {
  comm::WatchdogLabel label("checkpoint save");  // rank 0 commits while the others wait, within dist.timeout_s
  const FileInfo& mine = p.mine;
  std::vector<FileInfo> files{mine};
  if (d.size() > 1) {  // this all-gather is also the barrier after the writes
    Tensor row = zeros({1, 8}, DType::i64);  // bytes, expert range, replicated, SHA-256 as 4 words
    int64_t* r = row.data<int64_t>();
    r[0] = mine.bytes;
    r[1] = mine.expert_begin;
    r[2] = mine.expert_end;
    r[3] = mine.replicated ? 1 : 0;
    for (int i = 0; i < 4; ++i) r[4 + i] = static_cast<int64_t>(std::stoull(mine.sha256.substr(16 * i, 16), nullptr, 16));
    Tensor all = d.world->all_gather(row);
    files.clear();
    for (int k = 0; k < d.size(); ++k) {
      const int64_t* a = all.data<int64_t>() + 8 * k;
      FileInfo f;
      f.name = rank_file(k);
      f.rank = k;
      const int local = k % d.grid.replicas();
      f.pp_index = k / d.grid.replicas();
      f.dp_index = local / d.grid.ep;
      f.ep_index = local % d.grid.ep;
      f.bytes = a[0];
      f.expert_begin = a[1];
      f.expert_end = a[2];
      f.replicated = a[3] != 0;
      for (int i = 0; i < 4; ++i) f.sha256 += fmt::format("{:016x}", static_cast<uint64_t>(a[4 + i]));
      files.push_back(f);
    }
    if (d.zero > 0) {  // each file's optimizer pieces, as JSON text (one i32 per byte)
      json pieces = json::array();
      for (const auto& [name, begin, end] : mine.pieces) pieces.push_back({name, begin, end});
      const std::string text = pieces.dump();
      Tensor bytes = empty({static_cast<int64_t>(text.size())}, DType::i32);
      for (size_t i = 0; i < text.size(); ++i) bytes.data<int32_t>()[i] = static_cast<unsigned char>(text[i]);
      Tensor count = empty({1, 1}, DType::i64);
      count.data<int64_t>()[0] = bytes.numel();
      const Tensor counts = d.world->all_gather(count);
      const Tensor all_bytes = comm::all_gather_owned(*d.world, bytes);
      int64_t at = 0;
      for (int k = 0; k < d.size(); ++k) {
        const int64_t n = counts.data<int64_t>()[k];
        std::string t;
        for (int64_t i = 0; i < n; ++i) t += static_cast<char>(all_bytes.data<int32_t>()[at + i]);
        at += n;
        for (const json& e : json::parse(t))
          files[static_cast<size_t>(k)].pieces.emplace_back(e.at(0).get<std::string>(), e.at(1).get<int64_t>(),
                                                            e.at(2).get<int64_t>());
      }
    }
  }

  const fs::path final_dir = p.root / p.name;
  if (d.root()) {
    config.save((p.tmp / kConfig).string());
    FileInfo cfg;
    cfg.name = kConfig;
    cfg.bytes = static_cast<int64_t>(fs::file_size(p.tmp / kConfig));
    cfg.sha256 = sha256_file(p.tmp / kConfig);
    json files_json = json::array();
    for (const FileInfo& f : files) files_json.push_back(file_json(f, true));
    json manifest = {{"format", kFormat},
                           {"version", d.zero > 0 ? kCheckpointVersionSharded : kCheckpointVersion},
                           {"step", p.step},
                           {"tokens", p.tokens},
                           {"world", d.size()},
                           {"pp", d.grid.pp},
                           {"dp", d.grid.dp},
                           {"ep", d.grid.ep},
                           {"num_experts", p.experts},
                           {"dtype", p.dtype},
                           {"config_sha256", p.config_sha256},
                           {"run_id", options.run_id},
                           {"lineage", options.lineage},
                           {"files", files_json},
                           {"config", file_json(cfg, false)}};
    if (d.zero > 0) manifest["zero"] = d.zero;
    write_file_atomically(p.tmp / kManifest, manifest.dump(2) + "\n", false);
    write_file_atomically(p.tmp / kCommit, p.name + "\n", false);
    fsync_path(p.tmp, true);  // both files' renames, before the directory's own rename
    if (options.kill_at == CheckpointKillPoint::before_rename) kill_self("after COMMIT, before the rename");
    std::error_code ec;
    fs::path old;
    const fs::file_status there = fs::symlink_status(final_dir, ec);
    // Only a committed checkpoint (a real directory with COMMIT) is ever replaced;
    // anything else of that name is not ours to delete.
    if (fs::exists(there) && !(fs::is_directory(there) && fs::exists(final_dir / kCommit, ec)))
      MT_THROW("checkpoint {}: something that is not a committed checkpoint ({}) has that name; this save cannot "
               "replace it: move it out of {} and resume (ckpt.resume: auto)", final_dir.string(),
               fs::is_directory(there) ? "a directory without COMMIT" : fs::is_symlink(there) ? "a link" : "a file",
               p.root.string());
    if (fs::exists(there)) {  // resumed from an older step: this save replaces the later one
      old = p.root / fmt::format("{}.old.{:x}", p.name, p.nonce);
      spdlog::warn("replacing checkpoint {} (saved again at the same step)", final_dir.string());
      fs::rename(final_dir, old, ec);
      if (ec) throw IoError(fmt::format("moving {} aside failed: {}", final_dir.string(), ec.message()));
    }
    fs::rename(p.tmp, final_dir, ec);
    if (ec)
      throw IoError(fmt::format("renaming {} to {} failed: {}", p.tmp.string(), final_dir.string(), ec.message()));
    fsync_path(p.root, true);
    if (!old.empty()) remove_all_logged(old, "replaced");
    if (options.kill_at == CheckpointKillPoint::before_latest) kill_self("after the rename, before `latest`");
    write_file_atomically(p.root / "latest", p.name + "\n");
    purge(p.root, options.keep_last, final_dir);
  }
  if (d.size() > 1) d.world->barrier();  // nobody goes on (or exits) before the commit
  return {final_dir.string(), mine.bytes,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - p.start).count()};
}

}  // namespace checkpoint_impl

SaveResult save_checkpoint(Distributed& d, const std::string& run_dir, const LanguageModel& model, const Optimizer& opt,
                           const TrainProgress& progress, const Config& config, const SaveOptions& options) {
  signals::SaveGuard saving;  // stop signals wait for the save to finish
  PendingSave p = begin_save(d, run_dir, model, progress, config);
  const RankFileContent content = rank_file_content(d, model, opt, progress, config, p, false);
  check_finite(content, p.name);
  write_rank_file(p, content, options.kill_at, d.root());
  if (options.after_rank_file) options.after_rank_file();
  return commit_save(d, p, config, options);
}

// ---------------------------------------------------------------- CheckpointSaver

struct CheckpointSaver::Job {
  signals::SaveGuard saving;  // from the copy to the commit
  PendingSave pending;
  SaveOptions options;
  std::thread thread;
  std::atomic<bool> done{false};
  std::exception_ptr error;
};

CheckpointSaver::CheckpointSaver(Distributed& d, std::string run_dir, const Config& config, bool async)
    : d_(d), run_dir_(std::move(run_dir)), config_(config), async_(async) {}

CheckpointSaver::~CheckpointSaver() {
  if (job_ && job_->thread.joinable()) job_->thread.join();  // an error path: the .tmp directory stays uncommitted
}

std::optional<SaveResult> CheckpointSaver::save(const LanguageModel& model, const Optimizer& opt,
                                                const TrainProgress& progress, const SaveOptions& options) {
  if (!async_) return save_checkpoint(d_, run_dir_, model, opt, progress, config_, options);
  std::optional<SaveResult> previous = finish();
  job_ = std::make_unique<Job>();
  job_->pending = begin_save(d_, run_dir_, model, progress, config_);
  job_->options = options;
  auto content = std::make_shared<RankFileContent>(
      rank_file_content(d_, model, opt, progress, config_, job_->pending, true));
  check_finite(*content, job_->pending.name);
  Job* job = job_.get();
  job->thread = std::thread([job, content] {
    try {
      write_rank_file(job->pending, *content, job->options.kill_at, /*report=*/false);  // beside training: quiet
      if (job->options.after_rank_file) job->options.after_rank_file();
    } catch (...) {
      job->error = std::current_exception();
    }
    job->done = true;
  });
  return previous;
}

std::optional<SaveResult> CheckpointSaver::poll() {
  if (!job_) return std::nullopt;
  comm::WatchdogLabel label("checkpoint save");
  bool all_done = job_->done;
  if (d_.size() > 1) {
    Tensor busy = full({1}, job_->done ? 0 : 1, DType::i32);
    d_.world->all_reduce_sum(busy);
    all_done = busy.data<int32_t>()[0] == 0;
  }
  if (!all_done) return std::nullopt;
  return finish();
}

std::optional<SaveResult> CheckpointSaver::finish() {
  if (!job_) return std::nullopt;
  job_->thread.join();
  std::unique_ptr<Job> job = std::move(job_);
  if (job->error) std::rethrow_exception(job->error);
  return commit_save(d_, job->pending, config_, job->options);
}

std::vector<CommittedCheckpoint> committed_checkpoints(const std::string& run_dir, bool log) {
  std::vector<CommittedCheckpoint> out;
  for (const auto& [step, dir] : committed(checkpoints_dir(run_dir), log)) {
    CommittedCheckpoint c;
    c.step = step;
    c.name = dir.filename().string();
    c.dir = dir.string();
    ManifestIds ids = manifest_ids(dir);
    c.run_id = std::move(ids.run_id);
    c.lineage = std::move(ids.lineage);
    c.manifest_problem = std::move(ids.problem);
    out.push_back(std::move(c));
  }
  return out;
}

// ---------------------------------------------------------------- load
//
// load_checkpoint, in steps: plan (the files this rank reads and the range of
// each tensor it needs, from the manifest alone), verify (size, SHA-256 and the
// files' own records against the manifest), locate (which dataset of which file
// holds each tensor: asked of the files, so only once verified), match (names
// and shapes, every mismatch in one message), copy (the data in, checked) and
// restore (counters, the optimizer's step count, the RNG).

namespace {

// What one rank loads: the files it reads and, per slot, the range it needs.
struct LoadPlan {
  // A range [begin, end) of a tensor's global flattened elements that one dataset of `file` holds.
  struct Piece {
    const FileInfo* file;
    int64_t begin, end;
  };
  // What a slot needs: the range [begin, end) of it.
  struct Need {
    int64_t begin = 0, end = 0;  // of the global flattened tensor
    int64_t row = 0;             // elements per expert row (expert tensors)
    std::vector<Piece> pieces;   // those overlapping [begin, end)
  };
  int64_t experts = 0;           // routed experts per MoE layer (global) of this config, 0 without MoE
  int64_t lo = 0, hi = 0;        // this rank's global expert rows [lo, hi)
  bool ckpt_has_experts = false;
  std::vector<const FileInfo*> replicated_files, expert_files;
  const FileInfo* own = nullptr;  // the counters and RNG: this rank's file, or rank 0's when the layout changed
  std::set<const FileInfo*> needed;
  ParameterList buffers;         // model.buffers(), kept alive for the slots (a move keeps its elements in place)
  std::vector<Slot> slots;
  std::vector<Need> needs;       // one per slot
  bool is_expert_slot(const Slot& s) const { return experts > 0 && is_expert(*s.param); }
};

// The opened files, by manifest entry.
using LoadReaders = std::map<const FileInfo*, std::unique_ptr<hdf5::Reader>>;

LoadPlan plan_checkpoint_load(const Distributed& d, const fs::path& dir, const Manifest& m, const LanguageModel& model,
                              const Optimizer* opt, const Config& config) {
  LoadPlan plan;
  plan.experts = global_experts(config);
  std::tie(plan.lo, plan.hi) = expert_range(d, plan.experts);
  const int64_t lo = plan.lo, hi = plan.hi;
  // The files this rank reads: those with replicated tensors (one per pipeline
  // stage of the saving run: rank 0's at pp = 1), those holding its experts, and
  // (train.zero 1 checkpoints) those holding pieces of the moments it needs.
  for (const FileInfo& f : m.files) {
    if (f.replicated) plan.replicated_files.push_back(&f);
    if (f.expert_end > f.expert_begin && f.expert_begin < hi && f.expert_end > lo) plan.expert_files.push_back(&f);
  }
  MT_CHECK(!plan.replicated_files.empty(), "checkpoint {}: {} names no file with the replicated tensors", dir.string(),
           kManifest);
  const FileInfo* replicated = plan.replicated_files.front();  // rank 0's: the counters when the layout changed
  const bool same_layout = m.world == d.size() && m.ep == d.grid.ep && m.pp == d.grid.pp;
  plan.own = same_layout ? &m.files[static_cast<size_t>(d.rank())] : replicated;

  // Every tensor as pieces: ranges [begin, end) of its global flattened elements,
  // each a dataset of some file. A slot needs the range [begin, end) of it.
  plan.buffers = model.buffers();
  plan.slots = slots(model, plan.buffers, opt);
  plan.ckpt_has_experts = m.num_experts > 0;
  auto range_of = [&](const Slot& s) {
    LoadPlan::Need n;
    const int64_t local = s.param->tensor.numel();
    n.row = plan.is_expert_slot(s) ? local / (hi - lo) : 0;
    const int64_t base = plan.is_expert_slot(s) ? lo * n.row : 0;
    if (s.moment() && opt && opt->sharded()) {  // a train.zero 1 run: its owned elements
      const ElementRange r = opt->owned(s.index);
      std::tie(n.begin, n.end) = std::pair{base + r.begin, base + r.end};
    } else {
      std::tie(n.begin, n.end) = std::pair{base, base + local};
    }
    return n;
  };
  // A zero 1 checkpoint's moment pieces, from the manifest alone (the other
  // tensors' pieces are found in the files: locate_checkpoint_pieces).
  auto moment_pieces = [&](const Slot& s, const LoadPlan::Need& n) {
    std::vector<LoadPlan::Piece> out;
    for (const FileInfo& f : m.files)
      for (const auto& [name, b, e] : f.pieces)
        if (name == s.param->name && b < n.end && e > n.begin) out.push_back({&f, b, e});
    return out;
  };
  for (const Slot& s : plan.slots) {
    LoadPlan::Need n = range_of(s);
    if (s.moment() && m.zero > 0) n.pieces = moment_pieces(s, n);
    plan.needs.push_back(std::move(n));
  }

  plan.needed = {plan.own};
  plan.needed.insert(plan.replicated_files.begin(), plan.replicated_files.end());
  plan.needed.insert(plan.expert_files.begin(), plan.expert_files.end());
  if (m.zero > 0)
    for (const LoadPlan::Need& n : plan.needs)
      for (const LoadPlan::Piece& c : n.pieces) plan.needed.insert(c.file);
  return plan;
}

// Each file's own record of its step and place in the layout must be the manifest's:
// a rank file copied in from another save (with a recomputed manifest) is refused.
void check_checkpoint_file_records(const fs::path& dir, const Manifest& m, const FileInfo& f, const hdf5::Reader& r) {
  auto same = [&](const char* key, int64_t want) {
    const std::optional<int64_t> v = r.attr_int("/", key);
    MT_CHECK(v && *v == want, "checkpoint {}: {} records {} = {}, but {} says {}: the file comes from another "
             "save; resume from another checkpoint (ckpt.resume: step_...)", dir.string(), f.name, key,
             v ? fmt::format("{}", *v) : std::string("nothing"), kManifest, want);
  };
  const std::optional<std::string> format = r.attr_string("/", "format");
  MT_CHECK(format == std::string(kFormat), "checkpoint {}: {} records format = '{}', expected '{}': not a moetrain "
           "checkpoint file; resume from another checkpoint (ckpt.resume: step_...)", dir.string(), f.name,
           format.value_or("nothing"), kFormat);
  same("version", m.version);
  same("step", m.step);
  same("world", m.world);
  if (r.attr_int("/", "pp")) same("pp", m.pp);
  same("dp", m.dp);
  same("ep", m.ep);
  same("num_experts", m.num_experts);
  if (m.tokens >= 0) same("tokens", m.tokens);
  same("rank", f.rank);
  if (r.attr_int("/", "pp_index")) same("pp_index", f.pp_index);
  same("dp_index", f.dp_index);
  same("ep_index", f.ep_index);
  if (m.zero > 0) same("zero", m.zero);
  // The counters this file carries: what a resume continues from.
  auto within = [&](const char* key, int64_t lo, int64_t hi, const std::string& bounds) {
    const std::optional<int64_t> v = r.attr_int("/", key);
    MT_CHECK(v && *v >= lo && *v <= hi, "checkpoint {}: {} records {} = {}, outside {}: the file is damaged or was "
             "edited; resume from another checkpoint (ckpt.resume: step_...)", dir.string(), f.name, key,
             v ? fmt::format("{}", *v) : std::string("nothing"), bounds);
    return *v;
  };
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  within("tokens", 0, kMax, "[0, ...)");
  const int64_t skipped = within("skipped", 0, m.step, fmt::format("[0, step = {}]", m.step));
  within("consecutive_skips", 0, skipped, fmt::format("[0, skipped = {}]", skipped));
  within("loader_epoch", 0, kMax, "[0, ...)");
  within("loader_position", 0, kMax, "[0, ...)");
  within("adam_step", 0, m.step, fmt::format("[0, step = {}]", m.step));
  const std::optional<std::string> sha = r.attr_string("/", "config_sha256");
  MT_CHECK(sha && *sha == m.config_sha256, "checkpoint {}: {} was written under another config (SHA-256 {}...) than "
           "{} records ({}...): the file comes from another save; resume from another checkpoint (ckpt.resume: "
           "step_...)", dir.string(), f.name, sha ? sha->substr(0, 12) : std::string("none"), kManifest,
           m.config_sha256.substr(0, 12));
}

// Size and SHA-256 of every file the plan needs and of the config, then opens them
// and checks each one's records against the manifest.
LoadReaders verify_checkpoint_files(const Distributed& d, const fs::path& dir, const Manifest& m,
                                    const LoadPlan& plan) {
  {
    int64_t total = 0;
    for (const FileInfo* f : plan.needed) total += f->bytes;
    data::Progress check(fmt::format("checkpoint {}: verify SHA-256", dir.filename().string()), total,
                         progress_options(d.root()));
    for (const FileInfo* f : plan.needed) verify_file(dir, *f, &check);
  }
  // The config the run was saved with (what a resume compares against, what export copies).
  if (!m.config.name.empty()) verify_file(dir, m.config);

  LoadReaders readers;
  for (const FileInfo* f : plan.needed) readers[f] = std::make_unique<hdf5::Reader>((dir / f->name).string());
  for (const auto& [f, r] : readers) check_checkpoint_file_records(dir, m, *f, *r);
  return readers;
}

// A replicated tensor's file: the (one) replicated file that holds it.
const FileInfo* replicated_checkpoint_holder(const LoadPlan& plan, const LoadReaders& readers,
                                             const std::string& group, const std::string& name) {
  for (const FileInfo* f : plan.replicated_files)
    if (readers.at(f)->has_dataset(group, name)) return f;
  return nullptr;
}

// The expert files that hold this tensor (under pp, each stage's files hold its own layers').
std::vector<const FileInfo*> expert_checkpoint_holders(const LoadPlan& plan, const LoadReaders& readers,
                                                       const std::string& group, const std::string& name) {
  std::vector<const FileInfo*> out;
  for (const FileInfo* f : plan.expert_files)
    if (readers.at(f)->has_dataset(group, name)) out.push_back(f);
  return out;
}

// The pieces of every tensor but a zero 1 checkpoint's moments (the plan has
// those): the expert files or the replicated file whose dataset holds it.
void locate_checkpoint_pieces(const Manifest& m, LoadPlan& plan, const LoadReaders& readers) {
  for (size_t k = 0; k < plan.slots.size(); ++k) {
    const Slot& s = plan.slots[k];
    LoadPlan::Need& n = plan.needs[k];
    if (s.moment() && m.zero > 0) continue;  // the plan has them
    if (plan.is_expert_slot(s) && plan.ckpt_has_experts) {
      for (const FileInfo* f : expert_checkpoint_holders(plan, readers, s.group, s.param->name))
        if (f->expert_begin * n.row < n.end && f->expert_end * n.row > n.begin)
          n.pieces.push_back({f, f->expert_begin * n.row, f->expert_end * n.row});
    } else if (const FileInfo* f = replicated_checkpoint_holder(plan, readers, s.group, s.param->name)) {
      n.pieces.push_back({f, 0, plan.is_expert_slot(s) ? plan.experts * n.row : s.param->tensor.numel()});
    }
  }
}

// Names and shapes: every mismatch in one message. Shapes are the parameters'
// global ones (a sharded optimizer's flat moments stand for their parameter's).
void match_checkpoint_tensors(const fs::path& dir, const Manifest& m, const LoadPlan& plan, const LoadReaders& readers,
                              const LanguageModel& model, const Optimizer* opt) {
  std::vector<std::string> missing, unexpected, mismatched;
  std::map<std::string, std::set<std::string>> expected;  // group -> names
  for (size_t k = 0; k < plan.slots.size(); ++k) {
    const Slot& s = plan.slots[k];
    expected[s.group].insert(s.param->name);
    const bool expert = plan.is_expert_slot(s);
    std::vector<int64_t> model_dims = s.param->tensor.shape().vec();
    if (expert) model_dims[0] = plan.experts;  // compare global shapes
    const Shape model_shape(model_dims);
    const std::string what = fmt::format("{}/{}", s.group, s.param->name);
    if (s.moment() && m.zero > 0) {  // pieces: their coverage is checked when copied
      if (plan.needs[k].end > plan.needs[k].begin && plan.needs[k].pieces.empty())
        missing.push_back(fmt::format("{} {}", what, shape_text(model_shape)));
      continue;
    }
    if (expert && plan.ckpt_has_experts) {
      const std::vector<const FileInfo*> holders = expert_checkpoint_holders(plan, readers, s.group, s.param->name);
      const hdf5::Reader* r = holders.empty() ? nullptr : readers.at(holders.front()).get();
      if (!r) {
        missing.push_back(fmt::format("{} {}", what, shape_text(model_shape)));
        continue;
      }
      std::vector<int64_t> dims = r->shape(s.group, s.param->name).vec();
      if (!dims.empty()) dims[0] = m.num_experts;
      if (Shape(dims) != model_shape)
        mismatched.push_back(fmt::format("{}: checkpoint {}, model {}", what, shape_text(Shape(dims)),
                                         shape_text(model_shape)));
    } else if (const FileInfo* f = replicated_checkpoint_holder(plan, readers, s.group, s.param->name); !f) {
      missing.push_back(fmt::format("{} {}", what, shape_text(model_shape)));
    } else if (Shape ck = readers.at(f)->shape(s.group, s.param->name); ck != model_shape) {
      mismatched.push_back(fmt::format("{}: checkpoint {}, model {}", what, shape_text(ck), shape_text(model_shape)));
    }
  }
  std::vector<const hdf5::Reader*> listed;
  for (const FileInfo* f : plan.replicated_files) listed.push_back(readers.at(f).get());
  for (const FileInfo* f : plan.expert_files) listed.push_back(readers.at(f).get());
  std::set<std::string> seen;
  for (const hdf5::Reader* r : listed)
    for (const std::string& g : r->groups("/")) {
      if (g == "experts" || g == "zero_range" || (!opt && is_state_group(g)))
        continue;  // optimizer state: not asked for
      if (m.zero > 0 && is_state_group(g)) continue;  // pieces of other ranks' ranges
      for (const std::string& name : r->datasets(g))
        if (!expected[g].count(name) && model.stage_holds(name) && seen.insert(g + "/" + name).second)
          unexpected.push_back(fmt::format("{}/{} {}", g, name, shape_text(r->shape(g, name))));
    }
  if (!missing.empty() || !unexpected.empty() || !mismatched.empty()) {
    std::string msg = fmt::format("checkpoint {} does not match the model of this config ({} tensors missing, {} "
                                  "unexpected, {} with another shape):", dir.string(), missing.size(),
                                  unexpected.size(), mismatched.size());
    for (const auto& s : missing) msg += "\n  missing in the checkpoint: " + s;
    for (const auto& s : unexpected) msg += "\n  not in the model: " + s;
    // A padded vocabulary (docs/model.md#padded-vocabulary) changes the rows of the
    // tables with one row per token id: GPT-2's wte, the hybrid's embedding and head.
    std::vector<std::string> vocab_tables;
    for (const auto& s : mismatched) {
      msg += "\n  shape differs: " + s;
      for (const char* table : {"wte.weight", "model.embed_tokens.weight", "lm_head.weight"})
        if (s.rfind(fmt::format("params/{}:", table), 0) == 0) vocab_tables.emplace_back(table);
    }
    msg += "\nresume with the config the checkpoint was saved with (" + checkpoint_config_path(dir.string()) + ")";
    if (!vocab_tables.empty())
      msg += fmt::format("; model.vocab_pad_multiple sets the rows of {}, so a checkpoint resumes only with the padding "
                         "it was saved with: to change it, export the checkpoint (moetrain export, which writes the "
                         "model.vocab_size real rows) and start a run from the export with model.init_from "
                         "(docs/checkpoints.md)", fmt::join(vocab_tables, " and "));
    throw Error(msg);
  }
}

// Copy the data in: the overlap of each piece with the range each slot needs.
void copy_checkpoint_tensors(const Distributed& d, const fs::path& dir, const Manifest& m, const LoadPlan& plan,
                             const LoadReaders& readers) {
  auto check_dtype = [&](const Tensor& src, const Slot& s, const std::string& file) {
    MT_CHECK(src.dtype() == s.tensor.dtype(), "checkpoint {}: {}/{} in {} is {}, the model's is {} (train.dtype)",
             dir.string(), s.group, s.param->name, file, src.dtype(), s.tensor.dtype());
  };
  int64_t load_total = 0;
  for (const Slot& s : plan.slots) load_total += s.tensor.nbytes();
  data::Progress loading(fmt::format("checkpoint {}: load", dir.filename().string()), load_total,
                         progress_options(d.root()));
  for (size_t k = 0; k < plan.slots.size(); ++k) {
    const Slot& s = plan.slots[k];
    const LoadPlan::Need& n = plan.needs[k];
    MT_ASSERT(s.tensor.is_cpu(), "checkpoint load needs CPU tensors (always contiguous in this project)");
    MT_ASSERT(s.tensor.numel() == n.end - n.begin, "checkpoint load: {}/{} holds {} elements for a range of {}",
              s.group, s.param->name, s.tensor.numel(), n.end - n.begin);
    const int64_t esize = dtype_size(s.tensor.dtype());
    int64_t covered = 0;
    for (const LoadPlan::Piece& c : n.pieces) {
      Tensor src = readers.at(c.file)->read(s.group, s.param->name);
      if (s.group == "params" && !m.dtype.empty())
        MT_CHECK(fmt::format("{}", src.dtype()) == m.dtype, "checkpoint {}: params/{} in {} is {}, but {} records "
                 "dtype = '{}': the files do not match their manifest; resume from another checkpoint (ckpt.resume: "
                 "step_...)", dir.string(), s.param->name, c.file->name, src.dtype(), kManifest, m.dtype);
      check_dtype(src, s, c.file->name);
      if (s.group == "exp_avg_sq")
        if (const int64_t negative = count_negative(src); negative > 0)
          MT_THROW("checkpoint {}: exp_avg_sq/{} in {} holds {} negative values of {} (AdamW's second moments are "
                   "means of squares, never negative): the file is damaged or was edited; resume from another "
                   "checkpoint (ckpt.resume: step_...)", dir.string(), s.param->name, c.file->name, negative,
                   src.numel());
      MT_CHECK(src.numel() == c.end - c.begin, "checkpoint {}: {}/{} in {} has {} elements, {} says it holds [{}, {}) "
               "of the tensor", dir.string(), s.group, s.param->name, c.file->name, src.numel(), kManifest, c.begin,
               c.end);
      const int64_t a = std::max(n.begin, c.begin), b = std::min(n.end, c.end);
      std::memcpy(static_cast<char*>(s.tensor.raw_data()) + (a - n.begin) * esize,
                  static_cast<const char*>(src.raw_data()) + (a - c.begin) * esize,
                  static_cast<size_t>((b - a) * esize));
      covered += b - a;
    }
    // Every element came from some piece (pieces do not overlap: each element has one holder).
    MT_CHECK(covered == n.end - n.begin, "checkpoint {}: its files hold {} of the {} elements [{}, {}) of {}/{} this "
             "rank needs", dir.string(), covered, n.end - n.begin, n.begin, n.end, s.group, s.param->name);
    loading.update(s.tensor.nbytes());
  }
  loading.finish();
  for (const Slot& s : plan.slots)
    if (const int64_t bad = count_non_finite(s.tensor); bad > 0)
      MT_THROW("checkpoint {}: {}/{} {} holds {} NaN or infinite values of {}; it cannot be trained from: resume "
               "from an earlier checkpoint (ckpt.resume: step_...)", dir.string(), s.group, s.param->name,
               s.tensor.shape(), bad, s.tensor.numel());
}

// The counters, the optimizer's step count (and, under mixed precision, its
// rounded parameters) and the RNG, from this rank's file (plan.own).
TrainProgress restore_checkpoint_progress(const fs::path& dir, const LoadPlan& plan, const LoadReaders& readers,
                                          Optimizer* opt) {
  const hdf5::Reader& mine = *readers.at(plan.own);
  auto attr = [&](const char* key) {
    std::optional<int64_t> v = mine.attr_int("/", key);
    MT_CHECK(v, "checkpoint {}: {} has no attribute {}", dir.string(), plan.own->name, key);
    return *v;
  };
  TrainProgress p;
  p.step = attr("step");
  p.tokens = attr("tokens");
  p.skipped = attr("skipped");
  p.consecutive_skips = attr("consecutive_skips");
  p.loader.epoch = static_cast<uint64_t>(attr("loader_epoch"));
  p.loader.position = attr("loader_position");
  if (opt) {
    opt->set_steps(attr("adam_step"));
    opt->round_parameters_from_master();  // mixed precision: bf16 parameters from the loaded masters
  }
  default_generator() = Generator(static_cast<uint64_t>(attr("rng_seed")));
  default_generator().set_offset(static_cast<uint64_t>(attr("rng_offset")));
  return p;
}

}  // namespace

TrainProgress load_checkpoint(Distributed& d, const std::string& dir_text, LanguageModel& model, Optimizer* opt,
                              const Config& config) {
  const fs::path dir(dir_text);
  comm::WatchdogLabel label("checkpoint load");
  MT_CHECK(fs::exists(dir / kCommit), "checkpoint {}: no COMMIT (an unfinished save); it cannot be loaded",
           dir.string());
  const Manifest m = read_manifest(dir);
  MT_CHECK(step_of(dir.filename().string()) < 0 || step_of(dir.filename().string()) == m.step,
           "checkpoint {}: {} says step {}, the directory name another", dir.string(), kManifest, m.step);
  // A resume with another config: the trainer lists the changed keys (Trainer::check_config_changes).

  NoGradGuard no_grad;
  LoadPlan plan = plan_checkpoint_load(d, dir, m, model, opt, config);
  const LoadReaders readers = verify_checkpoint_files(d, dir, m, plan);
  locate_checkpoint_pieces(m, plan, readers);
  match_checkpoint_tensors(dir, m, plan, readers, model, opt);
  copy_checkpoint_tensors(d, dir, m, plan, readers);
  return restore_checkpoint_progress(dir, plan, readers, opt);
}

}  // namespace moetrain
