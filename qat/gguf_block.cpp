#include "qat/gguf_block.h"

#include "kernels/error.h"

namespace qtrain::qat {

namespace {

int64_t numel_of(c10::IntArrayRef shape) {
  int64_t count = 1;
  for (const auto size : shape) count *= size;
  return count;
}

// The names of the quantized types whose row has `property` ("Q4_0 / Q8_0"), for messages that
// hold for all of them.
template <typename Property>
std::string names_of_types_where(Property property) {
  std::string names;
  for (const auto& format : gguf_block_formats()) {
    if (format.grid && property(format)) names += (names.empty() ? "" : " / ") + std::string(format.name);
  }
  return names;
}

// Why `spec`'s codes, on the integer grid of `format`'s width, are not `format`'s blocks: the
// field after the recipe key and the reason, or "" when they are.
std::string misfit(const GgufBlockFormat& format, const QuantSpec& spec) {
  const auto& grid = *format.grid;
  const std::string scheme = " (" + spec.describe() + ")";
  if (grid.symmetric && !spec.symmetric) {
    return ".symmetric: false cannot be written as GGUF " +
           names_of_types_where([](const GgufBlockFormat& other) { return other.grid->symmetric; }) +
           ", which are symmetric (no zero point)" + scheme + "; set symmetric: true or export as safetensors-int";
  }
  if (spec.granularity != Granularity::kPerGroup || spec.group_size != format.block_elements) {
    return ".group_size: GGUF " +
           names_of_types_where([&](const GgufBlockFormat& other) { return other.block_elements == format.block_elements; }) +
           " need granularity per_group with group_size " + std::to_string(format.block_elements) + scheme;
  }
  if (grid.fp16_scales && spec.scale_dtype != torch::kFloat16) {
    return ".scale_dtype: GGUF stores each block's scale as fp16, so the fake-quant scale must be fp16-rounded" + scheme +
           " (QuantSpec::gguf_q4_0() / gguf_q8_0() set it)";
  }
  if (spec.group_scales.is_two_level()) {
    return ".group_scales: GGUF " + std::string(format.name) + " stores each block's fp16 scale itself, with no second level of "
           "scales above it" + scheme;
  }
  return "";
}

// The quantized type whose integer width is `spec`'s, or null.
const GgufBlockFormat* type_of_width(const QuantSpec& spec) {
  for (const auto& format : gguf_block_formats()) {
    if (format.grid && spec.is_integer() && spec.bits == format.grid->bits) return &format;
  }
  return nullptr;
}

}  // namespace

bool gguf_block_fits(const GgufBlockFormat& format, const QuantSpec& spec) {
  return format.grid && spec.is_integer() && spec.bits == format.grid->bits && misfit(format, spec).empty();
}

GgufBlockType gguf_block_type_for(const QuantSpec& spec, const std::string& what) {
  if (spec.is_gguf_block()) return spec.gguf_block;
  const auto* format = type_of_width(spec);
  if (format == nullptr) {
    std::string widths;  // "int4 (Q4_0) or int8 (Q8_0)"
    for (const auto& candidate : gguf_block_formats()) {
      if (!candidate.grid) continue;
      widths += (widths.empty() ? "" : " or ") + ("int" + std::to_string(candidate.grid->bits)) + " (" + candidate.name + ")";
    }
    throw Error(ErrorCode::kRecipe, what + ": GGUF export holds " + widths + " weights only (and format gguf's own blocks), not " +
                spec.describe() + "; export it as safetensors-int");
  }
  const auto reason = misfit(*format, spec);
  if (!reason.empty()) throw Error(ErrorCode::kRecipe, what + reason);
  return format->type;
}

std::vector<uint8_t> encode_gguf_blocks(const QuantizedTensor& tensor, const std::string& what) {
  const auto& format = gguf_block_format(gguf_block_type_for(tensor.spec, what));
  const auto shape = tensor.codes.sizes();
  tensor.spec.validate_for_shape(what, shape);
  const auto codes = tensor.codes.to(torch::kCPU, torch::kInt8).contiguous();
  const auto scale = tensor.params.scale.to(torch::kCPU, torch::kFloat32).contiguous();
  const auto half_scale = scale.to(torch::kFloat16);
  if (!torch::equal(half_scale.to(torch::kFloat32), scale)) {
    throw Error(ErrorCode::kWeights, what + ": a scale of tensor " + shape_text(shape) + " is not an fp16 value, so GGUF cannot store it exactly");
  }
  if (tensor.params.zero_point.defined() && tensor.params.zero_point.ne(0).any().item<bool>()) {
    throw Error(ErrorCode::kWeights, what + ": tensor " + shape_text(shape) + " has non-zero zero points, which GGUF " +
                names_of_types_where([](const GgufBlockFormat& other) { return other.grid->symmetric; }) + " cannot store");
  }
  const int64_t blocks = codes.numel() / format.block_elements;
  std::vector<uint8_t> bytes(static_cast<size_t>(blocks * format.block_bytes));
  format.encode(codes.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(half_scale.data_ptr<at::Half>()), blocks,
                bytes.data());
  return bytes;
}

torch::Tensor decode_gguf_blocks(const std::vector<uint8_t>& bytes, GgufBlockType type, c10::IntArrayRef shape) {
  const auto& format = gguf_block_format(type);
  if (!format.decode) throw Error(ErrorCode::kInternal, std::string(format.name) + " holds values, not blocks to decode");
  const int64_t numel = numel_of(shape);
  const int64_t blocks = numel / format.block_elements;
  if (numel % format.block_elements != 0 || static_cast<int64_t>(bytes.size()) != blocks * format.block_bytes) {
    throw Error(ErrorCode::kWeights, std::string(format.name) + " data of " + std::to_string(bytes.size()) + " bytes does not hold a tensor of shape " +
                shape_text(shape));
  }
  auto codes = torch::empty({blocks, format.block_elements}, torch::kInt8);
  auto half_scale = torch::empty({blocks, 1}, torch::kFloat16);
  format.decode(bytes.data(), blocks, codes.data_ptr<int8_t>(), reinterpret_cast<uint16_t*>(half_scale.data_ptr<at::Half>()));
  // value = q * d in fp32, one rounding, as dequantize_row_q4_0 / _q8_0 compute it.
  return (codes.to(torch::kFloat32) * half_scale.to(torch::kFloat32)).reshape(shape);
}

}  // namespace qtrain::qat
