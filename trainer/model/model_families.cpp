#include "trainer/model/model_families.h"

namespace qtrain::trainer {

ModelFamily::ModelFamily(std::string architecture, std::string model_type, std::string gguf_name)
    : architecture(std::move(architecture)), model_type(std::move(model_type)) {
  gguf.name = std::move(gguf_name);
}

void ModelFamily::add_bench_shape(const std::string& name, const std::string& keys) {
  bench_shapes.push_back({name, R"({"architectures": [")" + architecture + R"("], "model_type": ")" + model_type + R"(", )" +
                                    keys + "}"});
}

const ModelFamily* find_model_family(const std::string& architecture, const std::string& model_type) {
  for (const auto& family : model_families()) {
    if (architecture.empty() ? family.model_type == model_type : family.architecture == architecture) return &family;
  }
  return nullptr;
}

std::string supported_architectures() {
  std::string names;
  for (const auto& family : model_families()) names += (names.empty() ? "" : ", ") + family.architecture;
  return names;
}

}  // namespace qtrain::trainer
