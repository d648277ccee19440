// Row-wise e4m3 quantization (kernels/float8_rows.h), one CUDA block per row: the block's absmax
// of the (column-scaled) row, then every value divided by the row's scale, clamped and cast as
// c10's Float8_e4m3fn cast rounds (the torch reference casts with the same code).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>
#include <limits>
#include <string>

#include "kernels/block_reduce.cuh"
#include "kernels/cuda_entry.cuh"
#include "kernels/float8_code.cuh"
#include "kernels/float8_rows.h"

namespace qtrain::kernels {

namespace {

constexpr float kLargestCode = kLargestFloat8Code;
constexpr float kSmallestAbsmax = 1e-12f;

// The row's scale from its absmax: clamp_min keeps a NaN, so the row's scale and codes become NaN,
// as the torch reference's.
__device__ __forceinline__ float row_scale(float absmax) {
  return absmax != absmax ? absmax : __fdiv_rn(absmax > kSmallestAbsmax ? absmax : kSmallestAbsmax, kLargestCode);
}

__device__ __forceinline__ c10::Float8_e4m3fn code_of(float value, float scale) { return float8_code_of(value, scale); }

template <typename scalar_t>
__device__ __forceinline__ float scaled_value(const scalar_t* row, const float* column_scale, int64_t j) {
  const float value = static_cast<float>(row[j]);
  return column_scale ? value * column_scale[j] : value;
}

template <typename scalar_t>
__global__ void quantize_rows_float8_kernel(const scalar_t* __restrict__ input, const float* __restrict__ column_scale,
                                            int64_t columns, c10::Float8_e4m3fn* __restrict__ codes,
                                            float* __restrict__ scales) {
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * columns;
  const scalar_t* row = input + offset;
  float absmax = 0.0f;
  for (int64_t j = threadIdx.x; j < columns; j += kThreads) {
    absmax = MaxKeepingNan{}(fabsf(scaled_value(row, column_scale, j)), absmax);
  }
  const float scale = row_scale(block_reduce(absmax, MaxKeepingNan{}, 0.0f));
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;
  for (int64_t j = threadIdx.x; j < columns; j += kThreads) codes[offset + j] = code_of(scaled_value(row, column_scale, j), scale);
}

// Rows of whole 16-byte vectors (up to 32,768 bf16 values): 16-byte loads, 8-byte (bf16) or
// 4-byte (fp32) stores of codes.
template <typename scalar_t>
using RowVector = ValuePack<scalar_t, kWideValues<scalar_t>>;

template <typename scalar_t>
__device__ __forceinline__ void scaled_values(const RowVector<scalar_t>& loaded, const float* column_scale,
                                              int64_t index, float (&values)[kWideValues<scalar_t>]) {
  constexpr int kValues = kWideValues<scalar_t>;
#pragma unroll
  for (int k = 0; k < kValues; ++k) values[k] = static_cast<float>(loaded.values[k]);
  if (column_scale) {
    const auto* scales = reinterpret_cast<const float4*>(column_scale + index * kValues);
#pragma unroll
    for (int q = 0; q < kValues / 4; ++q) {
      const float4 four = scales[q];
      values[4 * q] *= four.x;
      values[4 * q + 1] *= four.y;
      values[4 * q + 2] *= four.z;
      values[4 * q + 3] *= four.w;
    }
  }
}

// One block per row, as many threads as hold the row in registers at kVectorsPerThread vectors
// each (up to 1024 threads): the row is read from memory once.
constexpr int kVectorsPerThread = 4;
constexpr int kMaxThreads = 1024;

template <typename scalar_t>
__global__ void __launch_bounds__(kMaxThreads) quantize_rows_float8_vector_kernel(const scalar_t* __restrict__ input, const float* __restrict__ column_scale,
                                                   int64_t columns, c10::Float8_e4m3fn* __restrict__ codes,
                                                   float* __restrict__ scales) {
  using Vector = RowVector<scalar_t>;
  constexpr int kValues = kWideValues<scalar_t>;
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * columns;
  const int vectors = static_cast<int>(columns / kValues);
  const auto* row = reinterpret_cast<const Vector*>(input + offset);
  float held[kVectorsPerThread][kValues];
  float absmax = 0.0f;
#pragma unroll
  for (int v = 0; v < kVectorsPerThread; ++v) {
    const int index = v * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
    if (index < vectors) {
      scaled_values(row[index], column_scale, index, held[v]);
#pragma unroll
      for (int k = 0; k < kValues; ++k) absmax = MaxKeepingNan{}(fabsf(held[v][k]), absmax);
    }
  }
  const float scale = row_scale(block_reduce(absmax, MaxKeepingNan{}, 0.0f));
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;
  auto* out = reinterpret_cast<uint8_t*>(codes + offset);
#pragma unroll
  for (int v = 0; v < kVectorsPerThread; ++v) {
    const int index = v * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
    if (index < vectors) {
      alignas(8) uint8_t bytes[kValues];
#pragma unroll
      for (int k = 0; k < kValues; ++k) bytes[k] = code_of(held[v][k], scale).x;
      if constexpr (kValues == 8) {
        *reinterpret_cast<uint2*>(out + index * kValues) = *reinterpret_cast<const uint2*>(bytes);
      } else {
        *reinterpret_cast<uint32_t*>(out + index * kValues) = *reinterpret_cast<const uint32_t*>(bytes);
      }
    }
  }
}

// A 64 x 64 byte tile per block of 16 x 16 threads, moved as 32-bit words: each thread loads
// 4 words of the input's rows into shared memory, then assembles 4 words of the output's rows
// from 4 bytes each (the rows padded by a word against bank conflicts).
constexpr int kTile = 64;
constexpr int kTileThreads = 16;
constexpr int kTileWords = kTile / 4;

__global__ void transpose_bytes_kernel(const uint32_t* __restrict__ input, int64_t rows, int64_t columns,
                                       uint32_t* __restrict__ output) {
  __shared__ uint32_t tile[kTile][kTileWords + 1];
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile, column0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t input_words = columns / 4, output_words = rows / 4;
  for (int r = threadIdx.y; r < kTile; r += kTileThreads) {
    const int64_t row = row0 + r, word = column0 / 4 + threadIdx.x;
    tile[r][threadIdx.x] = row < rows && word < input_words ? input[row * input_words + word] : 0u;
  }
  __syncthreads();
  const auto* bytes = reinterpret_cast<const uint8_t*>(tile);
  constexpr int kRowBytes = (kTileWords + 1) * 4;
  for (int c = threadIdx.y; c < kTile; c += kTileThreads) {
    const int64_t out_row = column0 + c, out_word = row0 / 4 + threadIdx.x;
    if (out_row >= columns || out_word >= output_words) continue;
    const int r = 4 * threadIdx.x;
    const uint32_t word = static_cast<uint32_t>(bytes[r * kRowBytes + c]) |
                          static_cast<uint32_t>(bytes[(r + 1) * kRowBytes + c]) << 8 |
                          static_cast<uint32_t>(bytes[(r + 2) * kRowBytes + c]) << 16 |
                          static_cast<uint32_t>(bytes[(r + 3) * kRowBytes + c]) << 24;
    output[out_row * output_words + out_word] = word;
  }
}

}  // namespace

at::Tensor transpose_float8_cuda(const at::Tensor& codes) {
  const std::string what = "transpose_float8_cuda: codes";
  check_cuda_tensor(codes, what);
  check_scalar_type(codes, at::kFloat8_e4m3fn, what);
  if (codes.dim() != 2 || codes.size(0) % 4 != 0 || codes.size(1) % 4 != 0 ||
      reinterpret_cast<uintptr_t>(codes.data_ptr()) % 4 != 0 || ceil_div(codes.size(0), kTile) > 65535) {
    throw Error(ErrorCode::kInternal, what + " must be [rows, columns], both multiples of 4, 4-byte aligned (it moves "
                "32-bit words) and at most 4,194,240 rows");
  }
  const c10::cuda::CUDAGuard device_guard(codes.device());
  auto output = at::empty({codes.size(1), codes.size(0)}, codes.options());
  if (codes.numel() == 0) return output;
  const dim3 grid(static_cast<unsigned>(ceil_div(codes.size(1), kTile)), static_cast<unsigned>(ceil_div(codes.size(0), kTile)));
  const dim3 block(kTileThreads, kTileThreads);
  transpose_bytes_kernel<<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint32_t*>(codes.data_ptr()), codes.size(0), codes.size(1),
      reinterpret_cast<uint32_t*>(output.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return output;
}

std::pair<at::Tensor, at::Tensor> quantize_rows_float8_cuda(const at::Tensor& input, const at::Tensor& column_scale) {
  const std::string what = "quantize_rows_float8_cuda: ";
  check_cuda_tensor(input, what + "input");
  if (input.dim() != 2) throw Error(ErrorCode::kInternal, what + "input must be [rows, columns]");
  if (column_scale.defined()) {
    check_cuda_operands(input, {{&column_scale, "column_scale"}}, what);
    check_scalar_type(column_scale, at::kFloat, what + "column_scale");
    if (column_scale.numel() != input.size(1)) throw Error(ErrorCode::kInternal, what + "column_scale must have one value per column");
  }
  const c10::cuda::CUDAGuard device_guard(input.device());
  auto codes = at::empty(input.sizes(), input.options().dtype(at::kFloat8_e4m3fn));
  auto scales = at::empty({input.size(0), 1}, input.options().dtype(at::kFloat));
  if (input.numel() == 0) return {codes, scales};
  if (input.size(0) > std::numeric_limits<int32_t>::max()) throw Error(ErrorCode::kInternal, what + "too many rows for one grid");
  dispatch_float_type(input.scalar_type(), what + "input", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    constexpr int64_t kValues = kWideValues<scalar_t>;
    const auto* scale_values = column_scale.defined() ? column_scale.data_ptr<float>() : nullptr;
    const int64_t vectors = input.size(1) / kValues;
    const bool vectorized = packs_fit<scalar_t>({input.size(1)}, {input.data_ptr(), scale_values}) &&
                            vectors <= int64_t{kMaxThreads} * kVectorsPerThread &&
                            reinterpret_cast<uintptr_t>(codes.data_ptr()) % kValues == 0;
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const auto blocks = static_cast<unsigned>(input.size(0));
    if (vectorized) {
      const auto threads = static_cast<unsigned>(32 * ceil_div(ceil_div(vectors, kVectorsPerThread), 32));
      quantize_rows_float8_vector_kernel<scalar_t><<<blocks, threads, 0, stream>>>(
          input.data_ptr<scalar_t>(), scale_values, input.size(1), codes.data_ptr<c10::Float8_e4m3fn>(),
          scales.data_ptr<float>());
    } else {
      quantize_rows_float8_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
          input.data_ptr<scalar_t>(), scale_values, input.size(1), codes.data_ptr<c10::Float8_e4m3fn>(),
          scales.data_ptr<float>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {codes, scales};
}

bool float8_tensor_cores(int device_index) {
  const auto* properties = at::cuda::getDeviceProperties(device_index < 0 ? c10::cuda::current_device() : device_index);
  return properties->major * 10 + properties->minor >= 89;
}

}  // namespace qtrain::kernels
