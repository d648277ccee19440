// RMSNorm forward and backward, one CUDA block per row (kernels/llama_layers.h). The forward is
// transformers' LlamaRMSNorm: fp32 normalization, rounded to the input dtype, times the weight in
// that dtype; or, kUnitOffset, Gemma's: the fp32 normalization times (1 + weight) in fp32, rounded
// once. The backward differentiates exactly those roundings' chain in fp32.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <string>
#include <type_traits>

#include "kernels/cuda_entry.cuh"
#include "kernels/llama_layers.h"

namespace qtrain::kernels {

namespace {

// The sum of `value` over the block (kThreads threads), returned to every thread.
__device__ float block_sum(float value) {
  __shared__ float partial[kThreads / 32];
  __shared__ float total;
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = value;
  __syncthreads();
  if (threadIdx.x < 32) {
    float sum = threadIdx.x < kThreads / 32 ? partial[threadIdx.x] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (threadIdx.x == 0) total = sum;
  }
  __syncthreads();
  return total;
}

template <typename scalar_t, bool kUnitOffset>
__global__ void rms_norm_forward_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ weight,
                                        int64_t width, float eps, scalar_t* __restrict__ out,
                                        float* __restrict__ rstd_out) {
  const int64_t row = blockIdx.x;
  const scalar_t* row_x = x + row * width;
  float squares = 0.0f;
  for (int64_t i = threadIdx.x; i < width; i += kThreads) {
    const float value = static_cast<float>(row_x[i]);
    squares += value * value;
  }
  const float mean = block_sum(squares) / static_cast<float>(width);
  const float rstd = rsqrtf(mean + eps);
  if (threadIdx.x == 0) rstd_out[row] = rstd;
  for (int64_t i = threadIdx.x; i < width; i += kThreads) {
    if constexpr (kUnitOffset) {
      const float normalized = static_cast<float>(row_x[i]) * rstd;
      out[row * width + i] = static_cast<scalar_t>(normalized * (1.0f + static_cast<float>(weight[i])));
    } else {
      const scalar_t normalized = static_cast<scalar_t>(static_cast<float>(row_x[i]) * rstd);
      out[row * width + i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * static_cast<float>(normalized));
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

// y = w * n_t, n_t = dtype(n), n = x * r, r = rsqrt(mean(x^2) + eps):
// dn = dtype(dy * w) (the product's rounding; Gemma's: dy (1 + w)), dx = r dn - x r^3 mean(dn x).
template <typename scalar_t, bool kUnitOffset>
__global__ void rms_norm_backward_kernel(const scalar_t* __restrict__ grad_output, const scalar_t* __restrict__ x,
                                         const scalar_t* __restrict__ weight, const float* __restrict__ rstd,
                                         int64_t width, scalar_t* __restrict__ grad_x) {
  const int64_t row = blockIdx.x;
  const int64_t offset = row * width;
  float dot = 0.0f;
  for (int64_t i = threadIdx.x; i < width; i += kThreads) {
    const float grad_normalized = normalized_gradient<scalar_t, kUnitOffset>(grad_output[offset + i], weight[i]);
    dot += grad_normalized * static_cast<float>(x[offset + i]);
  }
  const float r = rstd[row];
  const float correction = block_sum(dot) / static_cast<float>(width) * r * r * r;
  for (int64_t i = threadIdx.x; i < width; i += kThreads) {
    const float grad_normalized = normalized_gradient<scalar_t, kUnitOffset>(grad_output[offset + i], weight[i]);
    grad_x[offset + i] = static_cast<scalar_t>(r * grad_normalized - static_cast<float>(x[offset + i]) * correction);
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

// Runs body with the kernels' kUnitOffset as a compile-time constant.
template <typename Body>
void with_unit_offset(bool unit_offset, const Body& body) {
  if (unit_offset) {
    body(std::true_type{});
  } else {
    body(std::false_type{});
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
    with_unit_offset(unit_offset, [&](auto offset) {
      rms_norm_forward_kernel<scalar_t, decltype(offset)::value>
          <<<static_cast<unsigned>(x.size(0)), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
              x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), x.size(1), static_cast<float>(eps),
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
    with_unit_offset(unit_offset, [&](auto offset) {
      rms_norm_backward_kernel<scalar_t, decltype(offset)::value>
          <<<static_cast<unsigned>(x.size(0)), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
              grad_output.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
              rstd.data_ptr<float>(), x.size(1), grad_x.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return grad_x;
}

}  // namespace qtrain::kernels
