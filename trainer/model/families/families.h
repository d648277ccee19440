#pragma once
// The list of decoder families, one line each, in the order supported_architectures() names them.
// Each X(NAME) is the row NAME_family() that trainer/model/families/NAME.cpp defines; adding a
// family is that file and its line here (ModelFamilies.EachFileOfTheFamiliesFolderIsOneRow counts).
#include "trainer/model/model_families.h"

#define QTRAIN_MODEL_FAMILIES(X) \
  X(llama)                       \
  X(mistral)                     \
  X(qwen2)                       \
  X(qwen3)                       \
  X(gemma2)                      \
  X(gemma3)                      \
  X(phi3)                        \
  X(qwen3_moe)                   \
  X(mixtral)                     \
  X(gpt_oss)

namespace qtrain::trainer {

#define QTRAIN_DECLARE_FAMILY(name) ModelFamily name##_family();
QTRAIN_MODEL_FAMILIES(QTRAIN_DECLARE_FAMILY)
#undef QTRAIN_DECLARE_FAMILY

}  // namespace qtrain::trainer
