// Durable small writes for checkpoints and exports: a file or directory synced to
// disk, a text file replaced atomically (temp file, fsync, rename), a directory
// built under a temp name and renamed into place, and directory creation.
// Failures of the system (disk full, read-only file system, permission, quota)
// throw IoError (exit code 5): one line naming the path and the system's message
// (strerror). Nothing partial is left at the final path.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace moetrain {

// Creates `dir` and its missing parents (nothing when it is a directory already).
// Throws IoError "cannot create directory DIR: <system message>"; Error when DIR
// exists and is not a directory. Never std::filesystem::filesystem_error.
void create_directories(const std::filesystem::path& dir);

// fsync of a file, or of a directory (makes the renames inside it durable; a file
// system that cannot sync directories, EINVAL, is accepted).
void fsync_path(const std::filesystem::path& path, bool directory);

// Writes `text` to `path.tmp.<pid>`, fsyncs it and renames it over `path`, so `path`
// holds the old or the new text, never a part; then fsyncs the directory unless
// sync_directory is false (the caller syncs it once after several files). On a
// failure the temp file is removed and `path` is as it was. A `path` that exists and
// is not a regular file (a directory, device, FIFO: io/paths.h check_output_file) is
// refused before anything is written: Error "cannot write PATH: exists and is not a
// regular file (...)".
void write_file_atomically(const std::filesystem::path& path, const std::string& text, bool sync_directory = true);

// `<dir>.tmp.<host>.<pid>` (io/paths.h temp_entry_name): where a directory that
// replaces `dir` is built (same parent, so the final rename stays within one file
// system).
std::filesystem::path temp_directory_for(const std::filesystem::path& dir);

// Removes the temp directories of temp_directory_for(dir) that runs killed on this
// host left beside `dir` (their process is gone: io/paths.h remove_stale_temp_entries)
// and returns them; those of live processes and of other hosts stay.
std::vector<std::filesystem::path> remove_stale_temp_directories(const std::filesystem::path& dir);

// Publishes the complete directory `built` as `dir`: an existing `dir` is renamed
// to `<dir>.old.<pid>` first and deleted after, so `dir` is the old or the new one,
// never a mix (between the two renames it is briefly absent). fsyncs the parent.
// On a failure of the second rename the old directory is put back. A `dir` that
// exists and is not a directory is refused first (Error, exit code 2: renaming it
// aside would move a device node or the user's file).
void replace_directory(const std::filesystem::path& built, const std::filesystem::path& dir);

}  // namespace moetrain
