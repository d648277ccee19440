#include "qat/compressed_weight.h"

#include <array>
#include <limits>
#include <utility>

#include "kernels/error.h"
#include "kernels/packed_int_dequantize.h"

namespace qtrain::qat {

namespace {

const std::array<std::pair<CompressionFormat, const char*>, 4> kFormatNames = {{
    {CompressionFormat::kPackQuantized, "pack-quantized"},
    {CompressionFormat::kIntQuantized, "int-quantized"},
    {CompressionFormat::kFloatQuantized, "float-quantized"},
    {CompressionFormat::kNvfp4PackQuantized, "nvfp4-pack-quantized"},
}};

// The eps compressed-tensors gives an e4m3 scale that comes out 0 (its _get_dtype_eps).
constexpr double kE4m3ScaleEps = 0.125;
constexpr int64_t kNvfp4Group = 16;

int64_t groups_of(const CompressedWeight& weight) {
  return params_shape(weight.spec, {weight.out_features, weight.in_features}).back();
}

// The grid's values [out, in] in `dtype`, scaled group by group by `scale` ([out, groups] or [1]).
torch::Tensor scale_groups(const torch::Tensor& values, const torch::Tensor& scale, int64_t groups) {
  if (scale.numel() == 1) return values * scale.reshape({1, 1});
  const auto out = values.size(0);
  return (values.reshape({out, groups, -1}) * scale.reshape({out, groups, 1})).reshape(values.sizes());
}

torch::Tensor e2m1_values(const torch::Device& device) {
  return float_grid_values(QuantFormat::kFp4E2m1).to(device);
}

}  // namespace

CompressionFormat parse_compression_format(const std::string& name, const std::string& what) {
  std::string known;
  for (const auto& [format, text] : kFormatNames) {
    if (name == text) return format;
    known += (known.empty() ? "" : ", ") + std::string(text);
  }
  throw Error(ErrorCode::kModelConfig, what + ": compression format '" + name + "' is not one qtrain reads (" + known + ")");
}

const char* compression_format_name(CompressionFormat format) {
  if (format == CompressionFormat::kFp8Blocks) return "fine-grained fp8";
  for (const auto& [candidate, text] : kFormatNames) {
    if (candidate == format) return text;
  }
  throw Error(ErrorCode::kInternal, "unknown compression format (internal error)");
}

torch::Tensor pack_int32(const torch::Tensor& codes, int64_t bits, int64_t packed_dim) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kInt8 && bits >= 1 && bits <= 8);
  auto rows_first = (packed_dim == 0 ? codes.t() : codes).to(torch::kCPU).contiguous();
  const int64_t rows = rows_first.size(0);
  const int64_t count = rows_first.size(1);
  const int64_t words = (count * bits + 31) / 32;
  auto packed = torch::zeros({rows, words}, torch::kInt32);
  const auto* in = rows_first.data_ptr<int8_t>();
  auto* out = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  const int64_t offset = int64_t{1} << (bits - 1);
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t index = 0; index < count; ++index) {
      const auto value = static_cast<uint64_t>(in[row * count + index] + offset);  // unsigned, `bits` wide
      const int64_t bit = index * bits;
      const uint64_t shifted = value << (bit % 32);
      out[row * words + bit / 32] |= static_cast<uint32_t>(shifted);
      if ((bit % 32) + bits > 32) out[row * words + bit / 32 + 1] |= static_cast<uint32_t>(shifted >> 32);
    }
  }
  packed = packed.to(codes.device());
  return packed_dim == 0 ? packed.t().contiguous() : packed;
}

torch::Tensor unpack_int32(const torch::Tensor& words, int64_t bits, int64_t count, int64_t packed_dim) {
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == torch::kInt32 && bits >= 1 && bits <= 8);
  const auto rows_first = (packed_dim == 0 ? words.t() : words).contiguous();
  const int64_t rows = rows_first.size(0);
  torch::Tensor unsigned_codes;
  if (bits == 4 || bits == 8) {
    // Whole bytes of little-endian words: int4 is two codes a byte, low nibble first.
    const auto bytes = rows_first.view(torch::kUInt8).reshape({rows, -1});
    unsigned_codes = bits == 8 ? bytes.to(torch::kInt16)
                               : torch::stack({bytes.bitwise_and(0x0F), bytes.bitwise_right_shift(4)}, -1)
                                     .reshape({rows, -1})
                                     .to(torch::kInt16);
    unsigned_codes = unsigned_codes.narrow(1, 0, count);
  } else {
    // Codes may straddle two words: read each code's pair of words as one 64-bit number.
    const auto as_unsigned = rows_first.to(torch::kInt64).bitwise_and(0xFFFFFFFFLL);
    const auto padded = torch::cat({as_unsigned, torch::zeros({rows, 1}, as_unsigned.options())}, 1);
    const auto bit = torch::arange(count, as_unsigned.options()) * bits;
    const auto word = bit.div(32, "floor");
    const auto pair = padded.index_select(1, word).bitwise_or(padded.index_select(1, word + 1).bitwise_left_shift(32));
    unsigned_codes = pair.bitwise_right_shift(bit.remainder(32)).bitwise_and((int64_t{1} << bits) - 1);
  }
  auto codes = (unsigned_codes - (int64_t{1} << (bits - 1))).to(torch::kInt8);
  return packed_dim == 0 ? codes.t().contiguous() : codes;
}

torch::Tensor CompressedWeight::codes() const {
  switch (format) {
    case CompressionFormat::kPackQuantized: return unpack_int32(data, spec.bits, in_features, 1);
    case CompressionFormat::kIntQuantized: return data;
    case CompressionFormat::kFloatQuantized:
    case CompressionFormat::kFp8Blocks: return data.to(torch::kFloat32);
    case CompressionFormat::kNvfp4PackQuantized: {
      const auto nibbles = torch::stack({data.bitwise_and(0x0F), data.bitwise_right_shift(4)}, -1).reshape({out_features, -1});
      return e2m1_values(data.device()).index({nibbles.to(torch::kInt64)});
    }
  }
  throw Error(ErrorCode::kInternal, "unknown compression format (internal error)");
}

torch::Tensor CompressedWeight::dequantize(torch::ScalarType dtype) const {
  torch::NoGradGuard no_grad;
  if (format == CompressionFormat::kNvfp4PackQuantized) {
    // compressed-tensors unpacks e2m1 to bf16, divides the bf16 scale by the fp32 global scale
    // (fp32), multiplies in fp32 and returns the unpacking's bf16.
    const auto group_scale = scale.to(torch::kBFloat16).to(torch::kFloat32) / global_scale.to(torch::kFloat32);
    return scale_groups(codes(), group_scale, groups_of(*this)).to(torch::kBFloat16).to(dtype);
  }
  if (format == CompressionFormat::kFp8Blocks) {
    // Each block's fp32 scale over its rows and columns (ragged at the edges), the product in fp32.
    const auto scales = scale.to(torch::kFloat32)
                            .repeat_interleave(block_rows, 0)
                            .repeat_interleave(block_columns, 1)
                            .narrow(0, 0, out_features)
                            .narrow(1, 0, in_features);
    return (data.to(torch::kFloat32) * scales).to(dtype);
  }
  // transformers loads the scales into parameters of the model's dtype and decompresses there.
  const auto scale_dtype = dtype;
  const bool reduced_or_single = dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kFloat16;
  if (kernels::kCudaKernelsBuilt && data.is_cuda() && format == CompressionFormat::kPackQuantized &&
      (spec.bits == 4 || spec.bits == 8) && reduced_or_single) {
    // One pass on the GPU, the bits of the operations below.
    return kernels::dequantize_packed_int_cuda(data.contiguous(), scale.to(dtype).contiguous(),
                                               zero_point.defined() ? zero_point.contiguous() : torch::Tensor(), spec.bits,
                                               in_features);
  }
  auto values = codes().to(scale_dtype);
  const int64_t groups = groups_of(*this);
  if (zero_point.defined()) {
    auto zero_points = format == CompressionFormat::kPackQuantized ? unpack_int32(zero_point, spec.bits, out_features, 0)
                                                                   : zero_point;
    zero_points = zero_points.to(scale_dtype);
    values = zero_points.numel() == 1 ? values - zero_points.reshape({1, 1})
                                      : (values.reshape({out_features, groups, -1}) - zero_points.reshape({out_features, groups, 1}))
                                            .reshape(values.sizes());
  }
  return scale_groups(values, scale.to(scale_dtype), groups);
}

int64_t CompressedWeight::stored_bytes() const {
  int64_t bytes = 0;
  for (const auto* tensor : {&data, &scale, &zero_point, &global_scale}) {
    if (tensor->defined()) bytes += tensor->numel() * static_cast<int64_t>(tensor->element_size());
  }
  return bytes;
}

CompressedWeight CompressedWeight::to(const torch::Device& device) const {
  CompressedWeight moved = *this;
  for (auto* tensor : {&moved.data, &moved.scale, &moved.zero_point, &moved.global_scale}) {
    if (tensor->defined()) *tensor = tensor->to(device);
  }
  return moved;
}

CompressedWeight compressed_weight_from_codes(const QuantizedTensor& quantized, CompressionFormat format,
                                              torch::ScalarType scale_dtype) {
  const auto& spec = quantized.spec;
  const bool integer = spec.is_integer() && spec.has_integer_zero_point();
  const bool float8 = spec.format == QuantFormat::kFp8E4m3;
  if (!(integer || float8) || quantized.codes.dim() != 2) {
    throw Error(ErrorCode::kUsage, "compressed-tensors stores int grids with integer zero points and e4m3 weights, not " +
                spec.describe());
  }
  if ((format == CompressionFormat::kFloatQuantized) != float8 || format == CompressionFormat::kNvfp4PackQuantized) {
    throw Error(ErrorCode::kInternal, std::string("compressed-tensors ") + compression_format_name(format) + " cannot hold " +
                spec.describe() + " (internal error)");
  }
  CompressedWeight weight;
  weight.format = format;
  weight.spec = spec;
  weight.out_features = quantized.codes.size(0);
  weight.in_features = quantized.codes.size(1);
  const auto codes = quantized.codes.to(torch::kCPU);
  weight.scale = quantized.params.scale.to(torch::kCPU, scale_dtype);
  if (!weight.scale.to(torch::kFloat32).equal(quantized.params.scale.to(torch::kCPU, torch::kFloat32))) {
    throw Error(ErrorCode::kUsage, "compressed-tensors export: the " + spec.describe() + " scales are not exact in " +
                std::string(c10::toString(scale_dtype)) + "; export in the dtype they were computed in");
  }
  if (float8) {
    weight.data = codes.view(torch::kFloat8_e4m3fn);
  } else if (format == CompressionFormat::kPackQuantized) {
    weight.data = pack_int32(codes, spec.bits, 1);
  } else {
    weight.data = codes.to(torch::kInt8);
  }
  if (!spec.symmetric) {
    const auto zero_points = quantized.params.zero_point.to(torch::kCPU).to(torch::kInt8);
    weight.zero_point = format == CompressionFormat::kPackQuantized ? pack_int32(zero_points, spec.bits, 0) : zero_points;
  }
  return weight;
}

namespace {

// llm-compressor's NVFP4 (quant_presets.h): the tensor's global scale, the e4m3 group scales under
// it, the e2m1 codes; in the weight's dtype where compressed-tensors computes in it.
CompressedWeight compress_nvfp4(const torch::Tensor& weight, const torch::Tensor& tensor_absmax) {
  const int64_t out = weight.size(0);
  const int64_t in = weight.size(1);
  if (in % kNvfp4Group != 0) {
    throw Error(ErrorCode::kUsage, "NVFP4 rounds groups of 16 input features; a weight of " + std::to_string(in) +
                " does not divide into them");
  }
  const auto dtype = weight.scalar_type();
  const double e4m3_max = quant_format_info(QuantFormat::kFp8E4m3).max_value;
  const double e2m1_max = quant_format_info(QuantFormat::kFp4E2m1).max_value;
  const auto groups = weight.reshape({out, in / kNvfp4Group, kNvfp4Group});
  const auto absmax = groups.abs().amax(-1);  // [out, groups], the weight's dtype
  // generate_gparam: 448 * 6 / absmax in the weight's dtype (absmax at least its smallest normal
  // number), 1 where that is not finite, then fp32.
  const auto whole = (tensor_absmax.defined() ? tensor_absmax : weight.abs().max()).to(dtype).reshape({1});
  const double tiny = dtype == torch::kBFloat16 ? static_cast<double>(std::numeric_limits<c10::BFloat16>::min())
                    : dtype == torch::kFloat16  ? static_cast<double>(std::numeric_limits<c10::Half>::min())
                                                : static_cast<double>(std::numeric_limits<float>::min());
  // Python's `2688.0 / tensor` is torch's reciprocal, then the product: one more rounding than a division.
  const auto global_scale =
      torch::nan_to_num(whole.clamp_min(tiny).reciprocal() * (e4m3_max * e2m1_max), 1.0, 1.0, 1.0).to(torch::kFloat32);
  // scale = e4m3(global * absmax / 6), 0.125 where it is 0.
  auto scale = (global_scale * (absmax / e2m1_max)).clamp(-e4m3_max, e4m3_max).to(torch::kFloat8_e4m3fn).to(torch::kFloat32);
  scale = torch::where(scale == 0, torch::full_like(scale, kE4m3ScaleEps), scale);
  QuantSpec spec;
  spec.format = QuantFormat::kFp4E2m1;
  spec.bits = 4;
  spec.granularity = Granularity::kPerGroup;
  spec.group_size = kNvfp4Group;
  spec.convention = QuantConvention::kCompressedTensors;
  // The group scale over the global one is fp32, so the division is (type promotion) too.
  const auto codes = quantize(spec, weight.to(torch::kFloat32), {scale / global_scale, torch::zeros_like(scale)});
  CompressedWeight compressed;
  compressed.format = CompressionFormat::kNvfp4PackQuantized;
  compressed.spec = spec;
  compressed.out_features = out;
  compressed.in_features = in;
  const auto pairs = codes.to(torch::kCPU).reshape({out, in / 2, 2});
  compressed.data = pairs.select(-1, 0).bitwise_or(pairs.select(-1, 1).bitwise_left_shift(4)).contiguous();
  compressed.scale = scale.to(torch::kCPU, torch::kFloat8_e4m3fn);
  compressed.global_scale = global_scale.to(torch::kCPU);
  return compressed;
}

}  // namespace

CompressedWeight compress_weight(const QuantPreset& preset, const torch::Tensor& weight, const torch::Tensor& tensor_absmax) {
  torch::NoGradGuard no_grad;
  if (weight.dim() != 2) throw Error(ErrorCode::kInternal, "compress_weight: a weight is [out, in] (internal error)");
  const auto format = parse_compression_format(preset.compression_format, std::string("scheme ") + preset.name);
  if (preset.two_level_scales) return compress_nvfp4(weight, tensor_absmax);
  const auto spec = QuantSpec::compressed_tensors_weights(preset);
  spec.validate_for_shape(std::string("scheme ") + preset.name, weight.sizes());
  const auto params = choose_qparams(spec, block_min_max(spec, weight));
  const auto dtype = weight.scalar_type() == torch::kFloat64 ? torch::kFloat32 : weight.scalar_type();
  return compressed_weight_from_codes(quantize_tensor(spec, weight, params), format, dtype);
}

}  // namespace qtrain::qat
