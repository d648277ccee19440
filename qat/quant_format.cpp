#include "qat/quant_format.h"

#include <array>

#include "kernels/error.h"

namespace qtrain::qat {

namespace {

// One row per format. The minifloat rows are the OCP 8-bit (OFP8) and MX specifications'
// parameters; e4m3's max is 1.75 * 2^8 because its all-ones code is NaN, not a number.
const std::array<QuantFormatInfo, 7> kFormats = {{
    {QuantFormat::kInt, "int", GridKind::kInteger, 8},
    {QuantFormat::kFp8E4m3, "fp8_e4m3", GridKind::kMinifloat, 8, 4, 3, 7, 448.0},
    {QuantFormat::kFp8E5m2, "fp8_e5m2", GridKind::kMinifloat, 8, 5, 2, 15, 57344.0},
    {QuantFormat::kFp4E2m1, "fp4_e2m1", GridKind::kMinifloat, 4, 2, 1, 1, 6.0},
    {QuantFormat::kNf4, "nf4", GridKind::kTable, 4, 0, 0, 0, 1.0, FourBitType::kNf4},
    {QuantFormat::kFp4, "fp4", GridKind::kTable, 4, 0, 0, 0, 1.0, FourBitType::kFp4},
    {QuantFormat::kGguf, "gguf", GridKind::kGgufBlocks, 8},  // bits: the widest block type's (Q8_0)
}};

}  // namespace

const QuantFormatInfo& quant_format_info(QuantFormat format) {
  for (const auto& info : kFormats) {
    if (info.format == format) return info;
  }
  throw Error(ErrorCode::kInternal, "unknown quant format (internal error)");
}

const std::vector<QuantFormat>& quant_formats() {
  static const std::vector<QuantFormat> formats = [] {
    std::vector<QuantFormat> all;
    for (const auto& info : kFormats) all.push_back(info.format);
    return all;
  }();
  return formats;
}

QuantFormat parse_quant_format(const std::string& name, const std::string& what) {
  std::string choices;
  for (const auto& info : kFormats) {
    if (name == info.name) return info.format;
    choices += (choices.empty() ? "" : ", ") + std::string(info.name);
  }
  throw Error(ErrorCode::kRecipe, what + ": unknown quant format '" + name + "' (expected one of " + choices + ")");
}

const char* quant_format_name(QuantFormat format) { return quant_format_info(format).name; }

}  // namespace qtrain::qat
