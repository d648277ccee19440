#include "trainer/model/model_families.h"

namespace qtrain::trainer {

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
