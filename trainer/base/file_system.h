#pragma once
// File operations that leave nothing half-written, and removing a directory tree without std::filesystem::remove_all: the torch wheel's libtorch
// exports its own copies of the std::filesystem functions, and where those win the dynamic
// link (seen with GCC 13 on the GPU machine) remove_all crashes. nftw is plain POSIX.
#include <ftw.h>
#include <sys/stat.h>

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

// Whether `path` is a regular file (following symlinks).
inline bool is_regular_file(const std::string& path) {
  struct stat status {};
  return ::stat(path.c_str(), &status) == 0 && S_ISREG(status.st_mode);
}

// Writes `text` to PATH.tmp, fsyncs it, renames it over `path` and fsyncs the directory, so
// `path` is always either the old file or the whole new one. Error naming the path on failure.
void write_file_atomically(const std::string& path, const std::string& text);

// A file written to PATH.tmp and renamed over PATH once complete and fsynced (the directory
// too); the temporary is removed when it is abandoned (destroyed before commit()). Errors name
// the path.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  void write(const void* data, size_t size);
  void commit();

 private:
  [[noreturn]] void fail(const std::string& what) const;

  std::string path_, temporary_;
  int descriptor_ = -1;
  bool committed_ = false;
};

// Puts the finished directory `staged` in place of `target`: an older `target` is swapped out
// atomically and then removed, so at every moment `target` is the old or the new version.
void replace_directory(const std::string& staged, const std::string& target);

}  // namespace qtrain::trainer
