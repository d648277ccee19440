#pragma once
// Removing a directory tree without std::filesystem::remove_all: the torch wheel's libtorch
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

}  // namespace qtrain::trainer
