#pragma once
// Well-known Llama shapes by name, for benchmarks and estimates that need a model's shape
// without its weights ("llama3-8b" is Meta-Llama-3-8B's config.json).
#include <string>
#include <vector>

#include "trainer/llama.h"

namespace qtrain::trainer {

// Error listing the known names for any other.
LlamaOptions llama_shape(const std::string& name);
std::vector<std::string> llama_shape_names();

}  // namespace qtrain::trainer
