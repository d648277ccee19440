// The merged-weight fake quantization of kernels/merged_fake_quantize.h. Two layouts:
//
//   tiled   blocks of 32 to 256 values whose slice of A fits shared memory: a CTA takes one
//           column block and 128 rows; A's [r, block] slice is read once (into registers for
//           ranks 8 / 16 / 32 / 64 where they fit, else into shared memory) and each warp walks
//           its rows, each lane holding block / 32 values of the row in registers between the
//           min/max reduction and the quantization.
//   rows    anything else (per-channel scales: a block is a whole row): a warp per block, two
//           passes over it (min/max, then quantize), computing M again in the second.
//
// Both evaluate M and the quantization with the same explicitly rounded fp32 operations
// (__fmul_rn / __fadd_rn / __fdiv_rn, which nvcc never contracts into an FMA), in the order the
// header states, so they agree with each other and with the CPU's torch operations bit for bit.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda_entry.cuh"
#include "kernels/merged_fake_quantize.h"

namespace qtrain::kernels {

namespace {

constexpr int kWarps = 8;
constexpr int kTileRows = 128;
constexpr int kMaxSharedFloats = 12 * 1024;  // 48 KiB: A's slice in the tiled layout
// torchao's eps, fp32's machine epsilon (qat/quantize.cpp).
constexpr float kScaleEps = 1.1920928955078125e-07f;

struct Grid {
  float quant_min, quant_max;
  bool symmetric, fp16_scale;
};

template <typename scalar_t>
struct Outputs {
  scalar_t* values;
  int8_t* codes;
  float* scale;
  float* zero_point;
  bool* inside;
};

// W0 + scale * sum_j B[o, j] A[j, k], every product and sum rounded on its own.
__device__ __forceinline__ float merged_value(float base, const float* b_row, const float* a_column, int64_t a_stride,
                                              int rank, float lora_scale) {
  float sum = 0.0f;
  for (int j = 0; j < rank; ++j) sum = __fadd_rn(sum, __fmul_rn(b_row[j], a_column[j * a_stride]));
  return __fadd_rn(base, __fmul_rn(lora_scale, sum));
}

__device__ __forceinline__ float effective_scale(float raw, bool fp16_scale) {
  float scale = fmaxf(raw, kScaleEps);
  if (fp16_scale) scale = __half2float(__float2half_rn(fminf(scale, 65504.0f)));
  return scale;
}

// choose_qparams for a block spanning [min, max] (qat/quantize.cpp).
__device__ __forceinline__ void block_params(float min, float max, const Grid& grid, float& scale, float& zero_point) {
  const float min_negative = fminf(min, 0.0f);
  const float max_positive = fmaxf(max, 0.0f);
  if (grid.symmetric) {
    const float absmax = fmaxf(-min_negative, max_positive);
    scale = effective_scale(__fdiv_rn(absmax, (grid.quant_max - grid.quant_min) / 2.0f), grid.fp16_scale);
    zero_point = 0.0f;
    return;
  }
  scale = effective_scale(__fdiv_rn(__fsub_rn(max_positive, min_negative), grid.quant_max - grid.quant_min),
                          grid.fp16_scale);
  zero_point = fminf(fmaxf(__fsub_rn(grid.quant_min, rintf(__fdiv_rn(min_negative, scale))), grid.quant_min),
                     grid.quant_max);
}

template <typename scalar_t>
__device__ __forceinline__ void write_quantized(float merged, float scale, float zero_point, const Grid& grid,
                                                int64_t index, const Outputs<scalar_t>& out) {
  const float unclamped = __fadd_rn(rintf(__fdiv_rn(merged, scale)), zero_point);
  const float clamped = fminf(fmaxf(unclamped, grid.quant_min), grid.quant_max);
  const auto code = static_cast<int8_t>(clamped);
  if (out.values) out.values[index] = static_cast<scalar_t>(__fmul_rn(__fsub_rn(static_cast<float>(code), zero_point), scale));
  if (out.codes) out.codes[index] = code;
  if (out.inside) out.inside[index] = unclamped >= grid.quant_min && unclamped <= grid.quant_max;
}

__device__ __forceinline__ void warp_min_max(float& min, float& max) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    min = fminf(min, __shfl_xor_sync(0xffffffffu, min, offset));
    max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, offset));
  }
}

// Tiled: blockIdx.x the column block, blockIdx.y the row tile; kPerLane = block_length / 32.
// kRank > 0 (the adapter's rank, when lanes can hold their columns of A: kPerLane * kRank <= 64
// registers): each lane keeps its columns of A in registers and reads only B's row per row, as
// aligned 16-byte loads every lane shares. kRank 0: A's slice in shared memory, any rank.
template <typename base_t, typename scalar_t, int kPerLane, int kRank>
__global__ void merged_fake_quantize_tiled(const base_t* __restrict__ base, const float* __restrict__ lora_A,
                                           const float* __restrict__ lora_B, int64_t rows, int64_t columns, int rank,
                                           float lora_scale, Grid grid, Outputs<scalar_t> out) {
  extern __shared__ float a_slice[];  // kRank 0: [rank][block_length]
  constexpr int kBlock = 32 * kPerLane;
  const int64_t first_column = static_cast<int64_t>(blockIdx.x) * kBlock;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  float a_columns[kRank > 0 ? kPerLane : 1][kRank > 0 ? kRank : 1];
  if constexpr (kRank > 0) {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
#pragma unroll
      for (int j = 0; j < kRank; ++j) a_columns[e][j] = lora_A[j * columns + first_column + lane + 32 * e];
    }
  } else {
    for (int i = threadIdx.x; i < rank * kBlock; i += blockDim.x) {
      a_slice[i] = lora_A[(i / kBlock) * columns + first_column + i % kBlock];
    }
    __syncthreads();
  }
  const int64_t blocks_per_row = columns / kBlock;
  const int64_t row_end = min(rows, static_cast<int64_t>(blockIdx.y + 1) * kTileRows);
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * kTileRows + warp; row < row_end; row += kWarps) {
    const float* b_row = lora_B + row * rank;  // the same address in every lane: one broadcast read
    float merged[kPerLane];
    float min = INFINITY, max = -INFINITY;
    if constexpr (kRank > 0) {
      float b[kRank];
#pragma unroll
      for (int j = 0; j < kRank; j += 4) *reinterpret_cast<float4*>(b + j) = *reinterpret_cast<const float4*>(b_row + j);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < kRank; ++j) sum = __fadd_rn(sum, __fmul_rn(b[j], a_columns[e][j]));
        const float w0 = static_cast<float>(base[row * columns + first_column + lane + 32 * e]);
        merged[e] = __fadd_rn(w0, __fmul_rn(lora_scale, sum));
        min = fminf(min, merged[e]);
        max = fmaxf(max, merged[e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int column = lane + 32 * e;
        const float w0 = static_cast<float>(base[row * columns + first_column + column]);
        merged[e] = merged_value(w0, b_row, a_slice + column, kBlock, rank, lora_scale);
        min = fminf(min, merged[e]);
        max = fmaxf(max, merged[e]);
      }
    }
    warp_min_max(min, max);
    float scale, zero_point;
    block_params(min, max, grid, scale, zero_point);
    const int64_t block = row * blocks_per_row + blockIdx.x;
    if (lane == 0) {
      out.scale[block] = scale;
      out.zero_point[block] = zero_point;
    }
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      write_quantized(merged[e], scale, zero_point, grid, row * columns + first_column + lane + 32 * e, out);
    }
  }
}

// Rows: a warp per block of any length, M computed in both passes; A read through the cache.
template <typename base_t, typename scalar_t>
__global__ void merged_fake_quantize_rows(const base_t* __restrict__ base, const float* __restrict__ lora_A,
                                          const float* __restrict__ lora_B, int64_t rows, int64_t columns,
                                          int64_t block_length, int rank, float lora_scale, Grid grid,
                                          Outputs<scalar_t> out) {
  const int lane = threadIdx.x % 32;
  const int64_t blocks_per_row = columns / block_length;
  const int64_t block = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (block >= rows * blocks_per_row) return;
  const int64_t row = block / blocks_per_row;
  const int64_t first = row * columns + (block % blocks_per_row) * block_length;
  const int64_t first_column = first - row * columns;
  const float* b_row = lora_B + row * rank;
  const auto merged_at = [&](int64_t offset) {
    return merged_value(static_cast<float>(base[first + offset]), b_row, lora_A + first_column + offset, columns, rank,
                        lora_scale);
  };
  float min = INFINITY, max = -INFINITY;
  for (int64_t offset = lane; offset < block_length; offset += 32) {
    const float merged = merged_at(offset);
    min = fminf(min, merged);
    max = fmaxf(max, merged);
  }
  warp_min_max(min, max);
  float scale, zero_point;
  block_params(min, max, grid, scale, zero_point);
  if (lane == 0) {
    out.scale[block] = scale;
    out.zero_point[block] = zero_point;
  }
  for (int64_t offset = lane; offset < block_length; offset += 32) {
    write_quantized(merged_at(offset), scale, zero_point, grid, first + offset, out);
  }
}

template <typename base_t, typename scalar_t>
void launch(const at::Tensor& base, const at::Tensor& lora_A, const at::Tensor& lora_B, float lora_scale,
            const MergedFakeQuantizeOptions& options, const Grid& grid, const Outputs<scalar_t>& out) {
  const int64_t rows = base.size(0);
  const int64_t columns = base.size(1);
  const int rank = static_cast<int>(lora_A.size(0));
  const int64_t block = options.block_length;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto* w0 = reinterpret_cast<const base_t*>(base.data_ptr());
  const auto* a = lora_A.data_ptr<float>();
  const auto* b = lora_B.data_ptr<float>();
  const bool tiled = (block == 32 || block == 64 || block == 128 || block == 256) && rank * block <= kMaxSharedFloats;
  if (tiled) {
    const dim3 blocks(static_cast<unsigned>(columns / block), static_cast<unsigned>(ceil_div(rows, kTileRows)));
    const auto shared = static_cast<size_t>(rank * block) * sizeof(float);
    const auto run = [&](auto per_lane) {
      constexpr int kPerLane = decltype(per_lane)::value;
      const auto launch_with = [&](auto kernel, size_t shared_bytes) {
        kernel<<<blocks, kWarps * 32, shared_bytes, stream>>>(w0, a, b, rows, columns, rank, lora_scale, grid, out);
      };
      // Ranks whose columns of A fit 64 registers a lane (B's rows 16-byte aligned: rank % 4 == 0).
      if (reinterpret_cast<uintptr_t>(b) % 16 != 0) return launch_with(merged_fake_quantize_tiled<base_t, scalar_t, kPerLane, 0>, shared);
      if (rank == 8 && kPerLane * 8 <= 64) return launch_with(merged_fake_quantize_tiled<base_t, scalar_t, kPerLane, 8>, 0);
      if (rank == 16 && kPerLane * 16 <= 64) return launch_with(merged_fake_quantize_tiled<base_t, scalar_t, kPerLane, 16>, 0);
      if (rank == 32 && kPerLane * 32 <= 64) return launch_with(merged_fake_quantize_tiled<base_t, scalar_t, kPerLane, 32>, 0);
      if (rank == 64 && kPerLane * 64 <= 64) return launch_with(merged_fake_quantize_tiled<base_t, scalar_t, kPerLane, 64>, 0);
      launch_with(merged_fake_quantize_tiled<base_t, scalar_t, kPerLane, 0>, shared);
    };
    if (block == 32) run(std::integral_constant<int, 1>{});
    if (block == 64) run(std::integral_constant<int, 2>{});
    if (block == 128) run(std::integral_constant<int, 4>{});
    if (block == 256) run(std::integral_constant<int, 8>{});
  } else {
    const auto blocks = static_cast<unsigned>(ceil_div(rows * (columns / block), kWarps));
    merged_fake_quantize_rows<base_t, scalar_t><<<blocks, kWarps * 32, 0, stream>>>(w0, a, b, rows, columns, block, rank,
                                                                                    lora_scale, grid, out);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

MergedFakeQuantized merged_fake_quantize_int_cuda(const at::Tensor& base, const at::Tensor& lora_A,
                                                  const at::Tensor& lora_B, double lora_scale,
                                                  const MergedFakeQuantizeOptions& options) {
  const std::string what = "merged_fake_quantize_int_cuda: ";
  check_cuda_tensor(base, what + "base");
  check_cuda_operands(base, {{&lora_A, "lora_A"}, {&lora_B, "lora_B"}}, what);
  check_scalar_type(lora_A, at::kFloat, what + "lora_A");
  check_scalar_type(lora_B, at::kFloat, what + "lora_B");
  const int64_t rows = base.dim() == 2 ? base.size(0) : -1;
  const int64_t columns = base.dim() == 2 ? base.size(1) : -1;
  if (rows < 0 || lora_A.dim() != 2 || lora_B.dim() != 2 || lora_A.size(1) != columns || lora_B.size(0) != rows ||
      lora_B.size(1) != lora_A.size(0) || options.block_length < 1 || columns % options.block_length != 0 ||
      !(options.quant_min < options.quant_max) || options.quant_min < -128 || options.quant_max > 127) {
    throw Error(ErrorCode::kInternal, what + "base " + shape_text(base.sizes()) + ", lora_A " + shape_text(lora_A.sizes()) +
                                          ", lora_B " + shape_text(lora_B.sizes()) + " in blocks of " +
                                          std::to_string(options.block_length) + " on the grid [" +
                                          std::to_string(options.quant_min) + ", " + std::to_string(options.quant_max) +
                                          "] do not fit together");
  }
  const auto on = [&](c10::ScalarType dtype) { return base.options().dtype(dtype); };
  MergedFakeQuantized result;
  result.scale = at::empty({rows, columns / options.block_length}, on(at::kFloat));
  result.zero_point = at::empty_like(result.scale);
  if (options.values) result.values = at::empty({rows, columns}, on(options.values_dtype));
  if (options.codes) result.codes = at::empty({rows, columns}, on(at::kChar));
  if (options.inside) result.inside = at::empty({rows, columns}, on(at::kBool));
  if (base.numel() == 0) return result;
  const c10::cuda::CUDAGuard device_guard(base.device());
  const Grid grid{static_cast<float>(options.quant_min), static_cast<float>(options.quant_max), options.symmetric,
                  options.fp16_scale};
  const auto values_dtype = options.values ? options.values_dtype : base.scalar_type();
  dispatch_float_type(base.scalar_type(), what + "base", [&](auto base_value) {
    using base_t = decltype(base_value);
    dispatch_float_type(values_dtype, what + "values_dtype", [&](auto value) {
      using scalar_t = decltype(value);
      const Outputs<scalar_t> out{options.values ? result.values.data_ptr<scalar_t>() : nullptr,
                                  options.codes ? result.codes.data_ptr<int8_t>() : nullptr,
                                  result.scale.data_ptr<float>(), result.zero_point.data_ptr<float>(),
                                  options.inside ? result.inside.data_ptr<bool>() : nullptr};
      launch<base_t, scalar_t>(base, lora_A, lora_B, static_cast<float>(lora_scale), options, grid, out);
    });
  });
  return result;
}

}  // namespace qtrain::kernels
