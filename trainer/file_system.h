#pragma once
// File operations that leave nothing half-written, and removing a directory tree without std::filesystem::remove_all: the torch wheel's libtorch
// exports its own copies of the std::filesystem functions, and where those win the dynamic
// link (seen with GCC 13 on the GPU machine) remove_all crashes. nftw is plain POSIX.
#include <ftw.h>

#include <cstdio>
#include <string>

namespace qtrain::trainer {

// Removes `path` and everything under it (symlinks are removed, not followed). Returns false
// when something could not be removed; a path that does not exist counts as removed.
inline bool remove_tree(const std::string& path) {
  struct stat status {};
  if (lstat(path.c_str(), &status) != 0) return true;
  auto remove_entry = [](const char* entry, const struct stat*, int, struct FTW*) -> int { return std::remove(entry); };
  return nftw(path.c_str(), remove_entry, /*open_descriptors=*/16, FTW_DEPTH | FTW_PHYS) == 0;
}

// Writes `text` to PATH.tmp, fsyncs it, renames it over `path` and fsyncs the directory, so
// `path` is always either the old file or the whole new one. Error naming the path on failure.
void write_file_atomically(const std::string& path, const std::string& text);

// Puts the finished directory `staged` in place of `target`: an older `target` is swapped out
// atomically and then removed, so at every moment `target` is the old or the new version.
void replace_directory(const std::string& staged, const std::string& target);

}  // namespace qtrain::trainer
