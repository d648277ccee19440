// The rotary embedding on the projection's [batch, seq, heads, head_dim] layout, one thread per
// rotated pair (i, i + rotary_dim / 2) or passed dimension (kernels/llama_layers.h). transformers
// computes x * cos + rotate_half(x) * sin in the model dtype: each product and the sum are rounded.
//
// Memory layout: each (batch, seq) position holds its heads side by side (head h at h * head_dim),
// and positions lie a row stride apart, x's and out's own: heads * head_dim for a contiguous tensor,
// the fused projection's width for the query or key part of Phi-3's qkv_proj output (or its
// gradient), read or written in place.
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

// Each head has head_dim - half slots: slot i < half turns the pair (i, i + half) of its leading
// rotary_dim = 2 * half dimensions, slot i >= half copies dimension half + i (partial rotary,
// Phi-4-mini's trailing quarter; none when rotary_dim == head_dim). cos / sin [positions, 2 * half].
// Forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2. Backward (the transpose): g1 = y1 c1 + y2 s2,
// g2 = y2 c2 - y1 s1 (autograd's rounding: each product, then the sum).
template <typename scalar_t, bool kInverse>
__global__ void rotary_kernel(const scalar_t* __restrict__ x, int64_t x_row_stride, const scalar_t* __restrict__ cos,
                              const scalar_t* __restrict__ sin, int64_t total_slots, int64_t heads, int64_t head_dim,
                              int64_t half, scalar_t* __restrict__ out, int64_t out_row_stride) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= total_slots) return;
  const int64_t slots_per_head = head_dim - half;
  const int64_t i = index % slots_per_head;
  const int64_t row = index / slots_per_head;  // (batch, seq, head)
  const int64_t position = row / heads;        // (batch, seq)
  const int64_t head_offset = (row - position * heads) * head_dim;
  const scalar_t* x_head = x + position * x_row_stride + head_offset;
  scalar_t* out_head = out + position * out_row_stride + head_offset;
  if (i >= half) {
    out_head[half + i] = x_head[half + i];
    return;
  }
  const int64_t angle = position * 2 * half + i;
  const float x1 = static_cast<float>(x_head[i]);
  const float x2 = static_cast<float>(x_head[i + half]);
  const float c1 = static_cast<float>(cos[angle]), c2 = static_cast<float>(cos[angle + half]);
  const float s1 = static_cast<float>(sin[angle]), s2 = static_cast<float>(sin[angle + half]);
  if (kInverse) {
    out_head[i] = static_cast<scalar_t>(product<scalar_t>(x1, c1) + product<scalar_t>(x2, s2));
    out_head[i + half] = static_cast<scalar_t>(product<scalar_t>(x2, c2) - product<scalar_t>(x1, s1));
  } else {
    out_head[i] = static_cast<scalar_t>(product<scalar_t>(x1, c1) + product<scalar_t>(-x2, s1));
    out_head[i + half] = static_cast<scalar_t>(product<scalar_t>(x2, c2) + product<scalar_t>(x1, s2));
  }
}

// The distance between consecutive (batch, seq) positions of a [batch, seq, heads, head_dim] view
// whose heads lie side by side; an Error naming `what` for any other layout.
int64_t rotary_row_stride(const at::Tensor& tensor, const std::string& what) {
  const int64_t batch = tensor.size(0), sequence = tensor.size(1), heads = tensor.size(2), head_dim = tensor.size(3);
  const int64_t row_stride = sequence > 1 ? tensor.stride(1) : batch > 1 ? tensor.stride(0) : heads * head_dim;
  const bool heads_side_by_side = tensor.stride(3) == 1 && (heads == 1 || tensor.stride(2) == head_dim);
  const bool rows_even = batch == 1 || sequence == 1 || tensor.stride(0) == sequence * row_stride;
  if (!heads_side_by_side || !rows_even || row_stride < heads * head_dim) {
    throw Error(ErrorCode::kInternal, what + " must hold each position's heads side by side and its positions one row stride "
                "apart (a contiguous tensor, or a head-aligned column range of one)");
  }
  return row_stride;
}

// Checks the operands (errors name `what`) and launches the kernel; x and out may be row-strided views.
void launch_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse, const at::Tensor& out,
                   const std::string& what) {
  check_cuda_tensor(cos, what + ": cos");
  check_cuda_tensor(sin, what + ": sin");
  for (const auto& [tensor, name] : {std::pair<const at::Tensor*, const char*>{&x, ": x"}, {&out, ": out"}}) {
    if (!tensor->defined() || !tensor->is_cuda()) throw Error(ErrorCode::kInternal, what + name + " must be a CUDA tensor");
    check_same_device(*tensor, cos, what + name);
    check_scalar_type(*tensor, cos.scalar_type(), what + name);
  }
  check_same_device(sin, cos, what + ": sin");
  check_scalar_type(sin, cos.scalar_type(), what + ": sin");
  if (x.dim() != 4 || !out.sizes().equals(x.sizes()) || cos.dim() != 3 || !cos.sizes().equals(sin.sizes()) ||
      cos.size(0) != x.size(0) || cos.size(1) != x.size(1) || cos.size(2) > x.size(3) || cos.size(2) % 2 != 0) {
    throw Error(ErrorCode::kInternal, what + ": expected x and out [batch, seq, heads, head_dim] and cos/sin [batch, seq, "
                "rotary_dim], rotary_dim even and at most head_dim");
  }
  const int64_t half = cos.size(2) / 2;
  const int64_t total_slots = x.size(0) * x.size(1) * x.size(2) * (x.size(3) - half);
  if (total_slots == 0) return;
  const int64_t x_row_stride = rotary_row_stride(x, what + ": x");
  const int64_t out_row_stride = rotary_row_stride(out, what + ": out");
  const c10::cuda::CUDAGuard device_guard(x.device());
  dispatch_float_type(x.scalar_type(), what + ": x", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    auto kernel = inverse ? rotary_kernel<scalar_t, true> : rotary_kernel<scalar_t, false>;
    kernel<<<static_cast<unsigned>(ceil_div(total_slots, kThreads)), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<scalar_t>(), x_row_stride, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), total_slots,
        x.size(2), x.size(3), half, out.data_ptr<scalar_t>(), out_row_stride);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

at::Tensor rotary_embedding_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse) {
  check_cuda_tensor(x, "rotary_embedding_cuda: x");
  auto out = at::empty_like(x);
  launch_rotary(x, cos, sin, inverse, out, "rotary_embedding_cuda");
  return out;
}

void rotary_embedding_into_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse,
                                const at::Tensor& out) {
  launch_rotary(x, cos, sin, inverse, out, "rotary_embedding_into_cuda");
}

}  // namespace qtrain::kernels
