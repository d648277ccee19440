#include "qat/fake_quantizer.h"

#include <cmath>
#include <utility>

#include "kernels/error.h"
#include "qat/gguf_grid.h"

namespace qtrain::qat {

FakeQuantizer::FakeQuantizer(const FakeQuantizerOptions& options, std::string what, std::vector<int64_t> fixed_shape)
    : options_(options), what_(std::move(what)), fixed_shape_(std::move(fixed_shape)) {
  const auto& spec = options_.spec;
  if (fixed_shape_.empty()) {
    spec.validate(what_);
  } else {
    spec.validate_for_shape(what_, fixed_shape_);
  }
  const bool is_static = options_.observer != ObserverKind::kDynamic;
  if (spec.is_gguf_block() && (is_static || options_.learned_scale || fixed_shape_.size() != 2)) {
    throw Error(ErrorCode::kRecipe, what_ + ".format: gguf rounds 2-D weights with scales chosen from each weight as it "
                "passes: it needs observer dynamic without learned_scale, and applies to weights only");
  }
  if (fixed_shape_.empty() && (is_static || options_.learned_scale) && spec.granularity != Granularity::kPerTensor) {
    throw Error(ErrorCode::kRecipe, what_ + ".granularity: " + granularity_name(spec.granularity) + " cannot keep " +
                (options_.learned_scale ? "a learned scale" : "an observed range") +
                " for activations, whose number of tokens changes from batch to batch (use per_tensor, or observer "
                "dynamic without learned_scale for per-token scales)");
  }
  if (options_.learned_scale && !spec.has_integer_zero_point()) {
    throw Error(ErrorCode::kRecipe, what_ + ".learned_scale: learned scales (LSQ) need format int with zero_point_domain int, "
                "got " + spec.describe());
  }
  const auto shape = fixed_shape_.empty() ? std::vector<int64_t>{1} : params_shape(spec, fixed_shape_);
  if (is_static) {
    if (!(options_.momentum > 0.0 && options_.momentum <= 1.0)) {
      throw Error(ErrorCode::kRecipe, what_ + ".momentum: " + std::to_string(options_.momentum) + " must be in (0, 1]");
    }
    observer_ = register_module("observer", std::make_shared<MinMaxObserver>(spec, shape, options_.observer, options_.momentum));
  }
  if (options_.learned_scale) {
    scale_ = register_parameter("scale", torch::ones(shape, torch::kFloat32));
    zero_point_ = register_buffer("zero_point", torch::zeros(shape, torch::kFloat32));
    scale_initialized_ = register_buffer("scale_initialized", torch::zeros({}, torch::kBool));
  }
}

bool FakeQuantizer::learned_scale_initialized() const {
  return scale_initialized_.defined() && scale_initialized_.item<bool>();
}

bool FakeQuantizer::has_scale() const {
  if (options_.learned_scale) return learned_scale_initialized();
  return !observer_ || observer_->has_observed();
}

void FakeQuantizer::initialize_learned_scale(const torch::Tensor& x) {
  if (!options_.learned_scale) throw Error(ErrorCode::kInternal, what_ + ": has no learned scale to initialise (internal error)");
  torch::NoGradGuard no_grad;
  const auto& spec = options_.spec;
  const auto range_params = observer_ && observer_->has_observed() ? observer_->qparams()
                                                                   : choose_qparams(spec, block_min_max(spec, x));
  auto scale = range_params.scale;
  if (options_.learned_scale_init == LearnedScaleInit::kPaper) {
    const auto blocks = x.detach().to(torch::kFloat32).reshape(block_view_shape(spec, x.sizes()));
    const int64_t positive_end = spec.symmetric ? spec.quant_max() : spec.quant_max() - spec.quant_min();
    scale = effective_scale(spec, 2.0 * blocks.abs().mean(-1) / std::sqrt(static_cast<double>(positive_end)));
  }
  scale_.copy_(scale);
  zero_point_.copy_(range_params.zero_point);
  scale_initialized_.fill_(true);
}

QuantParams FakeQuantizer::current_qparams(const torch::Tensor& x) const {
  const auto& spec = options_.spec;
  if (spec.is_gguf_block()) {
    throw Error(ErrorCode::kInternal, what_ + ": a GGUF block type's scales are its grid's (gguf_grid), not one scale per group");
  }
  if (options_.learned_scale) {
    if (!learned_scale_initialized()) {
      throw Error(ErrorCode::kInternal, what_ + ": the learned scale is not initialised yet (no fake-quantized forward has run)");
    }
    return {effective_scale(spec, scale_.detach()), zero_point_};
  }
  if (observer_) return observer_->qparams();
  return choose_qparams(spec, block_min_max(spec, x));
}

QuantizedTensor FakeQuantizer::quantize_tensor(const torch::Tensor& x) const {
  return qat::quantize_tensor(options_.spec, x, current_qparams(x));
}

torch::Tensor FakeQuantizer::forward(const torch::Tensor& x) {
  if (observer_ && observer_enabled_) observer_->observe(x);
  if (!fake_quant_enabled_) return x;
  if (options_.learned_scale) {
    if (!learned_scale_initialized()) initialize_learned_scale(x);
    const double gradient_scale = lsq_gradient_scale(options_.spec, x.numel() / scale_.numel());
    return fake_quantize_learned_scale(x, scale_, zero_point_, options_.spec, gradient_scale);
  }
  if (options_.spec.is_gguf_block()) {
    // The values of the weight's blocks on the GGUF type's grid, straight through: adding
    // x - x.detach() (exactly 0) gives the gradient to x and keeps the values bit for bit.
    torch::Tensor values;
    {
      torch::NoGradGuard no_grad;
      values = dequantize_gguf_grid(gguf_grid(x)).to(x.scalar_type());
    }
    return values + (x - x.detach());
  }
  return fake_quantize(x, options_.spec, current_qparams(x));
}

GgufGridTensor FakeQuantizer::gguf_grid(const torch::Tensor& x) const {
  if (!options_.spec.is_gguf_block()) throw Error(ErrorCode::kInternal, what_ + ": not a GGUF block type quantizer");
  torch::NoGradGuard no_grad;
  const auto weight = x.detach().to(torch::kFloat32);
  if (!llama_cpp_rounding_) return quantize_gguf_grid(weight, options_.spec.gguf_block);
  const auto& block = gguf_block_format(options_.spec.gguf_block);
  const auto values = weight.to(torch::kCPU).contiguous();
  std::vector<uint8_t> bytes(static_cast<size_t>(values.numel() / block.block_elements * block.block_bytes));
  block.quantize(values.data_ptr<float>(), bytes.data(), values.numel());
  auto grid = decode_gguf_grid(bytes, block.type, values.size(0), values.size(1));
  for (auto* level : {&grid.codes, &grid.scales, &grid.mins, &grid.d, &grid.m, &grid.dmin}) {
    if (level->defined()) *level = level->to(x.device());
  }
  return grid;
}

void FakeQuantizer::pretty_print(std::ostream& stream) const {
  stream << "qtrain::qat::FakeQuantizer(" << options_.spec.describe() << ", observer=" << observer_kind_name(options_.observer)
         << (options_.learned_scale ? ", learned_scale" : "") << (fake_quant_enabled_ ? "" : ", disabled") << ")";
}

}  // namespace qtrain::qat
