#pragma once
// The one exception type qtrain throws. Its text is a message to a user: it names the file,
// key or tensor, says what was expected and what to do. The CLI prints it and exits with 2.
#include <stdexcept>
#include <string>

namespace qtrain {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace qtrain
