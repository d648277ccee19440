// bitsandbytes' 4-bit dequantize kernel (kDequantizeBlockwise for NF4/FP4), with a double-quantized
// absmax rebuilt on the fly instead of in a separate 8-bit dequantize, so that a FourBitLinear's
// weight is one kernel away from its packed bytes. The CPU reference it must equal is
// qat/four_bit_codec.cpp; see kernels/blockwise_quantize.h.
//
// Each thread turns 4 packed bytes into 8 values: blocksizes are powers of two of at least 8, so
// the 8 share one absmax, and a full group is one 32-bit load and one 16- or 32-byte store.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <string>

#include "kernels/blockwise_quantize.h"
#include "kernels/bnb_fast_math.cuh"
#include "kernels/cuda_entry.cuh"

namespace qtrain::kernels {

namespace {

namespace fast = bnb_fast_math;

constexpr int kValuesPerThread = 8;
constexpr int kThreadsPerCudaBlock = 256;

struct DecodeTable {
  float values[16];
};

// The 8 outputs of one thread, stored at once (the output is freshly allocated, so aligned).
template <typename scalar_t>
struct alignas(sizeof(scalar_t) * kValuesPerThread) EightValues {
  scalar_t values[kValuesPerThread];
};

// bnb's value: table[code] * absmax with mul.ftz, rounded to the output type.
template <typename scalar_t>
__device__ __forceinline__ scalar_t decode_value(const float* table, uint32_t code, float absmax) {
  return static_cast<scalar_t>(fast::multiply(table[code], absmax));
}

template <typename scalar_t, bool kDoubleQuantized>
__global__ void dequantize_4bit_kernel(const uint8_t* __restrict__ packed, bool packed_word_aligned, int64_t n,
                                       int blocksize_log2, DecodeTable decode, const float* __restrict__ absmax,
                                       const uint8_t* __restrict__ absmax_codes,
                                       const float* __restrict__ nested_absmax,
                                       const float* __restrict__ nested_code, float offset,
                                       int64_t nested_blocksize, scalar_t* __restrict__ out) {
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = decode.values[threadIdx.x];
  __syncthreads();
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kValuesPerThread;
  if (first >= n) return;
  const int64_t block = first >> blocksize_log2;
  float scale;
  if (kDoubleQuantized) {
    // bnb's 8-bit dequantize (a mul.ftz) then torch's `absmax += offset`: two roundings, never an fma.
    const float centred = fast::multiply(__ldg(nested_code + __ldg(absmax_codes + block)),
                                         __ldg(nested_absmax + block / nested_blocksize));
    scale = __fadd_rn(centred, offset);
  } else {
    scale = __ldg(absmax + block);
  }
  if (first + kValuesPerThread <= n && packed_word_aligned) {
    const uint32_t word = __ldg(reinterpret_cast<const uint32_t*>(packed + first / 2));
    EightValues<scalar_t> group;
#pragma unroll
    for (int k = 0; k < kValuesPerThread / 2; ++k) {
      const uint32_t byte = (word >> (8 * k)) & 0xFF;  // little-endian: byte k of the word
      group.values[2 * k] = decode_value<scalar_t>(table, byte >> 4, scale);
      group.values[2 * k + 1] = decode_value<scalar_t>(table, byte & 0xF, scale);
    }
    *reinterpret_cast<EightValues<scalar_t>*>(out + first) = group;
    return;
  }
  const int64_t last = min(n, first + kValuesPerThread);
  for (int64_t i = first; i < last; ++i) {
    const uint32_t byte = __ldg(packed + i / 2);
    out[i] = decode_value<scalar_t>(table, i % 2 == 0 ? byte >> 4 : byte & 0xF, scale);
  }
}

int log2_of(int64_t power_of_two) {
  int log2 = 0;
  while ((int64_t{1} << log2) < power_of_two) ++log2;
  return log2;
}

void check_scales(const FourBitScales& scales, const at::Tensor& packed, int64_t blocks) {
  const std::string what = "dequantize_4bit_cuda: ";
  check_cuda_tensor(scales.absmax, what + "absmax");
  check_same_device(scales.absmax, packed, what + "absmax");
  if (scales.absmax.numel() != blocks) {
    throw Error(ErrorCode::kWeights, what + "absmax has " + std::to_string(scales.absmax.numel()) + " values, the packed weight has " +
                std::to_string(blocks) + " blocks");
  }
  if (!scales.nested_absmax.defined()) {
    check_scalar_type(scales.absmax, at::kFloat, what + "absmax (without nested_absmax)");
    return;
  }
  check_scalar_type(scales.absmax, at::kByte, what + "absmax (double quantized)");
  check_cuda_tensor(scales.nested_absmax, what + "nested_absmax");
  check_cuda_tensor(scales.nested_code, what + "nested_code");
  check_same_device(scales.nested_absmax, packed, what + "nested_absmax");
  check_same_device(scales.nested_code, packed, what + "nested_code");
  check_scalar_type(scales.nested_absmax, at::kFloat, what + "nested_absmax");
  check_scalar_type(scales.nested_code, at::kFloat, what + "nested_code");
  if (scales.nested_blocksize < 1) throw Error(ErrorCode::kWeights, what + "nested_blocksize must be positive");
  const int64_t nested_blocks = ceil_div(blocks, scales.nested_blocksize);
  if (scales.nested_absmax.numel() != nested_blocks || scales.nested_code.numel() != 256) {
    throw Error(ErrorCode::kWeights, what + "nested_absmax has " + std::to_string(scales.nested_absmax.numel()) + " values (expected " +
                std::to_string(nested_blocks) + ") and nested_code " + std::to_string(scales.nested_code.numel()) +
                " (expected 256)");
  }
}

}  // namespace

at::Tensor dequantize_4bit_cuda(const at::Tensor& packed, int64_t numel, int64_t blocksize,
                                c10::ArrayRef<float> decode, const FourBitScales& scales, c10::ScalarType dtype) {
  check_cuda_tensor(packed, "dequantize_4bit_cuda: packed");
  check_scalar_type(packed, at::kByte, "dequantize_4bit_cuda: packed");
  if (numel < 0 || packed.numel() != ceil_div(numel, 2)) {
    throw Error(ErrorCode::kWeights, "dequantize_4bit_cuda: packed has " + std::to_string(packed.numel()) + " bytes, " +
                std::to_string(numel) + " values need " + std::to_string(ceil_div(numel, 2)));
  }
  if (!is_power_of_two(blocksize) || blocksize < kValuesPerThread) {
    throw Error(ErrorCode::kWeights, "dequantize_4bit_cuda: blocksize " + std::to_string(blocksize) + " must be a power of two, at least 8");
  }
  if (decode.size() != 16) {
    throw Error(ErrorCode::kInternal, "dequantize_4bit_cuda: the decode table must have 16 values, got " + std::to_string(decode.size()));
  }
  const int64_t blocks = ceil_div(numel, blocksize);
  check_scales(scales, packed, blocks);
  DecodeTable table{};
  for (int code = 0; code < 16; ++code) table.values[code] = decode[code];

  const c10::cuda::CUDAGuard device_guard(packed.device());
  at::Tensor out;
  dispatch_float_type(dtype, "dequantize_4bit_cuda: dtype", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    out = at::empty({numel}, packed.options().dtype(dtype));
    if (numel == 0) return;
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const auto grid = static_cast<unsigned>(ceil_div(ceil_div(numel, kValuesPerThread), kThreadsPerCudaBlock));
    const bool packed_word_aligned = reinterpret_cast<uintptr_t>(packed.data_ptr<uint8_t>()) % 4 == 0;
    const bool double_quantized = scales.nested_absmax.defined();
    auto kernel = double_quantized ? dequantize_4bit_kernel<scalar_t, true> : dequantize_4bit_kernel<scalar_t, false>;
    kernel<<<grid, kThreadsPerCudaBlock, 0, stream>>>(
        packed.data_ptr<uint8_t>(), packed_word_aligned, numel, log2_of(blocksize), table,
        double_quantized ? nullptr : scales.absmax.data_ptr<float>(),
        double_quantized ? scales.absmax.data_ptr<uint8_t>() : nullptr,
        double_quantized ? scales.nested_absmax.data_ptr<float>() : nullptr,
        double_quantized ? scales.nested_code.data_ptr<float>() : nullptr, scales.offset, scales.nested_blocksize,
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace qtrain::kernels
