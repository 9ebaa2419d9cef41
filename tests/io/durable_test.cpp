// io/durable.h: directory creation, atomic text files and directory replacement,
// and their errors on a full and a read-only file system (1 MiB tmpfs; needs root
// for mount(8), skipped with a warning otherwise).
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "core/error.h"
#include "io/durable.h"
#include "io/paths.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::error_of;
using moetrain::testing::read_bytes;
using moetrain::testing::TempDir;
namespace fs = std::filesystem;

namespace {

struct Tmpfs {
  std::string dir;
  bool ok = false;
  Tmpfs(const std::string& path, const std::string& options) : dir(path) {
    fs::create_directories(dir);
    ok = moetrain::testing::run_command("mount -t tmpfs -o " + options + " tmpfs " + dir + " 2>/dev/null") == 0;
  }
  ~Tmpfs() {
    if (ok) moetrain::testing::run_command("umount " + dir);
  }
};

}  // namespace

TEST_CASE("durable: create_directories, write_file_atomically and replace_directory on a roomy disk", "[io]") {
  TempDir tmp;
  create_directories(tmp / "a/b/c");
  CHECK(fs::is_directory(tmp / "a/b/c"));
  create_directories(tmp / "a/b/c");  // already there: nothing to do
  tmp.write("file", "x");
  std::string err = error_of([&] { create_directories(tmp / "file"); });
  CHECK(err == "cannot create directory " + tmp / "file" + ": it exists and is not a directory; remove it or choose "
               "another path");
  err = error_of<IoError>([&] { create_directories(tmp / "file/below"); });  // a file where a parent should be
  CHECK(err == "cannot create directory " + tmp / "file/below" + ": Not a directory");

  write_file_atomically(tmp / "a/t.txt", "one");
  write_file_atomically(tmp / "a/t.txt", "two");
  CHECK(read_bytes(tmp / "a/t.txt") == "two");
  err = error_of([&] { write_file_atomically(tmp / "a/b", "three"); });  // a directory: refused before writing
  CHECK(err.find("cannot write " + tmp / "a/b" + ": exists and is not a regular file (a directory)") !=
        std::string::npos);

  CHECK(temp_directory_for(tmp / "out/").string() == tmp / "out" + ".tmp." + host_name() + "." +
                                                         std::to_string(::getpid()));
  tmp.write("new/x", "new");
  tmp.write("out/y", "old");
  replace_directory(tmp / "new", tmp / "out");
  CHECK(read_bytes(tmp / "out/x") == "new");
  CHECK(!fs::exists(tmp / "out/y"));
  CHECK(tmp.listing() == std::vector<std::string>{"a", "file", "out"});  // no out.old.<pid>, no new
  err = error_of<IoError>([&] { replace_directory(tmp / "missing", tmp / "out"); });
  CHECK(err.find("cannot write " + tmp / "out" + ": renaming " + tmp / "missing" + " into place failed: No such file") !=
        std::string::npos);
  CHECK(read_bytes(tmp / "out/x") == "new");  // the old directory was put back
  CHECK(tmp.listing() == std::vector<std::string>{"a", "file", "out"});
}

TEST_CASE("durable: a full or read-only file system is an IoError naming the path and the system's message",
          "[io][errors]") {
  TempDir tmp;
  Tmpfs full(tmp / "full", "size=1m"), ro(tmp / "ro", "ro,size=1m");
  if (!full.ok || !ro.ok) {
    WARN("skipped: cannot mount a tmpfs here (needs root)");
    return;
  }
  {
    const int fd = ::open((full.dir + "/filler").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    REQUIRE(fd >= 0);
    const std::string block(4096, 'x');
    while (::write(fd, block.data(), block.size()) > 0) {
    }
    ::close(fd);
  }
  std::string err = error_of<IoError>([&] { write_file_atomically(full.dir + "/t.txt", "text"); });
  CHECK(err.find("cannot write " + full.dir + "/t.txt: writing the temp file") != std::string::npos);
  CHECK(err.find("No space left on device") != std::string::npos);
  CHECK(!fs::exists(full.dir + "/t.txt"));
  CHECK(!fs::exists(full.dir + "/t.txt.tmp." + std::to_string(::getpid())));

  err = error_of<IoError>([&] { create_directories(ro.dir + "/run/x"); });
  CHECK(err == "cannot create directory " + ro.dir + "/run/x: Read-only file system");
  err = error_of<IoError>([&] { write_file_atomically(ro.dir + "/t.txt", "text"); });
  CHECK(err.find("cannot write " + ro.dir + "/t.txt: creating the temp file") != std::string::npos);
  CHECK(err.find("Read-only file system") != std::string::npos);
}
