#include "qat/lora_matmul.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <string>
#include <tuple>

#include "kernels/error.h"

namespace qtrain::qat {

namespace {

// scale * left right (+ bias), written without reading anything else (beta = 0). The rank-r
// product goes first and the base's large matmul accumulates onto it (beta = 1): that matmul is
// compute-bound and hides reading its C, where the rank-r one would spend its whole time on it.
torch::Tensor scaled_product(const torch::Tensor& left, const torch::Tensor& right, double scale,
                             const torch::Tensor& bias) {
  if (bias.defined()) return torch::addmm(bias.to(left.scalar_type()), left, right, /*beta=*/1.0, /*alpha=*/scale);
  auto product = torch::empty({left.size(0), right.size(1)}, left.options());
  return product.addmm_(left, right, /*beta=*/0.0, /*alpha=*/scale);
}

// Inverted dropout with a given mask: x * kept / (1 - p) in one pass over x (ATen's kernel for
// dropout's backward, one rounding as F::dropout's).
torch::Tensor dropped(const torch::Tensor& x, const torch::Tensor& kept, double dropout) {
  return at::native_dropout_backward(x, kept, 1.0 / (1.0 - dropout));
}

// What backward needs: x (or what makes it again), the dropout mask (1 byte per input value), x A^T
// (small: [tokens, rank]), A and B in the compute dtype, and the base to rebuild W from (or W
// itself when stored or kept).
class LoraMatmulBackward : public torch::autograd::Node {
 public:
  LoraMatmulBackward(std::shared_ptr<LinearLayer> base, torch::Tensor weight, torch::Tensor input_rows,
                     LinearLayer::InputRebuild rebuild_input, torch::Tensor kept, double dropout,
                     torch::Tensor projected, torch::Tensor a, torch::Tensor b, double scale,
                     std::vector<int64_t> input_shape, torch::ScalarType a_dtype, torch::ScalarType b_dtype)
      : base_(std::move(base)),
        weight_(std::move(weight)),
        input_rows_(std::move(input_rows)),
        rebuild_input_(std::move(rebuild_input)),
        kept_(std::move(kept)),
        dropout_(dropout),
        projected_(std::move(projected)),
        a_(std::move(a)),
        b_(std::move(b)),
        scale_(scale),
        input_shape_(std::move(input_shape)),
        a_dtype_(a_dtype),
        b_dtype_(b_dtype) {}
  std::string name() const override { return "qtrain::LoraMatmulBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const auto grad_rows = grads[0].reshape({-1, b_.size(0)});  // [tokens, out]
    const auto grad_projected = torch::mm(grad_rows, b_);       // [tokens, rank]
    torch::autograd::variable_list result(3);
    if (should_compute_output(0)) {
      auto grad_input = scaled_product(grad_projected, a_, scale_, torch::Tensor());  // [tokens, in]
      if (kept_.defined()) grad_input = dropped(grad_input, kept_, dropout_);       // dropout's backward
      if (base_->multiplies_itself()) {
        base_->own_input_gradient(grad_rows, grad_input);
      } else {
        grad_input.addmm_(grad_rows, weight_.defined() ? weight_ : base_->matmul_weight(grad_rows.scalar_type()));
      }
      result[0] = grad_input.view(input_shape_);
    }
    torch::Tensor rows = input_rows_;
    const auto input_rows = [&] {
      if (!rows.defined()) {
        torch::NoGradGuard no_grad;
        rows = rebuild_input_().reshape({-1, a_.size(1)});
      }
      return rows;
    };
    if (should_compute_output(1)) {
      const auto adapter_input = kept_.defined() ? dropped(input_rows(), kept_, dropout_) : input_rows();
      result[1] = torch::mm(grad_projected.t(), adapter_input).mul_(scale_).to(a_dtype_);
    }
    if (should_compute_output(2)) {
      // x A^T left to backward (an unread output without dropout): the forward's product, made here.
      const auto projected = projected_.defined() ? projected_ : torch::mm(input_rows(), a_.t());
      result[2] = torch::mm(grad_rows.t(), projected).mul_(scale_).to(b_dtype_);
    }
    return result;
  }

  // The engine calls this after apply unless the graph is retained.
  void release_variables() override {
    weight_ = input_rows_ = kept_ = projected_ = a_ = b_ = torch::Tensor();
    rebuild_input_ = nullptr;  // and what it holds
  }

 private:
  std::shared_ptr<LinearLayer> base_;
  torch::Tensor weight_, input_rows_, kept_, projected_, a_, b_;
  LinearLayer::InputRebuild rebuild_input_;  // when input_rows_ is not kept
  double dropout_;
  double scale_;
  std::vector<int64_t> input_shape_;
  torch::ScalarType a_dtype_, b_dtype_;
};

}  // namespace

torch::Tensor lora_matmul(const torch::Tensor& input, const std::shared_ptr<LinearLayer>& base,
                          const torch::Tensor& lora_A, const torch::Tensor& lora_B, const LoraMatmulOptions& options) {
  const double scale = options.scale;
  const double dropout = options.dropout;
  const auto& rebuild_input = options.rebuild_input;
  const auto dtype = input.scalar_type();
  const int64_t in = lora_A.size(1);
  const int64_t out = lora_B.size(0);
  if (dropout < 0.0 || dropout >= 1.0) throw Error(ErrorCode::kRecipe, "LoRA dropout must be in [0, 1), got " + std::to_string(dropout));
  torch::Tensor output, weight, rows, projected, a, b, kept;
  {
    torch::NoGradGuard no_grad;
    rows = input.reshape({-1, in});
    a = lora_A.to(dtype);
    b = lora_B.to(dtype);
    torch::Tensor adapter_rows = rows;
    if (dropout > 0.0) {
      // The mask and the dropped input in one pass (F::dropout's kernel, which keeps the mask).
      std::tie(adapter_rows, kept) = at::native_dropout(rows, dropout, /*train=*/true);
      if (kept.scalar_type() != torch::kBool) kept = kept.to(torch::kBool);  // the CPU kernel's is in x's dtype
    }
    // An unread output without dropout whose input backward makes again reads no input value here:
    // backward makes x A^T too, so that the caller may leave the input unwritten.
    if (!(options.output_unread && dropout == 0.0 && rebuild_input)) projected = torch::mm(adapter_rows, a.t());
    if (options.output_unread) {
      output = torch::empty({rows.size(0), out}, rows.options());
      // The weight backward multiplies by, where it keeps it (below): built now as it would be.
      if (!base->multiplies_itself() && (base->matmul_weight_kind() == LinearLayer::MatmulWeight::kStored ||
                                         KeepBuiltWeights::active())) {
        weight = base->matmul_weight(dtype);
      }
    } else {
      output = scaled_product(projected, b.t(), scale, base->bias());
      if (base->multiplies_itself()) {
        base->own_product(rows, output);
      } else {
        weight = base->matmul_weight(dtype);
        output.addmm_(rows, weight.t());
      }
    }
  }
  auto shape = input.sizes().vec();
  shape.back() = out;
  output = at::_unsafe_view(output, shape);  // not a view: the node below becomes its grad_fn
  const bool differentiable = torch::GradMode::is_enabled() &&
                              (input.requires_grad() || lora_A.requires_grad() || lora_B.requires_grad());
  if (!differentiable) return output;
  const bool keep_weight = weight.defined() && (base->matmul_weight_kind() == LinearLayer::MatmulWeight::kStored ||
                                                KeepBuiltWeights::active());
  auto node = std::shared_ptr<LoraMatmulBackward>(
      new LoraMatmulBackward(base, keep_weight ? weight : torch::Tensor(), rebuild_input ? torch::Tensor() : rows,
                             rebuild_input, kept, dropout, projected, a, b, scale, input.sizes().vec(),
                             lora_A.scalar_type(), lora_B.scalar_type()),
      torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input, lora_A, lora_B));
  torch::autograd::create_gradient_edge(output, node);
  return output;
}

}  // namespace qtrain::qat
