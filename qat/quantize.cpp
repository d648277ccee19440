#include "qat/quantize.h"

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/error.h"
#include "kernels/fake_quantize.h"
#include "qat/four_bit_format.h"

namespace qtrain::qat {

namespace {

// torchao's eps: fp32's machine epsilon, 2^-23 (also exact in fp16, as a subnormal).
constexpr double kScaleEps = 1.1920928955078125e-07;
constexpr double kFp16Max = 65504.0;
// The float zero point's eps, on the block's range before the division (MSLK's, torchao's).
constexpr double kRangeEps = 1e-6;

bool is_reduced_float(torch::ScalarType dtype) { return dtype == torch::kBFloat16 || dtype == torch::kFloat16; }

// torchao's grids round in fp32; compressed-tensors' in x's own dtype (quant_spec.h).
torch::Tensor to_blocks(const QuantSpec& spec, const torch::Tensor& x) {
  const bool own_dtype = spec.convention == QuantConvention::kCompressedTensors && is_reduced_float(x.scalar_type());
  return x.to(own_dtype ? x.scalar_type() : torch::kFloat32).reshape(block_view_shape(spec, x.sizes()));
}

void check_params(const QuantSpec& spec, const torch::Tensor& x, const QuantParams& params) {
  const auto expected = params_shape(spec, x.sizes());
  if (!params.scale.defined() || params.scale.sizes() != c10::IntArrayRef(expected)) {
    throw Error(ErrorCode::kInternal, "quantizer " + spec.describe() + ": scale of shape " +
                (params.scale.defined() ? shape_text(params.scale.sizes()) : std::string("(none)")) +
                " does not fit a tensor of shape " + shape_text(x.sizes()) + " (expected " + shape_text(expected) + ")");
  }
}

// The minifloat's bit fields of each (already saturated) magnitude a, rounded to nearest even.
// Returns the codes without the sign bit, as int64.
torch::Tensor minifloat_magnitude_codes(const QuantFormatInfo& info, const torch::Tensor& magnitude) {
  const int64_t mantissa_bits = info.mantissa_bits;
  const int64_t min_exponent = 1 - info.exponent_bias;  // of the normal numbers; subnormals share its step
  // a = f * 2^e with f in [0.5, 1): the binade of a is e - 1 (0 for a = 0, then raised to min_exponent).
  auto exponent = std::get<1>(torch::frexp(magnitude)).to(torch::kInt64).sub(1).clamp_min(min_exponent);
  // Step of the grid in that binade: 2^(exponent - mantissa_bits). The integer count of steps,
  // rounded half to even (torch::round), is the mantissa with its implicit leading bit.
  auto mantissa = torch::round(torch::ldexp(magnitude, mantissa_bits - exponent)).to(torch::kInt64);
  // Rounding up out of the binade (mantissa == 2^(m+1)) is the next binade's first value.
  const int64_t implicit_bit = int64_t{1} << mantissa_bits;
  const auto carried = mantissa >= 2 * implicit_bit;
  exponent = exponent + carried.to(torch::kInt64);
  mantissa = torch::where(carried, torch::full_like(mantissa, implicit_bit), mantissa);
  const auto normal = mantissa >= implicit_bit;
  const auto field = torch::where(normal, exponent + info.exponent_bias, torch::zeros_like(exponent));
  const auto fraction = torch::where(normal, mantissa - implicit_bit, mantissa);
  return field * implicit_bit + fraction;
}

torch::Tensor minifloat_values(const QuantFormatInfo& info) {
  const int64_t count = int64_t{1} << info.bits;
  const int64_t mantissa_codes = int64_t{1} << info.mantissa_bits;
  const int64_t field_codes = int64_t{1} << info.exponent_bits;
  std::vector<float> values(count);
  for (int64_t code = 0; code < count; ++code) {
    const int64_t fraction = code % mantissa_codes;
    const int64_t field = (code / mantissa_codes) % field_codes;
    const bool negative = code / (mantissa_codes * field_codes) != 0;
    double magnitude = field == 0 ? std::ldexp(static_cast<double>(fraction), 1 - info.exponent_bias - info.mantissa_bits)
                                  : std::ldexp(1.0 + static_cast<double>(fraction) / mantissa_codes,
                                               static_cast<int>(field - info.exponent_bias));
    // Beyond the largest finite value are the format's NaN / infinity codes.
    if (magnitude > info.max_value) magnitude = std::numeric_limits<double>::quiet_NaN();
    values[code] = static_cast<float>(negative ? -magnitude : magnitude);
  }
  return torch::tensor(values, torch::kFloat32);
}

// bitsandbytes' pivots and rank -> code map, as tensors on `device`.
struct TableQuantizer {
  torch::Tensor thresholds;    // fp32, ascending
  torch::Tensor code_of_rank;  // int64
  bool sign_magnitude;
};

TableQuantizer table_quantizer(FourBitType type, const torch::Device& device) {
  const auto& format = four_bit_format(type);
  std::vector<int64_t> codes(format.code_of_rank.begin(), format.code_of_rank.end());
  return {torch::tensor(format.thresholds, torch::kFloat32).to(device), torch::tensor(codes, torch::kInt64).to(device),
          format.sign_magnitude};
}

struct Quantized {
  torch::Tensor codes;   // in the block view
  torch::Tensor inside;  // bool, block view
};

Quantized quantize_blocks(const QuantSpec& spec, const torch::Tensor& blocks, const QuantParams& params) {
  // The division runs in the blocks' dtype: fp32, or a compressed-tensors grid's bf16 / fp16.
  const auto scale = params.scale.unsqueeze(-1).to(blocks.scalar_type());
  const auto& info = spec.format_info();
  switch (info.kind) {
    case GridKind::kInteger: {
      const auto zero_point = params.zero_point.unsqueeze(-1);
      const double quant_min = static_cast<double>(spec.quant_min());
      const double quant_max = static_cast<double>(spec.quant_max());
      torch::Tensor unclamped;
      if (spec.convention == QuantConvention::kCompressedTensors) {
        // The zero point joins before rounding (an integer: exact in any of the dtypes).
        unclamped = torch::round(blocks / scale + zero_point.to(blocks.scalar_type())).to(torch::kFloat32);
      } else if (spec.has_integer_zero_point()) {
        unclamped = torch::round(blocks / scale) + zero_point;
      } else {
        // A float zero point holds the block's minimum m: codes count steps up from it.
        unclamped = torch::round((blocks - zero_point) / scale) + quant_min;
      }
      return {unclamped.clamp(quant_min, quant_max).to(torch::kInt8), (unclamped >= quant_min) & (unclamped <= quant_max)};
    }
    case GridKind::kMinifloat: {
      const auto scaled = (blocks / scale).to(torch::kFloat32);
      const auto magnitude = scaled.abs();
      if (info.bits == 8) {
        // The OCP FP8 formats are torch's own dtypes, whose conversion rounds to nearest even as
        // the bit fields below do: one cast, after the saturation, gives their bytes.
        const auto dtype = info.format == QuantFormat::kFp8E4m3 ? torch::kFloat8_e4m3fn : torch::kFloat8_e5m2;
        return {scaled.clamp(-info.max_value, info.max_value).to(dtype).view(torch::kUInt8), magnitude <= info.max_value};
      }
      auto codes = minifloat_magnitude_codes(info, magnitude.clamp_max(info.max_value));
      const int64_t sign_bit = int64_t{1} << (info.bits - 1);
      codes = codes + (scaled < 0).to(torch::kInt64) * sign_bit;
      return {codes.to(torch::kUInt8), magnitude <= info.max_value};
    }
    case GridKind::kTable: {
      // bitsandbytes multiplies by the fp32 reciprocal of absmax rather than dividing.
      const auto scaled = blocks * torch::reciprocal(scale);
      const auto table = table_quantizer(info.four_bit_type, blocks.device());
      torch::Tensor codes;
      if (table.sign_magnitude) {
        codes = table.code_of_rank.index({torch::bucketize(scaled.abs(), table.thresholds)});
        codes = codes + (scaled < 0).to(torch::kInt64) * 8;
      } else {
        codes = table.code_of_rank.index({torch::bucketize(scaled, table.thresholds)});
      }
      return {codes.to(torch::kUInt8), scaled.abs() <= info.max_value};
    }
    case GridKind::kGgufBlocks: break;  // qat/gguf_grid.h rounds onto these
  }
  throw Error(ErrorCode::kInternal, std::string("format ") + info.name + " is not rounded here (internal error)");
}

torch::Tensor dequantize_blocks(const QuantSpec& spec, const torch::Tensor& codes, const QuantParams& params) {
  const auto scale = params.scale.unsqueeze(-1);
  if (spec.has_integer_zero_point()) return (codes.to(torch::kFloat32) - params.zero_point.unsqueeze(-1)) * scale;
  if (spec.is_integer()) {
    // torchao's float zero point z = m + s * -quant_min, then q * s + z: its operations, in its order.
    const auto float_zero_point = params.zero_point.unsqueeze(-1) + scale * static_cast<double>(-spec.quant_min());
    return codes.to(torch::kFloat32) * scale + float_zero_point;
  }
  const auto grid = float_grid_values(spec.format).to(codes.device());
  return grid.index({codes.to(torch::kInt64)}) * scale;
}

}  // namespace

BlockMinMax block_min_max(const QuantSpec& spec, const torch::Tensor& x) {
  torch::NoGradGuard no_grad;
  const auto [min, max] = torch::aminmax(to_blocks(spec, x.detach()), -1);  // one pass over x
  const auto dtype = x.scalar_type();
  return {min.to(torch::kFloat32), max.to(torch::kFloat32), is_reduced_float(dtype) ? dtype : torch::kFloat32};
}

torch::Tensor effective_scale(const QuantSpec& spec, const torch::Tensor& scale) {
  auto result = scale.to(torch::kFloat32).clamp_min(kScaleEps);
  if (spec.scale_dtype == torch::kFloat16) result = result.clamp_max(kFp16Max).to(torch::kFloat16).to(torch::kFloat32);
  return result;
}

namespace {

// compressed-tensors' calculate_qparams (quant_presets.h), every operation in the range's dtype.
QuantParams choose_qparams_compressed_tensors(const QuantSpec& spec, const BlockMinMax& range) {
  const auto dtype = range.dtype;
  const auto min_negative = range.min.to(dtype).clamp_max(0.0);
  const auto max_positive = range.max.to(dtype).clamp_min(0.0);
  const bool integer = spec.is_integer();
  const double quant_min = integer ? static_cast<double>(spec.quant_min()) : -spec.format_info().max_value;
  const double quant_max = integer ? static_cast<double>(spec.quant_max()) : spec.format_info().max_value;
  torch::Tensor scale;
  torch::Tensor zero_point = torch::zeros(min_negative.sizes(), min_negative.options().dtype(torch::kFloat32));
  if (spec.symmetric) {
    scale = torch::maximum(-min_negative, max_positive) / ((quant_max - quant_min) / 2.0);
  } else {
    scale = (max_positive - min_negative) / (quant_max - quant_min);
    // 0 / 0 where the block is all zeros: its codes are the zero point whatever it is; quant_min.
    zero_point = torch::nan_to_num((quant_min - min_negative / scale).to(torch::kFloat32), quant_min)
                     .clamp(quant_min, quant_max)
                     .round();
  }
  // finfo(dtype).eps, as compressed-tensors takes it.
  const double eps = dtype == torch::kBFloat16 ? static_cast<double>(std::numeric_limits<c10::BFloat16>::epsilon())
                   : dtype == torch::kFloat16  ? static_cast<double>(std::numeric_limits<c10::Half>::epsilon())
                                               : kScaleEps;
  scale = torch::where(scale == 0, torch::full_like(scale, eps), scale);
  return {scale.to(torch::kFloat32), zero_point};
}

}  // namespace

QuantParams choose_qparams(const QuantSpec& spec, const BlockMinMax& range) {
  torch::NoGradGuard no_grad;
  if (spec.convention == QuantConvention::kCompressedTensors) return choose_qparams_compressed_tensors(spec, range);
  const double quant_min = static_cast<double>(spec.quant_min());
  const double quant_max = static_cast<double>(spec.quant_max());
  if (spec.is_integer() && !spec.has_integer_zero_point()) {
    // The float zero point: the block's own range, in fp32 whatever x's dtype, its eps on the range.
    const auto min = range.min.to(torch::kFloat32);
    return {(range.max.to(torch::kFloat32) - min).clamp_min(kRangeEps) / (quant_max - quant_min), min};
  }
  // Integer grids compute in the range's dtype (quant_spec.h), float grids in fp32.
  const auto dtype = spec.is_integer() ? range.dtype : torch::kFloat32;
  const auto min_negative = range.min.to(dtype).clamp_max(0.0);
  const auto max_positive = range.max.to(dtype).clamp_min(0.0);
  const auto zeros = torch::zeros(min_negative.sizes(), min_negative.options().dtype(torch::kFloat32));
  if (!spec.is_integer()) {
    const auto absmax = torch::maximum(-min_negative, max_positive);
    return {effective_scale(spec, absmax / spec.format_info().max_value), zeros};
  }
  if (spec.symmetric) {
    const auto absmax = torch::maximum(-min_negative, max_positive);
    return {effective_scale(spec, absmax / ((quant_max - quant_min) / 2.0)), zeros};
  }
  const auto scale = effective_scale(spec, (max_positive - min_negative) / (quant_max - quant_min));
  const auto zero_point = (quant_min - torch::round(min_negative / scale.to(dtype))).clamp(quant_min, quant_max);
  return {scale, zero_point.to(torch::kFloat32)};
}

torch::Tensor quantize(const QuantSpec& spec, const torch::Tensor& x, const QuantParams& params) {
  check_params(spec, x, params);
  torch::NoGradGuard no_grad;
  return quantize_blocks(spec, to_blocks(spec, x.detach()), params).codes.reshape(x.sizes());
}

torch::Tensor dequantize(const QuantSpec& spec, const torch::Tensor& codes, const QuantParams& params) {
  check_params(spec, codes, params);
  torch::NoGradGuard no_grad;
  const auto blocks = codes.reshape(block_view_shape(spec, codes.sizes()));
  return dequantize_blocks(spec, blocks, params).reshape(codes.sizes());
}

FakeQuantized fake_quantize_values(const QuantSpec& spec, const torch::Tensor& x, const QuantParams& params) {
  // The kernel rounds torchao's way in fp32; a compressed-tensors grid only where that is the same
  // (symmetric: no zero point to add first) and x is fp32.
  const bool kernel_rounds_alike = spec.convention == QuantConvention::kTorchao ||
                     (spec.symmetric && x.scalar_type() == torch::kFloat32);
  if (!(kernels::kCudaKernelsBuilt && x.is_cuda() && spec.has_integer_zero_point() && kernel_rounds_alike)) {
    return fake_quantize_values_reference(spec, x, params);
  }
  check_params(spec, x, params);
  torch::NoGradGuard no_grad;
  auto fused = kernels::fake_quantize_int_cuda(
      to_blocks(spec, x.detach()).contiguous(), params.scale.to(torch::kFloat32).contiguous(),
      params.zero_point.to(torch::kFloat32).contiguous(), spec.quant_min(), spec.quant_max());
  return {fused.values.reshape(x.sizes()), fused.inside};
}

FakeQuantized fake_quantize_values_reference(const QuantSpec& spec, const torch::Tensor& x, const QuantParams& params) {
  check_params(spec, x, params);
  torch::NoGradGuard no_grad;
  const auto quantized = quantize_blocks(spec, to_blocks(spec, x.detach()), params);
  return {dequantize_blocks(spec, quantized.codes, params).reshape(x.sizes()), quantized.inside};
}

torch::Tensor QuantizedTensor::dequantize() const { return qat::dequantize(spec, codes, params); }

QuantizedTensor quantize_tensor(const QuantSpec& spec, const torch::Tensor& x, const QuantParams& params) {
  return {spec, quantize(spec, x, params), params};
}

torch::Tensor float_grid_values(QuantFormat format) {
  const auto& info = quant_format_info(format);
  switch (info.kind) {
    case GridKind::kMinifloat: {
      // Built once per format: the forward of every fake-quantized layer looks it up.
      static const torch::Tensor e4m3 = minifloat_values(quant_format_info(QuantFormat::kFp8E4m3));
      static const torch::Tensor e5m2 = minifloat_values(quant_format_info(QuantFormat::kFp8E5m2));
      static const torch::Tensor e2m1 = minifloat_values(quant_format_info(QuantFormat::kFp4E2m1));
      return format == QuantFormat::kFp8E4m3 ? e4m3 : format == QuantFormat::kFp8E5m2 ? e5m2 : e2m1;
    }
    case GridKind::kTable: return four_bit_decode_tensor(info.four_bit_type);
    case GridKind::kInteger:
    case GridKind::kGgufBlocks: break;
  }
  throw Error(ErrorCode::kInternal, std::string("format ") + info.name + " has no float grid");
}

}  // namespace qtrain::qat
