#pragma once
// A whole file into memory, for the text files data/ reads (JSON, templates, .txt data).
#include <string>

namespace qtrain::data {

// Error "PATH: cannot open (expected WHAT)" when the file cannot be read.
std::string read_text_file(const std::string& path, const std::string& what);

}  // namespace qtrain::data
