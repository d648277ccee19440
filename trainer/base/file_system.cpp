#include "trainer/base/file_system.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>
#include <algorithm>

#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

std::string parent_directory(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

void fsync_directory(const std::string& directory) {
  const int descriptor = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY);
  if (descriptor < 0) return;
  ::fsync(descriptor);
  ::close(descriptor);
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw Error(ErrorCode::kFileSystem, path + ": " + what + " (" + std::strerror(errno) + ")");
}

}  // namespace

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), temporary_(path_ + ".tmp") {
  descriptor_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (descriptor_ < 0) fail("cannot create " + temporary_);
}

AtomicFile::~AtomicFile() {
  if (descriptor_ >= 0) ::close(descriptor_);
  if (!committed_) ::unlink(temporary_.c_str());
}

void AtomicFile::write(const void* data, size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::write(descriptor_, bytes, std::min<size_t>(size, size_t{1} << 30));
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) fail("cannot write " + temporary_);
    bytes += written;
    size -= static_cast<size_t>(written);
  }
}

void AtomicFile::commit() {
  if (::fsync(descriptor_) != 0) fail("cannot flush " + temporary_ + " to disk");
  const int descriptor = descriptor_;
  descriptor_ = -1;
  if (::close(descriptor) != 0) fail("cannot close " + temporary_);
  if (::rename(temporary_.c_str(), path_.c_str()) != 0) fail("cannot rename " + temporary_ + " to " + path_);
  committed_ = true;
  // The rename itself survives a crash only once the directory is on disk.
  fsync_directory(parent_directory(path_));
}

void AtomicFile::fail(const std::string& what) const {
  throw Error(ErrorCode::kFileSystem, path_ + ": " + what + ": " + std::strerror(errno) +
              " (check that the directory exists, is writable and has free space)");
}

void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string temporary = path + ".tmp";
  const int descriptor = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (descriptor < 0) fail(temporary, "cannot create");
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t count = ::write(descriptor, text.data() + written, text.size() - written);
    if (count < 0 && errno == EINTR) continue;
    if (count <= 0) {
      ::close(descriptor);
      ::unlink(temporary.c_str());
      fail(temporary, "cannot write (is the disk full?)");
    }
    written += static_cast<size_t>(count);
  }
  if (::fsync(descriptor) != 0 || ::close(descriptor) != 0) {
    ::unlink(temporary.c_str());
    fail(temporary, "cannot flush to disk");
  }
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    ::unlink(temporary.c_str());
    fail(path, "cannot rename the finished file into place");
  }
  fsync_directory(parent_directory(path));
}

void replace_directory(const std::string& staged, const std::string& target) {
  // An existing target is swapped with the staged directory in one step (Linux's
  // RENAME_EXCHANGE), so `target` never stops existing; the old version, now at `staged`, goes.
  if (::access(target.c_str(), F_OK) == 0) {
    if (::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
      fsync_directory(parent_directory(target));
      if (!remove_tree(staged)) fail(staged, "cannot remove the previous version");
      return;
    }
    // File systems without the exchange (EINVAL): remove, then rename, as before.
    if (errno != EINVAL && errno != ENOSYS) fail(target, "cannot swap the finished directory into place");
    if (!remove_tree(target)) fail(target, "cannot remove the previous version");
  }
  if (::rename(staged.c_str(), target.c_str()) != 0) fail(target, "cannot rename the finished directory into place");
  fsync_directory(parent_directory(target));
}

}  // namespace qtrain::trainer
