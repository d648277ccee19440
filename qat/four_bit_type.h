#pragma once
// Which of bitsandbytes' 4-bit tables (qat/four_bit_format.h holds their values): the name alone,
// free of LibTorch, for the grids' table (qat/quant_format.h) that the recipe's parser reads.

namespace qtrain::qat {

enum class FourBitType { kNf4, kFp4 };

}  // namespace qtrain::qat
