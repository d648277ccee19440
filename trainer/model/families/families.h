#pragma once
// One row per decoder family, each defined in its own file here (NAME.cpp) and listed by
// model_families() (family_list.cpp).
#include "trainer/model/model_families.h"

namespace qtrain::trainer {

ModelFamily llama_family();
ModelFamily mistral_family();
ModelFamily qwen2_family();
ModelFamily qwen3_family();
ModelFamily gemma2_family();
ModelFamily gemma3_family();
ModelFamily phi3_family();

}  // namespace qtrain::trainer
