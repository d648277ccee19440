// The list of the families, one line each, in the order supported_architectures() names them.
#include "trainer/model/families/families.h"

namespace qtrain::trainer {

const std::vector<ModelFamily>& model_families() {
  static const std::vector<ModelFamily> families = {
      llama_family(),
      mistral_family(),
      qwen2_family(),
      qwen3_family(),
      gemma2_family(),
      gemma3_family(),
      phi3_family(),
  };
  return families;
}

}  // namespace qtrain::trainer
