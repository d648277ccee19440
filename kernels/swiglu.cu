// The gated MLP activations, act(gate) * up, and their backward as one kernel each
// (kernels/llama_layers.h): SwiGLU (silu) and GeGLU (tanh-approximated GELU, Gemma's), rounding as
// torch's silu / gelu, mul and silu_backward / gelu_backward do in the model dtype.
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
#include <vector>

#include "kernels/cuda_entry.cuh"
#include "kernels/llama_layers.h"

namespace qtrain::kernels {

namespace {

struct Silu {
  static __device__ __forceinline__ float value(float g) { return g / (1.0f + expf(-g)); }
  // d silu / d g = s (1 + g (1 - s)), s = sigmoid(g): torch's silu_backward.
  static __device__ __forceinline__ float derivative(float g) {
    const float sigmoid = 1.0f / (1.0f + expf(-g));
    return sigmoid * (1.0f + g * (1.0f - sigmoid));
  }
};

// torch's gelu(approximate="tanh"): 0.5 g (1 + tanh(b (g + k g^3))), b = sqrt(2 / pi), k = 0.044715,
// and its gelu_backward, each product grouped as torch's CUDA kernels group them.
struct GeluTanh {
  static constexpr float kBeta = 0.7978845608028654f;
  static constexpr float kKappa = 0.044715f;
  static __device__ __forceinline__ float value(float g) {
    const float cube = g * g * g;
    const float inner = kBeta * (g + kKappa * cube);
    return 0.5f * g * (1.0f + tanhf(inner));
  }
  static __device__ __forceinline__ float derivative(float g) {
    const float square = g * g;
    const float cube = square * g;
    const float tanh_inner = tanhf(kBeta * (g + kKappa * cube));
    const float left = 0.5f * g;
    const float right = 1.0f + tanh_inner;
    const float left_derivative = 0.5f * right;
    const float tanh_derivative = 1.0f - tanh_inner * tanh_inner;
    const float inner_derivative = kBeta * (1.0f + 3.0f * kKappa * square);
    return left_derivative + left * tanh_derivative * inner_derivative;
  }
};

template <typename scalar_t, typename Activation>
__device__ __forceinline__ float activation_rounded(float g) {
  return static_cast<float>(static_cast<scalar_t>(Activation::value(g)));
}

// Where value `index` of a [rows, width] operand lies in a tensor whose rows are `row_stride` apart:
// gate and up are either two contiguous tensors (row_stride == width) or the halves of one fused
// [rows, 2 * width] projection output (Phi-3's gate_up_proj), read in place.
__device__ __forceinline__ int64_t strided_offset(int64_t index, int64_t width, int64_t row_stride) {
  return row_stride == width ? index : (index / width) * row_stride + index % width;
}

template <typename scalar_t, int kVector, typename Activation>
__global__ void gated_forward_kernel(const scalar_t* __restrict__ gate, const scalar_t* __restrict__ up, int64_t n,
                                      int64_t width, int64_t row_stride, scalar_t* __restrict__ out) {
  using Values = ValuePack<scalar_t, kVector>;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVector;
  if (first >= n) return;
  const int64_t offset = strided_offset(first, width, row_stride);
  const Values g = *reinterpret_cast<const Values*>(gate + offset);
  const Values u = *reinterpret_cast<const Values*>(up + offset);
  Values y;
#pragma unroll
  for (int k = 0; k < kVector; ++k) {
    y.values[k] = static_cast<scalar_t>(activation_rounded<scalar_t, Activation>(static_cast<float>(g.values[k])) *
                                        static_cast<float>(u.values[k]));
  }
  *reinterpret_cast<Values*>(out + first) = y;
}

// d up = dtype(dy * act_t), d act = dtype(dy * up), d gate = dtype(d act * act'(g)).
template <typename scalar_t, int kVector, typename Activation>
__global__ void gated_backward_kernel(const scalar_t* __restrict__ grad_output, const scalar_t* __restrict__ gate,
                                       const scalar_t* __restrict__ up, int64_t n, int64_t width, int64_t row_stride,
                                       scalar_t* __restrict__ grad_gate, scalar_t* __restrict__ grad_up) {
  using Values = ValuePack<scalar_t, kVector>;  // kVector values per thread
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVector;
  if (first >= n) return;
  const int64_t offset = strided_offset(first, width, row_stride);
  const Values dy = *reinterpret_cast<const Values*>(grad_output + first);
  const Values g = *reinterpret_cast<const Values*>(gate + offset);
  const Values u = *reinterpret_cast<const Values*>(up + offset);
  Values dg, du;
#pragma unroll
  for (int k = 0; k < kVector; ++k) {
    const float dy_k = static_cast<float>(dy.values[k]);
    const float g_k = static_cast<float>(g.values[k]);
    du.values[k] = static_cast<scalar_t>(dy_k * activation_rounded<scalar_t, Activation>(g_k));
    const float grad_activated = static_cast<float>(static_cast<scalar_t>(dy_k * static_cast<float>(u.values[k])));
    dg.values[k] = static_cast<scalar_t>(grad_activated * Activation::derivative(g_k));
  }
  *reinterpret_cast<Values*>(grad_gate + offset) = dg;
  *reinterpret_cast<Values*>(grad_up + offset) = du;
}

// Runs the kernel with wide packs over n values when the row width, n, the row stride and every
// pointer allow them (packs_fit), else the one-value kernel.
template <typename scalar_t, typename Launch>
void launch(int64_t n, int64_t width, int64_t row_stride, std::initializer_list<const void*> pointers, const Launch& run) {
  constexpr int kWide = kWideValues<scalar_t>;
  if (packs_fit<scalar_t>({n, width, row_stride}, pointers)) {
    run(std::integral_constant<int, kWide>{}, static_cast<unsigned>(ceil_div(n / kWide, kThreads)));
  } else {
    run(std::integral_constant<int, 1>{}, static_cast<unsigned>(ceil_div(n, kThreads)));
  }
}

void check_pair(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  check_cuda_tensor(a, what);
  check_cuda_tensor(b, what);
  check_same_device(b, a, what);
  check_scalar_type(b, a.scalar_type(), what);
  if (!a.sizes().equals(b.sizes())) throw Error(ErrorCode::kInternal, what + ": the tensors must have one shape");
}

// gate and up as [rows, width] views `row_stride` values apart; out [rows, width] contiguous.
template <typename Activation>
void gated_forward(const void* gate, const void* up, int64_t width, int64_t row_stride, at::Tensor& out) {
  const c10::cuda::CUDAGuard device_guard(out.device());
  const int64_t n = out.numel();
  if (n == 0) return;
  dispatch_float_type(out.scalar_type(), "gated activation forward: gate", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    launch<scalar_t>(n, width, row_stride, {gate, up, out.data_ptr()}, [&](auto vector, unsigned blocks) {
      gated_forward_kernel<scalar_t, decltype(vector)::value, Activation>
          <<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          static_cast<const scalar_t*>(gate), static_cast<const scalar_t*>(up), n, width, row_stride,
          out.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// grad_output [rows, width] contiguous; gate / up and grad_gate / grad_up `row_stride` apart.
template <typename Activation>
void gated_backward(const at::Tensor& grad_output, const void* gate, const void* up, int64_t width,
                    int64_t row_stride, void* grad_gate, void* grad_up) {
  const c10::cuda::CUDAGuard device_guard(grad_output.device());
  const int64_t n = grad_output.numel();
  if (n == 0) return;
  dispatch_float_type(grad_output.scalar_type(), "gated activation backward: gate", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    launch<scalar_t>(n, width, row_stride, {grad_output.data_ptr(), gate, up, grad_gate, grad_up},
                     [&](auto vector, unsigned blocks) {
                       gated_backward_kernel<scalar_t, decltype(vector)::value, Activation>
                           <<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
                               grad_output.data_ptr<scalar_t>(), static_cast<const scalar_t*>(gate),
                               static_cast<const scalar_t*>(up), n, width, row_stride,
                               static_cast<scalar_t*>(grad_gate), static_cast<scalar_t*>(grad_up));
                       C10_CUDA_KERNEL_LAUNCH_CHECK();
                     });
  });
}

template <typename Activation>
at::Tensor pair_forward(const at::Tensor& gate, const at::Tensor& up) {
  check_pair(gate, up, "gated activation forward: gate and up");
  auto out = at::empty_like(gate);
  const int64_t width = std::max<int64_t>(gate.numel(), 1);
  gated_forward<Activation>(gate.data_ptr(), up.data_ptr(), width, width, out);
  return out;
}

template <typename Activation>
std::pair<at::Tensor, at::Tensor> pair_backward(const at::Tensor& grad_output, const at::Tensor& gate,
                                                const at::Tensor& up) {
  check_pair(gate, up, "gated activation backward: gate and up");
  check_pair(gate, grad_output, "gated activation backward: gate and grad_output");
  auto grad_gate = at::empty_like(gate);
  auto grad_up = at::empty_like(up);
  const int64_t width = std::max<int64_t>(gate.numel(), 1);
  gated_backward<Activation>(grad_output, gate.data_ptr(), up.data_ptr(), width, width, grad_gate.data_ptr(),
                             grad_up.data_ptr());
  return {grad_gate, grad_up};
}

// The fused projection's output [..., 2 * width]: gate the first half of each row, up the second.
int64_t half_width(const at::Tensor& gate_up, const std::string& what) {
  check_cuda_tensor(gate_up, what);
  if (gate_up.dim() == 0 || gate_up.size(-1) % 2 != 0) {
    throw Error(ErrorCode::kInternal, what + ": the last dimension must hold gate and up, two equal halves");
  }
  return gate_up.size(-1) / 2;
}

template <typename Activation>
at::Tensor fused_forward(const at::Tensor& gate_up) {
  const int64_t width = half_width(gate_up, "gated activation forward: gate_up");
  std::vector<int64_t> sizes = gate_up.sizes().vec();
  sizes.back() = width;
  auto out = at::empty(sizes, gate_up.options());
  const auto* base = static_cast<const char*>(gate_up.data_ptr());
  gated_forward<Activation>(base, base + width * gate_up.element_size(), width, 2 * width, out);
  return out;
}

template <typename Activation>
at::Tensor fused_backward(const at::Tensor& grad_output, const at::Tensor& gate_up) {
  const int64_t width = half_width(gate_up, "gated activation backward: gate_up");
  check_cuda_tensor(grad_output, "gated activation backward: grad_output");
  check_same_device(grad_output, gate_up, "gated activation backward: grad_output");
  check_scalar_type(grad_output, gate_up.scalar_type(), "gated activation backward: grad_output");
  if (grad_output.numel() * 2 != gate_up.numel()) {
    throw Error(ErrorCode::kInternal, "gated activation backward: grad_output must be half of gate_up");
  }
  auto grad_gate_up = at::empty_like(gate_up);
  const auto* base = static_cast<const char*>(gate_up.data_ptr());
  auto* grad_base = static_cast<char*>(grad_gate_up.data_ptr());
  const int64_t up_bytes = width * gate_up.element_size();
  gated_backward<Activation>(grad_output, base, base + up_bytes, width, 2 * width, grad_base, grad_base + up_bytes);
  return grad_gate_up;
}

}  // namespace

at::Tensor swiglu_forward_cuda(const at::Tensor& gate, const at::Tensor& up) { return pair_forward<Silu>(gate, up); }

std::pair<at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate,
                                                       const at::Tensor& up) {
  return pair_backward<Silu>(grad_output, gate, up);
}

at::Tensor geglu_forward_cuda(const at::Tensor& gate, const at::Tensor& up) { return pair_forward<GeluTanh>(gate, up); }

std::pair<at::Tensor, at::Tensor> geglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate,
                                                      const at::Tensor& up) {
  return pair_backward<GeluTanh>(grad_output, gate, up);
}

at::Tensor swiglu_fused_forward_cuda(const at::Tensor& gate_up) { return fused_forward<Silu>(gate_up); }

at::Tensor swiglu_fused_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate_up) {
  return fused_backward<Silu>(grad_output, gate_up);
}

at::Tensor geglu_fused_forward_cuda(const at::Tensor& gate_up) { return fused_forward<GeluTanh>(gate_up); }

at::Tensor geglu_fused_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate_up) {
  return fused_backward<GeluTanh>(grad_output, gate_up);
}

}  // namespace qtrain::kernels
