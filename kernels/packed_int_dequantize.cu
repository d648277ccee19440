// The one-pass dequantization of kernels/packed_int_dequantize.h: one thread per int32 word of
// codes, its 8 (int4) or 4 (int8) values written in the output dtype.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <string>

#include "kernels/cuda_entry.cuh"
#include "kernels/packed_int_dequantize.h"

namespace qtrain::kernels {

namespace {

template <typename T, int kBits>
__global__ void dequantize_packed_int_kernel(const int32_t* __restrict__ words, const T* __restrict__ scale,
                                             const int32_t* __restrict__ zero_words, int64_t rows, int64_t row_words,
                                             int64_t columns, int64_t group, int64_t groups, bool one_scale,
                                             T* __restrict__ out) {
  constexpr int kPerWord = 32 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1;
  constexpr int kOffset = 1 << (kBits - 1);
  const int64_t n = rows * row_words;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < n;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = index / row_words;
    const int64_t first = (index % row_words) * kPerWord;
    const auto word = static_cast<uint32_t>(__ldg(words + index));
    // A row's zero points sit at bit row * bits of the words of its group's column, never straddling.
    const int64_t zero_bit = row * kBits;
#pragma unroll
    for (int k = 0; k < kPerWord; ++k) {
      const int64_t column = first + k;
      if (column >= columns) break;
      const int64_t g = column / group;
      const int q = static_cast<int>((word >> (k * kBits)) & kMask) - kOffset;
      int z = 0;
      if (zero_words != nullptr) {
        const auto zero_word = static_cast<uint32_t>(__ldg(zero_words + (zero_bit / 32) * groups + g));
        z = static_cast<int>((zero_word >> (zero_bit % 32)) & kMask) - kOffset;
      }
      const float s = static_cast<float>(scale[one_scale ? 0 : row * groups + g]);
      // An integer times a value of T: exact in fp32, then rounded once to T, as torch rounds it.
      out[row * columns + column] = static_cast<T>(__fmul_rn(static_cast<float>(q - z), s));
    }
  }
}

}  // namespace

at::Tensor dequantize_packed_int_cuda(const at::Tensor& words, const at::Tensor& scale, const at::Tensor& zero_words,
                                      int64_t bits, int64_t columns) {
  const std::string what = "dequantize_packed_int_cuda: ";
  check_cuda_tensor(words, what + "words");
  check_cuda_operands(words, {{&scale, "scale"}}, what);
  check_scalar_type(words, at::kInt, what + "words");
  if (zero_words.defined()) {
    check_cuda_operands(words, {{&zero_words, "zero_words"}}, what);
    check_scalar_type(zero_words, at::kInt, what + "zero_words");
  }
  const int64_t rows = words.dim() == 2 ? words.size(0) : 0;
  const int64_t row_words = words.dim() == 2 ? words.size(1) : 0;
  const bool one_scale = scale.numel() == 1;
  const int64_t groups = one_scale ? 1 : (scale.dim() == 2 ? scale.size(1) : 0);
  if ((bits != 4 && bits != 8) || words.dim() != 2 || row_words * 32 < columns * bits || groups < 1 ||
      columns % groups != 0 || (!one_scale && scale.size(0) != rows) ||
      (zero_words.defined() && (zero_words.dim() != 2 || zero_words.size(1) != groups ||
                                zero_words.size(0) * 32 < rows * bits))) {
    throw Error(ErrorCode::kInternal, what + "int" + std::to_string(bits) + " words of shape [" + std::to_string(rows) + ", " +
                                          std::to_string(row_words) + "] do not hold " + std::to_string(columns) +
                                          " columns with " + std::to_string(scale.numel()) + " scales");
  }
  auto out = at::empty({rows, columns}, scale.options());
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(words.device());
  const int64_t wanted = ceil_div(rows * row_words, kThreads);
  const auto grid = static_cast<unsigned>(wanted < 65535 * 16 ? wanted : 65535 * 16);
  const int64_t group = columns / groups;
  dispatch_float_type(scale.scalar_type(), what + "scale", [&](auto type) {
    using T = decltype(type);
    const auto* zeros = zero_words.defined() ? zero_words.data_ptr<int32_t>() : nullptr;
    auto launch = [&](auto kernel) {
      kernel<<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          words.data_ptr<int32_t>(), scale.data_ptr<T>(), zeros, rows, row_words, columns, group, groups, one_scale,
          out.data_ptr<T>());
    };
    if (bits == 4) {
      launch(dequantize_packed_int_kernel<T, 4>);
    } else {
      launch(dequantize_packed_int_kernel<T, 8>);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace qtrain::kernels
