#pragma once
// Well-known model shapes by name, for benchmarks and estimates that need a model's shape
// without its weights: each family's bench shapes (ModelFamily::bench_shapes, e.g. "llama3-8b" is
// Meta-Llama-3-8B's config.json, "qwen3-8b" Qwen3-8B's), read as a checkpoint's config.json is,
// with 8192 positions.
#include <string>

#include "trainer/model/llama_options.h"

namespace qtrain::trainer {

// Error listing the known names for any other.
LlamaOptions llama_shape(const std::string& name);
// "llama3-8b, llama3-1b, ...": every family's shapes, in the families' order, for help and messages.
std::string llama_shape_names();

}  // namespace qtrain::trainer
