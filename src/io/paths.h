// Paths a user names, checked before they are read or replaced, and the temp
// entries that killed runs leave behind (docs/troubleshooting.md, "Files that are
// not regular files").
//
// Reading: open(2) of a FIFO waits for a writer, for ever, and a character device
// (/dev/zero) never ends, so every reader of a user-given path opens it through
// open_regular_file (or checks it with require_regular_file when a library opens
// it by name): anything but a regular file (links followed) is refused before it
// is opened for real.
// Writing: a file written to a temp name and renamed over `path` replaces whatever
// `path` is, a device node (/dev/null as root), a FIFO or the input file itself,
// so check_output_file refuses those before anything is written.
// Bad input throws Error (exit code 2) naming the path; failures of the system
// (EIO, too many open files) throw IoError (exit code 5).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moetrain {

// "a regular file", "a directory", "a FIFO", "a character device", "a block
// device", "a socket", "a symbolic link" or "a file of unknown kind", for st_mode.
std::string file_kind_name(unsigned mode);

// Opens `path` read-only (O_CLOEXEC) and returns the descriptor; the caller
// closes it. Never blocks: the kind is checked with stat(2) before the open and
// with fstat(2) after (the open is O_NONBLOCK, cleared once the file is known to
// be regular). Throws Error "PATH: not a regular file (a FIFO); expected WHAT",
// Error "PATH: cannot open WHAT: <system message>" (missing, permission), or
// IoError for a failure of the system.
int open_regular_file(const std::string& path, const std::string& what);

// For readers that a library opens by name (HDF5): throws like open_regular_file
// when `path` is missing or is not a regular file; opens nothing.
void require_regular_file(const std::string& path, const std::string& what);

// The whole content of the regular file `path` (open_regular_file). With
// max_bytes >= 0 a file of more bytes is refused before it is read: Error "PATH:
// N bytes, more than the M bytes a WHAT may hold". Read errors: IoError.
std::string read_regular_file(const std::string& path, const std::string& what, int64_t max_bytes = -1);

// Before `path` is written by temp file and rename: throws Error when `path`
// exists (links followed) and is not a regular file (the rename would replace the
// device, FIFO or socket; a directory cannot be replaced by a file), or when it is
// the same file (device and inode; a hard or symbolic link included) as one of
// `inputs` (the rename would replace the input). `what` names the path in the
// message, e.g. "op --out". A missing `path` or input is fine.
void check_output_file(const std::string& path, const std::string& what, const std::vector<std::string>& inputs = {});

// Before a directory is built aside and renamed into place as `dir`: throws Error
// when `dir` exists (links followed) and is not a directory.
void check_output_directory(const std::string& dir, const std::string& what);

// This host's name (gethostname), with characters other than [A-Za-z0-9._-]
// replaced by '_'.
std::string host_name();

// "<prefix><host>.<pid>": the name of a temp entry this process owns, which
// remove_stale_temp_entries can tell from those of live runs, here or on other
// hosts sharing the file system.
std::string temp_entry_name(const std::string& prefix);

// Removes (recursively, links not followed) each entry of `parent` named
// "<prefix><host>.<pid>" (temp_entry_name) whose host is this host and whose pid
// is no live process here (kill(pid, 0) fails with ESRCH): what a killed run left.
// Entries of other hosts, of live processes, of this process and every other name
// stay. Returns the paths removed; a removal that fails is a warning, not an error.
std::vector<std::filesystem::path> remove_stale_temp_entries(const std::filesystem::path& parent,
                                                             const std::string& prefix);

}  // namespace moetrain
