#pragma once
// The loop structure the CPU reference paths of bitsandbytes' blockwise quantization share
// (4-bit in qat/four_bit_codec.cpp, 8-bit in kernels/blockwise_8bit.cpp): n values in blocks of
// `blocksize`, the last one partial, each block reduced to its absmax as bnb's kernels reduce it.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

namespace qtrain::kernels {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks are independent: parallel over blocks; function(block, first, last) with last exclusive.
template <typename BlockFunction>
void for_each_block(int64_t n, int64_t blocksize, const BlockFunction& function) {
  const int64_t blocks = ceil_div(n, blocksize);
  at::parallel_for(0, blocks, std::max<int64_t>(1, 16384 / blocksize), [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = block * blocksize;
      function(block, first, std::min(n, first + blocksize));
    }
  });
}

// max |x| over [first, last), as the kernels reduce it (fmaxf from -FLT_MAX; the zero padding
// of a partial block cannot raise it).
inline float block_absmax(const float* values, int64_t first, int64_t last) {
  float absmax = -FLT_MAX;
  for (int64_t i = first; i < last; ++i) absmax = std::fmax(absmax, std::fabs(values[i]));
  return std::fmax(absmax, 0.0f);
}

}  // namespace qtrain::kernels
