#include "data/example.h"

#include <cstddef>

namespace qtrain::data {

int64_t Example::predicted_tokens() const {
  int64_t count = 0;
  for (size_t position = 1; position < labels.size(); ++position) count += labels[position] != kIgnoreLabel;
  return count;
}

}  // namespace qtrain::data
