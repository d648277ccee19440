#include "data/text_file.h"

#include <filesystem>
#include <fstream>

#include "kernels/error.h"

namespace qtrain::data {

std::string read_text_file(const std::string& path, const std::string& what) {
  std::ifstream input(path, std::ios::binary);
  if (!input) throw Error(ErrorCode::kFileSystem, path + ": cannot open (expected " + what + ")");
  // Sized up front and read in blocks, rather than through a stringstream, which grows and
  // copies a 30 MB tokenizer.json several times over.
  std::string contents;
  std::error_code size_error;
  const auto size = std::filesystem::file_size(path, size_error);
  if (!size_error) contents.reserve(static_cast<size_t>(size));
  char block[1 << 16];
  while (input.read(block, sizeof block) || input.gcount() > 0) contents.append(block, static_cast<size_t>(input.gcount()));
  if (input.bad()) throw Error(ErrorCode::kFileSystem, path + ": read error");
  return contents;
}

}  // namespace qtrain::data
