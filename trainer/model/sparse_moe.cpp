#include "trainer/model/sparse_moe.h"

#include "kernels/error.h"
#include "trainer/model/llama_layers.h"

namespace qtrain::trainer {

namespace {

// Each token's k rows of `rows` summed in the order `by_token` lists them (every token's k rows in
// turn), from zero in fp32 (or wider), rounded to the rows' dtype once: what the CPU's index_add_
// of the rows into zeros computes (16-bit types accumulate in fp32 there), bit for bit, by a
// gather and k adds instead of CUDA's atomics.
torch::Tensor sum_token_rows(const torch::Tensor& rows, const torch::Tensor& by_token, int64_t k) {
  const int64_t tokens = by_token.size(0) / k;
  const auto gathered = rows.index_select(0, by_token).view({tokens, k, rows.size(1)});
  const auto accumulate = rows.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  auto sum = torch::zeros({tokens, rows.size(1)}, rows.options().dtype(accumulate));
  for (int64_t slot = 0; slot < k; ++slot) sum.add_(gathered.select(1, slot));
  return sum.to(rows.scalar_type());
}

// Gathering the tokens' states into rows and summing the rows' outputs back are each other's
// adjoints: each one's backward is the other.
class GatherTokenRows : public torch::autograd::Function<GatherTokenRows> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* context, const torch::Tensor& x,
                               const torch::Tensor& token_of_row, const torch::Tensor& by_token, int64_t k) {
    context->saved_data["by_token"] = by_token;
    context->saved_data["k"] = k;
    return x.index_select(0, token_of_row);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list grads) {
    return {sum_token_rows(grads[0], context->saved_data["by_token"].toTensor(), context->saved_data["k"].toInt()),
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

class SumTokenRows : public torch::autograd::Function<SumTokenRows> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* context, const torch::Tensor& rows,
                               const torch::Tensor& token_of_row, const torch::Tensor& by_token, int64_t k) {
    context->saved_data["token_of_row"] = token_of_row;
    return sum_token_rows(rows, by_token, k);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list grads) {
    return {grads[0].index_select(0, context->saved_data["token_of_row"].toTensor()), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

std::vector<ProjectionShape> bank_projections(const LlamaOptions& options) {
  const int64_t experts = options.experts.num_experts;
  const int64_t hidden = options.hidden_size;
  const int64_t intermediate = options.experts.intermediate_size;
  const bool bias = options.experts.biases;
  return {{"gate_up_proj", hidden, experts * 2 * intermediate, bias, ProjectionInput::kBlockInput, experts},
          {"down_proj", intermediate, experts * hidden, bias, ProjectionInput::kBlockActivation, experts}};
}

// The router, then the banks under `experts.`: the names transformers gives them.
std::vector<ProjectionShape> sparse_moe_projections(const LlamaOptions& options) {
  ProjectionShape router{options.experts.router, options.hidden_size, options.experts.num_experts, options.experts.biases};
  router.stays_dense = true;
  std::vector<ProjectionShape> shapes = {router};
  for (auto shape : bank_projections(options)) {
    shape.name = "experts." + shape.name;
    shapes.push_back(shape);
  }
  return shapes;
}

// Per routed token (k of them per token): gate and up (the activation's backward keeps them), the
// torch operations' act(gate) too, and the sorted copy of the token the banks multiply.
double sparse_moe_activation_values_per_token(const LlamaOptions& options, bool fused_kernels) {
  const auto& experts = options.experts;
  return static_cast<double>(experts.experts_per_token) *
         ((fused_kernels ? 2.0 : 3.0) * static_cast<double>(experts.intermediate_size) +
          static_cast<double>(options.hidden_size));
}

FeedForward make_sparse_moe(const LlamaOptions& options, const std::string& prefix, const LinearFactory& make_linear,
                            torch::ScalarType dtype) {
  return FeedForward(std::shared_ptr<FeedForwardImpl>(std::make_shared<SparseMoeBlockImpl>(options, prefix, make_linear, dtype)));
}

}  // namespace

RowRouting route_rows(const torch::Tensor& order, int64_t k) {
  // Row r holds the pair order[r] = token * k + choice. Each token's rows are its k places in the
  // inverse permutation, sorted k at a time (what a stable sort of every row by token gives).
  const auto inverse = torch::empty_like(order).scatter_(0, order, torch::arange(order.numel(), order.options()));
  return {order.div(k, "floor"), std::get<0>(inverse.view({-1, k}).sort(-1)).reshape(-1), k};
}

torch::Tensor gather_token_rows(const torch::Tensor& x, const RowRouting& routing) {
  return GatherTokenRows::apply(x, routing.token_of_row, routing.by_token, routing.k);
}

torch::Tensor sum_rows_by_token(const torch::Tensor& rows, const RowRouting& routing) {
  return SumTokenRows::apply(rows, routing.token_of_row, routing.by_token, routing.k);
}

const FeedForwardRow& sparse_moe_row() {
  static const FeedForwardRow row{FeedForwardKind::kExperts, "mlp", sparse_moe_projections,
                                  sparse_moe_activation_values_per_token, make_sparse_moe};
  return row;
}

ExpertBanksImpl::ExpertBanksImpl(const LlamaOptions& options, const std::string& prefix, const LinearFactory& make_linear,
                                 torch::ScalarType dtype)
    : experts_(options.experts.num_experts), activation_(options.activation), swiglu_limit_(options.experts.swiglu_limit) {
  register_projections(*this, bank_projections(options), prefix, make_linear, dtype,
                       [this](const std::string& name) { return slot(name); });
}

std::shared_ptr<qat::LinearLayer>* ExpertBanksImpl::slot(const std::string& child_name) {
  return child_name == "gate_up_proj" ? &gate_up_proj : child_name == "down_proj" ? &down_proj : nullptr;
}

int64_t ExpertBanksImpl::bank_experts(const std::string& child_name) const {
  return child_name == "gate_up_proj" || child_name == "down_proj" ? experts_ : 0;
}

void ExpertBanksImpl::replace_linear(const std::string& child_name, std::shared_ptr<qat::LinearLayer> layer) {
  replace_projection(*this, [this](const std::string& name) { return slot(name); }, child_name, std::move(layer));
}

namespace {

// Each row times its expert's weight, plus its expert's bias where the bank has them (gpt-oss).
// `output_unread`: only the output's place in autograd's graph is needed (qat::bank_product_for_graph).
torch::Tensor bank_forward(qat::LinearLayer& bank, int64_t experts, const torch::Tensor& rows, const torch::Tensor& counts,
                           const torch::Tensor& row_experts, bool output_unread = false) {
  auto* lora = dynamic_cast<qat::ExpertLora*>(&bank);
  auto product = lora             ? lora->grouped_forward(rows, counts, output_unread)
                 : output_unread ? qat::bank_product_for_graph(bank, experts, rows, counts)
                                 : qat::bank_product(bank, experts, rows, counts);
  const auto bias = bank.bias();
  if (!bias.defined()) return product;
  return product + bias.to(product.scalar_type()).view({experts, -1}).index_select(0, row_experts);
}

// gpt-oss's SwiGLU: gate capped at `limit` from above, up clamped to ±limit, then
// (up + 1) · gate σ(1.702 gate), as transformers' GptOssExperts.
torch::Tensor clamped_swiglu(const torch::Tensor& gate, const torch::Tensor& up, double limit) {
  const auto capped = gate.clamp_max(limit);
  return (up.clamp(-limit, limit) + 1) * (capped * torch::sigmoid(capped * 1.702));
}

}  // namespace

torch::Tensor ExpertBanksImpl::forward(const torch::Tensor& rows, const torch::Tensor& counts, const torch::Tensor& row_experts,
                                       const torch::Tensor& row_weights, bool output_unread) {
  const auto fused = bank_forward(*gate_up_proj, experts_, rows, counts, row_experts);
  // Gate's half first, as transformers' chunk(2): read in place (no copies of the halves, and one
  // gradient of the fused rows in backward) but for gpt-oss's clamped form.
  torch::Tensor product;
  if (swiglu_limit_ > 0) {
    const int64_t intermediate = fused.size(-1) / 2;
    product = clamped_swiglu(fused.narrow(-1, 0, intermediate), fused.narrow(-1, intermediate, intermediate), swiglu_limit_);
  } else {
    product = activation_ == Activation::kGeluTanh ? geglu_of_fused(fused) : swiglu_of_fused(fused);
  }
  if (row_weights.defined()) product = (product * row_weights).to(product.scalar_type());
  return bank_forward(*down_proj, experts_, product, counts, row_experts, output_unread);
}

SparseMoeBlockImpl::SparseMoeBlockImpl(const LlamaOptions& options, const std::string& prefix,
                                       const LinearFactory& make_linear, torch::ScalarType dtype)
    : options_(options.experts) {
  const auto router = sparse_moe_projections(options).front();
  gate = register_module(router.name, make_linear(prefix + "." + router.name, projection_options(router, dtype)));
  router_name_ = router.name;
  experts = register_module("experts", ExpertBanks(options, prefix + ".experts", make_linear, dtype));
}

void SparseMoeBlockImpl::replace_linear(const std::string& child_name, std::shared_ptr<qat::LinearLayer> layer) {
  if (child_name != router_name_) {
    throw Error(ErrorCode::kInternal, "a mixture-of-experts block has no linear layer '" + child_name + "'");
  }
  gate = replace_module(child_name, std::move(layer));
}

torch::Tensor SparseMoeBlockImpl::forward(const torch::Tensor& hidden, const qat::LinearLayer::InputRebuild&) {
  return run(hidden, /*for_graph=*/false);
}

torch::Tensor SparseMoeBlockImpl::forward_for_graph(const torch::Tensor& hidden, const qat::LinearLayer::InputRebuild&) {
  return run(hidden, /*for_graph=*/true);
}

torch::Tensor SparseMoeBlockImpl::run(const torch::Tensor& hidden, bool for_graph) {
  const auto shape = hidden.sizes().vec();
  auto x = hidden.reshape({-1, shape.back()});
  const double jitter = options_.router_jitter_noise;
  if (is_training() && jitter > 0) x = x * torch::empty_like(x).uniform_(1.0 - jitter, 1.0 + jitter);
  const int64_t k = options_.experts_per_token;
  const int64_t count = options_.num_experts;

  // The router, as transformers' TopKRouter: logits in the model dtype.
  const auto logits = gate->forward(x);
  torch::Tensor weights, chosen, balance;
  if (options_.top_k_then_softmax) {
    // gpt-oss: the top-k logits' own softmax, in the model dtype.
    auto top = logits.topk(k, -1);
    chosen = std::get<1>(top);
    weights = torch::softmax(std::get<0>(top), -1, logits.scalar_type());
    if (router_loss_) {
      // The balance loss reads the softmax over every expert, which the output does not: its
      // gradient joins through a term that adds nothing.
      const auto observed = router_loss_->observe(torch::softmax(logits, -1, torch::kFloat32), chosen);
      if (observed.requires_grad()) balance = observed.sum() * 0;
    }
  } else {
    // softmax in fp32 over every expert, then the top k.
    auto probabilities = torch::softmax(logits, -1, torch::kFloat32);
    std::tie(weights, chosen) = probabilities.topk(k, -1);
    if (router_loss_) {
      probabilities = router_loss_->observe(probabilities, chosen);
      weights = probabilities.gather(1, chosen);  // the same values, through the loss's gradient
    }
    if (options_.normalize_top_k) weights = weights / weights.sum(-1, true);
    if (!options_.weights_in_fp32) weights = weights.to(hidden.scalar_type());
  }

  // Every (token, choice) pair sorted by expert; each expert's rows in token order.
  const auto flat_choice = chosen.reshape(-1);
  const auto order = std::get<1>(flat_choice.sort(/*stable=*/true, 0, false));
  const auto routing = route_rows(order, k);
  // How many rows each expert takes, without a trip to the host (bincount's length would need one).
  const auto counts = torch::zeros({count}, flat_choice.options()).index_add_(0, flat_choice, torch::ones_like(flat_choice));
  // Backward sums each token's rows' gradients as the output sums the rows (no atomics).
  const auto rows = gather_token_rows(x, routing);
  const auto row_weights = weights.reshape(-1).index_select(0, order).unsqueeze(1);
  torch::Tensor outputs;
  if (options_.biases) {
    // gpt-oss: each row's expert for the banks' biases, and the output with its bias weighed.
    outputs = experts->forward(rows, counts, flat_choice.index_select(0, order)) * row_weights;
  } else {
    // The router's weight scales the rows down_proj multiplies, not its output (the same products
    // to rounding: the bank is linear). So no backward reads down's output (the weight's gradient
    // is <down^T grad, rows>), and a recomputation (`for_graph`) leaves that product out.
    outputs = experts->forward(rows, counts, torch::Tensor(), row_weights, for_graph);
  }
  // Each token's k outputs added in expert order, in the model dtype, as transformers' index_add_
  // adds them (on the CPU; CUDA's atomics add in any order).
  auto result = sum_rows_by_token(outputs.to(x.scalar_type()), routing);
  if (balance.defined()) result = result + balance.to(result.scalar_type());
  return result.view(shape);
}

}  // namespace qtrain::trainer
