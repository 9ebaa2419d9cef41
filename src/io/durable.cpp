#include "io/durable.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/error.h"
#include "io/paths.h"

namespace moetrain {

namespace fs = std::filesystem;

void create_directories(const fs::path& dir) {
  std::error_code ec;
  if (fs::is_directory(dir, ec)) return;
  fs::create_directories(dir, ec);
  if (!ec) return;
  std::error_code probe;
  if (fs::exists(dir, probe) && !fs::is_directory(dir, probe))
    throw Error(fmt::format("cannot create directory {}: it exists and is not a directory; remove it or choose "
                            "another path", dir.string()));
  throw IoError(fmt::format("cannot create directory {}: {}", dir.string(), ec.message()));
}

void fsync_path(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw IoError(fmt::format("{}: cannot open to fsync: {}", path.string(), std::strerror(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && !(directory && err == EINVAL))
    throw IoError(fmt::format("{}: fsync failed: {}", path.string(), std::strerror(err)));
}

void write_file_atomically(const fs::path& path, const std::string& text, bool sync_directory) {
  check_output_file(path.string(), "cannot write");
  const fs::path tmp = path.string() + fmt::format(".tmp.{}", ::getpid());
  // The first failing call's errno, named with the final path and the temp file.
  auto fail = [&](const char* what, int err, int fd) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    return IoError(fmt::format("cannot write {}: {} the temp file {} failed: {}", path.string(), what, tmp.string(),
                               std::strerror(err)));
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    throw IoError(fmt::format("cannot write {}: creating the temp file {} failed: {}", path.string(), tmp.string(),
                              std::strerror(err)));
  }
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw fail("writing", errno, fd);
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) throw fail("fsync of", errno, fd);
  if (::close(fd) != 0) throw fail("closing", errno, -1);
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw fail("renaming", errno, -1);
  if (sync_directory) fsync_path(path.parent_path().empty() ? fs::path(".") : path.parent_path(), true);
}

namespace {
// "DIR/" -> "DIR"
fs::path without_trailing_slash(const fs::path& dir) {
  fs::path d = dir.lexically_normal();
  return d.filename().empty() ? d.parent_path() : d;
}
}  // namespace

fs::path temp_directory_for(const fs::path& dir) {
  const fs::path d = without_trailing_slash(dir);
  return d.parent_path() / temp_entry_name(d.filename().string() + ".tmp.");
}

std::vector<fs::path> remove_stale_temp_directories(const fs::path& dir) {
  const fs::path d = without_trailing_slash(dir);
  return remove_stale_temp_entries(d.parent_path(), d.filename().string() + ".tmp.");
}

void replace_directory(const fs::path& built, const fs::path& dir) {
  check_output_directory(dir.string(), "cannot replace");
  const fs::path parent = dir.parent_path().empty() ? fs::path(".") : dir.parent_path();
  std::error_code ec;
  fs::path old;
  if (fs::exists(dir, ec)) {
    old = fs::path(fmt::format("{}.old.{}", dir.string(), ::getpid()));
    fs::remove_all(old, ec);
    if (::rename(dir.c_str(), old.c_str()) != 0)
      throw IoError(fmt::format("cannot replace {}: moving it aside to {} failed: {}", dir.string(), old.string(),
                                std::strerror(errno)));
  }
  if (::rename(built.c_str(), dir.c_str()) != 0) {
    const int err = errno;
    if (!old.empty()) ::rename(old.c_str(), dir.c_str());
    throw IoError(fmt::format("cannot write {}: renaming {} into place failed: {}", dir.string(), built.string(),
                              std::strerror(err)));
  }
  fsync_path(parent, true);
  if (old.empty()) return;
  fs::remove_all(old, ec);  // the new directory is in place: a leftover costs only space
  if (ec) spdlog::warn("{} is in place, but removing the old copy {} failed: {}; delete it by hand", dir.string(),
                       old.string(), ec.message());
}

}  // namespace moetrain
