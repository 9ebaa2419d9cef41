// A small HDF5 reader and writer (HDF5 C API, serial, Debian libhdf5-dev; the only
// file that includes hdf5.h is hdf5.cpp). It moves float tensors and scalar
// attributes between moetrain and tools such as h5py, for `moetrain op`
// (docs/op.md). What it covers, and nothing more:
//   - datasets of f32, f64, i64 (64-bit signed integers: expert indices) or u16
//     (bf16 bit patterns of an export, docs/export.md), any rank (rank 0 included),
//     read into CPU tensors of the same dtype with the dataset's shape; written from
//     f32/f64/i64/u16 tensors;
//   - scalar attributes of groups: float (read as double), integer (int64), string
//     (fixed or variable length, as h5py writes str) and h5py's bool (an enum of
//     int8, read as the integer 0/1); one-element attribute arrays count as scalars;
//   - nested groups addressed by '/'-separated paths ("", "/" and "." are the root;
//     "kda/params" is the group params inside kda).
// Errors throw moetrain::Error naming the file, the group or dataset and what is
// wrong (missing, wrong rank, unsupported dtype), plus HDF5's own innermost message
// where it has one (e.g. "truncated file"). HDF5's automatic error printing is off.
// A Writer failing to write, close, sync or rename throws IoError (exit code 5).
// Writes go to `path.tmp.<pid>`; commit() closes, fsyncs and renames it over `path`,
// so `path` never holds a half-written file; a Writer destroyed without commit()
// removes its temp file.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "core/tensor.h"

namespace moetrain::hdf5 {

using Attribute = std::variant<double, int64_t, std::string>;

// "a/b/", "/a//b" -> "/a/b"; "", ".", "/" -> "/".
std::string normalize_group(const std::string& group);
// "/a/b" + "c" -> "/a/b/c" (root: "/c").
std::string join(const std::string& group, const std::string& name);

class Reader {
 public:
  // Opens read-only; throws naming the path when it is missing, not a regular file
  // (a directory, a FIFO, a device: io/paths.h require_regular_file) or not HDF5.
  explicit Reader(const std::string& path);
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  const std::string& path() const { return path_; }
  bool has_group(const std::string& group) const;
  bool has_dataset(const std::string& group, const std::string& name) const;
  // Names of the datasets (not subgroups) directly in `group`, sorted.
  std::vector<std::string> datasets(const std::string& group) const;
  // Names of the subgroups directly in `group`, sorted.
  std::vector<std::string> groups(const std::string& group) const;
  // A fresh CPU tensor (f32, f64, i64 or u16, as stored). Throws when the group or
  // dataset is missing (listing what the group holds) or the dtype is none of those.
  Tensor read(const std::string& group, const std::string& name) const;
  // The dataset's shape, without reading its data; throws like read().
  Shape shape(const std::string& group, const std::string& name) const;
  // Like read(), and the rank must be `rank`.
  Tensor read(const std::string& group, const std::string& name, int rank) const;

  bool has_attribute(const std::string& group, const std::string& name) const;
  // Names of the group's attributes, sorted.
  std::vector<std::string> attributes(const std::string& group) const;
  // nullopt when absent; throws when present but not a scalar of a supported type.
  std::optional<Attribute> attribute(const std::string& group, const std::string& name) const;
  // Typed access: nullopt when absent; throws naming file, group and attribute when it
  // has another type (an integer is accepted as a double; a double holding an integer
  // value is accepted as an integer; bools are integers 0/1).
  std::optional<double> attr_double(const std::string& group, const std::string& name) const;
  std::optional<int64_t> attr_int(const std::string& group, const std::string& name) const;
  std::optional<std::string> attr_string(const std::string& group, const std::string& name) const;
  std::optional<bool> attr_bool(const std::string& group, const std::string& name) const;

 private:
  std::string where(const std::string& group, const std::string& name = "") const;
  std::string path_;
  int64_t file_ = -1;  // hid_t
};

class Writer {
 public:
  // Creates `path.tmp.<pid>` (path itself is untouched until commit()). Throws Error
  // first when `path` exists and is not a regular file (io/paths.h check_output_file).
  explicit Writer(const std::string& path);
  ~Writer();  // without commit(): closes and removes the temp file
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  const std::string& path() const { return path_; }
  // Creates the group and its parents if needed.
  void create_group(const std::string& group);
  // Writes an f32/f64/i64/u16 tensor (any device; copied to the host) as group/name.
  // Creates the group if needed; the dataset must not exist yet. checksum: stored
  // in chunks of at most 4 MiB with HDF5's Fletcher32 filter, so a reader fails
  // naming this dataset when its bytes change (checkpoints). Rank-0 and empty
  // tensors cannot be chunked and are stored plainly.
  void write(const std::string& group, const std::string& name, const Tensor& t, bool checksum = false);
  // A scalar attribute on the group (created if needed); replaces an existing one.
  void set_attribute(const std::string& group, const std::string& name, const Attribute& value);
  // Closes the file, fsyncs it, renames it over `path` and fsyncs the directory.
  void commit();

 private:
  std::string where(const std::string& group, const std::string& name = "") const;
  int64_t open_group(const std::string& group);  // creates missing levels; caller closes
  std::string path_, tmp_;
  int64_t file_ = -1;
  bool committed_ = false;
};

}  // namespace moetrain::hdf5
