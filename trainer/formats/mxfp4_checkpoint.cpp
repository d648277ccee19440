#include "trainer/formats/mxfp4_checkpoint.h"

#include "kernels/error.h"
#include "qat/mxfp4_linear.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {

bool is_mxfp4_checkpoint(const HfModelConfig& config) {
  if (!config.has_quantization_config) return false;
  const auto object = quantization_config_json(config);
  return object.is_object() && object.value("quant_method", std::string()) == "mxfp4";
}

LoadedModel load_mxfp4_llama(const std::string& model_dir, const HfModelConfig& config, const ModelLoadOptions& options) {
  const auto& experts = config.llama.experts;
  if (config.llama.feed_forward != FeedForwardKind::kExperts) {
    throw Error(ErrorCode::kModelConfig, config.path + ": quantization_config mxfp4 on a model without experts; qtrain reads "
                                         "MXFP4 expert banks (gpt-oss)");
  }
  const auto weights = SafetensorsCheckpoint::open(model_dir);
  const auto read = [&](const std::string& name, std::set<std::string>& used) {
    if (!weights.contains(name)) throw Error(ErrorCode::kWeights, model_dir + ": tensor '" + name + "' is missing (an MXFP4 expert bank's)");
    used.insert(name);
    return weights.tensor(name);
  };
  const QuantizedLayerReader read_layer = [&](const std::string& name, const qat::DenseLinearOptions& dense,
                                              std::set<std::string>& used) -> std::shared_ptr<qat::LinearLayer> {
    const bool gate_up = name.size() > 13 && name.compare(name.size() - 13, 13, ".gate_up_proj") == 0;
    const bool down = name.size() > 10 && name.compare(name.size() - 10, 10, ".down_proj") == 0;
    if (name.find(".mlp.experts.") == std::string::npos || !(gate_up || down) || !weights.contains(name + "_blocks")) return nullptr;
    auto blocks = read(name + "_blocks", used);  // [experts, out, in / 32, 16]
    auto scales = read(name + "_scales", used);  // [experts, out, in / 32]
    auto bias = dense.bias ? read(name + "_bias", used) : torch::Tensor();  // [experts, out]
    if (blocks.dim() != 4 || blocks.size(0) != experts.num_experts || blocks.size(1) * blocks.size(0) != dense.out_features ||
        blocks.size(2) * 32 != dense.in_features) {
      throw Error(ErrorCode::kWeights, model_dir + ": tensor '" + name + "_blocks' has shape " + shape_text(blocks.sizes()) +
                                           ", config.json expects [" + std::to_string(experts.num_experts) + ", " +
                                           std::to_string(dense.out_features / experts.num_experts) + ", " +
                                           std::to_string(dense.in_features / 32) + ", 16]");
    }
    if (gate_up && experts.interleaved_gate_up) {
      // Gate's rows (even) first, then up's (odd), as the bank holds them: whole rows move.
      const int64_t rows = blocks.size(1);
      const auto order = torch::cat({torch::arange(0, rows, 2), torch::arange(1, rows, 2)});
      blocks = blocks.index_select(1, order);
      scales = scales.index_select(1, order);
      if (bias.defined()) bias = bias.index_select(1, order);
    }
    return std::make_shared<qat::Mxfp4Linear>(blocks.flatten(0, 1), scales.flatten(0, 1),
                                              bias.defined() ? bias.flatten() : torch::Tensor(), options.dtype);
  };
  return load_quantized_llama(model_dir, config, options, weights, read_layer);
}

}  // namespace qtrain::trainer
