#include "data/text_file.h"

#include <fstream>
#include <sstream>

#include "kernels/error.h"

namespace qtrain::data {

std::string read_text_file(const std::string& path, const std::string& what) {
  std::ifstream input(path, std::ios::binary);
  if (!input) throw Error(ErrorCode::kFileSystem, path + ": cannot open (expected " + what + ")");
  std::stringstream contents;
  contents << input.rdbuf();
  if (input.bad()) throw Error(ErrorCode::kFileSystem, path + ": read error");
  return contents.str();
}

}  // namespace qtrain::data
