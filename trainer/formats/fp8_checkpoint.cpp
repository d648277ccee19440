#include "trainer/formats/fp8_checkpoint.h"

#include <set>

#include "kernels/error.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {

namespace {

constexpr const char* kScaleSuffix = "_scale_inv";

struct Fp8BlockConfig {
  int64_t block_rows = 128;
  int64_t block_columns = 128;
};

Fp8BlockConfig read_fp8_block_config(const HfModelConfig& config) {
  const auto object = quantization_config_json(config);
  const std::string where = config.path + ": quantization_config.";
  const std::string format = object.value("fmt", std::string("e4m3"));
  if (format != "e4m3") {
    throw Error(ErrorCode::kModelConfig, where + "fmt is '" + format + "': only e4m3 FP8 checkpoints are read");
  }
  if (!object.contains("weight_block_size") || !object.at("weight_block_size").is_array() ||
      object.at("weight_block_size").size() != 2) {
    throw Error(ErrorCode::kModelConfig, where + "weight_block_size must be [rows, columns] (fine-grained FP8, as "
                "Qwen3 and DeepSeek publish); per-tensor FP8 checkpoints are not read");
  }
  Fp8BlockConfig result;
  result.block_rows = object.at("weight_block_size").at(0).get<int64_t>();
  result.block_columns = object.at("weight_block_size").at(1).get<int64_t>();
  if (result.block_rows < 1 || result.block_columns < 1) {
    throw Error(ErrorCode::kModelConfig, where + "weight_block_size must be positive, got " +
                                             object.at("weight_block_size").dump());
  }
  return result;
}

}  // namespace

bool is_fp8_block_checkpoint(const HfModelConfig& config) {
  if (!config.has_quantization_config) return false;
  const auto object = quantization_config_json(config);
  return object.is_object() && object.value("quant_method", std::string()) == "fp8";
}

torch::Tensor dequantize_fp8_blocks(const torch::Tensor& fp8, const torch::Tensor& scale_inv, int64_t block_rows,
                                    int64_t block_columns, torch::ScalarType dtype) {
  const int64_t rows = fp8.size(0);
  const int64_t columns = fp8.size(1);
  const auto scales = scale_inv.to(torch::kFloat32)
                          .repeat_interleave(block_rows, 0)
                          .repeat_interleave(block_columns, 1)
                          .narrow(0, 0, rows)
                          .narrow(1, 0, columns);
  return (fp8.to(torch::kFloat32) * scales).to(dtype);
}

LoadedModel load_fp8_block_llama(const std::string& model_dir, const HfModelConfig& config,
                                 const ModelLoadOptions& options) {
  const auto blocks = read_fp8_block_config(config);
  const auto weights = SafetensorsCheckpoint::open(model_dir);
  LoadedModel loaded;
  loaded.config = config;
  loaded.model = LlamaForCausalLM(config.llama, options.dtype, options.make_linear);
  std::set<std::string> dequantized;
  {
    torch::NoGradGuard no_grad;
    for (auto& item : loaded.model->named_parameters(/*recurse=*/true)) {
      const std::string& name = item.key();
      if (!weights.contains(name) || weights.info(name).dtype != "F8_E4M3") continue;
      const std::string scale_name = name + kScaleSuffix;
      if (!weights.contains(scale_name)) {
        throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + name + "' is FP8 but '" + scale_name +
                                             "' (its blocks' scales) is missing");
      }
      const auto fp8 = weights.tensor(name);
      const auto scale_inv = weights.tensor(scale_name);
      auto& target = item.value();
      const std::vector<int64_t> expected_scales = {(fp8.size(0) + blocks.block_rows - 1) / blocks.block_rows,
                                                    (fp8.size(1) + blocks.block_columns - 1) / blocks.block_columns};
      if (fp8.dim() != 2 || fp8.sizes() != target.sizes() || scale_inv.sizes().vec() != expected_scales) {
        throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + name + "' " + shape_text(fp8.sizes()) +
                                             " with scales " + shape_text(scale_inv.sizes()) + ": the model expects " +
                                             shape_text(target.sizes()) + " and scales of its " +
                                             std::to_string(blocks.block_rows) + " x " +
                                             std::to_string(blocks.block_columns) + " blocks");
      }
      target.copy_(dequantize_fp8_blocks(fp8, scale_inv, blocks.block_rows, blocks.block_columns, options.dtype));
      dequantized.insert(name);
      dequantized.insert(scale_name);
    }
  }
  // The activation scales some FP8 checkpoints carry (static activation schemes) are not used:
  // the matmuls run in the compute dtype.
  std::set<std::string> unused = dequantized;
  const std::string activation_scale = ".input_scale";
  for (const auto& name : weights.names()) {
    if (name.size() > activation_scale.size() &&
        name.compare(name.size() - activation_scale.size(), activation_scale.size(), activation_scale) == 0) {
      unused.insert(name);
    }
  }
  load_state(*loaded.model, weights, model_dir, config.llama.tie_word_embeddings, unused);
  loaded.model->to(options.device);
  loaded.model->eval();
  return loaded;
}

}  // namespace qtrain::trainer
