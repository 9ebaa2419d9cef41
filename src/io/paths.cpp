// File kinds of user-given paths, output targets and stale temp entries (paths.h).
#include "io/paths.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/error.h"

namespace moetrain {

namespace fs = std::filesystem;

namespace {

// Opening failed with `err`: the user's path is wrong (missing, permission, a
// loop of links) or the system failed.
[[noreturn]] void throw_open_error(const std::string& path, const std::string& what, int err) {
  const std::string message = fmt::format("{}: cannot open {}: {}", path, what, std::strerror(err));
  switch (err) {
    case ENOENT: case ENOTDIR: case EACCES: case EPERM: case ELOOP: case ENAMETOOLONG: case EISDIR: case ENXIO:
    case ENODEV: case EROFS: case ETXTBSY:
      throw Error(message);
    default:
      throw IoError(message);
  }
}

[[noreturn]] void throw_not_regular(const std::string& path, const std::string& what, unsigned mode) {
  throw Error(fmt::format("{}: not a regular file ({}); expected {}", path, file_kind_name(mode), what));
}

}  // namespace

std::string file_kind_name(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFIFO: return "a FIFO";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFSOCK: return "a socket";
    case S_IFLNK: return "a symbolic link";
    default: return "a file of unknown kind";
  }
}

int open_regular_file(const std::string& path, const std::string& what) {
  require_regular_file(path, what);
  // O_NONBLOCK: should the path have become a FIFO since the stat, the open
  // returns at once and the fstat below refuses it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) throw_open_error(path, what, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError(fmt::format("{}: cannot stat {}: {}", path, what, std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw_not_regular(path, what, st.st_mode);
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

void require_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw_open_error(path, what, errno);
  if (!S_ISREG(st.st_mode)) throw_not_regular(path, what, st.st_mode);
}

std::string read_regular_file(const std::string& path, const std::string& what, int64_t max_bytes) {
  const int fd = open_regular_file(path, what);
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } close_fd{fd};
  auto too_large = [&](int64_t size) {
    return Error(fmt::format("{}: {} bytes, more than the {} bytes ({} MiB) {} may hold; is this the right file?",
                             path, size, max_bytes, max_bytes >> 20, what));
  };
  struct stat st {};
  if (::fstat(fd, &st) == 0 && max_bytes >= 0 && st.st_size > max_bytes) throw too_large(st.st_size);
  std::string text;
  // Bounded even where st_size says nothing (files of /proc report 0) or the file grows.
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw IoError(fmt::format("{}: cannot read {} at byte offset {}: {}", path, what, text.size(),
                                std::strerror(errno)));
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (max_bytes >= 0 && static_cast<int64_t>(text.size()) > max_bytes)
      throw too_large(static_cast<int64_t>(text.size()));
  }
  return text;
}

void check_output_file(const std::string& path, const std::string& what, const std::vector<std::string>& inputs) {
  struct stat out {};
  if (::stat(path.c_str(), &out) != 0) return;  // absent (or unreachable: the write names the reason)
  if (!S_ISREG(out.st_mode))
    throw Error(fmt::format("{} {}: exists and is not a regular file ({}); the output is written to a temp file and "
                            "renamed over it, which would replace it: choose another path",
                            what, path, file_kind_name(out.st_mode)));
  for (const std::string& input : inputs) {
    struct stat in {};
    if (::stat(input.c_str(), &in) == 0 && in.st_dev == out.st_dev && in.st_ino == out.st_ino)
      throw Error(fmt::format("{} {}: is the same file as the input {}; writing it would replace the input: choose "
                              "another path",
                              what, path, input));
  }
}

void check_output_directory(const std::string& dir, const std::string& what) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || S_ISDIR(st.st_mode)) return;
  throw Error(fmt::format("{} {}: exists and is not a directory ({}); the output directory is built aside and renamed "
                          "into its place, which would replace it: choose another path",
                          what, dir, file_kind_name(st.st_mode)));
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  std::string name(buf);
  for (char& c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_')) c = '_';
  return name;
}

std::string temp_entry_name(const std::string& prefix) {
  return fmt::format("{}{}.{}", prefix, host_name(), ::getpid());
}

std::vector<fs::path> remove_stale_temp_entries(const fs::path& parent, const std::string& prefix) {
  std::vector<fs::path> removed;
  const std::string host = host_name();
  std::error_code ec;
  fs::directory_iterator it(parent.empty() ? fs::path(".") : parent, ec);
  if (ec) return removed;  // no such directory yet: nothing was left there
  for (const fs::directory_entry& entry : it) {
    const std::string name = entry.path().filename().string();
    // "<prefix><host>.<pid>" with exactly this host: another host's pid says nothing here.
    if (name.size() <= prefix.size() + host.size() + 1 || name.compare(0, prefix.size(), prefix) != 0 ||
        name.compare(prefix.size(), host.size(), host) != 0 || name[prefix.size() + host.size()] != '.')
      continue;
    const std::string digits = name.substr(prefix.size() + host.size() + 1);
    int64_t pid = 0;
    const auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
    if (err != std::errc() || end != digits.data() + digits.size() || digits[0] == '0' || pid <= 0 ||
        pid > 0x7fffffff || pid == ::getpid())
      continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive (EPERM: another user's)
    std::error_code rm;
    fs::remove_all(entry.path(), rm);
    if (rm) {
      spdlog::warn("{}: left by process {}, which is gone, but removing it failed: {}; delete it by hand",
                   entry.path().string(), pid, rm.message());
      continue;
    }
    removed.push_back(entry.path());
  }
  return removed;
}

}  // namespace moetrain
