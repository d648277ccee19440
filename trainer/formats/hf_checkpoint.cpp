#include "trainer/formats/hf_checkpoint.h"

#include <set>
#include <sstream>
#include <vector>

#include "kernels/error.h"
#include "trainer/formats/bnb_checkpoint.h"
#include "trainer/formats/compressed_tensors.h"
#include "trainer/formats/expert_checkpoint.h"
#include "trainer/formats/fp8_checkpoint.h"
#include "trainer/formats/mxfp4_checkpoint.h"
#include "trainer/formats/safetensors_int.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {

namespace {

// Tensors a checkpoint may hold that the model recomputes instead of loading.
bool is_derived_tensor(const std::string& name, bool tie_word_embeddings) {
  const std::string rotary_suffix = "rotary_emb.inv_freq";
  if (name.size() >= rotary_suffix.size() &&
      name.compare(name.size() - rotary_suffix.size(), rotary_suffix.size(), rotary_suffix) == 0) {
    return true;
  }
  return tie_word_embeddings && name == "lm_head.weight";
}

}  // namespace

void load_state(torch::nn::Module& model, const SafetensorsCheckpoint& weights, const std::string& source,
                bool tie_word_embeddings, const std::set<std::string>& loaded_elsewhere) {
  torch::NoGradGuard no_grad;
  std::set<std::string> used = loaded_elsewhere;
  auto load_into = [&](const std::string& name, torch::Tensor& target) {
    if (loaded_elsewhere.count(name)) return;
    if (!weights.contains(name)) {
      throw Error(ErrorCode::kWeights, source + ": tensor '" + name + "' is missing (the model expects shape " +
                  shape_text(target.sizes()) + ")");
    }
    auto stored = weights.tensor(name);
    if (stored.sizes() != target.sizes()) {
      throw Error(ErrorCode::kWeights, source + ": tensor '" + name + "' has shape " + shape_text(stored.sizes()) +
                  ", config.json expects " + shape_text(target.sizes()));
    }
    if (!stored.is_floating_point()) {
      throw Error(ErrorCode::kWeights, source + ": tensor '" + name + "' has dtype " + std::string(c10::toString(stored.scalar_type())) +
                  ", expected floating point weights");
    }
    target.copy_(stored);
    used.insert(name);
  };
  for (auto& item : model.named_parameters(/*recurse=*/true)) load_into(item.key(), item.value());
  for (auto& item : model.named_buffers(/*recurse=*/true)) load_into(item.key(), item.value());

  std::vector<std::string> unexpected;
  for (const auto& name : weights.names()) {
    if (!used.count(name) && !is_derived_tensor(name, tie_word_embeddings)) unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string listed;
    for (size_t index = 0; index < unexpected.size() && index < 3; ++index) listed += " '" + unexpected[index] + "'";
    throw Error(ErrorCode::kWeights, source + ": " + std::to_string(unexpected.size()) +
                " tensor(s) the Llama model does not have:" + listed +
                (unexpected.size() > 3 ? " ..." : "") + " (is this a LlamaForCausalLM checkpoint?)");
  }
}

LoadedModel load_quantized_llama(const std::string& model_dir, const HfModelConfig& config,
                                 const ModelLoadOptions& options, const SafetensorsCheckpoint& weights,
                                 const QuantizedLayerReader& read_layer) {
  std::set<std::string> used;
  LinearFactory make_linear = [&](const std::string& name,
                                  const qat::DenseLinearOptions& dense) -> std::shared_ptr<qat::LinearLayer> {
    auto quantized = read_layer(name, dense, used);
    return quantized ? quantized : std::make_shared<qat::DenseLinear>(dense);
  };
  LoadedModel loaded;
  loaded.config = config;
  loaded.model = LlamaForCausalLM(config.llama, options.dtype, make_linear);
  // The quantized layers hold what the reader read; everything else loads by name.
  for (const auto& item : loaded.model->named_modules()) {
    const auto layer = std::dynamic_pointer_cast<qat::LinearLayer>(item.value());
    if (!layer || std::dynamic_pointer_cast<qat::DenseLinear>(layer)) continue;
    for (const auto& buffer : layer->named_buffers()) used.insert(item.key() + "." + buffer.key());
  }
  load_state(*loaded.model, weights, model_dir, config.llama.tie_word_embeddings, used);
  loaded.model->to(options.device);
  loaded.model->eval();
  return loaded;
}

torch::Tensor read_bias(const SafetensorsCheckpoint& weights, const std::string& name,
                        const qat::DenseLinearOptions& dense, const std::string& source, std::set<std::string>& used) {
  if (!dense.bias) return torch::Tensor();
  if (!weights.contains(name + ".bias")) throw Error(ErrorCode::kWeights, source + ": tensor '" + name + ".bias' is missing");
  used.insert(name + ".bias");
  return weights.tensor(name + ".bias");
}

namespace {

// The pre-quantized checkpoint formats, one row each: which quantization_config it is, and its
// loader (which keeps the quantized projections in their stored form where it can).
struct PrequantizedFormat {
  const char* name;  // for messages: what quant_method it reads
  bool (*is)(const HfModelConfig& config);
  LoadedModel (*load)(const std::string& model_dir, const HfModelConfig& config, const ModelLoadOptions& options);
};

const std::vector<PrequantizedFormat>& prequantized_formats() {
  static const std::vector<PrequantizedFormat> rows = {
      {"bitsandbytes 4-bit", is_bnb_4bit_checkpoint, load_bnb_4bit_llama},
      {"bitsandbytes 8-bit", is_bnb_8bit_checkpoint, load_bnb_8bit_llama},
      {"qtrain (safetensors-int)", is_qtrain_quantized_checkpoint, load_qtrain_quantized_llama},
      {"fp8 (fine-grained)", is_fp8_block_checkpoint, load_fp8_block_llama},
      {"compressed-tensors", is_compressed_tensors_checkpoint, load_compressed_tensors_llama},
      {"mxfp4", is_mxfp4_checkpoint, load_mxfp4_llama},
  };
  return rows;
}

}  // namespace

LoadedModel load_llama(const std::string& model_dir, const ModelLoadOptions& options) {
  LoadedModel loaded;
  loaded.config = read_hf_config(model_dir);
  std::string known;
  for (const auto& format : prequantized_formats()) {
    if (format.is(loaded.config)) return format.load(model_dir, loaded.config, options);
    known += (known.empty() ? "" : ", ") + std::string(format.name);
  }
  if (loaded.config.has_quantization_config) {
    throw Error(ErrorCode::kModelConfig, loaded.config.path + ": quantization_config is of a kind qtrain does not read (it reads " +
                known + "); give the unquantized model, or one of those");
  }
  auto weights = SafetensorsCheckpoint::open(model_dir);
  loaded.model = LlamaForCausalLM(loaded.config.llama, options.dtype, options.make_linear);
  std::set<std::string> experts;  // a mixture of experts' banks, stored per expert or fused
  load_expert_tensors(*loaded.model, loaded.config, weights, model_dir, experts);
  load_state(*loaded.model, weights, model_dir, loaded.config.llama.tie_word_embeddings, experts);
  loaded.model->to(options.device);
  loaded.model->eval();
  return loaded;
}

}  // namespace qtrain::trainer
