#include "trainer/recipe_training.h"

#include "trainer/causal_lm_loss.h"

namespace qtrain::trainer {

PeftAdapterConfig lora_adapter_config(const Recipe& recipe) {
  if (!recipe.lora.init_from.empty()) return read_peft_adapter_config(recipe.lora.init_from);
  PeftAdapterConfig config;
  config.lora.rank = recipe.lora.rank;
  config.lora.alpha = recipe.lora.alpha;
  config.lora.dropout = recipe.lora.dropout;
  config.lora.rslora = recipe.lora.rslora;
  config.targets.include.names = recipe.lora.target_modules;
  return config;
}

int64_t loss_chunk_tokens(const Recipe& recipe, int64_t vocab_size) {
  return recipe.train.loss_chunk_tokens > 0 ? recipe.train.loss_chunk_tokens : auto_loss_chunk_tokens(vocab_size);
}

}  // namespace qtrain::trainer
