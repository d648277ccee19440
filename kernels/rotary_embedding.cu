// The rotary embedding on the projection's [batch, seq, heads, head_dim] layout, one thread per
// rotated pair (i, i + head_dim / 2) (kernels/llama_layers.h). transformers computes
// x * cos + rotate_half(x) * sin in the model dtype: each product and the sum are rounded.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <string>

#include "kernels/cuda_entry.cuh"
#include "kernels/llama_layers.h"

namespace qtrain::kernels {

namespace {

template <typename scalar_t>
__device__ __forceinline__ float product(float a, float b) {
  return static_cast<float>(static_cast<scalar_t>(a * b));
}

// Forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2. Backward (the transpose): g1 = y1 c1 + y2 s2,
// g2 = y2 c2 - y1 s1 (autograd's rounding: each product, then the sum).
template <typename scalar_t, bool kInverse>
__global__ void rotary_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ cos,
                              const scalar_t* __restrict__ sin, int64_t pairs, int64_t heads, int64_t half,
                              scalar_t* __restrict__ out) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= pairs) return;
  const int64_t i = index % half;
  const int64_t row = index / half;    // (batch, seq, head)
  const int64_t position = row / heads;  // (batch, seq)
  const int64_t first = row * 2 * half + i;
  const int64_t angle = position * 2 * half + i;
  const float x1 = static_cast<float>(x[first]);
  const float x2 = static_cast<float>(x[first + half]);
  const float c1 = static_cast<float>(cos[angle]), c2 = static_cast<float>(cos[angle + half]);
  const float s1 = static_cast<float>(sin[angle]), s2 = static_cast<float>(sin[angle + half]);
  if (kInverse) {
    out[first] = static_cast<scalar_t>(product<scalar_t>(x1, c1) + product<scalar_t>(x2, s2));
    out[first + half] = static_cast<scalar_t>(product<scalar_t>(x2, c2) - product<scalar_t>(x1, s1));
  } else {
    out[first] = static_cast<scalar_t>(product<scalar_t>(x1, c1) + product<scalar_t>(-x2, s1));
    out[first + half] = static_cast<scalar_t>(product<scalar_t>(x2, c2) + product<scalar_t>(x1, s2));
  }
}

}  // namespace

at::Tensor rotary_embedding_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse) {
  const std::string what = "rotary_embedding_cuda";
  check_cuda_tensor(x, what + ": x");
  check_cuda_tensor(cos, what + ": cos");
  check_cuda_tensor(sin, what + ": sin");
  check_same_device(cos, x, what + ": cos");
  check_same_device(sin, x, what + ": sin");
  check_scalar_type(cos, x.scalar_type(), what + ": cos");
  check_scalar_type(sin, x.scalar_type(), what + ": sin");
  if (x.dim() != 4 || cos.dim() != 3 || !cos.sizes().equals(sin.sizes()) || cos.size(0) != x.size(0) ||
      cos.size(1) != x.size(1) || cos.size(2) != x.size(3) || x.size(3) % 2 != 0) {
    throw Error(ErrorCode::kInternal, what + ": expected x [batch, seq, heads, head_dim] (head_dim even) and cos/sin [batch, seq, head_dim]");
  }
  const c10::cuda::CUDAGuard device_guard(x.device());
  auto out = at::empty_like(x);
  const int64_t half = x.size(3) / 2;
  const int64_t pairs = x.numel() / 2;
  if (pairs == 0) return out;
  dispatch_float_type(x.scalar_type(), what + ": x", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    auto kernel = inverse ? rotary_kernel<scalar_t, true> : rotary_kernel<scalar_t, false>;
    kernel<<<static_cast<unsigned>(ceil_div(pairs, kThreads)), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), pairs, x.size(2), half,
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace qtrain::kernels
