#include "trainer/formats/expert_checkpoint.h"

#include <map>

#include "kernels/error.h"
#include "trainer/formats/safetensors.h"
#include "trainer/model/model_families.h"

namespace qtrain::trainer {

namespace {

// model.layers.N.mlp.{gate.weight, experts.gate_up_proj.weight, experts.down_proj.weight}: the
// names the model gives them.
struct LayerNames {
  std::string layer;  // "model.layers.N."
  std::string router() const { return layer + "mlp.gate.weight"; }
  std::string bank(const std::string& projection) const { return layer + "mlp.experts." + projection + ".weight"; }
};

bool has_experts(const LlamaOptions& llama, int64_t layer) {
  return llama.layer_feed_forward(layer) == FeedForwardKind::kExperts;
}

// gpt-oss's interleaved gate / up along `dim` (gate even, up odd) as the bank's gate-first halves, and back.
torch::Tensor gate_first(const torch::Tensor& interleaved, int64_t dim) {
  const int64_t width = interleaved.size(dim);
  return torch::cat({interleaved.slice(dim, 0, width, 2), interleaved.slice(dim, 1, width, 2)}, dim);
}
torch::Tensor interleaved(const torch::Tensor& gate_first_halves, int64_t dim) {
  const auto halves = gate_first_halves.chunk(2, dim);
  return torch::stack({halves[0], halves[1]}, dim + 1).flatten(dim, dim + 1);
}

}  // namespace

void load_expert_tensors(torch::nn::Module& model, const HfModelConfig& config, const SafetensorsCheckpoint& weights,
                         const std::string& source, std::set<std::string>& loaded) {
  const auto& llama = config.llama;
  if (llama.feed_forward != FeedForwardKind::kExperts) return;
  const auto& stored = config.family->expert_names;
  std::map<std::string, torch::Tensor> parameters;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) parameters[item.key()] = item.value();
  for (const auto& item : model.named_buffers(/*recurse=*/true)) parameters[item.key()] = item.value();
  torch::NoGradGuard no_grad;

  const auto read = [&](const std::string& name, const std::vector<int64_t>& shape) {
    if (!weights.contains(name)) throw Error(ErrorCode::kWeights, source + ": tensor '" + name + "' is missing");
    auto tensor = weights.tensor(name);
    if (tensor.sizes().vec() != shape) {
      throw Error(ErrorCode::kWeights, source + ": tensor '" + name + "' has shape " + shape_text(tensor.sizes()) +
                                           ", config.json expects " + shape_text(shape));
    }
    loaded.insert(name);
    return tensor;
  };
  const auto fill = [&](const std::string& name, const torch::Tensor& value) {
    const auto found = parameters.find(name);
    if (found == parameters.end()) return;  // a bank held in another form (a pre-quantized base)
    found->second.copy_(value.reshape(found->second.sizes()));
    loaded.insert(name);
  };

  const int64_t experts = llama.experts.num_experts;
  const int64_t hidden = llama.hidden_size;
  const int64_t intermediate = llama.experts.intermediate_size;
  for (int64_t layer = 0; layer < llama.num_hidden_layers; ++layer) {
    if (!has_experts(llama, layer)) continue;
    const LayerNames names{"model.layers." + std::to_string(layer) + "."};
    const std::string block = names.layer + stored.block + ".";
    // Mixtral's published router sits in its block_sparse_moe; elsewhere it loads by its name.
    if (!weights.contains(names.router()) && weights.contains(block + "gate.weight")) {
      fill(names.router(), read(block + "gate.weight", {experts, hidden}));
    }
    if (llama.experts.interleaved_gate_up) {
      // gpt-oss: [experts, in, out] as x @ W, gate / up interleaved, with biases (its MXFP4 form
      // is trainer/formats/mxfp4_checkpoint.h's).
      const std::string fused = names.layer + "mlp.experts.";
      fill(names.bank("gate_up_proj"), gate_first(read(fused + "gate_up_proj", {experts, hidden, 2 * intermediate}).transpose(1, 2), 1));
      fill(names.layer + "mlp.experts.gate_up_proj.bias", gate_first(read(fused + "gate_up_proj_bias", {experts, 2 * intermediate}), 1));
      fill(names.bank("down_proj"), read(fused + "down_proj", {experts, intermediate, hidden}).transpose(1, 2));
      fill(names.layer + "mlp.experts.down_proj.bias", read(fused + "down_proj_bias", {experts, hidden}));
      continue;
    }
    if (weights.contains(names.layer + "mlp.experts.gate_up_proj")) {
      fill(names.bank("gate_up_proj"), read(names.layer + "mlp.experts.gate_up_proj", {experts, 2 * intermediate, hidden}));
      fill(names.bank("down_proj"), read(names.layer + "mlp.experts.down_proj", {experts, hidden, intermediate}));
      continue;
    }
    std::vector<torch::Tensor> gate_up, down;
    for (int64_t expert = 0; expert < experts; ++expert) {
      const std::string prefix = block + "experts." + std::to_string(expert) + ".";
      gate_up.push_back(torch::cat({read(prefix + stored.gate + ".weight", {intermediate, hidden}),
                                    read(prefix + stored.up + ".weight", {intermediate, hidden})}));
      down.push_back(read(prefix + stored.down + ".weight", {hidden, intermediate}));
    }
    fill(names.bank("gate_up_proj"), torch::stack(gate_up));
    fill(names.bank("down_proj"), torch::stack(down));
  }
}

std::vector<std::pair<std::string, torch::Tensor>> published_expert_tensors(const HfModelConfig& config,
                                                                           const std::string& name,
                                                                           const torch::Tensor& tensor) {
  const auto& llama = config.llama;
  if (llama.feed_forward != FeedForwardKind::kExperts) return {{name, tensor}};
  const auto& stored = config.family->expert_names;
  for (int64_t layer = 0; layer < llama.num_hidden_layers; ++layer) {
    if (!has_experts(llama, layer)) continue;
    const LayerNames names{"model.layers." + std::to_string(layer) + "."};
    const std::string block = names.layer + stored.block + ".";
    const int64_t experts = llama.experts.num_experts;
    if (llama.experts.interleaved_gate_up) {
      // gpt-oss: fused, [experts, in, out], gate / up interleaved, biases beside.
      const std::string fused = names.layer + "mlp.experts.";
      if (name == names.bank("gate_up_proj")) {
        return {{fused + "gate_up_proj", interleaved(tensor.reshape({experts, -1, tensor.size(-1)}), 1).transpose(1, 2).contiguous()}};
      }
      if (name == fused + "gate_up_proj.bias") return {{fused + "gate_up_proj_bias", interleaved(tensor.reshape({experts, -1}), 1).contiguous()}};
      if (name == names.bank("down_proj")) return {{fused + "down_proj", tensor.reshape({experts, -1, tensor.size(-1)}).transpose(1, 2).contiguous()}};
      if (name == fused + "down_proj.bias") return {{fused + "down_proj_bias", tensor.reshape({experts, -1})}};
      continue;
    }
    if (name == names.router() && stored.block != "mlp") return {{block + "gate.weight", tensor}};
    const bool gate_up = name == names.bank("gate_up_proj");
    if (!gate_up && name != names.bank("down_proj")) continue;
    const auto banks = tensor.reshape({experts, -1, tensor.size(-1)});
    std::vector<std::pair<std::string, torch::Tensor>> published;
    for (int64_t expert = 0; expert < experts; ++expert) {
      const std::string prefix = block + "experts." + std::to_string(expert) + ".";
      if (gate_up) {
        const auto halves = banks[expert].chunk(2, 0);
        published.emplace_back(prefix + stored.gate + ".weight", halves[0].contiguous());
        published.emplace_back(prefix + stored.up + ".weight", halves[1].contiguous());
      } else {
        published.emplace_back(prefix + stored.down + ".weight", banks[expert].contiguous());
      }
    }
    return published;
  }
  return {{name, tensor}};
}

}  // namespace qtrain::trainer
