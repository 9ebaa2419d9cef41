#include "io/durable.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "core/error.h"

namespace moetrain {

void fsync_path(const std::filesystem::path& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw IoError(fmt::format("{}: cannot open to fsync: {}", path.string(), std::strerror(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && !(directory && err == EINVAL))
    throw IoError(fmt::format("{}: fsync failed: {}", path.string(), std::strerror(err)));
}

void write_file_atomically(const std::filesystem::path& path, const std::string& text, bool sync_directory) {
  const std::filesystem::path tmp = path.string() + fmt::format(".tmp.{}", ::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw IoError(fmt::format("{}: writing failed: {}", tmp.string(), std::strerror(errno)));
  }
  fsync_path(tmp, false);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw IoError(fmt::format("renaming {} to {} failed: {}", tmp.string(), path.string(), ec.message()));
  if (sync_directory) fsync_path(path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path(), true);
}

}  // namespace moetrain
