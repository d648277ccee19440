#include "qat/four_bit_format.h"

#include <algorithm>
#include <cmath>

#include "kernels/error.h"

namespace qtrain::qat {

namespace {

// bitsandbytes' get_4bit_type("nf4") as fp32 (the values of its `quant_map`).
constexpr std::array<float, 16> kNf4Code = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

// dQuantizeNF4's pivots as bitsandbytes writes them: the midpoints of neighbouring codes, printed
// with 16-17 digits. Four exact midpoints (indices 0, 8, 12, 14) fall exactly halfway between two
// fp32 values; the printed decimals are a hair off that tie and the compiler rounds them to the
// other neighbour than round-half-even of the exact midpoint would. So they are data, not computed.
constexpr std::array<float, 15> kNf4Thresholds = {
    -0.8480964004993439f,  -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f,   0.2035212516784668f,  0.2920137718319893f,  0.3893125355243683f,
    0.5016634166240692f,   0.6427869200706482f,  0.8614784181118011f};

// FP4's values before bitsandbytes divides them by their maximum, 12 (in fp32). Index 8 is +0:
// bnb writes it `-0`, a Python int.
constexpr std::array<float, 16> kFp4Unscaled = {0.0f,  0.0625f,  8.0f,  12.0f,  4.0f,  6.0f,  2.0f,  3.0f,
                                                0.0f,  -0.0625f, -8.0f, -12.0f, -4.0f, -6.0f, -2.0f, -3.0f};

// dQuantizeFP4's pivots on |x|, as bitsandbytes writes them: decimal roundings of the midpoints
// (7/12 appears as 0.583333, not 0.5833333), which decide codes near them, so they are data.
constexpr std::array<float, 7> kFp4Thresholds = {0.00260417f, 0.0859375f, 0.20833333f, 0.29166667f,
                                                 0.4166667f,  0.583333f,  0.8333333f};
// The FP4 magnitude codes in increasing value: 0, 0.0625, 2, 3, 4, 6, 8, 12.
constexpr std::array<uint8_t, 8> kFp4MagnitudeOrder = {0b000, 0b001, 0b110, 0b111, 0b100, 0b101, 0b010, 0b011};

FourBitFormat make_nf4() {
  FourBitFormat format;
  format.type = FourBitType::kNf4;
  format.name = "nf4";
  format.code = kNf4Code;
  format.decode = kNf4Code;
  format.thresholds.assign(kNf4Thresholds.begin(), kNf4Thresholds.end());
  for (uint8_t code = 0; code < 16; ++code) format.code_of_rank.push_back(code);
  return format;
}

FourBitFormat make_fp4() {
  FourBitFormat format;
  format.type = FourBitType::kFp4;
  format.name = "fp4";
  for (size_t index = 0; index < kFp4Unscaled.size(); ++index) format.code[index] = kFp4Unscaled[index] / 12.0f;
  format.decode = format.code;
  format.decode[8] = -0.0f;
  format.sign_magnitude = true;
  format.thresholds.assign(kFp4Thresholds.begin(), kFp4Thresholds.end());
  format.code_of_rank.assign(kFp4MagnitudeOrder.begin(), kFp4MagnitudeOrder.end());
  return format;
}

}  // namespace

uint8_t FourBitFormat::quantize(float x) const {
  uint8_t sign = 0;
  if (sign_magnitude) {
    if (x < 0.0f) sign = 0b1000;
    x = std::fabs(x);
  }
  // Thresholds are few (7 or 15); a linear scan equals the kernels' decision tree.
  size_t rank = 0;
  while (rank < thresholds.size() && x > thresholds[rank]) ++rank;
  return static_cast<uint8_t>(code_of_rank[rank] | sign);
}

const FourBitFormat& four_bit_format(FourBitType type) {
  static const FourBitFormat nf4 = make_nf4();
  static const FourBitFormat fp4 = make_fp4();
  return type == FourBitType::kNf4 ? nf4 : fp4;
}

FourBitType parse_four_bit_type(const std::string& name, const std::string& what, ErrorCode code) {
  if (name == "nf4") return FourBitType::kNf4;
  if (name == "fp4") return FourBitType::kFp4;
  throw Error(code, what + ": unsupported 4-bit quant type '" + name + "' (expected nf4 or fp4)");
}

const std::string& four_bit_type_name(FourBitType type) { return four_bit_format(type).name; }

torch::Tensor four_bit_code_tensor(FourBitType type) {
  const auto& code = four_bit_format(type).code;
  return torch::tensor(std::vector<float>(code.begin(), code.end()), torch::kFloat32);
}

torch::Tensor four_bit_decode_tensor(FourBitType type) {
  const auto& decode = four_bit_format(type).decode;
  return torch::tensor(std::vector<float>(decode.begin(), decode.end()), torch::kFloat32);
}

}  // namespace qtrain::qat
