#pragma once
// The one exception type qtrain throws. Its text is a message to a user: it names the file,
// key or tensor, says what was expected and what to do. The CLI prints it and exits with 2.
#include <c10/util/ArrayRef.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace qtrain {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// "[8192, 256]": a tensor shape as error messages write it.
inline std::string shape_text(c10::IntArrayRef shape) {
  std::ostringstream text;
  text << shape;
  return text.str();
}

}  // namespace qtrain
