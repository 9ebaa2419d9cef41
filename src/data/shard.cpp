// llm.c token shards: atomic writer, validating reader (format in shard.h).
#include "data/shard.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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

TokenWidth shard_width_for_vocab(int64_t vocab_size) {
  MT_ASSERT(vocab_size >= 1, "shard_width_for_vocab: vocab_size = {}", vocab_size);
  return vocab_size <= kShardMaxId16 + 1 ? TokenWidth::u16 : TokenWidth::u32;
}

const char* token_width_name(TokenWidth width) { return width == TokenWidth::u16 ? "uint16" : "uint32"; }

namespace {

// Writes the header for `count` tokens of `width`, then body(fd) (false, errno set,
// on failure), to a temporary name beside `path`; fsync, rename.
template <class Body>
void write_shard_file(const std::string& path, TokenWidth width, size_t count, Body&& body) {
  MT_CHECK(static_cast<int64_t>(count) <= kShardMaxTokens,
           "{}: {} tokens exceed the {} a shard header can count; write more, smaller shards", path, count,
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
  const bool wide = width == TokenWidth::u32;
  store_le32(header + 0, wide ? kShardMagic32 : kShardMagic);
  store_le32(header + 4, wide ? kShardVersion32 : kShardVersion);
  store_le32(header + 8, static_cast<int32_t>(count));
  bool ok = write_all(fd, header, sizeof(header)) && body(fd) && ::fsync(fd) == 0;
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

}  // namespace

void write_shard(const std::string& path, std::span<const uint16_t> tokens) {
  write_shard_file(path, TokenWidth::u16, tokens.size(),
                   [&](int fd) { return write_all(fd, tokens.data(), tokens.size_bytes()); });
}

void write_shard(const std::string& path, std::span<const uint32_t> tokens, TokenWidth width) {
  if (width == TokenWidth::u32) {
    write_shard_file(path, width, tokens.size(),
                     [&](int fd) { return write_all(fd, tokens.data(), tokens.size_bytes()); });
    return;
  }
  const auto wide = std::find_if(tokens.begin(), tokens.end(), [](uint32_t t) { return t > kShardMaxId16; });
  MT_CHECK(wide == tokens.end(),
           "{}: token id {} at token offset {} does not fit a uint16 shard (ids up to {}); write a uint32 shard", path,
           wide == tokens.end() ? 0 : *wide, wide - tokens.begin(), kShardMaxId16);
  write_shard_file(path, width, tokens.size(), [&](int fd) {
    constexpr size_t kBlock = size_t{1} << 15;
    std::vector<uint16_t> block(std::min(kBlock, tokens.size()));
    for (size_t first = 0; first < tokens.size(); first += kBlock) {
      const size_t n = std::min(kBlock, tokens.size() - first);
      for (size_t i = 0; i < n; ++i) block[i] = static_cast<uint16_t>(tokens[first + i]);
      if (!write_all(fd, block.data(), n * sizeof(uint16_t))) return false;
    }
    return true;
  });
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
    MT_CHECK(magic == kShardMagic || magic == kShardMagic32,
             "{}: bad magic {} at offset 0 (expected {} for uint16 ids or {} for uint32 ids; is this an llm.c token "
             "shard?)",
             path_, magic, kShardMagic, kShardMagic32);
    width_ = magic == kShardMagic ? TokenWidth::u16 : TokenWidth::u32;
    const int32_t want_version = width_ == TokenWidth::u16 ? kShardVersion : kShardVersion32;
    MT_CHECK(version == want_version, "{}: unsupported version {} at offset 4 (expected {} with magic {}, {} ids)",
             path_, version, want_version, magic, token_width_name(width_));
    MT_CHECK(count >= 0, "{}: negative token count {} at offset 8", path_, count);
    const int64_t bpt = bytes_per_token();
    const int64_t expected = kShardHeaderBytes + bpt * static_cast<int64_t>(count);
    MT_CHECK(size >= expected,
             "{}: truncated: the header says {} tokens (offset 8) of {} bytes ({}), so the file should have {} "
             "bytes, but it has {} (the data ends at byte offset {}, after {} whole tokens)",
             path_, count, bpt, token_width_name(width_), expected, size, size, (size - kShardHeaderBytes) / bpt);
    MT_CHECK(size == expected,
             "{}: {} trailing bytes at offset {}: the header says {} tokens (offset 8) of {} bytes ({}), so the file "
             "should have {} bytes, but it has {}",
             path_, size - expected, expected, count, bpt, token_width_name(width_), expected, size);
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
                                path_, offset, now, kShardHeaderBytes + bytes_per_token() * num_tokens_));
    }
    p += r;
    offset += r;
    n -= r;
  }
}

void TokenShard::read(int64_t first, int64_t count, uint32_t* out) const {
  MT_CHECK(first >= 0 && count >= 0 && first + count <= num_tokens_,
           "{}: tokens [{}, {}) are outside the shard's {} tokens", path_, first, first + count, num_tokens_);
  const int64_t bpt = bytes_per_token();
  read_bytes(kShardHeaderBytes + bpt * first, out, bpt * count);
  if (width_ == TokenWidth::u32) return;
  // The uint16 ids fill the first half of out's bytes; widen from the back: token
  // i's 4 bytes at 4i cover the 2-byte ids 2i and 2i + 1, widened already (or, at
  // i = 0, id 0 itself, loaded before the store).
  auto* bytes = reinterpret_cast<const unsigned char*>(out);
  for (int64_t i = count; i-- > 0;) {
    uint16_t id;
    std::memcpy(&id, bytes + 2 * i, sizeof(id));
    out[i] = id;
  }
}

std::vector<uint32_t> TokenShard::read_all() const {
  std::vector<uint32_t> tokens(static_cast<size_t>(num_tokens_));
  read(0, num_tokens_, tokens.data());
  return tokens;
}

TokenShard::~TokenShard() {
  if (fd_ >= 0) ::close(fd_);
}

TokenShard::TokenShard(TokenShard&& other) noexcept
    : path_(std::move(other.path_)), fd_(other.fd_), num_tokens_(other.num_tokens_), width_(other.width_) {
  other.fd_ = -1;
  other.num_tokens_ = 0;
}

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = other.fd_;
    num_tokens_ = other.num_tokens_;
    width_ = other.width_;
    other.fd_ = -1;
    other.num_tokens_ = 0;
  }
  return *this;
}

std::vector<uint32_t> read_shard(const std::string& path) { return TokenShard(path).read_all(); }

}  // namespace moetrain::data
