#pragma once
// The 4-bit data types of bitsandbytes (Dettmers et al. 2023, "QLoRA") and the 8-bit dynamic map
// its double quantization uses, as data, named once. Everything else (the codec, the checkpoint
// reader, fake-quant grids) looks them up here.
//
// A 4-bit code is an index into a 16-entry table of values in [-1, 1]; a block of `blocksize`
// weights stores codes plus one fp32 absmax, and decodes as table[code] * absmax.
//
//   NF4  the 16 quantiles of N(0, 1) scaled to [-1, 1], with an exact zero (index 7); sorted.
//   FP4  sign bit (8) + a 3-bit magnitude (e2m1 with bias 3: 0, 0.0625, 8, 12, 4, 6, 2, 3)
//        divided by 12, so index 3 is 1.0.
#include <torch/types.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/blockwise_8bit.h"
#include "kernels/error.h"
#include "qat/four_bit_type.h"

namespace qtrain::qat {

struct FourBitFormat {
  FourBitType type;
  std::string name;            // "nf4" / "fp4", as bitsandbytes and transformers spell them
  std::array<float, 16> code;  // the value of each 4-bit code (bnb's `quant_map`), fp32
  // What the dequantization kernels decode each code to: `code`, except that FP4's code 8 (sign
  // bit, zero magnitude) decodes to -0.0 while bnb's quant_map holds +0 there (Python's `-0`).
  std::array<float, 16> decode;
  // How bitsandbytes' kernels (dQuantizeNF4 / dQuantizeFP4) pick a code for a normalized value
  // x = w * (1 / absmax): a decision tree whose pivots are the `thresholds` below, compared with
  // `x > threshold` in fp32. So the result is the rank r = number of thresholds below x, and a
  // value exactly on a threshold goes to the lower code. For FP4 the tree sees |x| and the sign
  // bit is added for x < 0 (so -0.0 and NaN get code 0; NaN gets code 0 for NF4 as well).
  bool sign_magnitude = false;
  std::vector<float> thresholds;      // ascending
  std::vector<uint8_t> code_of_rank;  // thresholds.size() + 1 entries
  // The 4-bit code bitsandbytes gives the normalized value x.
  uint8_t quantize(float x) const;
};

const FourBitFormat& four_bit_format(FourBitType type);
// "nf4" / "fp4" -> type; anything else is an Error naming `what` (a file and key), with `code`
// (a recipe key by default; a checkpoint's config.json or quant state passes its own).
FourBitType parse_four_bit_type(const std::string& name, const std::string& what, ErrorCode code = ErrorCode::kRecipe);
const std::string& four_bit_type_name(FourBitType type);
// The table (`code`) as an fp32 [16] CPU tensor, and the decode table.
torch::Tensor four_bit_code_tensor(FourBitType type);
torch::Tensor four_bit_decode_tensor(FourBitType type);

// bitsandbytes' signed dynamic map (defined in kernels/blockwise_8bit.h).
using kernels::signed_dynamic_map;

}  // namespace qtrain::qat
