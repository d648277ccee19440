#include "trainer/base/dtype_names.h"

#include <array>

namespace qtrain::trainer {
namespace {

// Every safetensors dtype that LibTorch has a scalar type for. F4 / F6_* pack several elements
// into a byte and have none, so a file holding them is an Error naming the dtype.
constexpr std::array<SafetensorsDtype, 19> kDtypes{{
    {"F64", c10::ScalarType::Double},
    {"F32", c10::ScalarType::Float},
    {"F16", c10::ScalarType::Half},
    {"BF16", c10::ScalarType::BFloat16},
    {"I64", c10::ScalarType::Long},
    {"I32", c10::ScalarType::Int},
    {"I16", c10::ScalarType::Short},
    {"I8", c10::ScalarType::Char},
    {"U64", c10::ScalarType::UInt64},
    {"U32", c10::ScalarType::UInt32},
    {"U16", c10::ScalarType::UInt16},
    {"U8", c10::ScalarType::Byte},
    {"BOOL", c10::ScalarType::Bool},
    {"F8_E4M3", c10::ScalarType::Float8_e4m3fn},
    {"F8_E5M2", c10::ScalarType::Float8_e5m2},
    {"F8_E4M3FNUZ", c10::ScalarType::Float8_e4m3fnuz},
    {"F8_E5M2FNUZ", c10::ScalarType::Float8_e5m2fnuz},
    {"F8_E8M0", c10::ScalarType::Float8_e8m0fnu},
    {"C64", c10::ScalarType::ComplexFloat},
}};

}  // namespace

std::optional<SafetensorsDtype> safetensors_dtype(const std::string& name) {
  for (const auto& dtype : kDtypes) {
    if (name == dtype.name) return dtype;
  }
  return std::nullopt;
}

std::optional<SafetensorsDtype> safetensors_dtype(c10::ScalarType scalar_type) {
  for (const auto& dtype : kDtypes) {
    if (scalar_type == dtype.scalar_type) return dtype;
  }
  return std::nullopt;
}

std::string safetensors_dtype_names() {
  std::string names;
  for (const auto& dtype : kDtypes) {
    if (!names.empty()) names += ", ";
    names += dtype.name;
  }
  return names;
}

}  // namespace qtrain::trainer
