#include "trainer/formats/llama_shapes.h"

#include "kernels/error.h"
#include "trainer/formats/hf_config.h"
#include "trainer/model/model_families.h"

namespace qtrain::trainer {

namespace {

// Benchmarks build the rotary tables for this many positions, whatever the model's context.
constexpr int64_t kBenchPositions = 8192;

}  // namespace

std::string llama_shape_names() {
  std::string known;
  for (const auto& family : model_families()) {
    for (const auto& shape : family.bench_shapes) known += (known.empty() ? "" : ", ") + shape.name;
  }
  return known;
}

LlamaOptions llama_shape(const std::string& name) {
  for (const auto& family : model_families()) {
    for (const auto& shape : family.bench_shapes) {
      if (shape.name == name) {
        auto options = parse_hf_config(shape.config_json, "the config.json of model shape '" + name + "'").llama;
        options.max_position_embeddings = kBenchPositions;
        return options;
      }
    }
  }
  throw Error(ErrorCode::kUsage, "unknown model shape '" + name + "' (known: " + llama_shape_names() + ")");
}

}  // namespace qtrain::trainer
