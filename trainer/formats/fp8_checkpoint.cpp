#include "trainer/formats/fp8_checkpoint.h"

#include <set>

#include "kernels/error.h"
#include "qat/compressed_linear.h"
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

LoadedModel load_fp8_block_llama(const std::string& model_dir, const HfModelConfig& config,
                                 const ModelLoadOptions& options) {
  const auto blocks = read_fp8_block_config(config);
  const auto weights = SafetensorsCheckpoint::open(model_dir);
  // The activation scales some FP8 checkpoints carry (static activation schemes) are not used:
  // the matmuls run in the compute dtype.
  const std::string activation_scale = ".input_scale";
  return load_quantized_llama(
      model_dir, config, options, weights,
      [&](const std::string& name, const qat::DenseLinearOptions& dense,
          std::set<std::string>& used) -> std::shared_ptr<qat::LinearLayer> {
        const std::string weight_name = name + ".weight";
        if (!weights.contains(weight_name) || weights.info(weight_name).dtype != "F8_E4M3") return nullptr;
        const std::string scale_name = weight_name + kScaleSuffix;
        if (!weights.contains(scale_name)) {
          throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + weight_name + "' is FP8 but '" + scale_name +
                                               "' (its blocks' scales) is missing");
        }
        qat::CompressedWeight stored;
        stored.format = qat::CompressionFormat::kFp8Blocks;
        stored.spec.format = qat::QuantFormat::kFp8E4m3;
        stored.spec.bits = 8;
        stored.out_features = dense.out_features;
        stored.in_features = dense.in_features;
        stored.block_rows = blocks.block_rows;
        stored.block_columns = blocks.block_columns;
        stored.data = weights.tensor(weight_name);
        stored.scale = weights.tensor(scale_name);
        const std::vector<int64_t> expected_scales = {(dense.out_features + blocks.block_rows - 1) / blocks.block_rows,
                                                      (dense.in_features + blocks.block_columns - 1) / blocks.block_columns};
        if (stored.data.sizes() != c10::IntArrayRef({dense.out_features, dense.in_features}) ||
            stored.scale.sizes().vec() != expected_scales || !stored.scale.is_floating_point()) {
          throw Error(ErrorCode::kWeights, weights.source() + ": tensor '" + weight_name + "' " + shape_text(stored.data.sizes()) +
                                               " with scales " + shape_text(stored.scale.sizes()) + ": the model expects " +
                                               shape_text({dense.out_features, dense.in_features}) + " and scales of its " +
                                               std::to_string(blocks.block_rows) + " x " +
                                               std::to_string(blocks.block_columns) + " blocks");
        }
        used.insert(weight_name);
        used.insert(scale_name);
        if (weights.contains(name + activation_scale)) used.insert(name + activation_scale);
        const auto bias = read_bias(weights, name, dense, model_dir, used);
        return std::make_shared<qat::CompressedLinear>(std::move(stored), bias, options.dtype);
      });
}

}  // namespace qtrain::trainer
