#include "trainer/formats/merged_export.h"

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "qat/linear.h"
#include "trainer/base/file_system.h"
#include "trainer/formats/expert_checkpoint.h"
#include "trainer/formats/generation_config.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {

namespace {

std::string torch_dtype_name(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat16: return "float16";
    case torch::kFloat32: return "float32";
    default: throw Error(ErrorCode::kUsage, "merged export: cannot write weights as " + std::string(c10::toString(dtype)) +
                         " (use bf16, fp16 or fp32)");
  }
}

// Walks the module tree in registration order (the order save_pretrained writes), taking each
// linear layer whole, so a LoRA layer's base_layer / lora_A / lora_B become one weight.
void collect(const torch::nn::Module& module, const std::string& prefix, torch::ScalarType dtype,
             std::vector<std::pair<std::string, torch::Tensor>>& out) {
  auto cpu = [dtype](const torch::Tensor& tensor) { return tensor.detach().to(torch::kCPU, dtype).contiguous(); };
  if (const auto* linear = dynamic_cast<const qat::LinearLayer*>(&module)) {
    // The merge and the dequantization run in fp32 whatever the output dtype, on the layer's device.
    out.emplace_back(prefix + "weight", cpu(linear->dense_weight(torch::kFloat32)));
    if (linear->bias().defined()) out.emplace_back(prefix + "bias", cpu(linear->bias()));
    return;
  }
  for (const auto& parameter : module.named_parameters(/*recurse=*/false)) {
    out.emplace_back(prefix + parameter.key(), cpu(parameter.value()));
  }
  for (const auto& child : module.named_children()) collect(*child.value(), prefix + child.key() + ".", dtype, out);
}

}  // namespace

std::vector<std::pair<std::string, torch::Tensor>> merged_weights(const LlamaForCausalLMImpl& model,
                                                                  torch::ScalarType dtype) {
  torch_dtype_name(dtype);  // refuses what Hugging Face configs cannot name
  torch::NoGradGuard no_grad;
  std::vector<std::pair<std::string, torch::Tensor>> weights;
  collect(model, "", dtype, weights);
  return weights;
}

std::string merged_config_json(const HfModelConfig& base_config, torch::ScalarType dtype) {
  auto config = nlohmann::ordered_json::parse(base_config.json);
  config.erase("quantization_config");
  const std::string name = torch_dtype_name(dtype);
  bool named = false;
  for (const char* key : {"dtype", "torch_dtype"}) {
    if (config.contains(key)) {
      config[key] = name;
      named = true;
    }
  }
  // transformers 4.x reads only torch_dtype; 5.x reads it too.
  if (!named) config["torch_dtype"] = name;
  return config.dump(2) + "\n";
}

uint64_t parse_byte_size(const std::string& text, const std::string& what) {
  struct Unit {
    const char* suffix;
    uint64_t bytes;
  };
  // Longest suffixes first, so "GIB" is not read as "B".
  static const Unit units[] = {{"GIB", 1ull << 30}, {"MIB", 1ull << 20}, {"KIB", 1ull << 10}, {"GB", 1'000'000'000},
                               {"MB", 1'000'000},   {"KB", 1'000},       {"B", 1}};
  std::string upper = text;
  std::transform(upper.begin(), upper.end(), upper.begin(), [](unsigned char c) { return std::toupper(c); });
  uint64_t multiplier = 1;
  std::string number = upper;
  for (const auto& unit : units) {
    const std::string suffix = unit.suffix;
    if (upper.size() > suffix.size() && upper.compare(upper.size() - suffix.size(), suffix.size(), suffix) == 0) {
      multiplier = unit.bytes;
      number = upper.substr(0, upper.size() - suffix.size());
      break;
    }
  }
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(number, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != number.size() || number.empty() || !(value > 0)) {
    throw Error(ErrorCode::kUsage, what + ": '" + text + "' is not a size (write it like 5GB, 500MB, 2GiB or a number of bytes)");
  }
  return static_cast<uint64_t>(value * static_cast<double>(multiplier));
}

void write_merged_model(const LlamaForCausalLMImpl& model, const BaseDirectory& base, const std::string& out_dir,
                        const MergedExportOptions& options) {
  // A mixture of experts' banks go out one tensor per expert, as its published checkpoints hold them.
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& [name, tensor] : merged_weights(model, options.dtype)) {
    for (auto& published : published_expert_tensors(base.config, name, tensor)) tensors.push_back(std::move(published));
  }
  write_safetensors_checkpoint(out_dir, tensors, options.max_shard_bytes);
  write_file_atomically(out_dir + "/config.json", merged_config_json(base.config, options.dtype));
  write_generation_config_and_tokenizer(base, out_dir);
}

void write_generation_config_and_tokenizer(const BaseDirectory& base, const std::string& out_dir) {
  write_file_atomically(out_dir + "/generation_config.json", generation_config_json(base));
  for (const auto& [name, text] : base.tokenizer_files) write_file_atomically(out_dir + "/" + name, text);
}

}  // namespace qtrain::trainer
