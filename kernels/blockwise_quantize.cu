// bitsandbytes' blockwise quantize kernels (4-bit NF4/FP4 and the 8-bit dynamic map), bit for bit.
// The CPU reference they must equal is qat/four_bit_codec.cpp; see kernels/blockwise_quantize.h.
//
// One warp per quantization block: the 32 lanes stride over the block's elements (coalesced), take
// max |w| with a shuffle reduction (max is exact, so its order is free), every lane forms the same
// approximate reciprocal, and the lanes write the codes. Eight warps, eight blocks, per CUDA block.
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
#include "kernels/dynamic_map_code.h"

namespace qtrain::kernels {

namespace {

namespace fast = bnb_fast_math;

constexpr int kMaxThresholds = 15;

// FourBitQuantizer as a kernel argument (it lives in the constant bank; every lane reads the same
// threshold at the same time).
struct FourBitPicker {
  float thresholds[kMaxThresholds];
  int threshold_count;
  uint64_t codes_by_rank;  // the code of rank r in bits [4r, 4r + 4)
  bool sign_magnitude;
};

__device__ __forceinline__ uint8_t pick_four_bit_code(const FourBitPicker& picker, float x) {
  uint32_t sign = 0;
  if (picker.sign_magnitude) {
    if (x < 0.0f) sign = 8;
    x = fast::absolute(x);
  }
  // The count of thresholds below x is the leaf bnb's decision tree reaches (NaN: rank 0).
  int rank = 0;
#pragma unroll
  for (int k = 0; k < kMaxThresholds; ++k) rank += (k < picker.threshold_count && x > picker.thresholds[k]) ? 1 : 0;
  return static_cast<uint8_t>(((picker.codes_by_rank >> (4 * rank)) & 0xF) | sign);
}

// max |w| over [first, first + count), reduced over the warp. Starting from 0 equals bnb's
// -FLT_MAX start with its zero padding, except for a block of NaNs only (absmax 0 here and on the
// CPU path).
template <typename scalar_t>
__device__ __forceinline__ float warp_block_absmax(const scalar_t* input, int64_t first, int64_t count, int lane) {
  float block_max = 0.0f;
  for (int64_t i = lane; i < count; i += kWarpSize) {
    block_max = fast::maximum(block_max, fast::absolute(static_cast<float>(input[first + i])));
  }
  return fast::warp_maximum(block_max);
}

template <typename scalar_t>
__global__ void quantize_4bit_kernel(const scalar_t* __restrict__ input, int64_t n, int64_t blocksize,
                                     int64_t blocks, FourBitPicker picker, uint8_t* __restrict__ packed,
                                     float* __restrict__ absmax) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t block = static_cast<int64_t>(blockIdx.x) * kWarpsPerCudaBlock + threadIdx.x / kWarpSize;
  if (block >= blocks) return;  // the whole warp leaves together
  const int64_t first = block * blocksize;
  const int64_t count = min(blocksize, n - first);
  const float block_max = warp_block_absmax(input, first, count, lane);
  if (lane == 0) absmax[block] = block_max;
  const float inverse = fast::reciprocal(block_max);
  // Blocksizes are even, so a byte never straddles two blocks. bnb pads a partial block with zeros
  // and quantizes them like the rest (0 * inverse: NaN for a block of zeros, code 0).
  const int64_t bytes = (count + 1) / 2;
  for (int64_t byte = lane; byte < bytes; byte += kWarpSize) {
    const int64_t i = first + 2 * byte;
    const float high = static_cast<float>(input[i]);
    const float low = 2 * byte + 1 < count ? static_cast<float>(input[i + 1]) : 0.0f;
    packed[i / 2] = static_cast<uint8_t>((pick_four_bit_code(picker, fast::multiply(high, inverse)) << 4) |
                                         pick_four_bit_code(picker, fast::multiply(low, inverse)));
  }
}

template <typename scalar_t>
__global__ void quantize_8bit_kernel(const scalar_t* __restrict__ input, int64_t n, int64_t blocksize,
                                     int64_t blocks, const float* __restrict__ code, uint8_t* __restrict__ codes,
                                     float* __restrict__ absmax) {
  __shared__ float table[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) table[i] = code[i];
  __syncthreads();
  const int lane = threadIdx.x % kWarpSize;
  const int64_t block = static_cast<int64_t>(blockIdx.x) * kWarpsPerCudaBlock + threadIdx.x / kWarpSize;
  if (block >= blocks) return;
  const int64_t first = block * blocksize;
  const int64_t count = min(blocksize, n - first);
  const float block_max = warp_block_absmax(input, first, count, lane);
  if (lane == 0) absmax[block] = block_max;
  const float inverse = fast::reciprocal(block_max);
  for (int64_t i = lane; i < count; i += kWarpSize) {
    codes[first + i] = dynamic_map_code(table, fast::multiply(static_cast<float>(input[first + i]), inverse));
  }
}

FourBitPicker make_picker(const FourBitQuantizer& quantizer) {
  const auto threshold_count = static_cast<int64_t>(quantizer.thresholds.size());
  if (threshold_count > kMaxThresholds || static_cast<int64_t>(quantizer.code_of_rank.size()) != threshold_count + 1) {
    throw Error(ErrorCode::kInternal, "quantize_4bit_cuda: a 4-bit quantizer needs at most 15 thresholds and one code per rank, got " +
                std::to_string(threshold_count) + " thresholds and " + std::to_string(quantizer.code_of_rank.size()) +
                " codes");
  }
  FourBitPicker picker{};
  picker.threshold_count = static_cast<int>(threshold_count);
  for (int64_t k = 0; k < threshold_count; ++k) picker.thresholds[k] = quantizer.thresholds[k];
  for (int64_t rank = 0; rank <= threshold_count; ++rank) {
    if (quantizer.code_of_rank[rank] > 15) throw Error(ErrorCode::kInternal, "quantize_4bit_cuda: a 4-bit code must be below 16");
    picker.codes_by_rank |= static_cast<uint64_t>(quantizer.code_of_rank[rank]) << (4 * rank);
  }
  picker.sign_magnitude = quantizer.sign_magnitude;
  return picker;
}

}  // namespace

BlockwiseCodes quantize_4bit_cuda(const at::Tensor& input, const FourBitQuantizer& quantizer, int64_t blocksize) {
  check_cuda_tensor(input, "quantize_4bit_cuda: input");
  if (!is_power_of_two(blocksize) || blocksize < 8) {
    throw Error(ErrorCode::kRecipe, "quantize_4bit_cuda: blocksize " + std::to_string(blocksize) + " must be a power of two, at least 8");
  }
  const FourBitPicker picker = make_picker(quantizer);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const int64_t n = input.numel();
  const int64_t blocks = ceil_div(n, blocksize);
  BlockwiseCodes result{at::empty({ceil_div(n, 2)}, input.options().dtype(at::kByte)),
                        at::empty({blocks}, input.options().dtype(at::kFloat))};
  if (n == 0) return result;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto grid = static_cast<unsigned>(ceil_div(blocks, kWarpsPerCudaBlock));
  dispatch_float_type(input.scalar_type(), "quantize_4bit_cuda: input", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    quantize_4bit_kernel<scalar_t><<<grid, kWarpSize * kWarpsPerCudaBlock, 0, stream>>>(
        input.data_ptr<scalar_t>(), n, blocksize, blocks, picker, result.codes.data_ptr<uint8_t>(),
        result.absmax.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return result;
}

BlockwiseCodes quantize_blockwise_8bit_cuda(const at::Tensor& input, const at::Tensor& code, int64_t blocksize) {
  check_cuda_tensor(input, "quantize_blockwise_8bit_cuda: input");
  check_cuda_tensor(code, "quantize_blockwise_8bit_cuda: code");
  check_same_device(code, input, "quantize_blockwise_8bit_cuda: code");
  check_scalar_type(code, at::kFloat, "quantize_blockwise_8bit_cuda: code");
  if (code.numel() != 256) {
    throw Error(ErrorCode::kInternal, "quantize_blockwise_8bit_cuda: the code must have 256 values, got " + std::to_string(code.numel()));
  }
  if (blocksize < 1) throw Error(ErrorCode::kRecipe, "quantize_blockwise_8bit_cuda: blocksize " + std::to_string(blocksize) + " must be positive");
  const c10::cuda::CUDAGuard device_guard(input.device());
  const int64_t n = input.numel();
  const int64_t blocks = ceil_div(n, blocksize);
  BlockwiseCodes result{at::empty({n}, input.options().dtype(at::kByte)),
                        at::empty({blocks}, input.options().dtype(at::kFloat))};
  if (n == 0) return result;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto grid = static_cast<unsigned>(ceil_div(blocks, kWarpsPerCudaBlock));
  dispatch_float_type(input.scalar_type(), "quantize_blockwise_8bit_cuda: input", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    quantize_8bit_kernel<scalar_t><<<grid, kWarpSize * kWarpsPerCudaBlock, 0, stream>>>(
        input.data_ptr<scalar_t>(), n, blocksize, blocks, code.data_ptr<float>(), result.codes.data_ptr<uint8_t>(),
        result.absmax.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return result;
}

}  // namespace qtrain::kernels
