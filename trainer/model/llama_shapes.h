#pragma once
// Well-known model shapes by name, for benchmarks and estimates that need a model's shape
// without its weights ("llama3-8b" is Meta-Llama-3-8B's config.json, "qwen3-8b" Qwen3-8B's,
// "qwen2.5-7b" Qwen2.5-7B's, "mistral-7b" Mistral-7B-v0.3's).
#include <string>
#include <vector>

#include "trainer/model/llama.h"

namespace qtrain::trainer {

// Error listing the known names for any other.
LlamaOptions llama_shape(const std::string& name);

}  // namespace qtrain::trainer
