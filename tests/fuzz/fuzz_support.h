#pragma once
// What the fuzz targets share. A target feeds libFuzzer's bytes to one parser; a qtrain::Error
// is the parser refusing bad input, which is the contract. Anything else escaping (another
// exception type, a sanitizer report, a crash, a hang) is a bug that libFuzzer reports.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "kernels/error.h"

namespace qtrain::fuzz {

// Runs `parse`; a qtrain::Error is an accepted outcome, other exceptions propagate.
template <typename Parse>
void expect_only_qtrain_errors(Parse&& parse) {
  try {
    parse();
  } catch (const qtrain::Error&) {
  }
}

inline std::string bytes_text(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

// A private scratch directory of this process (parsers that take a path read from it).
inline const std::string& scratch_directory() {
  static const std::string directory = [] {
    const char* base = std::getenv("TMPDIR");
    std::string path = std::string(base && *base ? base : "/tmp") + "/qtrain-fuzz-" + std::to_string(::getpid());
    std::string command = "mkdir -p '" + path + "'";
    if (std::system(command.c_str()) != 0) std::abort();
    return path;
  }();
  return directory;
}

// Writes `bytes` to scratch_directory()/name and returns that path.
inline std::string write_scratch_file(const std::string& name, const std::string& bytes) {
  const std::string path = scratch_directory() + "/" + name;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  return path;
}

// The reference fixtures (QTRAIN_FIXTURES, else the directory the build was configured with):
// targets that need a real tokenizer load it from tiny-llama/.
inline std::string fixtures_directory() {
  const char* from_environment = std::getenv("QTRAIN_FIXTURES");
  return from_environment && *from_environment ? from_environment : QTRAIN_FIXTURES_DIR;
}

}  // namespace qtrain::fuzz
