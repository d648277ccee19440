#pragma once
// A model directory's generation_config.json, what transformers' generate() starts from.
#include <string>

#include "trainer/formats/base_directory.h"
#include "trainer/formats/hf_config.h"
#include "trainer/model/generation.h"

namespace qtrain::trainer {

// GenerationConfig keys do_sample, temperature, top_k, top_p, repetition_penalty,
// max_new_tokens and eos_token_id (an id or a list), over transformers' defaults (greedy;
// temperature 1, top_k 50, top_p 1, no repetition penalty). Without the file, or without its
// eos_token_id, config.json's eos_token_id. A wrong value is an Error naming the file and key.
GenerationOptions read_generation_config(const std::string& model_dir, const HfModelConfig& config);

// The generation_config.json a model-directory export writes: the base's, or one made of its
// config.json's token ids (bos, eos, pad) when it has none.
std::string generation_config_json(const BaseDirectory& base);

}  // namespace qtrain::trainer
