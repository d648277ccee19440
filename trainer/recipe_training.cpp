#include "trainer/recipe_training.h"

#include "qat/four_bit_linear.h"
#include "qat/int8_linear.h"
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

LoadedModel load_base_model(const Recipe& recipe, torch::ScalarType dtype, const torch::Device& device,
                            bool quantize_base) {
  ModelLoadOptions options;
  options.dtype = dtype;
  auto loaded = load_llama(recipe.model.path, options);
  if (quantize_base && recipe.quant == "qlora" && recipe.qlora.quant_type == "int8") {
    qat::Int8Options int8;
    int8.threshold = recipe.qlora.llm_int8_threshold;
    int8.compute_dtype = dtype;
    int8.device = device;
    qat::quantize_linear_layers_int8(*loaded.model, int8, recipe.qlora.skip_modules);
  } else if (quantize_base && recipe.quant == "qlora") {
    qat::FourBitOptions four_bit;
    four_bit.quant_type = recipe.qlora.quant_type;
    four_bit.blocksize = recipe.qlora.blocksize;
    four_bit.double_quant = recipe.qlora.double_quant;
    four_bit.compute_dtype = dtype;
    four_bit.device = device;
    qat::quantize_linear_layers(*loaded.model, four_bit, recipe.qlora.skip_modules);
  }
  return loaded;
}

int64_t loss_chunk_tokens(const Recipe& recipe, int64_t vocab_size) {
  return recipe.train.loss_chunk_tokens > 0 ? recipe.train.loss_chunk_tokens : auto_loss_chunk_tokens(vocab_size);
}

}  // namespace qtrain::trainer
