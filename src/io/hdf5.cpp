// HDF5 reading and writing through the C API (see hdf5.h for what is covered).
// Only version-independent calls are used (H5Gget_info + H5Lget_name_by_idx to
// list, H5Oopen + H5Iget_type to classify; the *2 error calls by name), so the
// code builds against the 1.8-default API Debian configures and against newer HDF5.
#include "io/hdf5.h"

#include <fcntl.h>
#include <unistd.h>

#include <hdf5.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "io/paths.h"

namespace moetrain::hdf5 {

namespace {

void init_library() {
  static std::once_flag once;
  std::call_once(once, [] {
    // No library shutdown at exit: after a failed close (disk full) HDF5 1.10 keeps
    // the file in its tables and crashes closing it again from its atexit handler,
    // turning exit code 5 into a segfault. Every object is closed explicitly anyway.
    H5dont_atexit();
    H5open();
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // we report errors ourselves
  });
}

// The innermost description on HDF5's error stack (e.g. "truncated file: eof = ..."), then clears it.
std::string library_error() {
  std::string text;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* e, void* data) -> herr_t {
        auto* s = static_cast<std::string*>(data);
        if (s->empty() && e->desc) *s = e->desc;
        return 0;
      },
      &text);
  H5Eclear2(H5E_DEFAULT);
  std::replace(text.begin(), text.end(), '\n', ' ');  // one line (write errors embed a ctime() stamp)
  return text.empty() ? std::string() : " (HDF5: " + text + ")";
}

// An owned HDF5 identifier, closed with the matching H5?close.
class Id {
 public:
  Id() = default;
  Id(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~Id() { reset(); }
  Id(Id&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  Id& operator=(Id&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_;
      close_ = o.close_;
      o.id_ = -1;
    }
    return *this;
  }
  Id(const Id&) = delete;
  Id& operator=(const Id&) = delete;
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  void reset() {
    if (id_ >= 0 && close_) close_(id_);
    id_ = -1;
  }

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

std::vector<std::string> split_path(const std::string& group) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : group) {
    if (c == '/') {
      if (!cur.empty() && cur != ".") parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty() && cur != ".") parts.push_back(cur);
  return parts;
}

// The type of the object at `path` (H5I_GROUP, H5I_DATASET, ...) or H5I_BADID when
// there is none. Checks each level, since H5Lexists fails on a missing intermediate.
H5I_type_t object_type(hid_t file, const std::string& path) {
  std::vector<std::string> parts = split_path(path);
  if (parts.empty()) return H5I_GROUP;
  std::string prefix;
  for (const std::string& p : parts) {
    prefix += "/" + p;
    htri_t e = H5Lexists(file, prefix.c_str(), H5P_DEFAULT);
    if (e <= 0) {
      H5Eclear2(H5E_DEFAULT);
      return H5I_BADID;
    }
  }
  Id obj(H5Oopen(file, prefix.c_str(), H5P_DEFAULT), H5Oclose);
  if (!obj.valid()) {
    H5Eclear2(H5E_DEFAULT);
    return H5I_BADID;  // e.g. a dangling soft link
  }
  return H5Iget_type(obj.get());
}

// Children of a group with their types.
std::vector<std::pair<std::string, H5I_type_t>> children(hid_t file, const std::string& group) {
  std::vector<std::pair<std::string, H5I_type_t>> out;
  Id g(H5Gopen2(file, normalize_group(group).c_str(), H5P_DEFAULT), H5Gclose);
  if (!g.valid()) {
    H5Eclear2(H5E_DEFAULT);
    return out;
  }
  H5G_info_t info;
  if (H5Gget_info(g.get(), &info) < 0) {
    H5Eclear2(H5E_DEFAULT);
    return out;
  }
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    ssize_t n = H5Lget_name_by_idx(g.get(), ".", H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT);
    if (n < 0) continue;
    std::string name(static_cast<size_t>(n) + 1, '\0');
    H5Lget_name_by_idx(g.get(), ".", H5_INDEX_NAME, H5_ITER_INC, i, name.data(), name.size(), H5P_DEFAULT);
    name.resize(static_cast<size_t>(n));
    out.emplace_back(name, object_type(file, join(group, name)));
  }
  H5Eclear2(H5E_DEFAULT);
  return out;
}

// "int32", "uint8", "f16", "string", "compound", ... for messages.
std::string type_text(hid_t type) {
  size_t size = H5Tget_size(type);
  switch (H5Tget_class(type)) {
    case H5T_INTEGER: return fmt::format("{}int{}", H5Tget_sign(type) == H5T_SGN_NONE ? "u" : "", 8 * size);
    case H5T_FLOAT: return fmt::format("f{}", 8 * size);
    case H5T_STRING: return "string";
    case H5T_ENUM: return "enum (bool?)";
    case H5T_COMPOUND: return "compound (complex?)";
    case H5T_ARRAY: return "array";
    case H5T_VLEN: return "variable-length sequence";
    case H5T_OPAQUE: return "opaque";
    case H5T_REFERENCE: return "reference";
    case H5T_BITFIELD: return "bitfield";
    default: return "unknown";
  }
}

std::string list_text(const std::vector<std::string>& names) {
  if (names.empty()) return "nothing";
  std::string s;
  for (size_t i = 0; i < names.size() && i < 24; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > 24) s += fmt::format(", ... ({} in all)", names.size());
  return s;
}

// False when the path cannot be opened or fsync fails.
bool fsync_path(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags);
  if (fd < 0) return false;
  const bool ok = ::fsync(fd) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

std::string normalize_group(const std::string& group) {
  std::string out;
  for (const std::string& p : split_path(group)) out += "/" + p;
  return out.empty() ? "/" : out;
}

std::string join(const std::string& group, const std::string& name) {
  std::string g = normalize_group(group);
  return g == "/" ? "/" + name : g + "/" + name;
}

// ---------------------------------------------------------------- Reader

Reader::Reader(const std::string& path) : path_(path) {
  init_library();
  std::error_code ec;  // exists() without it throws for a parent without permission: exit 1, not 2
  MT_CHECK(std::filesystem::exists(path, ec) || ec, "HDF5 file {}: no such file", path);
  require_regular_file(path, "an HDF5 file");  // HDF5 would block on a FIFO, read a device for ever
  htri_t is = H5Fis_hdf5(path.c_str());
  if (is <= 0) {
    std::string why = library_error();
    MT_THROW("HDF5 file {}: not an HDF5 file{}", path, why);
  }
  file_ = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (file_ < 0) {
    std::string why = library_error();
    MT_THROW("HDF5 file {}: cannot open{}; on a network file system try HDF5_USE_FILE_LOCKING=FALSE", path, why);
  }
}

Reader::~Reader() {
  if (file_ >= 0) H5Fclose(file_);
}

std::string Reader::where(const std::string& group, const std::string& name) const {
  return name.empty() ? fmt::format("HDF5 file {}: group {}", path_, normalize_group(group))
                      : fmt::format("HDF5 file {}: {}", path_, join(group, name));
}

bool Reader::has_group(const std::string& group) const { return object_type(file_, group) == H5I_GROUP; }

bool Reader::has_dataset(const std::string& group, const std::string& name) const {
  return object_type(file_, join(group, name)) == H5I_DATASET;
}

std::vector<std::string> Reader::datasets(const std::string& group) const {
  std::vector<std::string> names;
  for (const auto& [n, t] : children(file_, group))
    if (t == H5I_DATASET) names.push_back(n);
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> Reader::groups(const std::string& group) const {
  std::vector<std::string> names;
  for (const auto& [n, t] : children(file_, group))
    if (t == H5I_GROUP) names.push_back(n);
  std::sort(names.begin(), names.end());
  return names;
}

Tensor Reader::read(const std::string& group, const std::string& name) const {
  if (!has_group(group))
    MT_THROW("HDF5 file {}: no group {} (the root holds groups: {})", path_, normalize_group(group),
             list_text(groups("/")));
  H5I_type_t type = object_type(file_, join(group, name));
  if (type != H5I_DATASET) {
    if (type == H5I_GROUP) MT_THROW("{} is a group, expected a dataset", where(group, name));
    MT_THROW("{}: missing dataset {} (the group holds datasets: {})", where(group), name, list_text(datasets(group)));
  }
  Id ds(H5Dopen2(file_, join(group, name).c_str(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) MT_THROW("{}: cannot open the dataset{}", where(group, name), library_error());
  Id ft(H5Dget_type(ds.get()), H5Tclose);
  DType dtype;
  hid_t mem;
  if (H5Tget_class(ft.get()) == H5T_FLOAT && H5Tget_size(ft.get()) == 4) {
    dtype = DType::f32;
    mem = H5T_NATIVE_FLOAT;
  } else if (H5Tget_class(ft.get()) == H5T_FLOAT && H5Tget_size(ft.get()) == 8) {
    dtype = DType::f64;
    mem = H5T_NATIVE_DOUBLE;
  } else if (H5Tget_class(ft.get()) == H5T_INTEGER && H5Tget_size(ft.get()) == 8 &&
             H5Tget_sign(ft.get()) == H5T_SGN_2) {
    dtype = DType::i64;
    mem = H5T_NATIVE_INT64;
  } else if (H5Tget_class(ft.get()) == H5T_INTEGER && H5Tget_size(ft.get()) == 2 &&
             H5Tget_sign(ft.get()) == H5T_SGN_NONE) {
    dtype = DType::u16;
    mem = H5T_NATIVE_UINT16;
  } else {
    MT_THROW("{} has dtype {}; expected f32, f64, i64 or uint16 (convert it, e.g. h5py: f.create_dataset(name, "
             "data=x.astype('float64')))",
             where(group, name), type_text(ft.get()));
  }
  Id space(H5Dget_space(ds.get()), H5Sclose);
  H5S_class_t cls = H5Sget_simple_extent_type(space.get());
  MT_CHECK(cls == H5S_SCALAR || cls == H5S_SIMPLE, "{} has no dataspace (an empty/null dataset); expected an array",
           where(group, name));
  int rank = H5Sget_simple_extent_ndims(space.get());
  std::vector<hsize_t> dims(static_cast<size_t>(std::max(rank, 0)));
  if (rank > 0) H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  std::vector<int64_t> shape(dims.begin(), dims.end());
  Tensor t = empty(Shape(shape), dtype);
  if (t.numel() > 0 && H5Dread(ds.get(), mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw_data()) < 0)
    MT_THROW("{}: reading the data failed{}", where(group, name), library_error());
  return t;
}

Shape Reader::shape(const std::string& group, const std::string& name) const {
  if (object_type(file_, join(group, name)) != H5I_DATASET) return read(group, name).shape();  // throws, naming it
  Id ds(H5Dopen2(file_, join(group, name).c_str(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) MT_THROW("{}: cannot open the dataset{}", where(group, name), library_error());
  Id space(H5Dget_space(ds.get()), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space.get());
  MT_CHECK(rank >= 0, "{}: cannot read the shape{}", where(group, name), library_error());
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  if (rank > 0) H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  return Shape(std::vector<int64_t>(dims.begin(), dims.end()));
}

Tensor Reader::read(const std::string& group, const std::string& name, int rank) const {
  Tensor t = read(group, name);
  MT_CHECK(t.dim() == rank, "{} has rank {} (shape {}); expected rank {}", where(group, name), t.dim(), t.shape(),
           rank);
  return t;
}

bool Reader::has_attribute(const std::string& group, const std::string& name) const {
  if (!has_group(group)) return false;
  htri_t e = H5Aexists_by_name(file_, normalize_group(group).c_str(), name.c_str(), H5P_DEFAULT);
  if (e < 0) H5Eclear2(H5E_DEFAULT);
  return e > 0;
}

std::vector<std::string> Reader::attributes(const std::string& group) const {
  std::vector<std::string> names;
  if (!has_group(group)) return names;
  Id g(H5Gopen2(file_, normalize_group(group).c_str(), H5P_DEFAULT), H5Gclose);
  if (!g.valid()) {
    H5Eclear2(H5E_DEFAULT);
    return names;
  }
  H5Aiterate2(
      g.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr,
      [](hid_t, const char* name, const H5A_info_t*, void* data) -> herr_t {
        static_cast<std::vector<std::string>*>(data)->push_back(name);
        return 0;
      },
      &names);
  H5Eclear2(H5E_DEFAULT);
  std::sort(names.begin(), names.end());
  return names;
}

std::optional<Attribute> Reader::attribute(const std::string& group, const std::string& name) const {
  if (!has_attribute(group, name)) return std::nullopt;
  const std::string at = fmt::format("HDF5 file {}: attribute {} of group {}", path_, name, normalize_group(group));
  Id a(H5Aopen_by_name(file_, normalize_group(group).c_str(), name.c_str(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!a.valid()) MT_THROW("{}: cannot open{}", at, library_error());
  Id space(H5Aget_space(a.get()), H5Sclose);
  hssize_t n = H5Sget_simple_extent_npoints(space.get());
  MT_CHECK(n == 1, "{} holds {} values; expected a scalar", at, n);
  Id ft(H5Aget_type(a.get()), H5Tclose);
  switch (H5Tget_class(ft.get())) {
    case H5T_FLOAT: {
      double v = 0;
      if (H5Aread(a.get(), H5T_NATIVE_DOUBLE, &v) < 0) MT_THROW("{}: read failed{}", at, library_error());
      return Attribute(v);
    }
    case H5T_INTEGER: {
      int64_t v = 0;
      if (H5Aread(a.get(), H5T_NATIVE_INT64, &v) < 0) MT_THROW("{}: read failed{}", at, library_error());
      return Attribute(v);
    }
    case H5T_ENUM: {  // h5py's bool: enum {FALSE = 0, TRUE = 1} over int8
      Id base(H5Tget_super(ft.get()), H5Tclose);
      Id mem(H5Tget_native_type(ft.get(), H5T_DIR_ASCEND), H5Tclose);
      size_t size = H5Tget_size(mem.get());
      MT_CHECK(size <= 8 && H5Tget_class(base.get()) == H5T_INTEGER, "{} is an enum of {}; expected a bool", at,
               type_text(base.get()));
      unsigned char buf[8] = {};
      if (H5Aread(a.get(), mem.get(), buf) < 0) MT_THROW("{}: read failed{}", at, library_error());
      int64_t v = 0;
      bool is_signed = H5Tget_sign(base.get()) != H5T_SGN_NONE;
      switch (size) {
        case 1: { int8_t x; std::memcpy(&x, buf, 1); v = is_signed ? x : static_cast<uint8_t>(x); break; }
        case 2: { int16_t x; std::memcpy(&x, buf, 2); v = is_signed ? x : static_cast<uint16_t>(x); break; }
        case 4: { int32_t x; std::memcpy(&x, buf, 4); v = is_signed ? x : static_cast<uint32_t>(x); break; }
        default: std::memcpy(&v, buf, 8);
      }
      return Attribute(v);
    }
    case H5T_STRING: {
      if (H5Tis_variable_str(ft.get()) > 0) {
        Id mem(H5Tcopy(H5T_C_S1), H5Tclose);
        H5Tset_size(mem.get(), H5T_VARIABLE);
        H5Tset_cset(mem.get(), H5Tget_cset(ft.get()));
        char* s = nullptr;
        if (H5Aread(a.get(), mem.get(), &s) < 0) MT_THROW("{}: read failed{}", at, library_error());
        std::string v = s ? s : "";
        H5free_memory(s);
        return Attribute(v);
      }
      size_t size = H5Tget_size(ft.get());
      Id mem(H5Tcopy(H5T_C_S1), H5Tclose);
      H5Tset_size(mem.get(), size);
      H5Tset_strpad(mem.get(), H5T_STR_NULLPAD);
      H5Tset_cset(mem.get(), H5Tget_cset(ft.get()));
      std::string v(size, '\0');
      if (H5Aread(a.get(), mem.get(), v.data()) < 0) MT_THROW("{}: read failed{}", at, library_error());
      v.resize(std::strlen(v.c_str()));
      return Attribute(v);
    }
    default:
      MT_THROW("{} has type {}; expected a number, a bool or a string", at, type_text(ft.get()));
  }
}

std::optional<double> Reader::attr_double(const std::string& group, const std::string& name) const {
  std::optional<Attribute> a = attribute(group, name);
  if (!a) return std::nullopt;
  if (const double* d = std::get_if<double>(&*a)) return *d;
  if (const int64_t* i = std::get_if<int64_t>(&*a)) return static_cast<double>(*i);
  MT_THROW("HDF5 file {}: attribute {} of group {} is the string \"{}\"; expected a number", path_, name,
           normalize_group(group), std::get<std::string>(*a));
}

std::optional<int64_t> Reader::attr_int(const std::string& group, const std::string& name) const {
  std::optional<Attribute> a = attribute(group, name);
  if (!a) return std::nullopt;
  if (const int64_t* i = std::get_if<int64_t>(&*a)) return *i;
  if (const double* d = std::get_if<double>(&*a)) {
    MT_CHECK(*d == static_cast<double>(static_cast<int64_t>(*d)),
             "HDF5 file {}: attribute {} of group {} is {}; expected an integer", path_, name, normalize_group(group),
             *d);
    return static_cast<int64_t>(*d);
  }
  MT_THROW("HDF5 file {}: attribute {} of group {} is the string \"{}\"; expected an integer", path_, name,
           normalize_group(group), std::get<std::string>(*a));
}

std::optional<std::string> Reader::attr_string(const std::string& group, const std::string& name) const {
  std::optional<Attribute> a = attribute(group, name);
  if (!a) return std::nullopt;
  if (const std::string* s = std::get_if<std::string>(&*a)) return *s;
  MT_THROW("HDF5 file {}: attribute {} of group {} is a number; expected a string", path_, name,
           normalize_group(group));
}

std::optional<bool> Reader::attr_bool(const std::string& group, const std::string& name) const {
  std::optional<Attribute> a = attribute(group, name);
  if (!a) return std::nullopt;
  if (const int64_t* i = std::get_if<int64_t>(&*a)) {
    MT_CHECK(*i == 0 || *i == 1, "HDF5 file {}: attribute {} of group {} is {}; expected a bool (0 or 1)", path_,
             name, normalize_group(group), *i);
    return *i == 1;
  }
  if (const std::string* s = std::get_if<std::string>(&*a)) {
    if (*s == "true" || *s == "True") return true;
    if (*s == "false" || *s == "False") return false;
    MT_THROW("HDF5 file {}: attribute {} of group {} is the string \"{}\"; expected a bool", path_, name,
             normalize_group(group), *s);
  }
  MT_THROW("HDF5 file {}: attribute {} of group {} is a float; expected a bool (an integer 0 or 1)", path_, name,
           normalize_group(group));
}

// ---------------------------------------------------------------- Writer

Writer::Writer(const std::string& path) : path_(path), tmp_(fmt::format("{}.tmp.{}", path, ::getpid())) {
  check_output_file(path, "HDF5 file");  // commit() renames over it: never over a device, FIFO or directory
  init_library();
  file_ = H5Fcreate(tmp_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (file_ < 0) {
    std::string why = library_error();
    throw IoError(fmt::format("HDF5 file {}: cannot create {}{} (does the directory exist and is it writable?)", path_,
                              tmp_, why));
  }
}

Writer::~Writer() {
  if (file_ >= 0) H5Fclose(file_);
  if (!committed_) {
    std::error_code ec;
    std::filesystem::remove(tmp_, ec);
  }
}

std::string Writer::where(const std::string& group, const std::string& name) const {
  return name.empty() ? fmt::format("HDF5 file {}: group {}", path_, normalize_group(group))
                      : fmt::format("HDF5 file {}: {}", path_, join(group, name));
}

int64_t Writer::open_group(const std::string& group) {
  MT_CHECK(file_ >= 0, "HDF5 file {}: already committed", path_);
  std::string prefix;
  for (const std::string& p : split_path(group)) {
    prefix += "/" + p;
    H5I_type_t t = object_type(file_, prefix);
    if (t == H5I_GROUP) continue;
    MT_CHECK(t == H5I_BADID, "{}: {} exists and is not a group", where(group), prefix);
    Id g(H5Gcreate2(file_, prefix.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
    if (!g.valid()) MT_THROW("{}: cannot create the group{}", where(prefix), library_error());
  }
  hid_t g = H5Gopen2(file_, normalize_group(group).c_str(), H5P_DEFAULT);
  if (g < 0) MT_THROW("{}: cannot open the group{}", where(group), library_error());
  return g;
}

void Writer::create_group(const std::string& group) { H5Gclose(open_group(group)); }

void Writer::write(const std::string& group, const std::string& name, const Tensor& tensor, bool checksum) {
  MT_CHECK(tensor.defined(), "{}: cannot write an undefined tensor", where(group, name));
  MT_CHECK(tensor.dtype() == DType::f32 || tensor.dtype() == DType::f64 || tensor.dtype() == DType::i64 ||
               tensor.dtype() == DType::u16,
           "{}: dtype {} cannot be written; f32, f64, i64 or u16", where(group, name), tensor.dtype());
  MT_CHECK(!name.empty() && name.find('/') == std::string::npos, "{}: a dataset name must be non-empty and have no '/'",
           where(group, name));
  Tensor t = tensor.is_cpu() ? tensor : tensor.to(kCpu);
  Id g(open_group(group), H5Gclose);
  MT_CHECK(H5Lexists(g.get(), name.c_str(), H5P_DEFAULT) <= 0, "{} already exists", where(group, name));
  std::vector<hsize_t> dims;
  for (int i = 0; i < t.dim(); ++i) dims.push_back(static_cast<hsize_t>(t.size(i)));
  Id space(dims.empty() ? H5Screate(H5S_SCALAR) : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
           H5Sclose);
  const hid_t file_type = t.dtype() == DType::f64   ? H5T_IEEE_F64LE
                          : t.dtype() == DType::f32 ? H5T_IEEE_F32LE
                          : t.dtype() == DType::u16 ? H5T_STD_U16LE
                                                    : H5T_STD_I64LE;
  const hid_t mem_type = t.dtype() == DType::f64   ? H5T_NATIVE_DOUBLE
                         : t.dtype() == DType::f32 ? H5T_NATIVE_FLOAT
                         : t.dtype() == DType::u16 ? H5T_NATIVE_UINT16
                                                   : H5T_NATIVE_INT64;
  Id create(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (checksum && !dims.empty() && t.numel() > 0) {
    // Whole rows of dim 0 per chunk, at most 4 MiB (HDF5 chunks must stay below 4 GiB).
    std::vector<hsize_t> chunk = dims;
    const int64_t row_bytes = t.numel() / t.size(0) * dtype_size(t.dtype());
    chunk[0] = static_cast<hsize_t>(std::clamp<int64_t>((int64_t{4} << 20) / std::max<int64_t>(row_bytes, 1), 1,
                                                        t.size(0)));
    for (size_t i = 1; i < chunk.size() && row_bytes > (int64_t{4} << 20); ++i) chunk[i] = 1;  // huge rows
    if (H5Pset_chunk(create.get(), static_cast<int>(chunk.size()), chunk.data()) < 0 ||
        H5Pset_fletcher32(create.get()) < 0)
      MT_THROW("{}: cannot set up chunked storage with Fletcher32{}", where(group, name), library_error());
  }
  Id ds(H5Dcreate2(g.get(), name.c_str(), file_type, space.get(), H5P_DEFAULT, create.get(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) throw IoError(fmt::format("{}: cannot create the dataset{}", where(group, name), library_error()));
  if (t.numel() > 0 && H5Dwrite(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw_data()) < 0)
    throw IoError(fmt::format("{}: writing the data failed{}", where(group, name), library_error()));
}

void Writer::set_attribute(const std::string& group, const std::string& name, const Attribute& value) {
  Id g(open_group(group), H5Gclose);
  if (H5Aexists(g.get(), name.c_str()) > 0) H5Adelete(g.get(), name.c_str());
  Id space(H5Screate(H5S_SCALAR), H5Sclose);
  auto create = [&](hid_t file_type) {
    Id a(H5Acreate2(g.get(), name.c_str(), file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
    if (!a.valid()) MT_THROW("{}: cannot create attribute {}{}", where(group), name, library_error());
    return a;
  };
  herr_t ok;
  if (const double* d = std::get_if<double>(&value)) {
    ok = H5Awrite(create(H5T_IEEE_F64LE).get(), H5T_NATIVE_DOUBLE, d);
  } else if (const int64_t* i = std::get_if<int64_t>(&value)) {
    ok = H5Awrite(create(H5T_STD_I64LE).get(), H5T_NATIVE_INT64, i);
  } else {
    Id type(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(type.get(), H5T_VARIABLE);
    H5Tset_cset(type.get(), H5T_CSET_UTF8);
    const char* s = std::get<std::string>(value).c_str();
    ok = H5Awrite(create(type.get()).get(), type.get(), &s);
  }
  if (ok < 0) MT_THROW("{}: writing attribute {} failed{}", where(group), name, library_error());
}

void Writer::commit() {
  MT_CHECK(file_ >= 0, "HDF5 file {}: already committed", path_);
  herr_t closed = H5Fclose(file_);
  file_ = -1;
  if (closed < 0) throw IoError(fmt::format("HDF5 file {}: closing {} failed{}", path_, tmp_, library_error()));
  if (!fsync_path(tmp_, O_RDONLY))
    throw IoError(fmt::format("HDF5 file {}: fsync of {} failed: {}", path_, tmp_, std::strerror(errno)));
  std::error_code ec;
  std::filesystem::rename(tmp_, path_, ec);
  if (ec) throw IoError(fmt::format("HDF5 file {}: renaming {} into place failed: {}", path_, tmp_, ec.message()));
  committed_ = true;
  std::filesystem::path dir = std::filesystem::path(path_).parent_path();
  fsync_path(dir.empty() ? "." : dir.string(), O_RDONLY | O_DIRECTORY);
}

}  // namespace moetrain::hdf5
