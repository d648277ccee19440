#include "qat/expert_linear.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/error.h"
#include "qat/adapter_switch.h"

namespace qtrain::qat {

namespace {

// torch's grouped GEMM takes bf16 / fp16 operands whose rows are whole 16-byte multiples.
bool grouped_gemm_takes(const torch::Tensor& rows, const torch::Tensor& weights) {
  if (!rows.is_cuda()) return false;
  const auto dtype = rows.scalar_type();
  if (dtype != torch::kBFloat16 || weights.scalar_type() != dtype) return false;
  const int64_t per_16_bytes = 8;
  return rows.size(1) % per_16_bytes == 0 && weights.size(1) % per_16_bytes == 0;
}

}  // namespace

torch::Tensor grouped_linear(const torch::Tensor& rows, const torch::Tensor& weights, const torch::Tensor& counts) {
  if (grouped_gemm_takes(rows, weights)) {
    const auto offsets = counts.cumsum(0).to(torch::kInt32);
    return at::_grouped_mm(rows.contiguous(), weights.transpose(1, 2), offsets);
  }
  // One product per expert with rows, in expert order: the counts come to the host once.
  const auto host_counts = counts.to(torch::kCPU, torch::kInt64);
  const auto* count = host_counts.data_ptr<int64_t>();
  std::vector<torch::Tensor> outputs;
  int64_t start = 0;
  for (int64_t expert = 0; expert < weights.size(0); ++expert) {
    if (count[expert] == 0) continue;
    outputs.push_back(torch::nn::functional::linear(rows.narrow(0, start, count[expert]), weights[expert]));
    start += count[expert];
  }
  if (outputs.empty()) return rows.new_empty({0, weights.size(1)});
  return torch::cat(outputs);
}

namespace {

// The bytes of the whole bank built in `dtype`.
int64_t built_bytes(const LinearLayer& bank, torch::ScalarType dtype) {
  return bank.out_features() * bank.in_features() * static_cast<int64_t>(c10::elementSize(dtype));
}

// experts_per_block for the bank built in `dtype`; all where the bank builds only whole weights.
int64_t bank_experts_per_block(const LinearLayer& bank, int64_t experts, torch::ScalarType dtype, int64_t block_bytes) {
  if (!bank.builds_weight_rows() || bank.multiplies_itself()) return experts;
  return experts_per_block(experts, built_bytes(bank, dtype) / experts, block_bytes);
}

// The grouped product of rows sorted by expert with each row's W_e, or with W_e^T (`transposed`:
// the input gradient), the bank built `per_block` experts at a time. Each block multiplies its own
// experts' rows (the counts on the host say where they lie), so every expert's product is the
// whole bank's; a block whose experts have no rows is not built.
torch::Tensor product_by_expert_blocks(const LinearLayer& bank, int64_t experts, const torch::Tensor& rows,
                                       const torch::Tensor& counts, const std::vector<int64_t>& on_host,
                                       int64_t per_block, bool transposed) {
  const int64_t out = bank.out_features() / experts;
  std::vector<torch::Tensor> products;
  int64_t start = 0;
  for (int64_t first = 0; first < experts; first += per_block) {
    const int64_t n = std::min(per_block, experts - first);
    int64_t block_rows = 0;
    for (int64_t expert = first; expert < first + n; ++expert) block_rows += on_host[expert];
    if (block_rows == 0) continue;
    auto weights = bank.matmul_weight_rows(rows.scalar_type(), first * out, (first + n) * out).view({n, out, -1});
    if (transposed) weights = weights.transpose(1, 2);
    products.push_back(grouped_linear(rows.narrow(0, start, block_rows), weights, counts.narrow(0, first, n)));
    start += block_rows;
  }
  if (products.empty()) return rows.new_empty({0, transposed ? bank.in_features() : out});
  return products.size() == 1 ? products.front() : torch::cat(products);
}

// What a product with a frozen bank that keeps only the counts saves for its backward, which
// builds the weights again (the bank outlives the step's backward: it is the model's). Built in
// blocks of experts where BuildBanksInBlocks asked it at the forward (the backward runs on
// autograd's thread); the counts then come to the host once, at the forward. Returns the experts
// a block holds and, for blocks, the counts on the host.
std::pair<int64_t, std::vector<int64_t>> save_for_rebuilding(torch::autograd::AutogradContext* context,
                                                             const torch::Tensor& rows, const torch::Tensor& counts,
                                                             const LinearLayer* bank, int64_t experts) {
  context->save_for_backward({counts});
  context->saved_data["bank"] = reinterpret_cast<int64_t>(bank);
  context->saved_data["experts"] = experts;
  const int64_t per_block = bank_experts_per_block(*bank, experts, rows.scalar_type(), BuildBanksInBlocks::bytes());
  context->saved_data["per_block"] = per_block;
  std::vector<int64_t> on_host;
  if (per_block < experts) {
    on_host = host_counts(counts);
    context->saved_data["host_counts"] = on_host;
  }
  return {per_block, on_host};
}

// The gradient of the rows, the bank built again: grad_e W_e for expert e's rows, the grouped
// product with W_e^T as its [in, out] weight.
torch::autograd::variable_list rebuilt_input_gradient(torch::autograd::AutogradContext* context,
                                                      const torch::autograd::variable_list& grad_outputs) {
  const auto* bank = reinterpret_cast<const LinearLayer*>(context->saved_data["bank"].toInt());
  const int64_t experts = context->saved_data["experts"].toInt();
  const int64_t per_block = context->saved_data["per_block"].toInt();
  const auto grad = grad_outputs[0].contiguous();
  const auto counts = context->get_saved_variables()[0];
  const auto grad_rows =
      per_block < experts
          ? product_by_expert_blocks(*bank, experts, grad, counts, context->saved_data["host_counts"].toIntVector(),
                                     per_block, true)
          : grouped_linear(grad, expert_weights(*bank, experts, grad.scalar_type()).transpose(1, 2), counts);
  return {grad_rows, torch::Tensor(), torch::Tensor(), torch::Tensor()};
}

// The product with a frozen built bank that keeps only the counts: backward builds the weights again.
class RebuiltBankProduct : public torch::autograd::Function<RebuiltBankProduct> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* context, const torch::Tensor& rows,
                               const torch::Tensor& counts, const LinearLayer* bank, int64_t experts) {
    const auto [per_block, on_host] = save_for_rebuilding(context, rows, counts, bank, experts);
    if (per_block < experts) {
      return product_by_expert_blocks(*bank, experts, rows.contiguous(), counts, on_host, per_block, false);
    }
    return grouped_linear(rows, expert_weights(*bank, experts, rows.scalar_type()), counts);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list grad_outputs) {
    return rebuilt_input_gradient(context, grad_outputs);
  }
};

// bank_product_for_graph: the product's place in autograd's graph, its values left unwritten. Its
// backward is RebuiltBankProduct's, which reads no values of the output.
class UnreadBankProduct : public torch::autograd::Function<UnreadBankProduct> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* context, const torch::Tensor& rows,
                               const torch::Tensor& counts, const LinearLayer* bank, int64_t experts) {
    save_for_rebuilding(context, rows, counts, bank, experts);
    return rows.new_empty({rows.size(0), bank->out_features() / experts});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list grad_outputs) {
    return rebuilt_input_gradient(context, grad_outputs);
  }
};

// base + update · scale where nothing reads the sum (ExpertLora's output in a recomputation): its
// place in autograd's graph, its values unwritten; backward gives the sum's gradients.
class UnreadScaledSum : public torch::autograd::Function<UnreadScaledSum> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* context, const torch::Tensor& base,
                               const torch::Tensor& update, double scale) {
    context->saved_data["scale"] = scale;
    return base.new_empty(base.sizes());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list grad_outputs) {
    return {grad_outputs[0], grad_outputs[0] * context->saved_data["scale"].toDouble(), torch::Tensor()};
  }
};

bool trains(const LinearLayer& layer) {
  for (const auto& parameter : layer.parameters()) {
    if (parameter.requires_grad()) return true;
  }
  return false;
}

}  // namespace

torch::Tensor bank_product(const LinearLayer& bank, int64_t experts, const torch::Tensor& rows, const torch::Tensor& counts) {
  // A stored weight (a 16-bit bank) costs nothing to keep, and a bank that trains (QAT's
  // fake-quantized weights) needs autograd's own product; a built frozen one (a dequantized base)
  // is kept only as KeepBuiltWeights says.
  const bool built = bank.matmul_weight_kind() != LinearLayer::MatmulWeight::kStored;
  const bool rebuilt = built && torch::GradMode::is_enabled() && rows.requires_grad() && !KeepBuiltWeights::active() &&
                       !trains(bank);
  if (rebuilt) return RebuiltBankProduct::apply(rows, counts, &bank, experts);
  if (built && !torch::GradMode::is_enabled()) {  // a checkpointed forward without grad
    const int64_t per_block = bank_experts_per_block(bank, experts, rows.scalar_type(), BuildBanksInBlocks::bytes());
    if (per_block < experts && built_bytes(bank, rows.scalar_type()) > WholeBanksWithoutGrad::up_to_bytes()) {
      return product_by_expert_blocks(bank, experts, rows.contiguous(), counts, host_counts(counts), per_block, false);
    }
  }
  return grouped_linear(rows, expert_weights(bank, experts, rows.scalar_type()), counts);
}

torch::Tensor bank_product_for_graph(const LinearLayer& bank, int64_t experts, const torch::Tensor& rows,
                                     const torch::Tensor& counts) {
  // A bank that trains needs autograd's own product (its weight's gradient); without grad there
  // is no graph to place the output in.
  if (!torch::GradMode::is_enabled() || trains(bank)) return bank_product(bank, experts, rows, counts);
  return UnreadBankProduct::apply(rows, counts, &bank, experts);
}

std::vector<int64_t> host_counts(const torch::Tensor& counts) {
  // The last counts brought here on this thread. The weak reference keeps their TensorImpl's
  // address from being another tensor's, and holds no device memory.
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct Last {
    WeakImpl counts{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
    int64_t version = 0;
    std::vector<int64_t> values;
  };
  thread_local Last last;
  if (!last.counts.expired() && last.counts._unsafe_get_target() == counts.unsafeGetTensorImpl() &&
      last.version == static_cast<int64_t>(counts._version())) {
    return last.values;
  }
  const auto host = counts.to(torch::kCPU, torch::kInt64).contiguous();
  last.counts = WeakImpl(counts.getIntrusivePtr());
  last.version = static_cast<int64_t>(counts._version());
  last.values.assign(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  return last.values;
}

int64_t experts_per_block(int64_t experts, int64_t expert_bytes, int64_t block_bytes) {
  if (block_bytes <= 0 || expert_bytes <= 0) return experts;
  return std::clamp<int64_t>(block_bytes / expert_bytes, 1, experts);
}

std::map<std::string, int64_t> expert_banks(const torch::nn::Module& root) {
  std::map<std::string, int64_t> banks;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    const auto* owner = dynamic_cast<const ExpertBankOwner*>(item.value().get());
    if (owner == nullptr) continue;
    for (const auto& child : item.value()->named_children()) {
      if (const int64_t experts = owner->bank_experts(child.key())) banks[item.key() + "." + child.key()] = experts;
    }
  }
  return banks;
}

torch::Tensor expert_weights(const LinearLayer& bank, int64_t experts, torch::ScalarType dtype) {
  const auto weight = bank.matmul_weight_kind() == LinearLayer::MatmulWeight::kNone || bank.multiplies_itself()
                          ? bank.dense_weight(dtype)
                          : bank.matmul_weight(dtype);
  return weight.view({experts, -1, bank.in_features()});
}

ExpertLora::ExpertLora(std::shared_ptr<LinearLayer> base, int64_t experts, const LoraOptions& options)
    : base_(std::move(base)), experts_(experts), options_(options), scale_(options.scale()) {
  if (!base_) throw Error(ErrorCode::kInternal, "ExpertLora needs a base layer, got none");
  if (experts_ <= 0 || base_->out_features() % experts_ != 0) {
    throw Error(ErrorCode::kInternal, "an expert bank of " + std::to_string(base_->out_features()) +
                                          " rows does not split into " + std::to_string(experts_) + " experts");
  }
  if (options_.dropout != 0.0 || options_.dora) {
    throw Error(ErrorCode::kRecipe, std::string("LoRA on an expert bank takes no ") + (options_.dora ? "DoRA" : "dropout") +
                                        " (peft's ParamWrapper, which loads such adapters, refuses it)");
  }
  register_module("base_layer", base_);
  for (auto& parameter : base_->parameters()) parameter.requires_grad_(false);
  const auto device = module_device(*base_);
  const int64_t ranks = options_.rank * experts_;
  lora_A_ = register_module("lora_A", torch::nn::Linear(torch::nn::LinearOptions(in_features(), ranks).bias(false)));
  lora_B_ = register_module("lora_B", torch::nn::Linear(torch::nn::LinearOptions(ranks, out_features() / experts_).bias(false)));
  lora_A_->to(device, torch::kFloat32);
  lora_B_->to(device, torch::kFloat32);
  reset();
}

void ExpertLora::reset() {
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(lora_A_->weight, /*a=*/std::sqrt(5.0));
  lora_B_->weight.zero_();
}

torch::Tensor ExpertLora::grouped_forward(const torch::Tensor& rows, const torch::Tensor& counts, bool output_unread) {
  const auto dtype = rows.scalar_type();
  const int64_t rank = options_.rank;
  const auto base = output_unread ? bank_product_for_graph(*base_, experts_, rows, counts)
                                  : bank_product(*base_, experts_, rows, counts);
  if (!adapters_enabled()) return base;
  // A_e: rows e·rank ... of A; B_e: columns e, e + experts, ... of B.
  const auto a = lora_A_->weight.to(dtype).view({experts_, rank, -1});
  const auto b = lora_B_->weight.to(dtype).view({-1, rank, experts_}).permute({2, 0, 1});
  const auto update = grouped_linear(grouped_linear(rows, a, counts), b.contiguous(), counts);
  if (output_unread && torch::GradMode::is_enabled()) return UnreadScaledSum::apply(base, update, scale_);
  return base + update * scale_;
}

torch::Tensor ExpertLora::forward(const torch::Tensor&) {
  throw Error(ErrorCode::kInternal, "an expert bank multiplies tokens sorted by expert (grouped_forward), not all rows");
}

torch::Tensor ExpertLora::dense_weight(torch::ScalarType dtype) const {
  if (!adapters_enabled()) return base_->dense_weight(dtype);
  const int64_t rank = options_.rank;
  const auto a = lora_A_->weight.view({experts_, rank, -1});
  const auto b = lora_B_->weight.view({-1, rank, experts_}).permute({2, 0, 1});
  const auto update = torch::bmm(b, a).reshape({-1, in_features()});  // [experts · out, in]
  return (base_->dense_weight(torch::kFloat32) + scale_ * update).to(dtype);
}

void ExpertLora::pretty_print(std::ostream& stream) const {
  stream << "qtrain::qat::ExpertLora(experts=" << experts_ << ", in_features=" << in_features()
         << ", out_features=" << out_features() / experts_ << ", rank=" << options_.rank << ", alpha=" << options_.alpha
         << ", scale=" << scale_ << (options_.rslora ? ", rslora" : "") << ")";
}

}  // namespace qtrain::qat
