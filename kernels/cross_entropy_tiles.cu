// The fused cross-entropy's per-tile arithmetic (kernels/cross_entropy_tiles.h), one CUDA block per
// row of a [rows, tile] logits block in the model dtype, read 16 bytes at a time where the rows
// allow. The statistics take two passes over the row, its max then the sum of exp(z - max) (the
// second mostly from L2: a 32768-column bf16 row is 64 KiB), which may write each exp(z - max) over
// its logit. Each value is computed as the torch operations of trainer/model/fused_linear_cross_entropy.cpp compute it:
// expf, the full-precision exp that torch's CUDA exp runs on fp32, and __fmul_rn / __fadd_rn /
// __fsub_rn where a product and a sum must each round on their own, as two torch kernels round
// them, and not as the one fused multiply-add the compiler would make of them.
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "kernels/block_reduce.cuh"
#include "kernels/cross_entropy_tiles.h"
#include "kernels/cuda_entry.cuh"

namespace qtrain::kernels {

namespace {

// statistics[row] folded with the row's tile (the header's formulas); packs of kValues logits;
// with kExponentials each exp(z - max) written over its logit (0 at the target), times the cap's
// derivative 1 - (z / cap)^2 where softcap > 0 (z the capped logit).
template <typename scalar_t, int kValues, bool kExponentials>
__global__ void tile_statistics_kernel(const scalar_t* logits, int64_t tile,
                                       const int64_t* __restrict__ targets, int64_t begin,
                                       const float* __restrict__ seen_max, const float* __restrict__ seen_sum,
                                       const float* __restrict__ seen_target_logit, float* __restrict__ max_out,
                                       float* __restrict__ sum_out, float* __restrict__ target_logit_out,
                                       scalar_t* exponentials,  // `logits` itself (no restrict), or null
                                       float softcap) {
  using Pack = ValuePack<scalar_t, kValues>;
  const int64_t row = blockIdx.x;
  const scalar_t* row_logits = logits + row * tile;
  const auto* packs = reinterpret_cast<const Pack*>(row_logits);
  const int64_t pack_count = tile / kValues;
  const float max_before = seen_max[row];
  const int64_t target_column = targets[row] - begin;  // outside [0, tile) when the target is elsewhere or ignored
  // Read before the block's first barrier, after which the exponentials may overwrite it.
  const float target_logit = target_column >= 0 && target_column < tile ? static_cast<float>(row_logits[target_column])
                                                                      : seen_target_logit[row];

  float tile_max = -INFINITY;
  for (int64_t p = threadIdx.x; p < pack_count; p += kThreads) {
    const Pack pack = packs[p];
#pragma unroll
    for (int k = 0; k < kValues; ++k) tile_max = MaxKeepingNan{}(static_cast<float>(pack.values[k]), tile_max);
  }
  tile_max = block_reduce(tile_max, MaxKeepingNan{}, -INFINITY);
  const float row_max = MaxKeepingNan{}(max_before, tile_max);

  float tile_sum = 0.0f;
  for (int64_t p = threadIdx.x; p < pack_count; p += kThreads) {
    const Pack pack = packs[p];
    Pack out;
#pragma unroll
    for (int k = 0; k < kValues; ++k) {
      const float exponential = expf(static_cast<float>(pack.values[k]) - row_max);
      tile_sum += exponential;
      if constexpr (kExponentials) {
        float weight = exponential;
        if (softcap > 0.0f) {
          // 1 - (z / cap)^2, each step rounded alone as the torch operations round them.
          const float ratio = __fdiv_rn(static_cast<float>(pack.values[k]), softcap);
          weight = __fmul_rn(weight, __fsub_rn(1.0f, __fmul_rn(ratio, ratio)));
        }
        out.values[k] = static_cast<scalar_t>(p * kValues + k == target_column ? 0.0f : weight);
      }
    }
    // In place: this thread read the pack it writes.
    if constexpr (kExponentials) reinterpret_cast<Pack*>(exponentials + row * tile)[p] = out;
  }
  tile_sum = block_reduce(tile_sum, SumOp{}, 0.0f);

  if (threadIdx.x == 0) {
    // seen.sum * exp(seen.max - max) + the tile's sum: a product and a sum, rounded as torch's mul and add.
    sum_out[row] = __fadd_rn(__fmul_rn(seen_sum[row], expf(max_before - row_max)), tile_sum);
    max_out[row] = row_max;
    target_logit_out[row] = target_logit;
  }
}

// Calls run(std::integral_constant<int, kValues>{}) with 16-byte packs when every row of the
// tile starts on 16 bytes (the width a whole number of packs, the pointers aligned), else with
// packs of one value.
template <typename scalar_t, typename Launch>
void launch_over_logit_packs(int64_t tile, std::initializer_list<const void*> pointers, const Launch& run) {
  if (packs_fit<scalar_t>({tile}, pointers)) {
    run(std::integral_constant<int, kWideValues<scalar_t>>{});
  } else {
    run(std::integral_constant<int, 1>{});
  }
}

// logits [rows, tile] and targets [rows] int64, contiguous on one CUDA device.
void check_logit_tile(const at::Tensor& logits, const at::Tensor& targets, const std::string& what) {
  check_cuda_tensor(logits, what + "logits");
  if (logits.dim() != 2) {
    throw Error(ErrorCode::kInternal, what + "logits must be [rows, tile], got " + shape_text(logits.sizes()));
  }
  check_cuda_operands(logits, {{&targets, "targets"}}, what);
  check_scalar_type(targets, at::kLong, what + "targets");
  if (targets.dim() != 1 || targets.size(0) != logits.size(0)) {
    throw Error(ErrorCode::kInternal, what + "targets must be [rows] = [" + std::to_string(logits.size(0)) + "], got " +
                                          shape_text(targets.sizes()));
  }
}

// A per-row fp32 operand [rows] beside the logits.
void check_row_values(const at::Tensor& values, const at::Tensor& logits, const std::string& what) {
  check_cuda_operands(logits, {{&values, ""}}, what);
  check_scalar_type(values, at::kFloat, what);
  if (values.dim() != 1 || values.size(0) != logits.size(0)) {
    throw Error(ErrorCode::kInternal, what + " must be [rows] = [" + std::to_string(logits.size(0)) + "], got " +
                                          shape_text(values.sizes()));
  }
}

// Both entry points of the statistics kernel: `exponentials` the logits' own storage, or null.
LogSumExpStatistics tile_statistics(const LogSumExpStatistics& seen, const at::Tensor& logits, const at::Tensor& targets,
                                    int64_t begin, bool exponentials, double softcap, const std::string& what) {
  check_logit_tile(logits, targets, what);
  check_row_values(seen.max, logits, what + "max");
  check_row_values(seen.sum, logits, what + "sum");
  check_row_values(seen.target_logit, logits, what + "target_logit");
  const c10::cuda::CUDAGuard device_guard(logits.device());
  LogSumExpStatistics folded{at::empty_like(seen.max), at::empty_like(seen.sum), at::empty_like(seen.target_logit)};
  const int64_t rows = logits.size(0), tile = logits.size(1);
  if (rows == 0) return folded;
  dispatch_float_type(logits.scalar_type(), what + "logits", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    launch_over_logit_packs<scalar_t>(tile, {logits.data_ptr()}, [&](auto values) {
      const auto launch = [&](auto kernel) {
        kernel<<<static_cast<unsigned>(rows), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            logits.data_ptr<scalar_t>(), tile, targets.data_ptr<int64_t>(), begin, seen.max.data_ptr<float>(),
            seen.sum.data_ptr<float>(), seen.target_logit.data_ptr<float>(), folded.max.data_ptr<float>(),
            folded.sum.data_ptr<float>(), folded.target_logit.data_ptr<float>(),
            exponentials ? logits.data_ptr<scalar_t>() : nullptr, static_cast<float>(softcap));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      constexpr int kValues = decltype(values)::value;
      if (exponentials) {
        launch(tile_statistics_kernel<scalar_t, kValues, true>);
      } else {
        launch(tile_statistics_kernel<scalar_t, kValues, false>);
      }
    });
  });
  return folded;
}

}  // namespace

LogSumExpStatistics cross_entropy_tile_statistics_cuda(const LogSumExpStatistics& seen, const at::Tensor& logits,
                                                       const at::Tensor& targets, int64_t begin) {
  return tile_statistics(seen, logits, targets, begin, /*exponentials=*/false, /*softcap=*/0.0,
                         "cross_entropy_tile_statistics_cuda: ");
}

LogSumExpStatistics cross_entropy_tile_exponentials_cuda(const LogSumExpStatistics& seen, at::Tensor& logits,
                                                         const at::Tensor& targets, int64_t begin, double softcap) {
  return tile_statistics(seen, logits, targets, begin, /*exponentials=*/true, softcap,
                         "cross_entropy_tile_exponentials_cuda: ");
}

}  // namespace qtrain::kernels
