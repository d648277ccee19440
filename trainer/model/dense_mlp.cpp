#include "trainer/model/dense_mlp.h"

#include "trainer/model/llama_layers.h"

namespace qtrain::trainer {

namespace {

std::vector<ProjectionShape> dense_mlp_projections(const LlamaOptions& options) {
  const int64_t hidden = options.hidden_size;
  const int64_t intermediate = options.intermediate_size;
  const bool bias = options.mlp_bias;
  const ProjectionShape down{"down_proj", intermediate, hidden, bias, ProjectionInput::kBlockActivation};
  if (options.fused_projections) return {{"gate_up_proj", hidden, 2 * intermediate, bias}, down};
  return {{"gate_proj", hidden, intermediate, bias}, {"up_proj", hidden, intermediate, bias}, down};
}

// The gate and up outputs, which the activation's backward keeps, and the torch operations' act(gate).
double dense_mlp_activation_values_per_token(const LlamaOptions& options, bool fused_kernels) {
  return (fused_kernels ? 2.0 : 3.0) * static_cast<double>(options.intermediate_size);
}

FeedForward make_dense_mlp(const LlamaOptions& options, const std::string& prefix, const LinearFactory& make_linear,
                           torch::ScalarType dtype) {
  // As the interface's pointer: a ModuleHolder converts to another no other way.
  return FeedForward(std::shared_ptr<FeedForwardImpl>(std::make_shared<DenseMlpImpl>(options, prefix, make_linear, dtype)));
}

// act(gate) * up; where `up` is undefined, `gate` is the fused projection's output holding both.
torch::Tensor gated_activation(bool gelu, const torch::Tensor& gate, const torch::Tensor& up) {
  if (!up.defined()) return gelu ? geglu_of_fused(gate) : swiglu_of_fused(gate);
  return gelu ? geglu(gate, up) : swiglu(gate, up);
}

}  // namespace

const FeedForwardRow& dense_mlp_row() {
  static const FeedForwardRow row{FeedForwardKind::kDense, "mlp", dense_mlp_projections,
                                  dense_mlp_activation_values_per_token, make_dense_mlp};
  return row;
}

DenseMlpImpl::DenseMlpImpl(const LlamaOptions& options, const std::string& prefix, const LinearFactory& make_linear,
                           torch::ScalarType dtype)
    : activation_(options.activation) {
  register_projections(*this, dense_mlp_projections(options), prefix, make_linear, dtype,
                       [this](const std::string& name) { return slot(name); });
}

std::shared_ptr<qat::LinearLayer>* DenseMlpImpl::slot(const std::string& child_name) {
  return child_name == "gate_proj"      ? &gate_proj
         : child_name == "gate_up_proj" ? &gate_up_proj
         : child_name == "up_proj"      ? &up_proj
         : child_name == "down_proj"    ? &down_proj
                                        : nullptr;
}

torch::Tensor DenseMlpImpl::forward(const torch::Tensor& hidden, const qat::LinearLayer::InputRebuild& rebuild_hidden) {
  return run(hidden, rebuild_hidden, /*for_graph=*/false);
}

torch::Tensor DenseMlpImpl::forward_for_graph(const torch::Tensor& hidden,
                                              const qat::LinearLayer::InputRebuild& rebuild_hidden) {
  return run(hidden, rebuild_hidden, /*for_graph=*/true);
}

torch::Tensor DenseMlpImpl::run(const torch::Tensor& hidden, const qat::LinearLayer::InputRebuild& rebuild_hidden,
                                bool for_graph) {
  // With gate_up_proj, `gate` is its whole [tokens, 2 * intermediate] output (gate's half first, as
  // Phi-3's chunk(2)), which the activation reads in place, and `up` stays undefined.
  torch::Tensor gate, up;
  if (gate_up_proj) {
    gate = gate_up_proj->forward_rebuilding_input(hidden, rebuild_hidden);
  } else {
    // up before gate: the order GCC evaluated them in as arguments of one call, which LoRA
    // dropout's masks draw their random numbers in (runs keep the numbers they always had).
    up = up_proj->forward_rebuilding_input(hidden, rebuild_hidden);
    gate = gate_proj->forward_rebuilding_input(hidden, rebuild_hidden);
  }
  const bool gelu = activation_ == Activation::kGeluTanh;
  if (!torch::GradMode::is_enabled()) {
    // Let go of gate and up before down_proj runs: where autograd keeps nothing (checkpointing's
    // first forward, evaluation) their 2 x [tokens, intermediate] go back now, not after it.
    const auto product = gated_activation(gelu, gate, up);
    gate = up = torch::Tensor();
    return for_graph ? down_proj->forward_for_graph(product, {}) : down_proj->forward(product);
  }
  // The activation's backward keeps gate and up; down_proj's adapter makes the product again from
  // them for its own backward instead of keeping it too ([tokens, intermediate]: a fifth of what a
  // layer keeps). The same kernel on the same values: the same bits.
  const auto rebuild = [gate = gate.detach(), up = up.defined() ? up.detach() : torch::Tensor(), gelu] {
    return gated_activation(gelu, gate, up);
  };
  // Where down_proj's output is unread and it reads no value of its input either (it makes it
  // again for backward), the product's values are left unwritten too: only the activation's node.
  const auto product = for_graph && !down_proj->reads_input_for_graph() ? gated_activation_for_graph(gelu, gate, up)
                                                                        : gated_activation(gelu, gate, up);
  gate = up = torch::Tensor();
  return for_graph ? down_proj->forward_for_graph(product, rebuild) : down_proj->forward_rebuilding_input(product, rebuild);
}

void DenseMlpImpl::replace_linear(const std::string& child_name, std::shared_ptr<qat::LinearLayer> layer) {
  replace_projection(*this, [this](const std::string& name) { return slot(name); }, child_name, std::move(layer));
}

}  // namespace qtrain::trainer
