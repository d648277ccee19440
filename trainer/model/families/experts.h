#pragma once
// What the mixture-of-experts families share (defined in qwen3_moe.cpp): their expert block's keys
// of config.json (llama_options.h's ExpertOptions).
#include <string>

#include "trainer/model/config_reader.h"
#include "trainer/model/llama_options.h"

namespace qtrain::trainer {

// Makes every layer's block FeedForwardKind::kExperts with `experts_key` experts,
// num_experts_per_tok of them per token, each `intermediate_key` wide (intermediate_size where the
// dense layers have their own), and the load-balancing loss's output_router_logits and
// router_aux_loss_coef (`aux_loss_default` where config.json has none, the family's config class
// default).
void read_expert_block(const HfConfigReader& config, LlamaOptions& llama, const std::string& experts_key,
                       const std::string& intermediate_key, double aux_loss_default);

}  // namespace qtrain::trainer
