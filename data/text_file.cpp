#include "data/text_file.h"

#include <fstream>

#include "kernels/error.h"

namespace qtrain::data {

std::string read_text_file(const std::string& path, const std::string& what) {
  std::ifstream input(path, std::ios::binary);
  if (!input) throw Error(ErrorCode::kFileSystem, path + ": cannot open (expected " + what + ")");
  // In blocks rather than through a stringstream, which copies a 30 MB tokenizer.json twice.
  std::string contents;
  char block[1 << 16];
  while (input.read(block, sizeof block) || input.gcount() > 0) contents.append(block, static_cast<size_t>(input.gcount()));
  if (input.bad()) throw Error(ErrorCode::kFileSystem, path + ": read error");
  return contents;
}

}  // namespace qtrain::data
