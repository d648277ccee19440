// RMSNorm forward and backward (kernels/llama_layers.h). The forward is transformers' LlamaRMSNorm:
// fp32 normalization, rounded to the input dtype, times the weight in that dtype; or, kUnitOffset,
// Gemma's: the fp32 normalization times (1 + weight) in fp32, rounded once. The backward
// differentiates exactly those roundings' chain in fp32.
//
// A row of x [rows, width] is read in packs of 16 bytes (8 bf16 / fp16 or 4 fp32 values), one
// access each, where every row and operand starts on 16 bytes (the width a whole number of packs,
// the pointers aligned), else in packs of one value. A group of threads shares a row, each holding
// up to 4 of its packs in registers from the sum of squares to the output, so x (and in the
// backward the output's gradient) is read from memory once:
//   - rows of up to 128 packs (1024 bf16 values, 512 fp32; 128 values unaligned): the fewest lanes
//     of one warp, a power of two, that hold the row, several rows to a block, summed by warp
//     shuffles (Qwen3's per-head q and k norms, width 128 in bf16: 16 lanes of one pack, 16 rows to
//     a block of 256 threads);
//   - longer rows (the hidden size): a block each, summing through shared memory, of up to 256
//     threads of up to 4 packs (Llama's 4096 in bf16: 256 threads of 2 packs; 5120: 160 of 4), then
//     up to 512 threads; packs past what those hold (rows over 2048 packs: 32 KiB, or 2048 values
//     unaligned) are read again for the output.
// What may differ from the torch operations is the order of the fp32 sums.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "kernels/block_reduce.cuh"
#include "kernels/cuda_entry.cuh"
#include "kernels/llama_layers.h"

namespace qtrain::kernels {

namespace {

constexpr int kMaxNormPacksPerThread = 4;  // in registers: up to 32 bf16 / fp16 or 16 fp32 values of x
constexpr int kMaxNormBlockThreads = 512;  // a long row's block (at most 128 registers a thread)

// x's rows as a launch spreads them: `threads_per_row` consecutive threads share a row, a power of
// two up to 32 (rows share a warp) or the whole block (a whole number of warps, one row a block).
// Thread `lane` of a row holds its packs lane, lane + threads_per_row, ...
struct NormRows {
  int64_t rows;
  int64_t width;
  int threads_per_row;
};

// A thread's row: where it starts, the thread's lane in it, and how many packs it has (none for a
// group past the last row, which takes part in the warp's shuffles and reads nothing).
struct NormThread {
  int64_t row;
  int64_t offset;
  int lane;
  int64_t packs;
};

template <int kPackValues>
__device__ __forceinline__ NormThread norm_thread(const NormRows& layout) {
  const int rows_per_block = blockDim.x / layout.threads_per_row;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / layout.threads_per_row;
  const bool in_rows = row < layout.rows;
  return {row, in_rows ? row * layout.width : 0, static_cast<int>(threadIdx.x % layout.threads_per_row),
          in_rows ? layout.width / kPackValues : 0};
}

// Pack `pack` of a row that has `packs` packs, zeros past them.
template <typename Pack, typename scalar_t>
__device__ __forceinline__ Pack load_norm_pack(const scalar_t* row, int64_t pack, int64_t packs) {
  if (pack < packs) return reinterpret_cast<const Pack*>(row)[pack];
  return Pack{};
}

template <typename Pack, typename scalar_t>
__device__ __forceinline__ void store_norm_pack(scalar_t* row, int64_t pack, int64_t packs, const Pack& values) {
  if (pack < packs) reinterpret_cast<Pack*>(row)[pack] = values;
}

// The sum of `value` over the row's threads, returned to each.
__device__ __forceinline__ float norm_row_sum(float value, int threads_per_row) {
  if (threads_per_row <= kWarpSize) return warp_reduce(value, SumOp{}, threads_per_row);
  return block_reduce(value, SumOp{}, 0.0f);
}

template <typename scalar_t, int kValues>
__device__ __forceinline__ float sum_of_squares(const ValuePack<scalar_t, kValues>& x) {
  float squares = 0.0f;
#pragma unroll
  for (int k = 0; k < kValues; ++k) {
    const float value = static_cast<float>(x.values[k]);
    squares += value * value;
  }
  return squares;
}

// Llama's: weight * dtype(x32 * rstd), the product in fp32 rounded to the dtype (torch's mul in the
// dtype); Gemma's: dtype(x32 * rstd * (1 + weight32)).
template <bool kUnitOffset, typename scalar_t, int kValues>
__device__ __forceinline__ ValuePack<scalar_t, kValues> normalized_pack(const ValuePack<scalar_t, kValues>& x,
                                                                       const ValuePack<scalar_t, kValues>& weight,
                                                                       float rstd) {
  ValuePack<scalar_t, kValues> out;
#pragma unroll
  for (int k = 0; k < kValues; ++k) {
    if constexpr (kUnitOffset) {
      const float normalized = static_cast<float>(x.values[k]) * rstd;
      out.values[k] = static_cast<scalar_t>(normalized * (1.0f + static_cast<float>(weight.values[k])));
    } else {
      const scalar_t normalized = static_cast<scalar_t>(static_cast<float>(x.values[k]) * rstd);
      out.values[k] = static_cast<scalar_t>(static_cast<float>(weight.values[k]) * static_cast<float>(normalized));
    }
  }
  return out;
}

template <typename scalar_t, bool kUnitOffset, int kPackValues, int kPacks>
__global__ void __launch_bounds__(kMaxNormBlockThreads)
    rms_norm_forward_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ weight, NormRows layout,
                            float eps, scalar_t* __restrict__ out, float* __restrict__ rstd_out) {
  using Pack = ValuePack<scalar_t, kPackValues>;
  const NormThread thread = norm_thread<kPackValues>(layout);
  const int stride = layout.threads_per_row;  // packs between a thread's packs
  const scalar_t* row_x = x + thread.offset;
  scalar_t* row_out = out + thread.offset;
  Pack x_packs[kPacks];
  Pack weight_packs[kPacks];
  float squares = 0.0f;
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    const int64_t pack = thread.lane + int64_t{j} * stride;
    x_packs[j] = load_norm_pack<Pack>(row_x, pack, thread.packs);
    weight_packs[j] = load_norm_pack<Pack>(weight, pack, thread.packs);
    squares += sum_of_squares(x_packs[j]);
  }
  // Rows longer than the registers hold (only launched with the most packs a thread): the rest
  // read here and again below.
  const int64_t first_unheld = thread.lane + int64_t{kPacks} * stride;
  if constexpr (kPacks == kMaxNormPacksPerThread) {
#pragma unroll 1
    for (int64_t pack = first_unheld; pack < thread.packs; pack += stride) {
      squares += sum_of_squares(load_norm_pack<Pack>(row_x, pack, thread.packs));
    }
  }
  const float mean = norm_row_sum(squares, stride) / static_cast<float>(layout.width);
  const float rstd = rsqrtf(mean + eps);
  if (thread.lane == 0 && thread.packs > 0) rstd_out[thread.row] = rstd;
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    const int64_t pack = thread.lane + int64_t{j} * stride;
    store_norm_pack(row_out, pack, thread.packs, normalized_pack<kUnitOffset>(x_packs[j], weight_packs[j], rstd));
  }
  if constexpr (kPacks == kMaxNormPacksPerThread) {
#pragma unroll 1
    for (int64_t pack = first_unheld; pack < thread.packs; pack += stride) {
      const Pack x_pack = load_norm_pack<Pack>(row_x, pack, thread.packs);
      const Pack weight_pack = load_norm_pack<Pack>(weight, pack, thread.packs);
      store_norm_pack(row_out, pack, thread.packs, normalized_pack<kUnitOffset>(x_pack, weight_pack, rstd));
    }
  }
}

// The gradient reaching the fp32 normalized value: Llama's rounds dy * w to the dtype (its
// product's rounding); Gemma's multiplies by (1 + w) in fp32.
template <typename scalar_t, bool kUnitOffset>
__device__ __forceinline__ float normalized_gradient(scalar_t grad_output, scalar_t weight) {
  if constexpr (kUnitOffset) return static_cast<float>(grad_output) * (1.0f + static_cast<float>(weight));
  return static_cast<float>(static_cast<scalar_t>(static_cast<float>(grad_output) * static_cast<float>(weight)));
}

// A pack's dn (normalized_gradient of each value) into grad_normalized; returns its sum of dn x.
template <bool kUnitOffset, typename scalar_t, int kValues>
__device__ __forceinline__ float pack_normalized_gradient(const ValuePack<scalar_t, kValues>& grad_output,
                                                          const ValuePack<scalar_t, kValues>& weight,
                                                          const ValuePack<scalar_t, kValues>& x,
                                                          float (&grad_normalized)[kValues]) {
  float dot = 0.0f;
#pragma unroll
  for (int k = 0; k < kValues; ++k) {
    grad_normalized[k] = normalized_gradient<scalar_t, kUnitOffset>(grad_output.values[k], weight.values[k]);
    dot += grad_normalized[k] * static_cast<float>(x.values[k]);
  }
  return dot;
}

// dx = r dn - x correction, correction = r^3 mean(dn x), rounded to the dtype.
template <typename scalar_t, int kValues>
__device__ __forceinline__ ValuePack<scalar_t, kValues> pack_input_gradient(const float (&grad_normalized)[kValues],
                                                                           const ValuePack<scalar_t, kValues>& x,
                                                                           float r, float correction) {
  ValuePack<scalar_t, kValues> grad_x;
#pragma unroll
  for (int k = 0; k < kValues; ++k) {
    grad_x.values[k] = static_cast<scalar_t>(r * grad_normalized[k] - static_cast<float>(x.values[k]) * correction);
  }
  return grad_x;
}

// y = w * n_t, n_t = dtype(n), n = x * r, r = rsqrt(mean(x^2) + eps):
// dn = dtype(dy * w) (the product's rounding; Gemma's: dy (1 + w)), dx = r dn - x r^3 mean(dn x).
template <typename scalar_t, bool kUnitOffset, int kPackValues, int kPacks>
__global__ void __launch_bounds__(kMaxNormBlockThreads)
    rms_norm_backward_kernel(const scalar_t* __restrict__ grad_output, const scalar_t* __restrict__ x,
                             const scalar_t* __restrict__ weight, const float* __restrict__ rstd, NormRows layout,
                             scalar_t* __restrict__ grad_x) {
  using Pack = ValuePack<scalar_t, kPackValues>;
  const NormThread thread = norm_thread<kPackValues>(layout);
  const int stride = layout.threads_per_row;  // packs between a thread's packs
  const float r = thread.packs > 0 ? rstd[thread.row] : 0.0f;
  const scalar_t* row_grad_output = grad_output + thread.offset;
  const scalar_t* row_x = x + thread.offset;
  scalar_t* row_grad_x = grad_x + thread.offset;
  Pack x_packs[kPacks];
  float grad_normalized[kPacks][kPackValues];
  float dot = 0.0f;
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    const int64_t pack = thread.lane + int64_t{j} * stride;
    x_packs[j] = load_norm_pack<Pack>(row_x, pack, thread.packs);
    dot += pack_normalized_gradient<kUnitOffset>(load_norm_pack<Pack>(row_grad_output, pack, thread.packs),
                                                 load_norm_pack<Pack>(weight, pack, thread.packs), x_packs[j],
                                                 grad_normalized[j]);
  }
  // Rows longer than the registers hold (only launched with the most packs a thread): the rest
  // read here and again below.
  const int64_t first_unheld = thread.lane + int64_t{kPacks} * stride;
  if constexpr (kPacks == kMaxNormPacksPerThread) {
#pragma unroll 1
    for (int64_t pack = first_unheld; pack < thread.packs; pack += stride) {
      float unheld[kPackValues];
      dot += pack_normalized_gradient<kUnitOffset>(load_norm_pack<Pack>(row_grad_output, pack, thread.packs),
                                                   load_norm_pack<Pack>(weight, pack, thread.packs),
                                                   load_norm_pack<Pack>(row_x, pack, thread.packs), unheld);
    }
  }
  const float correction = norm_row_sum(dot, stride) / static_cast<float>(layout.width) * r * r * r;
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    const int64_t pack = thread.lane + int64_t{j} * stride;
    store_norm_pack(row_grad_x, pack, thread.packs, pack_input_gradient(grad_normalized[j], x_packs[j], r, correction));
  }
  if constexpr (kPacks == kMaxNormPacksPerThread) {
#pragma unroll 1
    for (int64_t pack = first_unheld; pack < thread.packs; pack += stride) {
      const Pack x_pack = load_norm_pack<Pack>(row_x, pack, thread.packs);
      float unheld[kPackValues];
      pack_normalized_gradient<kUnitOffset>(load_norm_pack<Pack>(row_grad_output, pack, thread.packs),
                                            load_norm_pack<Pack>(weight, pack, thread.packs), x_pack, unheld);
      store_norm_pack(row_grad_x, pack, thread.packs, pack_input_gradient(unheld, x_pack, r, correction));
    }
  }
}

// A launch of the kernels: its NormRows, the kernels' kPackValues and kPacks, and its shape.
struct NormLaunch {
  NormRows layout;
  bool vectorized;  // kPackValues 16 bytes' worth, else 1
  int packs_per_thread;
  int threads_per_block;
  int64_t blocks;
};

// The launch over `rows` rows of `width` values, in 16-byte packs where the width is a whole number
// of them and `operands`, the data pointers the kernel reads and writes in packs, all start on 16 bytes.
template <typename scalar_t>
NormLaunch plan_norm_launch(int64_t rows, int64_t width, std::initializer_list<const void*> operands) {
  const bool vectorized = packs_fit<scalar_t>({width}, operands);
  const int64_t packs = vectorized ? width / kWideValues<scalar_t> : width;
  int packs_per_thread = 1;
  if (packs <= int64_t{kWarpSize} * kMaxNormPacksPerThread) {
    // The fewest packs a lane, then the fewest lanes (a power of two), that hold the row.
    while (packs_per_thread * kWarpSize < packs) packs_per_thread *= 2;
    int threads_per_row = 1;
    while (threads_per_row * packs_per_thread < packs) threads_per_row *= 2;
    return {{rows, width, threads_per_row}, vectorized, packs_per_thread, kThreads,
            ceil_div(rows, kThreads / threads_per_row)};
  }
  // A block holding the row: up to kThreads threads, more packs a thread before more threads; past
  // kThreads threads of the most packs, up to kMaxNormBlockThreads, and the kernels read the rest twice.
  while (packs_per_thread < kMaxNormPacksPerThread && packs_per_thread * int64_t{kThreads} < packs) {
    packs_per_thread *= 2;
  }
  const int threads = static_cast<int>(
      std::min<int64_t>(ceil_div(packs, packs_per_thread * kWarpSize) * kWarpSize, kMaxNormBlockThreads));
  return {{rows, width, threads}, vectorized, packs_per_thread, threads, rows};
}

// Runs body(kUnitOffset, kPackValues, kPacks) with the kernels' template arguments as
// std::integral_constant values.
template <typename scalar_t, typename Body>
void with_norm_constants(bool unit_offset, const NormLaunch& launch, const Body& body) {
  static_assert(kMaxNormPacksPerThread == 4, "the cases below");
  const auto with_packs = [&](auto unit_offset_constant, auto pack_values) {
    switch (launch.packs_per_thread) {
      case 1:
        body(unit_offset_constant, pack_values, std::integral_constant<int, 1>{});
        return;
      case 2:
        body(unit_offset_constant, pack_values, std::integral_constant<int, 2>{});
        return;
      default:
        body(unit_offset_constant, pack_values, std::integral_constant<int, 4>{});
        return;
    }
  };
  const auto with_pack_values = [&](auto unit_offset_constant) {
    if (launch.vectorized) {
      with_packs(unit_offset_constant, std::integral_constant<int, kWideValues<scalar_t>>{});
    } else {
      with_packs(unit_offset_constant, std::integral_constant<int, 1>{});
    }
  };
  if (unit_offset) {
    with_pack_values(std::true_type{});
  } else {
    with_pack_values(std::false_type{});
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const std::string& what) {
  check_cuda_tensor(x, what + ": x");
  check_cuda_tensor(weight, what + ": weight");
  check_same_device(weight, x, what + ": weight");
  check_scalar_type(weight, x.scalar_type(), what + ": weight");
  if (x.dim() != 2 || weight.dim() != 1 || weight.size(0) != x.size(1)) {
    throw Error(ErrorCode::kInternal, what + ": expected x [rows, width] and weight [width], got " + std::to_string(x.dim()) + "-d x and " +
                std::to_string(weight.numel()) + " weights");
  }
}

}  // namespace

std::pair<at::Tensor, at::Tensor> rms_norm_forward_cuda(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                        bool unit_offset) {
  check_rows(x, weight, "rms_norm_forward_cuda");
  const c10::cuda::CUDAGuard device_guard(x.device());
  auto out = at::empty_like(x);
  auto rstd = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  if (x.numel() == 0) return {out, rstd};
  dispatch_float_type(x.scalar_type(), "rms_norm_forward_cuda: x", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    const NormLaunch launch =
        plan_norm_launch<scalar_t>(x.size(0), x.size(1), {x.data_ptr(), weight.data_ptr(), out.data_ptr()});
    with_norm_constants<scalar_t>(unit_offset, launch, [&](auto offset, auto pack_values, auto packs) {
      rms_norm_forward_kernel<scalar_t, decltype(offset)::value, decltype(pack_values)::value, decltype(packs)::value>
          <<<static_cast<unsigned>(launch.blocks), launch.threads_per_block, 0, c10::cuda::getCurrentCUDAStream()>>>(
              x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), launch.layout, static_cast<float>(eps),
              out.data_ptr<scalar_t>(), rstd.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {out, rstd};
}

at::Tensor rms_norm_backward_cuda(const at::Tensor& grad_output, const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& rstd, bool unit_offset) {
  check_rows(x, weight, "rms_norm_backward_cuda");
  check_cuda_tensor(grad_output, "rms_norm_backward_cuda: grad_output");
  check_cuda_tensor(rstd, "rms_norm_backward_cuda: rstd");
  check_scalar_type(grad_output, x.scalar_type(), "rms_norm_backward_cuda: grad_output");
  check_scalar_type(rstd, at::kFloat, "rms_norm_backward_cuda: rstd");
  if (!grad_output.sizes().equals(x.sizes()) || rstd.numel() != x.size(0)) {
    throw Error(ErrorCode::kInternal, "rms_norm_backward_cuda: grad_output must have x's shape and rstd one value per row");
  }
  const c10::cuda::CUDAGuard device_guard(x.device());
  auto grad_x = at::empty_like(x);
  if (x.numel() == 0) return grad_x;
  dispatch_float_type(x.scalar_type(), "rms_norm_backward_cuda: x", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    const NormLaunch launch = plan_norm_launch<scalar_t>(
        x.size(0), x.size(1), {grad_output.data_ptr(), x.data_ptr(), weight.data_ptr(), grad_x.data_ptr()});
    with_norm_constants<scalar_t>(unit_offset, launch, [&](auto offset, auto pack_values, auto packs) {
      rms_norm_backward_kernel<scalar_t, decltype(offset)::value, decltype(pack_values)::value, decltype(packs)::value>
          <<<static_cast<unsigned>(launch.blocks), launch.threads_per_block, 0, c10::cuda::getCurrentCUDAStream()>>>(
              grad_output.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
              rstd.data_ptr<float>(), launch.layout, grad_x.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return grad_x;
}

}  // namespace qtrain::kernels
