#pragma once
// bitsandbytes' nearest-code search in a sorted 256-entry map (dQuantize<0>, deterministic
// rounding), the one step of its 8-bit blockwise quantization that is more than arithmetic. One
// definition for the CPU reference path (qat/four_bit_codec.cpp) and the CUDA kernel
// (kernels/blockwise_quantize.cu): it compiles for both.
#include <c10/macros/Macros.h>

#include <cstdint>

namespace qtrain::kernels {

// Seven halving steps from index 127 track the last codes below (lower) and at or above (upper)
// x, then x goes to the final pivot or the neighbour on its side, whichever is nearer by an fp32
// midpoint test (a tie keeps the pivot). The bracket starts as [-1, 1], bnb's signed-map
// assumption, also for an unsigned map.
C10_HOST_DEVICE inline uint8_t dynamic_map_code(const float* code, float x) {
  int pivot = 127, lower_index = 0, upper_index = 255;
  float lower = -1.0f, upper = 1.0f;
  float value = code[pivot];
  for (int step = 64; step > 0; step /= 2) {
    if (x > value) {
      lower_index = pivot;
      lower = value;
      pivot += step;
    } else {
      upper_index = pivot;
      upper = value;
      pivot -= step;
    }
    value = code[pivot];
  }
  if (upper_index == 255) upper = code[255];
  if (lower_index == 0) lower = code[0];
  if (x > value) {
    const float midpoint = (upper + value) * 0.5f;
    return static_cast<uint8_t>(x > midpoint ? upper_index : pivot);
  }
  const float midpoint = (lower + value) * 0.5f;
  return static_cast<uint8_t>(x < midpoint ? lower_index : pivot);
}

}  // namespace qtrain::kernels
