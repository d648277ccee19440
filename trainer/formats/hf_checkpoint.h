#pragma once
// Loading a Hugging Face Llama directory (config.json + safetensors) into LlamaForCausalLM.
#include <set>
#include <string>

#include "trainer/formats/hf_config.h"
#include "trainer/model/llama.h"

namespace qtrain::trainer {

class SafetensorsCheckpoint;

struct ModelLoadOptions {
  torch::ScalarType dtype = torch::kFloat32;  // of the loaded (unquantized) weights and compute
  torch::Device device = torch::kCPU;
  LinearFactory make_linear = dense_linear_factory();
};

struct LoadedModel {
  HfModelConfig config;
  LlamaForCausalLM model{nullptr};
};

LoadedModel load_llama(const std::string& model_dir, const ModelLoadOptions& options = {});

// Copies every parameter and buffer of `model` from `weights` by its Hugging Face name,
// checking shapes; a missing or unexpected tensor is an Error naming it and `source`.
// `loaded_elsewhere` names model tensors already filled (skipped) and checkpoint tensors
// already consumed (not unexpected), e.g. by a quantized layer built from its stored state.
void load_state(torch::nn::Module& model, const SafetensorsCheckpoint& weights, const std::string& source,
                bool tie_word_embeddings, const std::set<std::string>& loaded_elsewhere = {});

}  // namespace qtrain::trainer
