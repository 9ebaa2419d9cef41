// llm.c token shards: atomic writer, validating reader (format in shard.h).
#include "data/shard.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "core/error.h"
#include "io/paths.h"

namespace moetrain::data {

// Tokens are written and read as they lie in memory.
static_assert(std::endian::native == std::endian::little, "token shards are little-endian; add byte swapping");

namespace {

void store_le32(unsigned char* p, int32_t v) {
  const auto u = static_cast<uint32_t>(v);
  for (int k = 0; k < 4; ++k) p[k] = static_cast<unsigned char>(u >> (8 * k));
}

int32_t load_le32(const unsigned char* p) {
  uint32_t u = 0;
  for (int k = 0; k < 4; ++k) u |= static_cast<uint32_t>(p[k]) << (8 * k);
  return static_cast<int32_t>(u);
}

// Writes all of [data, data + n) to fd; false (errno set) on failure.
bool write_all(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

}  // namespace

void write_shard(const std::string& path, std::span<const uint16_t> tokens) {
  MT_CHECK(static_cast<int64_t>(tokens.size()) <= kShardMaxTokens,
           "{}: {} tokens exceed the {} a shard header can count; write more, smaller shards", path, tokens.size(),
           kShardMaxTokens);
  check_output_file(path, "token shard");  // the rename must not replace a device, a FIFO or a directory
  static std::atomic<uint64_t> counter{0};
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  const std::string tmp = fmt::format("{}.{}.tmp.{}.{}", dir, base, ::getpid(), counter++);

  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0)
    throw IoError(fmt::format("{}: cannot create token shard (temporary {}): {}", path, tmp, std::strerror(errno)));
  unsigned char header[kShardHeaderBytes] = {};
  store_le32(header + 0, kShardMagic);
  store_le32(header + 4, kShardVersion);
  store_le32(header + 8, static_cast<int32_t>(tokens.size()));
  bool ok = write_all(fd, header, sizeof(header)) && write_all(fd, tokens.data(), tokens.size_bytes()) &&
            ::fsync(fd) == 0;
  int saved_errno = errno;
  if (::close(fd) != 0 && ok) {
    ok = false;
    saved_errno = errno;
  }
  if (ok && ::rename(tmp.c_str(), path.c_str()) != 0) {
    ok = false;
    saved_errno = errno;
  }
  if (!ok) {
    ::unlink(tmp.c_str());
    throw IoError(fmt::format("{}: cannot write token shard: {}", path, std::strerror(saved_errno)));
  }
}

TokenShard::TokenShard(std::string path) : path_(std::move(path)) {
  fd_ = open_regular_file(path_, "a token shard");  // a FIFO or a device is refused, never waited on
  try {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) MT_THROW("{}: cannot stat token shard: {}", path_, std::strerror(errno));
    const auto size = static_cast<int64_t>(st.st_size);
    MT_CHECK(size >= kShardHeaderBytes,
             "{}: truncated header: the file has {} bytes, a token shard starts with a {}-byte header", path_, size,
             kShardHeaderBytes);
    unsigned char bytes[12];
    read_bytes(0, bytes, sizeof(bytes));
    const int32_t magic = load_le32(bytes), version = load_le32(bytes + 4), count = load_le32(bytes + 8);
    if (magic == 20240801)
      MT_THROW("{}: bad magic {} at offset 0 (expected {}): this is llm.c's uint32-token shard format, which "
               "moetrain does not read",
               path_, magic, kShardMagic);
    MT_CHECK(magic == kShardMagic, "{}: bad magic {} at offset 0 (expected {}; is this an llm.c token shard?)", path_,
             magic, kShardMagic);
    MT_CHECK(version == kShardVersion, "{}: unsupported version {} at offset 4 (expected {})", path_, version,
             kShardVersion);
    MT_CHECK(count >= 0, "{}: negative token count {} at offset 8", path_, count);
    const int64_t expected = kShardHeaderBytes + 2 * static_cast<int64_t>(count);
    MT_CHECK(size >= expected,
             "{}: truncated: the header says {} tokens (offset 8), so the file should have {} bytes, but it has {} "
             "(the data ends at byte offset {}, after {} whole tokens)",
             path_, count, expected, size, size, (size - kShardHeaderBytes) / 2);
    MT_CHECK(size == expected,
             "{}: {} trailing bytes at offset {}: the header says {} tokens (offset 8), so the file should have {} "
             "bytes, but it has {}",
             path_, size - expected, expected, count, expected, size);
    num_tokens_ = count;
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

void TokenShard::read_bytes(int64_t offset, void* out, int64_t n) const {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t r = ::pread(fd_, p, static_cast<size_t>(n), offset);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw IoError(fmt::format("{}: cannot read token shard at byte offset {}: {}", path_, offset,
                                         std::strerror(errno)));
    if (r == 0) {
      struct stat st {};
      const int64_t now = ::fstat(fd_, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
      throw IoError(fmt::format("{}: the token shard was truncated while in use: byte offset {} is past its end "
                                "(it has {} bytes now, {} when it was opened); a shard must not change while a "
                                "run reads it: write new data to a new file (moetrain prepare does)",
                                path_, offset, now, kShardHeaderBytes + 2 * num_tokens_));
    }
    p += r;
    offset += r;
    n -= r;
  }
}

void TokenShard::read(int64_t first, int64_t count, uint16_t* out) const {
  MT_CHECK(first >= 0 && count >= 0 && first + count <= num_tokens_,
           "{}: tokens [{}, {}) are outside the shard's {} tokens", path_, first, first + count, num_tokens_);
  read_bytes(kShardHeaderBytes + 2 * first, out, 2 * count);
}

std::vector<uint16_t> TokenShard::read_all() const {
  std::vector<uint16_t> tokens(static_cast<size_t>(num_tokens_));
  read(0, num_tokens_, tokens.data());
  return tokens;
}

TokenShard::~TokenShard() {
  if (fd_ >= 0) ::close(fd_);
}

TokenShard::TokenShard(TokenShard&& other) noexcept
    : path_(std::move(other.path_)), fd_(other.fd_), num_tokens_(other.num_tokens_) {
  other.fd_ = -1;
  other.num_tokens_ = 0;
}

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = other.fd_;
    num_tokens_ = other.num_tokens_;
    other.fd_ = -1;
    other.num_tokens_ = 0;
  }
  return *this;
}

std::vector<uint16_t> read_shard(const std::string& path) { return TokenShard(path).read_all(); }

}  // namespace moetrain::data
