#include "qat/qat_lora_matmul.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <utility>
#include <vector>

#include "kernels/error.h"
#include "kernels/merged_fake_quantize.h"
#include "qat/four_bit_linear.h"

namespace qtrain::qat {

LoraGradient parse_lora_gradient(const std::string& name, const std::string& what) {
  if (name == "identity") return LoraGradient::kIdentity;
  if (name == "masked") return LoraGradient::kMasked;
  throw Error(ErrorCode::kRecipe, what + ": '" + name + "' is not a LoRA gradient under QAT (one of identity, masked)");
}

const char* lora_gradient_name(LoraGradient gradient) {
  return gradient == LoraGradient::kIdentity ? "identity" : "masked";
}

namespace {

// W0 as LoRA's forward multiplies by it: a dense weight as stored, a 4-bit one dequantized to
// the dtype it was quantized from (bitsandbytes' dequantize_4bit). Undefined for other bases.
torch::Tensor frozen_weight(const LinearLayer& base) {
  if (const auto* dense = dynamic_cast<const DenseLinear*>(&base)) return dense->weight();
  if (const auto* four_bit = dynamic_cast<const FourBitLinear*>(&base)) {
    return four_bit->dense_weight(four_bit->quant_state().dtype);
  }
  return torch::Tensor();
}

int64_t block_length(const QuantSpec& spec, int64_t columns) {
  return spec.granularity == Granularity::kPerGroup ? spec.group_size : columns;
}

// The torch-operation twin of the kernel: every product and sum its own fp32 operation, in the
// kernel's order, then quantize.cpp's reference quantization.
MergedFakeQuant fake_quantize_merged_reference(const torch::Tensor& base, const torch::Tensor& lora_A,
                                               const torch::Tensor& lora_B, double scale, const QuantSpec& spec,
                                               torch::ScalarType values_dtype, bool values, bool codes, bool inside) {
  auto sum = torch::zeros(base.sizes(), base.options().dtype(torch::kFloat32));
  for (int64_t j = 0; j < lora_A.size(0); ++j) sum = sum + lora_B.select(1, j).unsqueeze(1) * lora_A.select(0, j).unsqueeze(0);
  const auto merged = base.to(torch::kFloat32) + sum * scale;
  const auto params = choose_qparams(spec, block_min_max(spec, merged));
  MergedFakeQuant result;
  result.quantized = {spec, torch::Tensor(), params};
  if (values || inside) {
    const auto fake = fake_quantize_values_reference(spec, merged, params);
    if (values) result.values = fake.values.to(values_dtype);
    if (inside) result.inside = fake.inside.reshape(base.sizes());
  }
  if (codes) result.quantized.codes = quantize(spec, merged, params);
  return result;
}

}  // namespace

bool quantizer_fuses_merge(const FakeQuantizerOptions& weights) {
  const auto& spec = weights.spec;
  return spec.has_integer_zero_point() && (spec.granularity == Granularity::kPerGroup || spec.granularity == Granularity::kPerChannel) &&
         weights.observer == ObserverKind::kDynamic && !weights.learned_scale;
}

bool fuses_merged_fake_quant(const LoraLinear& lora, const FakeQuantizerOptions& weights) {
  return !lora.options().dora && frozen_weight(*lora.base_layer()).defined() && quantizer_fuses_merge(weights);
}

MergedFakeQuant fake_quantize_merged(const LoraLinear& lora, const QuantSpec& spec, torch::ScalarType values_dtype,
                                     bool values, bool codes, bool inside) {
  torch::NoGradGuard no_grad;
  const auto base = frozen_weight(*lora.base_layer());
  if (!base.defined()) {
    throw Error(ErrorCode::kInternal, "fake_quantize_merged: the LoRA base has no dense or 4-bit weight to merge "
                "(fuses_merged_fake_quant was not checked)");
  }
  spec.validate_for_shape("the merged weight", base.sizes());
  if (!(kernels::kCudaKernelsBuilt && base.is_cuda())) {
    return fake_quantize_merged_reference(base, lora.lora_A(), lora.lora_B(), lora.scale(), spec, values_dtype, values,
                                          codes, inside);
  }
  kernels::MergedFakeQuantizeOptions options;
  options.block_length = block_length(spec, base.size(1));
  options.quant_min = spec.quant_min();
  options.quant_max = spec.quant_max();
  options.symmetric = spec.symmetric;
  options.fp16_scale = spec.scale_dtype == torch::kFloat16;
  options.values = values;
  options.values_dtype = values_dtype;
  options.codes = codes;
  options.inside = inside;
  auto fused = kernels::merged_fake_quantize_int_cuda(base.contiguous(), lora.lora_A().detach().contiguous(),
                                                      lora.lora_B().detach().contiguous(), lora.scale(), options);
  const auto shape = params_shape(spec, base.sizes());
  return {fused.values, {spec, fused.codes, {fused.scale.view(shape), fused.zero_point.view(shape)}}, fused.inside};
}

namespace {

// What backward needs: the layer (to build the weight again), the input rows, and for the
// identity gradient x A^T and B in the compute dtype; the weight itself when kept.
class QatLoraMatmulBackward : public torch::autograd::Node {
 public:
  QatLoraMatmulBackward(std::shared_ptr<LoraLinear> lora, QuantSpec spec, LoraGradient gradient, torch::Tensor weight,
                        torch::Tensor rows, torch::Tensor projected, torch::Tensor b, std::vector<int64_t> input_shape)
      : lora_(std::move(lora)),
        spec_(std::move(spec)),
        gradient_(gradient),
        weight_(std::move(weight)),
        rows_(std::move(rows)),
        projected_(std::move(projected)),
        b_(std::move(b)),
        input_shape_(std::move(input_shape)) {}
  std::string name() const override { return "qtrain::QatLoraMatmulBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const auto dtype = rows_.scalar_type();
    const auto grad_rows = grads[0].reshape({-1, lora_->out_features()});  // [tokens, out]
    const bool masked = gradient_ == LoraGradient::kMasked && (should_compute_output(1) || should_compute_output(2));
    const bool build_values = should_compute_output(0) && !weight_.defined();
    MergedFakeQuant built;
    if (build_values || masked) built = fake_quantize_merged(*lora_, spec_, dtype, build_values, false, masked);
    torch::autograd::variable_list result(3);
    if (should_compute_output(0)) {
      result[0] = torch::mm(grad_rows, weight_.defined() ? weight_ : built.values).view(input_shape_);
    }
    const double scale = lora_->scale();
    if (masked) {
      const auto grad_merged = torch::mm(grad_rows.t(), rows_).to(torch::kFloat32).mul_(built.inside);  // [out, in]
      if (should_compute_output(1)) result[1] = torch::mm(lora_->lora_B().detach().t(), grad_merged).mul_(scale);
      if (should_compute_output(2)) result[2] = torch::mm(grad_merged, lora_->lora_A().detach().t()).mul_(scale);
      return result;
    }
    if (should_compute_output(1)) {
      result[1] = torch::mm(torch::mm(grad_rows, b_).t(), rows_).mul_(scale).to(torch::kFloat32);
    }
    if (should_compute_output(2)) result[2] = torch::mm(grad_rows.t(), projected_).mul_(scale).to(torch::kFloat32);
    return result;
  }

  void release_variables() override { weight_ = rows_ = projected_ = b_ = torch::Tensor(); }

 private:
  std::shared_ptr<LoraLinear> lora_;
  QuantSpec spec_;
  LoraGradient gradient_;
  torch::Tensor weight_, rows_, projected_, b_;
  std::vector<int64_t> input_shape_;
};

}  // namespace

torch::Tensor qat_lora_matmul(const torch::Tensor& input, const std::shared_ptr<LoraLinear>& lora, const QuantSpec& spec,
                              LoraGradient gradient) {
  const auto dtype = input.scalar_type();
  const auto& lora_A = lora->lora_A();
  const auto& lora_B = lora->lora_B();
  const bool differentiable = torch::GradMode::is_enabled() &&
                              (input.requires_grad() || lora_A.requires_grad() || lora_B.requires_grad());
  torch::Tensor output, weight, rows, projected, b;
  {
    torch::NoGradGuard no_grad;
    rows = input.reshape({-1, lora->in_features()});
    weight = fake_quantize_merged(*lora, spec, dtype, true, false, false).values;
    const auto bias = lora->bias();
    output = bias.defined() ? torch::addmm(bias.to(dtype), rows, weight.t()) : torch::mm(rows, weight.t());
    if (differentiable && gradient == LoraGradient::kIdentity) {
      b = lora_B.to(dtype);
      projected = torch::mm(rows, lora_A.to(dtype).t());  // [tokens, rank]
    }
  }
  auto shape = input.sizes().vec();
  shape.back() = lora->out_features();
  output = at::_unsafe_view(output, shape);  // not a view: the node below becomes its grad_fn
  if (!differentiable) return output;
  auto node = std::shared_ptr<QatLoraMatmulBackward>(
      new QatLoraMatmulBackward(lora, spec, gradient, KeepBuiltWeights::active() ? weight : torch::Tensor(), rows,
                                projected, b, input.sizes().vec()),
      torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input, lora_A, lora_B));
  torch::autograd::create_gradient_edge(output, node);
  return output;
}

}  // namespace qtrain::qat
