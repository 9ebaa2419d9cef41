// Durable small writes for checkpoints and exports: a file or directory synced to
// disk, and a text file replaced atomically (temp file, fsync, rename). Failures
// throw IoError (exit code 5) naming the path.
#pragma once

#include <filesystem>
#include <string>

namespace moetrain {

// fsync of a file, or of a directory (makes the renames inside it durable; a file
// system that cannot sync directories, EINVAL, is accepted).
void fsync_path(const std::filesystem::path& path, bool directory);

// Writes `text` to `path.tmp.<pid>`, fsyncs it and renames it over `path`, so `path`
// holds the old or the new text, never a part; then fsyncs the directory unless
// sync_directory is false (the caller syncs it once after several files).
void write_file_atomically(const std::filesystem::path& path, const std::string& text, bool sync_directory = true);

}  // namespace moetrain
