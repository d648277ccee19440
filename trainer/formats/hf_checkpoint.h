#pragma once
// Loading a Hugging Face Llama directory (config.json + safetensors) into LlamaForCausalLM.
#include <functional>
#include <memory>
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

// Pre-quantized checkpoints (bitsandbytes, compressed-tensors): reads the quantized projection
// `name` from the stored tensors (recording in `used` the ones it took), or returns nullptr for
// a projection stored dense.
using QuantizedLayerReader = std::function<std::shared_ptr<qat::LinearLayer>(
    const std::string& name, const qat::DenseLinearOptions& dense, std::set<std::string>& used)>;

// The Llama of `config` whose projections `read_layer` builds from the stored bytes; everything
// else (embeddings, norms, lm_head, projections stored dense) loads by name in options.dtype.
LoadedModel load_quantized_llama(const std::string& model_dir, const HfModelConfig& config,
                                 const ModelLoadOptions& options, const SafetensorsCheckpoint& weights,
                                 const QuantizedLayerReader& read_layer);

// `<name>.bias` when the projection has one (an Error naming `source` if the checkpoint lacks it),
// recorded in `used`; undefined otherwise.
torch::Tensor read_bias(const SafetensorsCheckpoint& weights, const std::string& name,
                        const qat::DenseLinearOptions& dense, const std::string& source, std::set<std::string>& used);

}  // namespace qtrain::trainer
