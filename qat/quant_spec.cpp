#include "qat/quant_spec.h"

#include <array>
#include <utility>

#include "kernels/error.h"

namespace qtrain::qat {

namespace {

const std::array<std::pair<Granularity, const char*>, 4> kGranularityNames = {{
    {Granularity::kPerTensor, "per_tensor"},
    {Granularity::kPerChannel, "per_channel"},
    {Granularity::kPerToken, "per_token"},
    {Granularity::kPerGroup, "per_group"},
}};

const std::array<std::pair<ZeroPointDomain, const char*>, 2> kZeroPointDomainNames = {{
    {ZeroPointDomain::kInt, "int"},
    {ZeroPointDomain::kFloat, "float"},
}};

constexpr int64_t kMinIntBits = 2;

}  // namespace

Granularity parse_granularity(const std::string& name, const std::string& what) {
  std::string choices;
  for (const auto& [granularity, granularity_text] : kGranularityNames) {
    if (name == granularity_text) return granularity;
    choices += (choices.empty() ? "" : ", ") + std::string(granularity_text);
  }
  throw Error(ErrorCode::kRecipe, what + ": unknown granularity '" + name + "' (expected one of " + choices + ")");
}

const char* granularity_name(Granularity granularity) {
  for (const auto& [candidate, text] : kGranularityNames) {
    if (candidate == granularity) return text;
  }
  throw Error(ErrorCode::kInternal, "unknown granularity (internal error)");
}

ZeroPointDomain parse_zero_point_domain(const std::string& name, const std::string& what) {
  for (const auto& [domain, text] : kZeroPointDomainNames) {
    if (name == text) return domain;
  }
  throw Error(ErrorCode::kRecipe, what + ": unknown zero point domain '" + name + "' (expected int or float)");
}

const char* zero_point_domain_name(ZeroPointDomain domain) {
  for (const auto& [candidate, text] : kZeroPointDomainNames) {
    if (candidate == domain) return text;
  }
  throw Error(ErrorCode::kInternal, "unknown zero point domain (internal error)");
}

int64_t QuantSpec::quant_min() const { return -(int64_t{1} << (bits - 1)); }
int64_t QuantSpec::quant_max() const { return (int64_t{1} << (bits - 1)) - 1; }

void QuantSpec::validate(const std::string& what) const {
  const auto& info = format_info();
  if (is_gguf_block()) {
    const auto& block = gguf_block_format(gguf_block);
    if (!block.integer_codes) {
      throw Error(ErrorCode::kRecipe, what + ".gguf_type: " + block.name + " is not a GGUF block type QAT trains on "
                                      "(the legacy types and the K-quants)");
    }
    if (granularity != Granularity::kPerGroup || group_size != block.block_elements) {
      throw Error(ErrorCode::kInternal, what + ": GGUF " + block.name + " rounds blocks of " + std::to_string(block.block_elements) +
                  " (internal error)");
    }
    return;
  }
  if (is_integer()) {
    if (bits < kMinIntBits || bits > info.bits) {
      throw Error(ErrorCode::kRecipe, what + ".bits: " + std::to_string(bits) + " is out of range (int formats take " +
                  std::to_string(kMinIntBits) + " to " + std::to_string(info.bits) + " bits)");
    }
  } else {
    if (bits != info.bits) {
      throw Error(ErrorCode::kRecipe, what + ".bits: " + std::to_string(bits) + " does not fit format " + info.name + ", which has " +
                  std::to_string(info.bits) + " bits");
    }
    if (!symmetric) {
      throw Error(ErrorCode::kRecipe, what + ".symmetric: false is not possible with format " + std::string(info.name) +
                  " (float grids are symmetric around 0; use format int for an asymmetric grid)");
    }
  }
  if (granularity == Granularity::kPerGroup && group_size <= 0) {
    throw Error(ErrorCode::kRecipe, what + ".group_size: " + std::to_string(group_size) + " must be positive for granularity per_group");
  }
  if (scale_dtype != torch::kFloat32 && scale_dtype != torch::kFloat16) {
    throw Error(ErrorCode::kRecipe, what + ".scale_dtype: " + std::string(c10::toString(scale_dtype)) +
                " is not supported (expected fp32, or fp16 as GGUF stores it)");
  }
  if (group_scales.is_two_level()) {
    throw Error(ErrorCode::kRecipe, what + ": a second level of scales (K-quant, MXFP4 or NVFP4 style) is not one qtrain's "
                "quantizers compute yet; they keep each group's scale in scale_dtype");
  }
  if (zero_point_domain == ZeroPointDomain::kFloat) {
    const std::string reason = what + ".zero_point_domain: float (torchao's int4 weight-only grid) needs ";
    if (!is_integer()) throw Error(ErrorCode::kRecipe, reason + "format int, got " + info.name);
    if (symmetric) throw Error(ErrorCode::kRecipe, reason + "symmetric: false (its zero point offsets each block's own range)");
    if (scale_dtype != torch::kFloat32) throw Error(ErrorCode::kRecipe, reason + "scale_dtype fp32");
    if (convention != QuantConvention::kTorchao) throw Error(ErrorCode::kRecipe, reason + "torchao's conventions");
  }
}

void QuantSpec::validate_for_shape(const std::string& what, c10::IntArrayRef shape) const {
  validate(what);
  if (shape.empty()) throw Error(ErrorCode::kInternal, what + ": cannot quantize a 0-d tensor (it has no last dimension to block)");
  const int64_t last = shape.back();
  if (granularity == Granularity::kPerGroup && last % group_size != 0) {
    throw Error(ErrorCode::kRecipe, what + ".group_size: " + std::to_string(group_size) + " does not divide the last dimension " +
                std::to_string(last) + " of a tensor of shape " + shape_text(shape));
  }
}

std::string QuantSpec::describe() const {
  if (is_gguf_block()) return std::string("gguf ") + gguf_block_format(gguf_block).name;
  std::string text = is_integer() ? "int" + std::to_string(bits) : std::string(format_info().name);
  text += symmetric ? " symmetric " : " asymmetric ";
  text += granularity_name(granularity);
  if (granularity == Granularity::kPerGroup) text += "(" + std::to_string(group_size) + ")";
  text += scale_dtype == torch::kFloat16 ? " scale fp16" : " scale fp32";
  if (zero_point_domain != ZeroPointDomain::kInt) text += std::string(" zero_point ") + zero_point_domain_name(zero_point_domain);
  if (group_scales.is_two_level()) text += " two-level scales";
  if (convention == QuantConvention::kCompressedTensors) text += " (compressed-tensors)";
  return text;
}

QuantSpec QuantSpec::gguf_block_type(GgufBlockType type) {
  QuantSpec spec;
  spec.format = QuantFormat::kGguf;
  spec.bits = quant_format_info(QuantFormat::kGguf).bits;
  spec.symmetric = false;
  spec.granularity = Granularity::kPerGroup;
  spec.group_size = gguf_block_format(type).block_elements;
  spec.scale_dtype = torch::kFloat16;
  spec.gguf_block = type;
  return spec;
}

QuantSpec QuantSpec::gguf_q4_0() {
  QuantSpec spec;
  spec.bits = 4;
  spec.group_size = 32;
  spec.scale_dtype = torch::kFloat16;
  return spec;
}

QuantSpec QuantSpec::gguf_q8_0() {
  QuantSpec spec = gguf_q4_0();
  spec.bits = 8;
  return spec;
}

QuantSpec QuantSpec::int4_weight(int64_t group_size) {
  QuantSpec spec;
  spec.bits = 4;
  spec.group_size = group_size;
  return spec;
}

QuantSpec QuantSpec::int8_dynamic_per_token_activation() {
  QuantSpec spec;
  spec.bits = 8;
  spec.symmetric = false;
  spec.granularity = Granularity::kPerToken;
  return spec;
}

QuantSpec QuantSpec::int4_weight_only(int64_t group_size) {
  QuantSpec spec = int4_weight(group_size);
  spec.symmetric = false;
  spec.zero_point_domain = ZeroPointDomain::kFloat;
  return spec;
}

namespace {

QuantSpec preset_grid(const QuantPreset& preset, const QuantPresetGrid& grid, const std::string& what) {
  if (preset.two_level_scales) {
    throw Error(ErrorCode::kRecipe, what + ": " + preset.name + " keeps its group scales in e4m3 under a scale of the whole "
                "tensor, a second level QAT does not train on: train on another scheme and export " + preset.name +
                " after training");
  }
  QuantSpec spec;
  spec.format = grid.format;
  spec.bits = grid.bits;
  spec.symmetric = grid.symmetric;
  spec.granularity = parse_granularity(grid.granularity, what);
  spec.group_size = grid.group_size > 0 ? grid.group_size : spec.group_size;
  spec.convention = QuantConvention::kCompressedTensors;
  return spec;
}

}  // namespace

QuantSpec QuantSpec::compressed_tensors_weights(const QuantPreset& preset) {
  return preset_grid(preset, preset.weights, std::string("scheme ") + preset.name);
}

QuantSpec QuantSpec::compressed_tensors_activations(const QuantPreset& preset) {
  if (!preset.quantizes_activations) {
    throw Error(ErrorCode::kInternal, std::string("scheme ") + preset.name + " leaves activations unquantized (internal error)");
  }
  return preset_grid(preset, preset.activations, std::string("scheme ") + preset.name);
}

std::vector<int64_t> params_shape(const QuantSpec& spec, c10::IntArrayRef shape) {
  if (spec.granularity == Granularity::kPerTensor) return {1};
  std::vector<int64_t> result(shape.begin(), shape.end() - 1);
  result.push_back(spec.granularity == Granularity::kPerGroup ? shape.back() / spec.group_size : 1);
  return result;
}

std::vector<int64_t> block_view_shape(const QuantSpec& spec, c10::IntArrayRef shape) {
  int64_t numel = 1;
  for (const auto size : shape) numel *= size;
  auto result = params_shape(spec, shape);
  switch (spec.granularity) {
    case Granularity::kPerTensor: result.push_back(numel); break;
    case Granularity::kPerGroup: result.push_back(spec.group_size); break;
    default: result.push_back(shape.back()); break;
  }
  return result;
}

}  // namespace qtrain::qat
