#include "trainer/llama_shapes.h"

#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

struct NamedShape {
  const char* name;
  int64_t vocab, hidden, intermediate, layers, heads, kv_heads;
  bool tied;
};

const NamedShape kShapes[] = {
    {"llama3-8b", 128256, 4096, 14336, 32, 32, 8, false},
    {"llama3-1b", 128256, 2048, 8192, 16, 32, 8, true},  // Llama-3.2-1B
    {"tiny", 8192, 256, 688, 4, 8, 2, false},             // the shape of tests' tiny-llama
};

}  // namespace

std::vector<std::string> llama_shape_names() {
  std::vector<std::string> names;
  for (const auto& shape : kShapes) names.emplace_back(shape.name);
  return names;
}

LlamaOptions llama_shape(const std::string& name) {
  for (const auto& shape : kShapes) {
    if (name != shape.name) continue;
    LlamaOptions options;
    options.vocab_size = shape.vocab;
    options.hidden_size = shape.hidden;
    options.intermediate_size = shape.intermediate;
    options.num_hidden_layers = shape.layers;
    options.num_attention_heads = shape.heads;
    options.num_key_value_heads = shape.kv_heads;
    options.head_dim = shape.hidden / shape.heads;
    options.tie_word_embeddings = shape.tied;
    options.max_position_embeddings = 8192;
    options.rms_norm_eps = 1e-5;
    options.rope.theta = 500000.0;
    return options;
  }
  std::string known;
  for (const auto& shape : kShapes) known += (known.empty() ? "" : ", ") + std::string(shape.name);
  throw Error(ErrorCode::kUsage, "unknown model shape '" + name + "' (known: " + known + ")");
}

}  // namespace qtrain::trainer
