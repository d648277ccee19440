#include "trainer/recipe/base_quantization.h"

#include <functional>

#include "kernels/error.h"
#include "kernels/cuda_build.h"
#include "kernels/float8_rows.h"
#include "qat/compressed_linear.h"
#include "qat/float8_matmul.h"
#include "qat/layer_replacement.h"
#include "qat/four_bit_codec.h"
#include "qat/four_bit_format.h"

namespace qtrain::trainer {

namespace {

// FP8 tensor cores take only multiples of 16; anything else would run the slow reference path.
// `key` names the setting that asked for them; `multiplies_on_float8` picks the layers it moves.
void require_float8_sizes(LlamaForCausalLMImpl& model, const std::string& key,
                          const std::function<bool(const std::string&, const qat::LinearLayer&)>& multiplies_on_float8) {
  const auto misfits = qat::find_linear_layers(
      model,
      [&](const std::string& name, const qat::LinearLayer& layer) {
        return multiplies_on_float8(name, layer) && (layer.in_features() % 16 != 0 || layer.out_features() % 16 != 0);
      },
      [](const qat::LinearLayer&) { return false; });
  if (!misfits.empty()) {
    const auto& layer = *misfits.front().layer;
    throw Error(ErrorCode::kRecipe, key + " multiplies on FP8 tensor cores, which take sizes in multiples of 16, and " +
                misfits.front().name + " is [" + std::to_string(layer.out_features()) + ", " +
                std::to_string(layer.in_features()) + "]: use nf4 without it, or add it to qlora.skip_modules");
  }
}

// The dense projections a base quantizes (not in qlora.skip_modules).
std::function<bool(const std::string&, const qat::LinearLayer&)> quantized_dense(const BaseQuantizationSettings& settings) {
  return [&settings](const std::string& name, const qat::LinearLayer& layer) {
    return !qat::module_name_matches(name, settings.skip_modules) && dynamic_cast<const qat::DenseLinear*>(&layer);
  };
}

bool is_four_bit(const std::string&, const qat::LinearLayer& layer) {
  return dynamic_cast<const qat::FourBitLinear*>(&layer) != nullptr;
}

void quantize_four_bit(LlamaForCausalLMImpl& model, const BaseQuantizationSettings& settings) {
  auto options = settings.four_bit;
  options.quant_type = base_quantization_name(settings.kind);
  const bool on_gpu = options.device && options.device->is_cuda();
  if (settings.multiply_on_float8 && on_gpu) {
    qat::require_float8_tensor_cores(*options.device, settings.compute_dtype, "qlora.fp8_compute", "train.dtype");
    // Before quantizing what the base quantizes, and again after it for the 4-bit layers a
    // pre-quantized checkpoint brought (every 4-bit layer multiplies on FP8).
    require_float8_sizes(model, "qlora.fp8_compute", quantized_dense(settings));
  }
  qat::quantize_linear_layers(model, options, settings.skip_modules);
  if (!settings.multiply_on_float8) return;
  if (on_gpu) require_float8_sizes(model, "qlora.fp8_compute", is_four_bit);
  const auto four_bit_layers = qat::find_linear_layers(model, is_four_bit, [](const qat::LinearLayer&) { return false; });
  for (const auto& found : four_bit_layers) {
    std::static_pointer_cast<qat::FourBitLinear>(found.layer)->multiply_on_float8(settings.float8.fast_accumulation);
  }
}

void quantize_int8(LlamaForCausalLMImpl& model, const BaseQuantizationSettings& settings) {
  qat::quantize_linear_layers_int8(model, settings.int8, settings.skip_modules);
}

// The projections as e4m3 rows (Float8Linear); `key` names the setting that asked for it.
void quantize_rows_float8(LlamaForCausalLMImpl& model, const BaseQuantizationSettings& settings,
                          const qat::Float8Options& options, const std::string& key) {
  if (options.device && options.device->is_cuda()) {
    qat::require_float8_tensor_cores(*options.device, settings.compute_dtype, key, "train.dtype");
    require_float8_sizes(model, key, quantized_dense(settings));
  }
  qat::quantize_linear_layers_float8(model, options, settings.skip_modules);
}

void quantize_float8(LlamaForCausalLMImpl& model, const BaseQuantizationSettings& settings) {
  quantize_rows_float8(model, settings, settings.float8, "qlora.quant_type: fp8");
}

// A 16-bit base stays dense, or multiplies on FP8 tensor cores from e4m3 rows, its 16-bit weights
// kept on the host.
void keep_dense(LlamaForCausalLMImpl& model, const BaseQuantizationSettings& settings) {
  // A checkpoint's own e4m3 rows (compressed-tensors FP8_DYNAMIC: FP8 weights, FP8 inputs per token)
  // multiply as they are stored, on FP8 tensor cores: under qlora.fp8_compute, and by default where
  // the GPU has them and the run computes in bf16 (the emulation runs at about a third of the speed).
  const auto& device = settings.float8.device;
  const bool on_tensor_cores = device && device->is_cuda() && kernels::kCudaKernelsBuilt &&
                               settings.compute_dtype == torch::kBFloat16 &&
                               kernels::float8_tensor_cores(device->has_index() ? device->index() : -1);
  if (settings.multiply_on_float8 && device && device->is_cuda()) {
    qat::require_float8_tensor_cores(*device, settings.compute_dtype, "qlora.fp8_compute", "train.dtype");
  }
  if (settings.multiply_on_float8 || on_tensor_cores) {
    qat::multiply_stored_float8_rows_on_tensor_cores(model, settings.compute_dtype, settings.float8.fast_accumulation);
  }
  if (!settings.multiply_on_float8) return;
  auto options = settings.float8;
  options.keep_dense_weight_on_host = true;
  quantize_rows_float8(model, settings, options, "qlora.fp8_compute");
}

// FourBitLinear's buffers (qat/four_bit_linear.h): the packed codes, an absmax per block (uint8
// codes when double-quantized, else fp32), the 4-bit code table, and with double quantization the
// fp32 absmax of every 256 absmax codes and their 256-entry table.
double four_bit_bytes(int64_t out, int64_t in, const BaseQuantizationSettings& settings) {
  const auto& options = settings.four_bit;
  const int64_t elements = out * in;
  const int64_t blocks = (elements + options.blocksize - 1) / options.blocksize;
  double bytes = static_cast<double>((elements + 1) / 2) + sizeof(qat::FourBitFormat::code);
  if (options.double_quant) {
    const int64_t nested_blocks = (blocks + qat::kNestedBlocksize - 1) / qat::kNestedBlocksize;
    bytes += static_cast<double>(blocks) + 4.0 * static_cast<double>(nested_blocks) +
             static_cast<double>(qat::signed_dynamic_map().nbytes());
  } else {
    bytes += 4.0 * static_cast<double>(blocks);
  }
  return bytes;
}

// Int8Linear's buffers (qat/int8_linear.h): one int8 code per weight, an fp32 absmax (SCB) per row.
double int8_bytes(int64_t out, int64_t in, const BaseQuantizationSettings&) {
  return static_cast<double>(in * out) + 4.0 * static_cast<double>(out);
}

// Float8Linear's buffers (qat/float8_linear.h): one e4m3 code per weight, an fp32 scale per row.
double float8_bytes(int64_t out, int64_t in, const BaseQuantizationSettings&) {
  return static_cast<double>(in * out) + 4.0 * static_cast<double>(out);
}

// On the device: the 16-bit weight, or its e4m3 rows when it multiplies on FP8.
double dense_bytes(int64_t out, int64_t in, const BaseQuantizationSettings& settings) {
  if (settings.multiply_on_float8) return float8_bytes(out, in, settings);
  return static_cast<double>(out * in) * static_cast<double>(c10::elementSize(settings.compute_dtype));
}

// A base of `kind` computing in `compute_dtype`, every other setting at its default.
BaseQuantizationSettings compute_settings(BaseQuantization kind, torch::ScalarType compute_dtype) {
  BaseQuantizationSettings settings;
  settings.kind = kind;
  settings.compute_dtype = compute_dtype;
  settings.four_bit.compute_dtype = compute_dtype;
  settings.int8.compute_dtype = compute_dtype;
  settings.float8.compute_dtype = compute_dtype;
  return settings;
}

// ---- random layers (qtrain bench) ----

// Random 4-bit codes and double-quantized absmax codes, indexing a real quantization's tables.
// Quantizing 8B random weights would run bnb's exact codec on the CPU for minutes and measure
// nothing a training step does.
std::shared_ptr<qat::LinearLayer> random_four_bit(const RandomLayerOptions& layer, const BaseQuantizationSettings& settings) {
  const auto& tables = layer.four_bit_tables;
  const int64_t out = layer.linear.out_features;
  const int64_t in = layer.linear.in_features;
  qat::FourBitTensor weight;
  weight.state = tables.state;
  weight.state.shape = {out, in};
  weight.state.dtype = settings.compute_dtype;
  const auto bytes = torch::TensorOptions().dtype(torch::kUInt8).device(layer.device);
  weight.packed = torch::randint(256, {(out * in + 1) / 2, 1}, bytes);
  const int64_t blocks = weight.state.blocks();
  weight.state.absmax = torch::randint(256, {blocks}, bytes);
  weight.state.nested_absmax = torch::full({(blocks + qat::kNestedBlocksize - 1) / qat::kNestedBlocksize}, 0.01,
                                           torch::TensorOptions().dtype(torch::kFloat32).device(layer.device));
  weight.state.code = tables.state.code.to(layer.device);
  weight.state.nested_code = tables.state.nested_code.to(layer.device);
  auto result = std::make_shared<qat::FourBitLinear>(weight, layer.bias, settings.compute_dtype);
  if (settings.multiply_on_float8) result->multiply_on_float8(settings.float8.fast_accumulation);
  return result;
}

// Random int8 codes and a row absmax of about what a 0.02-scaled weight has. Outlier columns come
// from the activations, not from here.
std::shared_ptr<qat::LinearLayer> random_int8(const RandomLayerOptions& layer, const BaseQuantizationSettings& settings) {
  const auto codes = torch::randint(-127, 128, {layer.linear.out_features, layer.linear.in_features},
                                    torch::TensorOptions().dtype(torch::kChar).device(layer.device));
  const auto absmax =
      torch::full({layer.linear.out_features}, 0.08, torch::TensorOptions().dtype(torch::kFloat32).device(layer.device));
  return std::make_shared<qat::Int8Linear>(codes, absmax, layer.bias, settings.int8.threshold, settings.compute_dtype);
}

// e4m3 rows of a random 0.02-scaled weight; `options` says whether its 16-bit weight waits on the host.
std::shared_ptr<qat::LinearLayer> random_float8_rows(const RandomLayerOptions& layer, const qat::Float8Options& options) {
  const auto on_device = torch::TensorOptions().dtype(options.compute_dtype).device(layer.device);
  return qat::Float8Linear::from_dense(
      torch::randn({layer.linear.out_features, layer.linear.in_features}, on_device) * 0.02, layer.bias, options);
}

std::shared_ptr<qat::LinearLayer> random_float8(const RandomLayerOptions& layer, const BaseQuantizationSettings& settings) {
  return random_float8_rows(layer, settings.float8);
}

// The 16-bit layer as the model builds it, or, multiplying on FP8, e4m3 rows as the FP8 base's
// with the 16-bit weight kept on the host.
std::shared_ptr<qat::LinearLayer> random_dense(const RandomLayerOptions& layer, const BaseQuantizationSettings& settings) {
  if (!settings.multiply_on_float8) return std::make_shared<qat::DenseLinear>(layer.linear);
  auto options = settings.float8;
  options.keep_dense_weight_on_host = true;
  return random_float8_rows(layer, options);
}

}  // namespace

const std::vector<BaseQuantizationRow>& base_quantizations() {
  static const std::vector<BaseQuantizationRow> rows = {
      // kind, description, quantize, weight_bytes, fused_lora, keeps_built_weights, builds_weight_rows,
      // random_layer
      {BaseQuantization::kNone, "16-bit base", keep_dense, dense_bytes, true, false, false, random_dense},
      {BaseQuantization::kNf4, "NF4 base (bitsandbytes Linear4bit)", quantize_four_bit, four_bit_bytes,
       true, true, true, random_four_bit},
      {BaseQuantization::kFp4, "FP4 base (bitsandbytes Linear4bit)", quantize_four_bit, four_bit_bytes,
       true, true, true, random_four_bit},
      {BaseQuantization::kInt8, "LLM.int8 base (bitsandbytes Linear8bitLt)", quantize_int8,
       int8_bytes, false, false, false, random_int8},
      {BaseQuantization::kFp8, "FP8 e4m3 base, a scale per row, FP8 tensor-core matmuls",
       quantize_float8, float8_bytes, true, false, false, random_float8},
  };
  return rows;
}

const BaseQuantizationRow& base_quantization_row(BaseQuantization kind) {
  for (const auto& row : base_quantizations()) {
    if (row.kind == kind) return row;
  }
  throw Error(ErrorCode::kInternal, "base quantization kind " + std::to_string(static_cast<int>(kind)) + " has no row");
}

const BaseQuantizationRow& base_quantization_named(const std::string& name, const std::string& what) {
  std::string names;
  for (const auto& row : base_quantization_names()) {
    if (row.name == name) return base_quantization_row(row.kind);
    names += (names.empty() ? "" : ", ") + std::string(row.name);
  }
  throw Error(ErrorCode::kUsage, what + ": '" + name + "' is not a base quantization (one of " + names + ")");
}

BaseQuantizationSettings base_quantization_settings(BaseQuantization kind, const QloraRecipe& qlora,
                                                    torch::ScalarType compute_dtype, const torch::Device& device) {
  BaseQuantizationSettings settings = compute_settings(kind, compute_dtype);
  settings.skip_modules = qlora.skip_modules;
  settings.four_bit.blocksize = qlora.blocksize;
  settings.four_bit.double_quant = qlora.double_quant;
  settings.four_bit.device = device;
  settings.int8.threshold = qlora.llm_int8_threshold;
  settings.float8.fast_accumulation = qlora.fp8_fast_accumulation;
  settings.multiply_on_float8 = qlora.fp8_compute;
  settings.int8.device = device;
  settings.float8.device = device;
  return settings;
}

BaseQuantizationSettings base_quantization(const Recipe& recipe, torch::ScalarType compute_dtype,
                                           const torch::Device& device) {
  BaseQuantization kind = BaseQuantization::kNone;
  if (recipe.quant == QuantMethod::kQlora) {
    kind = recipe.qlora.quant_type;
  } else if (recipe.quant == QuantMethod::kQat) {
    kind = recipe.qat.base;
  }
  const bool four_bit = kind == BaseQuantization::kNf4 || kind == BaseQuantization::kFp4;
  if (recipe.qlora.fp8_compute && recipe.quant == QuantMethod::kQat) {
    throw Error(ErrorCode::kRecipe, "qlora.fp8_compute multiplies a frozen 4-bit (quant: qlora) or 16-bit (quant: none) "
                "base on FP8 tensor cores, and quant is " + std::string(quant_method_name(recipe.quant)) + ": remove the key");
  }
  const bool dense_on_float8 = recipe.qlora.fp8_compute && recipe.quant == QuantMethod::kNone;
  if (dense_on_float8 && recipe.lora.rank == 0 && recipe.lora.init_from.empty()) {
    throw Error(ErrorCode::kRecipe, "qlora.fp8_compute multiplies a frozen base on FP8 tensor cores, and lora.rank: 0 "
                "trains every weight: give lora.rank, or remove the key");
  }
  if (recipe.qlora.fp8_compute && !four_bit && !dense_on_float8) {
    throw Error(ErrorCode::kRecipe, "qlora.fp8_compute multiplies a 4-bit base (nf4 or fp4) on FP8 tensor cores, and the "
                "base here is " + std::string(base_quantization_name(kind)) +
                (kind == BaseQuantization::kFp8 ? " (which multiplies on them already)" : "") + ": remove the key");
  }
  if (recipe.qlora.fp8_fast_accumulation && kind != BaseQuantization::kFp8 && !recipe.qlora.fp8_compute) {
    throw Error(ErrorCode::kRecipe, "qlora.fp8_fast_accumulation applies to FP8 matmuls only (qlora.quant_type: fp8, or "
                "qlora.fp8_compute: true), and the base here is " + std::string(base_quantization_name(kind)) +
                ": remove the key");
  }
  if (kind == BaseQuantization::kNone && !dense_on_float8) {
    auto settings = compute_settings(kind, compute_dtype);
    settings.float8.device = device;  // where a checkpoint's own e4m3 rows multiply (keep_dense)
    return settings;
  }
  return base_quantization_settings(kind, recipe.qlora, compute_dtype, device);
}

}  // namespace qtrain::trainer
