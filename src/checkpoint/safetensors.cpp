// Safetensors reading and writing: header parsing and validation, pread of one
// tensor (F16 converted to f32), and the temp file + fsync + rename writer. Format
// and the list of checks: safetensors.h. "File offset" in messages counts bytes from
// the start of the file, "data offset" from the start of the data buffer (8 + N).
#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <string_view>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "io/paths.h"

namespace moetrain {

// We copy little-endian file bytes straight into tensors.
static_assert(std::endian::native == std::endian::little, "safetensors reading assumes a little-endian host");

namespace {

using nlohmann::json;
using nlohmann::ordered_json;

template <class... Args>
[[noreturn]] void fail(const std::string& path, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format("safetensors file {}: {}", path, fmt::format(format, std::forward<Args>(args)...)));
}

std::string errno_text() { return std::strerror(errno); }

// A name as a JSON string literal: quoted, control characters escaped, so messages
// stay on one line whatever a tensor name holds.
std::string json_quoted(const std::string& s) { return json(s).dump(-1, ' ', false, json::error_handler_t::replace); }

// A JSON value for a message, cut short.
std::string brief(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() <= 40 ? s : s.substr(0, 37) + "...";
}

struct FileDType {
  std::string_view name;  // as in the header
  DType dtype;            // what read() returns
  int64_t size;           // bytes per element in the file
};
constexpr FileDType kFileDTypes[] = {
    {"F32", DType::f32, 4}, {"F64", DType::f64, 8}, {"BF16", DType::bf16, 2}, {"F16", DType::f32, 2},
    {"I32", DType::i32, 4}, {"I64", DType::i64, 8}, {"U16", DType::u16, 2}};
// Safetensors dtypes we do not read, to tell "unsupported" from "not a dtype at all".
constexpr std::string_view kOtherFormatDTypes[] = {"BOOL", "U8",   "I8",      "I16",     "U32",     "U64",
                                                   "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2",
                                                   "C64"};

const FileDType* find_file_dtype(std::string_view name) {
  for (const FileDType& d : kFileDTypes)
    if (d.name == name) return &d;
  return nullptr;
}

std::string_view file_dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u16: return "U16";
  }
  MT_ASSERT(false, "dtype {} has no safetensors name", t);
  return "";
}

// IEEE binary16 -> binary32, exact for every input (NaN payloads kept).
float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);  // normal: rebias
  } else {
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // zero or subnormal: m * 2^-24
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(bits);
}

// Reads exactly n bytes at `offset` or throws; `what` says what was being read.
void pread_all(int fd, void* dst, uint64_t n, uint64_t offset, const std::string& path, const std::string& what) {
  char* p = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < n) {
    ssize_t got = ::pread(fd, p + done, static_cast<size_t>(std::min<uint64_t>(n - done, 1u << 30)),
                          static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail(path, "reading {} at file offset {} failed: {}", what, offset + done, errno_text());
    if (got == 0)
      fail(path, "file ended at byte {} while reading {} (file offsets {}..{}); was it truncated after opening?",
           offset + done, what, offset, offset + n);
    done += static_cast<uint64_t>(got);
  }
}

// A non-negative integer that fits int64, or throws naming `what` ("shape[1]").
int64_t to_index(const json& v, const std::string& path, const std::string& tensor, const std::string& what) {
  if (!v.is_number_integer())
    fail(path, "tensor {}: {} is {}, expected a non-negative integer", tensor, what, brief(v));
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) fail(path, "tensor {}: {} = {} is too large", tensor, what, u);
    return static_cast<int64_t>(u);
  }
  int64_t s = v.get<int64_t>();
  if (s < 0) fail(path, "tensor {}: {} is negative ({})", tensor, what, s);
  return s;
}

const json& field(const json& entry, const char* key, const std::string& path, const std::string& tensor) {
  auto it = entry.find(key);
  if (it == entry.end())
    fail(path, "tensor {}: entry has no \"{}\" field; expected {{\"dtype\", \"shape\", \"data_offsets\"}}", tensor,
         key);
  return *it;
}

TensorEntry parse_entry(const std::string& path, const std::string& name, const json& v) {
  std::string q = json_quoted(name);
  if (!v.is_object())
    fail(path, "tensor {}: entry is {}, expected an object with dtype, shape and data_offsets", q, brief(v));

  const json& dtype = field(v, "dtype", path, q);
  if (!dtype.is_string()) fail(path, "tensor {}: \"dtype\" is {}, expected a string such as \"F32\"", q, brief(dtype));
  const std::string& dtype_name = dtype.get_ref<const std::string&>();
  const FileDType* file_dtype = find_file_dtype(dtype_name);
  if (!file_dtype) {
    bool in_format = std::find(std::begin(kOtherFormatDTypes), std::end(kOtherFormatDTypes), dtype_name) !=
                     std::end(kOtherFormatDTypes);
    fail(path, "tensor {} has dtype {}, {}; moetrain reads F32, F64, BF16, F16, I32, I64 and U16", q,
         json_quoted(dtype_name), in_format ? "a safetensors dtype moetrain does not support" : "which is not a safetensors dtype");
  }

  const json& shape_json = field(v, "shape", path, q);
  if (!shape_json.is_array())
    fail(path, "tensor {}: \"shape\" is {}, expected an array of non-negative integers", q, brief(shape_json));
  if (shape_json.size() > static_cast<size_t>(Shape::kMaxDims))
    fail(path, "tensor {}: shape {} has rank {}; moetrain supports at most {} dims", q, brief(shape_json),
         shape_json.size(), Shape::kMaxDims);
  std::vector<int64_t> dims;
  int64_t numel = 1, nbytes = 0;
  for (size_t i = 0; i < shape_json.size(); ++i) {
    dims.push_back(to_index(shape_json[i], path, q, fmt::format("shape[{}]", i)));
    if (__builtin_mul_overflow(numel, dims.back(), &numel))
      fail(path, "tensor {}: shape {} has more than 2^63 elements", q, brief(shape_json));
  }
  if (__builtin_mul_overflow(numel, file_dtype->size, &nbytes))
    fail(path, "tensor {}: shape {} of {} needs more than 2^63 bytes", q, brief(shape_json), dtype_name);

  const json& offsets = field(v, "data_offsets", path, q);
  if (!offsets.is_array() || offsets.size() != 2)
    fail(path, "tensor {}: \"data_offsets\" is {}, expected [BEGIN, END]", q, brief(offsets));
  int64_t begin = to_index(offsets[0], path, q, "data_offsets[0] (BEGIN)");
  int64_t end = to_index(offsets[1], path, q, "data_offsets[1] (END)");
  if (end < begin) fail(path, "tensor {}: data_offsets [{}, {}] end before they begin", q, begin, end);
  if (end - begin != nbytes)
    fail(path, "tensor {}: data_offsets [{}, {}] span {} bytes, but {} {} needs {} ({} elements of {} bytes)", q,
         begin, end, end - begin, dtype_name, brief(shape_json), nbytes, numel, file_dtype->size);
  return TensorEntry{name, dtype_name, file_dtype->dtype, Shape(dims), begin, end};
}

// Parses the header, rejecting duplicate keys at any depth (nlohmann-json would keep
// the last one silently; a parser callback sees every key as it is read).
// Rejects a duplicate key in any object of the header, naming it (and the object
// it is in). A SAX pass that builds nothing: nlohmann-json's callback parser scans
// the whole parent object each time an object ends, quadratic in the tensor count.
class DuplicateKeys : public nlohmann::json_sax<json> {
 public:
  explicit DuplicateKeys(const std::string& path) : path_(path) {}
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    frames_.emplace_back();
    return true;
  }
  bool key(string_t& key) override {
    if (!frames_.back().keys.insert(key).second) {
      if (frames_.size() == 1)
        fail(path_, "duplicate key {} in the header; every tensor name must be unique", json_quoted(key));
      fail(path_, "duplicate key {} inside {} in the header", json_quoted(key),
           json_quoted(frames_[frames_.size() - 2].key));
    }
    frames_.back().key = key;
    return true;
  }
  bool end_object() override {
    frames_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;  // the DOM parse that follows reports it
  }

 private:
  struct Frame {
    std::set<std::string> keys;
    std::string key;  // the latest key, which names what is being parsed inside
  };
  const std::string& path_;
  std::vector<Frame> frames_;
};

json parse_header(const std::string& path, const std::string& header) {
  DuplicateKeys duplicates(path);
  json::sax_parse(header, &duplicates);
  try {
    return json::parse(header);
  } catch (const json::parse_error& e) {
    std::string_view what = e.what();
    if (auto pos = what.find("] "); pos != std::string_view::npos) what.remove_prefix(pos + 2);  // drop the error id
    uint64_t byte = std::max<uint64_t>(e.byte, 1);  // 1-based in the header
    fail(path, "header is not valid JSON: {} (header byte {}, file offset {})", what, byte, 8 + byte - 1);
  } catch (const json::exception& e) {
    fail(path, "header is not valid JSON: {}", e.what());
  }
}

}  // namespace

class SafetensorsFile::FileHandle {
 public:
  explicit FileHandle(int fd) : fd(fd) {}
  ~FileHandle() { ::close(fd); }
  FileHandle(const FileHandle&) = delete;
  FileHandle& operator=(const FileHandle&) = delete;
  const int fd;
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  // A FIFO would block open(2) for ever and a device never end: refused before the open.
  const int fd = open_regular_file(path, "a safetensors file");
  f.file_ = std::make_shared<const FileHandle>(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail(path, "cannot stat: {}", errno_text());
  uint64_t file_size = static_cast<uint64_t>(st.st_size);

  if (file_size < 8)
    fail(path, "file is {} bytes, shorter than the 8-byte header length at byte 0; not a safetensors file",
         file_size);
  unsigned char length_bytes[8];
  pread_all(fd, length_bytes, 8, 0, path, "the header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | length_bytes[i];
  if (n > kSafetensorsMaxHeaderBytes)
    fail(path, "header length {} (u64 little-endian at byte 0) exceeds the limit of {} bytes; not a safetensors file, "
         "or a corrupt one", n, kSafetensorsMaxHeaderBytes);
  if (n > file_size - 8)
    fail(path, "header length {} (u64 little-endian at byte 0) runs beyond the end of the file: the header would end "
         "at byte {} but the file is {} bytes", n, 8 + n, file_size);
  std::string header(n, '\0');
  pread_all(fd, header.data(), n, 8, path, "the header");

  json doc = parse_header(path, header);
  if (!doc.is_object())
    fail(path, "header (file offsets 8..{}) is a JSON {}, expected an object of tensor entries", 8 + n,
         doc.type_name());
  if (header.front() != '{')
    fail(path, "header must start with '{{' at file offset 8 (the reference reader rejects anything else); found "
         "byte 0x{:02x}", static_cast<unsigned char>(header.front()));

  f.data_start_ = 8 + n;
  for (const auto& [name, value] : doc.items()) {
    if (name == "__metadata__") {
      if (value.is_null()) continue;
      if (!value.is_object()) fail(path, "\"__metadata__\" is {}, expected an object of strings", brief(value));
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string())
          fail(path, "\"__metadata__\" value of {} is {}, expected a string", json_quoted(key), brief(text));
        f.metadata_[key] = text.get<std::string>();
      }
      continue;
    }
    f.entries_.push_back(parse_entry(path, name, value));
  }

  // Readers sort by offsets (JSON key order means nothing); the data must then tile
  // [0, last END) exactly: no holes, no overlaps.
  std::sort(f.entries_.begin(), f.entries_.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  int64_t expected = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry& e : f.entries_) {
    if (e.begin != expected) {
      if (!previous)
        fail(path, "tensor {} starts at data offset {} (file offset {}), leaving a hole: the first tensor must start "
             "at data offset 0", json_quoted(e.name), e.begin, f.data_start_ + e.begin);
      if (e.begin > expected)
        fail(path, "hole of {} bytes at file offset {} between tensor {} (data_offsets [{}, {}]) and tensor {} "
             "(data_offsets [{}, {}]); tensor data must be contiguous", e.begin - expected, f.data_start_ + expected,
             json_quoted(previous->name), previous->begin, previous->end, json_quoted(e.name), e.begin, e.end);
      fail(path, "tensor {} (data_offsets [{}, {}]) overlaps tensor {} (data_offsets [{}, {}]) at file offset {}",
           json_quoted(e.name), e.begin, e.end, json_quoted(previous->name), previous->begin, previous->end,
           f.data_start_ + e.begin);
    }
    expected = e.end;
    previous = &e;
  }
  uint64_t data_end = f.data_start_ + static_cast<uint64_t>(expected);  // < 2^64: N <= 1e8, END < 2^63
  if (data_end < file_size)
    fail(path, "{} trailing bytes: the {} ends at file offset {} but the file is {} bytes", file_size - data_end,
         previous ? "last tensor's data" : "header (there are no tensors)", data_end, file_size);
  if (data_end > file_size)
    fail(path, "data buffer truncated: tensor {} ends at file offset {} but the file is only {} bytes",
         json_quoted(previous->name), data_end, file_size);

  for (size_t i = 0; i < f.entries_.size(); ++i) f.index_.emplace(f.entries_[i].name, i);
  return f;
}

const TensorEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = index_.find(name);
  if (it != index_.end()) return entries_[it->second];
  if (entries_.empty()) fail(path_, "no tensor {}: the file holds no tensors", json_quoted(name));
  // Suggest the names sharing the longest prefix with the one asked for.
  std::vector<std::pair<size_t, size_t>> ranked;  // (-common prefix, position)
  for (size_t i = 0; i < entries_.size(); ++i) {
    const std::string& other = entries_[i].name;
    auto [a, b] = std::mismatch(name.begin(), name.end(), other.begin(), other.end());
    ranked.emplace_back(SIZE_MAX - static_cast<size_t>(a - name.begin()), i);
  }
  size_t shown = std::min<size_t>(5, ranked.size());
  std::partial_sort(ranked.begin(), ranked.begin() + static_cast<ptrdiff_t>(shown), ranked.end());
  std::vector<std::string> names;
  for (size_t i = 0; i < shown; ++i) names.push_back(json_quoted(entries_[ranked[i].second].name));
  fail(path_, "no tensor {}; the file holds {} tensors, e.g. {}{}", json_quoted(name), entries_.size(),
       fmt::join(names, ", "), shown < entries_.size() ? ", ..." : "");
}

Tensor SafetensorsFile::read(const std::string& name) const {
  const TensorEntry& e = entry(name);
  Tensor t = empty(e.shape, e.dtype);
  if (e.nbytes() == 0) return t;
  uint64_t offset = data_start_ + static_cast<uint64_t>(e.begin);
  std::string what = fmt::format("tensor {}", json_quoted(e.name));
  if (e.dtype_name == "F16") {
    std::vector<uint16_t> half(static_cast<size_t>(t.numel()));
    pread_all(file_->fd, half.data(), static_cast<uint64_t>(e.nbytes()), offset, path_, what);
    float* out = t.data<float>();
    for (size_t i = 0; i < half.size(); ++i) out[i] = half_to_float(half[i]);
  } else {
    pread_all(file_->fd, t.raw_data(), static_cast<uint64_t>(e.nbytes()), offset, path_, what);
  }
  return t;
}

namespace {

template <class... Args>
[[noreturn]] void fail_write(const std::string& path, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format("writing safetensors file {}: {}", path, fmt::format(format, std::forward<Args>(args)...)));
}

// A failure of the system (disk full, read-only, permission, quota): IoError, exit 5.
template <class... Args>
[[noreturn]] void fail_io(const std::string& path, fmt::format_string<Args...> format, Args&&... args) {
  throw IoError(fmt::format("writing safetensors file {}: {}", path, fmt::format(format, std::forward<Args>(args)...)));
}

// The temp file until it is renamed: closed and removed on every early exit.
struct TempFile {
  std::string path;
  int fd = -1;
  bool remove = false;  // set once created, cleared once renamed
  ~TempFile() {
    if (fd >= 0) ::close(fd);
    if (remove) ::unlink(path.c_str());
  }
};

void write_all(const TempFile& tmp, const void* src, uint64_t n, const std::string& path) {
  const char* p = static_cast<const char*>(src);
  while (n > 0) {
    ssize_t put = ::write(tmp.fd, p, static_cast<size_t>(std::min<uint64_t>(n, 1u << 30)));
    if (put < 0 && errno == EINTR) continue;
    if (put < 0) fail_io(path, "writing {} failed: {}", tmp.path, errno_text());
    p += put;
    n -= static_cast<uint64_t>(put);
  }
}

void check_utf8(const std::string& text, const std::string& path, const char* what) {
  try {
    (void)json(text).dump();
  } catch (const json::type_error&) {
    fail_write(path, "{} {} is not valid UTF-8, which JSON headers require", what, json_quoted(text));
  }
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata,
                       const std::function<void(int64_t)>& on_written) {
  // Header first: every check happens before a file is created.
  ordered_json meta = ordered_json::object();
  if (!metadata.count("format")) meta["format"] = "pt";
  for (const auto& [key, value] : metadata) {
    check_utf8(key, path, "metadata key");
    check_utf8(value, path, "metadata value");
    meta[key] = value;
  }
  // The header object is assembled entry by entry: an ordered_json object finds
  // keys by linear search, quadratic in the tensor count (a 93-layer model with
  // 896 experts per layer has 247k tensors).
  std::string text = "{\"__metadata__\":" + meta.dump();

  std::vector<Tensor> host;
  std::unordered_set<std::string> seen;
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") fail_write(path, "\"__metadata__\" is reserved and cannot name a tensor");
    check_utf8(name, path, "tensor name");
    if (!seen.insert(name).second) fail_write(path, "tensor name {} appears twice; names must be unique", json_quoted(name));
    if (!t.defined()) fail_write(path, "tensor {} is undefined", json_quoted(name));
    Tensor h = t.is_cpu() ? t : t.detach().to(kCpu);
    ordered_json entry = ordered_json::object();
    entry["dtype"] = file_dtype_name(h.dtype());
    entry["shape"] = ordered_json::array();
    for (int64_t d : h.shape().dims()) entry["shape"].push_back(d);
    entry["data_offsets"] = ordered_json::array({offset, offset + h.nbytes()});
    text += ',' + json(name).dump() + ':' + entry.dump();
    offset += h.nbytes();
    host.push_back(std::move(h));
  }
  text += '}';
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts at 8 + N: a multiple of 8
  if (text.size() > kSafetensorsMaxHeaderBytes)
    fail_write(path, "the header would be {} bytes, over the {}-byte limit readers accept", text.size(),
               kSafetensorsMaxHeaderBytes);

  TempFile tmp{fmt::format("{}.tmp.{}", path, ::getpid())};
  tmp.fd = ::open(tmp.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (tmp.fd < 0) fail_io(path, "cannot create {}: {}", tmp.path, errno_text());
  tmp.remove = true;
  uint64_t n = text.size();  // little-endian in memory, as the file wants it
  write_all(tmp, &n, 8, path);
  write_all(tmp, text.data(), text.size(), path);
  for (const Tensor& h : host) {
    write_all(tmp, h.raw_data(), static_cast<uint64_t>(h.nbytes()), path);
    if (on_written) on_written(h.nbytes());
  }
  if (::fsync(tmp.fd) != 0) fail_io(path, "fsync of {} failed: {}", tmp.path, errno_text());
  int fd = tmp.fd;
  tmp.fd = -1;
  if (::close(fd) != 0) fail_io(path, "closing {} failed: {}", tmp.path, errno_text());
  if (::rename(tmp.path.c_str(), path.c_str()) != 0)
    fail_io(path, "renaming {} over it failed: {}", tmp.path, errno_text());
  tmp.remove = false;

  // Make the rename itself durable. The file at `path` is complete either way.
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) fail_io(path, "written, but opening directory {} to fsync it failed: {}", dir.string(), errno_text());
  int rc = ::fsync(dir_fd);
  int fsync_errno = errno;
  ::close(dir_fd);
  if (rc != 0 && fsync_errno != EINVAL)  // EINVAL: the file system cannot sync directories
    fail_io(path, "written, but fsync of directory {} failed: {}", dir.string(), std::strerror(fsync_errno));
}

}  // namespace moetrain
