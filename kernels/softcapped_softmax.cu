// Gemma 2's soft-capped, masked softmax and its backward, one CUDA block per row of scores
// (kernels/softcapped_softmax.h). Every step rounds as the torch operation it replaces does on a
// reduced-precision tensor: the product with a Python scalar in fp32, a division by a scalar as
// the product with its fp32 reciprocal, tanh and tanh_backward in fp32, each result rounded to the
// dtype; the softmax in fp32 as torch's softmax(dtype=float32).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <string>

#include "kernels/block_reduce.cuh"
#include "kernels/cuda_entry.cuh"
#include "kernels/softcapped_softmax.h"

namespace qtrain::kernels {

namespace {

template <typename scalar_t>
__device__ __forceinline__ float rounded(float value) {
  return static_cast<float>(static_cast<scalar_t>(value));
}

// The scalars as torch's kernels hold them: fp32 copies of the Python numbers, and the division's
// fp32 reciprocal.
struct Scalars {
  float scale, cap, inverse_cap;
  int64_t queries, past, window;
};

__device__ __forceinline__ bool visible(int64_t row, int64_t key, const Scalars& s) {
  const int64_t position = s.past + row % s.queries;
  return key <= position && (s.window <= 0 || key > position - s.window);
}

// c = dtype(dtype(tanh(dtype(dtype(s * scale) * (1 / cap)))) * cap): the capped score, and tanh's
// rounded output.
template <typename scalar_t>
__device__ __forceinline__ float capped(scalar_t raw, const Scalars& s, float& tanh_output) {
  const float scaled = rounded<scalar_t>(static_cast<float>(raw) * s.scale);
  const float divided = rounded<scalar_t>(scaled * s.inverse_cap);
  tanh_output = rounded<scalar_t>(tanhf(divided));
  return rounded<scalar_t>(tanh_output * s.cap);
}

template <typename scalar_t>
__global__ void softcapped_softmax_forward_kernel(const scalar_t* __restrict__ scores, int64_t keys, Scalars s,
                                                  scalar_t* __restrict__ probabilities,
                                                  float* __restrict__ probabilities32, scalar_t* __restrict__ tanh_out) {
  const int64_t row = blockIdx.x;
  const int64_t offset = row * keys;
  float row_max = -INFINITY;
  for (int64_t j = threadIdx.x; j < keys; j += kThreads) {
    float t;
    const float c = capped(scores[offset + j], s, t);
    tanh_out[offset + j] = static_cast<scalar_t>(t);
    if (visible(row, j, s)) row_max = fmaxf(row_max, c);
  }
  row_max = block_reduce(row_max, MaxOp{}, -INFINITY);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < keys; j += kThreads) {
    if (!visible(row, j, s)) continue;
    const float c = rounded<scalar_t>(static_cast<float>(tanh_out[offset + j]) * s.cap);
    sum += expf(c - row_max);
  }
  sum = block_reduce(sum, SumOp{}, 0.0f);
  for (int64_t j = threadIdx.x; j < keys; j += kThreads) {
    float p = 0.0f;
    if (visible(row, j, s)) p = expf(rounded<scalar_t>(static_cast<float>(tanh_out[offset + j]) * s.cap) - row_max) / sum;
    probabilities32[offset + j] = p;
    probabilities[offset + j] = static_cast<scalar_t>(p);
  }
}

// d scores = dtype(dtype(dtype(dtype(p (g - sum g p)) * cap) * (1 - t^2)) * (1 / cap)) * scale,
// zero where the mask hid the key.
template <typename scalar_t>
__global__ void softcapped_softmax_backward_kernel(const scalar_t* __restrict__ grad_probabilities,
                                                   const float* __restrict__ probabilities32,
                                                   const scalar_t* __restrict__ tanh_out, int64_t keys, Scalars s,
                                                   scalar_t* __restrict__ grad_scores) {
  const int64_t row = blockIdx.x;
  const int64_t offset = row * keys;
  float dot = 0.0f;
  for (int64_t j = threadIdx.x; j < keys; j += kThreads) {
    dot += static_cast<float>(grad_probabilities[offset + j]) * probabilities32[offset + j];
  }
  dot = block_reduce(dot, SumOp{}, 0.0f);
  for (int64_t j = threadIdx.x; j < keys; j += kThreads) {
    float grad = 0.0f;
    if (visible(row, j, s)) {
      const float g = static_cast<float>(grad_probabilities[offset + j]);
      const float capped_grad = rounded<scalar_t>(probabilities32[offset + j] * (g - dot));
      const float t = static_cast<float>(tanh_out[offset + j]);
      const float tanh_grad = rounded<scalar_t>(capped_grad * s.cap);
      const float divided_grad = rounded<scalar_t>(tanh_grad * (1.0f - t * t));
      const float scaled_grad = rounded<scalar_t>(divided_grad * s.inverse_cap);
      grad = scaled_grad * s.scale;
    }
    grad_scores[offset + j] = static_cast<scalar_t>(grad);
  }
}

Scalars scalars_of(const SoftcappedScores& options) {
  if (options.cap <= 0 || options.queries <= 0) {
    throw Error(ErrorCode::kInternal, "softcapped_softmax: the cap and the queries per head must be positive");
  }
  const float cap = static_cast<float>(options.cap);
  return {static_cast<float>(options.scale), cap, 1.0f / cap, options.queries, options.past, options.window};
}

void check_rows(const at::Tensor& tensor, const std::string& what) {
  check_cuda_tensor(tensor, what);
  if (tensor.dim() != 2) throw Error(ErrorCode::kInternal, what + " must be [rows, keys]");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> softcapped_softmax_forward_cuda(const at::Tensor& scores,
                                                                               const SoftcappedScores& options) {
  check_rows(scores, "softcapped_softmax_forward_cuda: scores");
  const auto s = scalars_of(options);
  const c10::cuda::CUDAGuard device_guard(scores.device());
  auto probabilities = at::empty_like(scores);
  auto probabilities32 = at::empty(scores.sizes(), scores.options().dtype(at::kFloat));
  auto tanh_output = at::empty_like(scores);
  if (scores.numel() == 0) return {probabilities, probabilities32, tanh_output};
  dispatch_float_type(scores.scalar_type(), "softcapped_softmax_forward_cuda: scores", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    softcapped_softmax_forward_kernel<scalar_t>
        <<<static_cast<unsigned>(scores.size(0)), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            scores.data_ptr<scalar_t>(), scores.size(1), s, probabilities.data_ptr<scalar_t>(),
            probabilities32.data_ptr<float>(), tanh_output.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {probabilities, probabilities32, tanh_output};
}

at::Tensor softcapped_softmax_backward_cuda(const at::Tensor& grad_probabilities, const at::Tensor& probabilities32,
                                            const at::Tensor& tanh_output, const SoftcappedScores& options) {
  const std::string what = "softcapped_softmax_backward_cuda: ";
  check_rows(grad_probabilities, what + "grad_probabilities");
  check_cuda_operands(grad_probabilities, {{&probabilities32, "probabilities32"}, {&tanh_output, "tanh_output"}}, what);
  check_scalar_type(probabilities32, at::kFloat, what + "probabilities32");
  check_scalar_type(tanh_output, grad_probabilities.scalar_type(), what + "tanh_output");
  if (!probabilities32.sizes().equals(grad_probabilities.sizes()) || !tanh_output.sizes().equals(grad_probabilities.sizes())) {
    throw Error(ErrorCode::kInternal, what + "the saved tensors must have the gradient's shape");
  }
  const auto s = scalars_of(options);
  const c10::cuda::CUDAGuard device_guard(grad_probabilities.device());
  auto grad_scores = at::empty_like(grad_probabilities);
  if (grad_scores.numel() == 0) return grad_scores;
  dispatch_float_type(grad_probabilities.scalar_type(), what + "grad_probabilities", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    softcapped_softmax_backward_kernel<scalar_t>
        <<<static_cast<unsigned>(grad_probabilities.size(0)), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            grad_probabilities.data_ptr<scalar_t>(), probabilities32.data_ptr<float>(), tanh_output.data_ptr<scalar_t>(),
            grad_probabilities.size(1), s, grad_scores.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_scores;
}

}  // namespace qtrain::kernels
