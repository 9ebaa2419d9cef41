// Safetensors reader and writer (the Hugging Face format; see
// shared/ECOSYSTEM_AND_RELIABILITY.md, "Safetensors, exactly"). Used to import and
// export GPT-2 weights.
//
// Layout: bytes 0..7 hold N, the header length (u64 little-endian); bytes 8..8+N a
// UTF-8 JSON object, possibly space-padded at the end; then the data buffer. Each
// header entry is {"dtype":"F32","shape":[...],"data_offsets":[BEGIN,END]}, offsets
// relative to the data buffer, END one past the last byte; "__metadata__" is an
// optional string->string map. Data is little-endian and row-major.
//
// Dtypes: F32 F64 BF16 I32 I64 U16 map to our dtypes one to one. F16 is read only:
// we have no f16 dtype, so read() converts it exactly to f32 (TensorEntry::dtype is
// then f32 while dtype_name stays "F16"). Any other dtype is an error.
//
// The reader checks everything the reference implementation (safetensors/src/tensor.rs)
// checks, plus duplicate JSON keys, which nlohmann-json would otherwise silently
// resolve to the last one. Unknown fields inside an entry are ignored, as there.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace moetrain {

// The header's largest allowed length, as in the reference reader (HeaderTooLarge).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

struct TensorEntry {
  std::string name;
  std::string dtype_name;  // as in the file: "F32", "BF16", "F16", ...
  DType dtype;             // of the tensor read() returns (f32 for "F16")
  Shape shape;
  int64_t begin, end;      // byte range in the data buffer (which starts at file offset 8 + N)

  int64_t nbytes() const { return end - begin; }
};

// An open, fully validated safetensors file. open() reads and checks the header
// only; read() fetches one tensor's bytes with pread, so a GPT-2-sized file is never
// held in memory whole. Copies share the open file descriptor; read() is const and
// safe to call from several threads.
class SafetensorsFile {
 public:
  // Throws moetrain::Error naming the file and the byte offset or the tensor when the
  // file cannot be opened or is not a well-formed safetensors file.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  // In data-buffer order (by BEGIN), which is the writer's order for our files.
  const std::vector<TensorEntry>& entries() const { return entries_; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  // Throws when absent; the message lists a few of the names the file does hold.
  const TensorEntry& entry(const std::string& name) const;
  // A fresh CPU tensor with the entry's shape and dtype (F16 converted to f32).
  Tensor read(const std::string& name) const;
  // "__metadata__" (empty when the file has none).
  std::map<std::string, std::string> metadata() const { return metadata_; }

 private:
  class FileHandle;  // owns the descriptor; shared by copies

  SafetensorsFile() = default;

  std::string path_;
  std::shared_ptr<const FileHandle> file_;
  uint64_t data_start_ = 0;  // 8 + N
  std::vector<TensorEntry> entries_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in entries_
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` (in the given order, data 8-byte aligned by space-padding the
// header) and `metadata` to `path`. Metadata gets "format":"pt" unless it sets
// "format" itself: transformers refuses a file without a valid format. Names must be
// unique and not "__metadata__". Tensors not on the CPU are copied to the host.
//
// The file is written to `path + ".tmp.<pid>"`, fsync'd, renamed over `path`, and the
// directory fsync'd, so `path` never holds a half-written file. On any error before
// the rename the temp file is removed and `path` is left as it was. Bad arguments throw
// Error; a failure of the system (disk full, read-only, permission) IoError with its
// strerror.
// on_written(bytes), when given, is called after each tensor's data is written (progress).
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {},
                       const std::function<void(int64_t)>& on_written = nullptr);

}  // namespace moetrain
