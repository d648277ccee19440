// The gated MLP activations, act(gate) * up, and their backward as one kernel each
// (kernels/llama_layers.h): SwiGLU (silu) and GeGLU (tanh-approximated GELU, Gemma's), rounding as
// torch's silu / gelu, mul and silu_backward / gelu_backward do in the model dtype.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "kernels/cuda_entry.cuh"
#include "kernels/llama_layers.h"

namespace qtrain::kernels {

namespace {

constexpr int kThreads = 256;

// kVector values per thread, loaded and stored 16 bytes at a time (the tensors are fresh or
// contiguous allocations, 16-byte aligned; launch() checks), or one when n does not divide.
template <typename scalar_t, int kVector>
struct alignas(sizeof(scalar_t) * kVector) Vector {
  scalar_t values[kVector];
};

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

template <typename scalar_t, int kVector, typename Activation>
__global__ void gated_forward_kernel(const scalar_t* __restrict__ gate, const scalar_t* __restrict__ up, int64_t n,
                                      scalar_t* __restrict__ out) {
  using Values = Vector<scalar_t, kVector>;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVector;
  if (first >= n) return;
  const Values g = *reinterpret_cast<const Values*>(gate + first);
  const Values u = *reinterpret_cast<const Values*>(up + first);
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
                                       const scalar_t* __restrict__ up, int64_t n, scalar_t* __restrict__ grad_gate,
                                       scalar_t* __restrict__ grad_up) {
  using Values = Vector<scalar_t, kVector>;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVector;
  if (first >= n) return;
  const Values dy = *reinterpret_cast<const Values*>(grad_output + first);
  const Values g = *reinterpret_cast<const Values*>(gate + first);
  const Values u = *reinterpret_cast<const Values*>(up + first);
  Values dg, du;
#pragma unroll
  for (int k = 0; k < kVector; ++k) {
    const float dy_k = static_cast<float>(dy.values[k]);
    const float g_k = static_cast<float>(g.values[k]);
    du.values[k] = static_cast<scalar_t>(dy_k * activation_rounded<scalar_t, Activation>(g_k));
    const float grad_activated = static_cast<float>(static_cast<scalar_t>(dy_k * static_cast<float>(u.values[k])));
    dg.values[k] = static_cast<scalar_t>(grad_activated * Activation::derivative(g_k));
  }
  *reinterpret_cast<Values*>(grad_gate + first) = dg;
  *reinterpret_cast<Values*>(grad_up + first) = du;
}

// Runs `kernel<scalar_t, 16 / sizeof(scalar_t)>` over n values when every pointer allows 16-byte
// accesses and n divides, else the one-value kernel.
template <typename scalar_t, typename Launch>
void launch(int64_t n, std::initializer_list<const void*> pointers, const Launch& run) {
  constexpr int kWide = 16 / sizeof(scalar_t);
  bool aligned = n % kWide == 0;
  for (const void* pointer : pointers) aligned = aligned && reinterpret_cast<uintptr_t>(pointer) % 16 == 0;
  if (aligned) {
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

template <typename Activation>
at::Tensor gated_forward(const at::Tensor& gate, const at::Tensor& up) {
  check_pair(gate, up, "gated activation forward: gate and up");
  const c10::cuda::CUDAGuard device_guard(gate.device());
  auto out = at::empty_like(gate);
  const int64_t n = gate.numel();
  if (n == 0) return out;
  dispatch_float_type(gate.scalar_type(), "gated activation forward: gate", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    launch<scalar_t>(n, {gate.data_ptr(), up.data_ptr(), out.data_ptr()}, [&](auto vector, unsigned blocks) {
      gated_forward_kernel<scalar_t, decltype(vector)::value, Activation>
          <<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), n, out.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

template <typename Activation>
std::pair<at::Tensor, at::Tensor> gated_backward(const at::Tensor& grad_output, const at::Tensor& gate,
                                                 const at::Tensor& up) {
  check_pair(gate, up, "gated activation backward: gate and up");
  check_pair(gate, grad_output, "gated activation backward: gate and grad_output");
  const c10::cuda::CUDAGuard device_guard(gate.device());
  auto grad_gate = at::empty_like(gate);
  auto grad_up = at::empty_like(up);
  const int64_t n = gate.numel();
  if (n == 0) return {grad_gate, grad_up};
  dispatch_float_type(gate.scalar_type(), "gated activation backward: gate", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    launch<scalar_t>(n, {grad_output.data_ptr(), gate.data_ptr(), up.data_ptr(), grad_gate.data_ptr(), grad_up.data_ptr()},
                     [&](auto vector, unsigned blocks) {
                       gated_backward_kernel<scalar_t, decltype(vector)::value, Activation>
                           <<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
                               grad_output.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), n,
                               grad_gate.data_ptr<scalar_t>(), grad_up.data_ptr<scalar_t>());
                       C10_CUDA_KERNEL_LAUNCH_CHECK();
                     });
  });
  return {grad_gate, grad_up};
}

}  // namespace

at::Tensor swiglu_forward_cuda(const at::Tensor& gate, const at::Tensor& up) { return gated_forward<Silu>(gate, up); }

std::pair<at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate,
                                                       const at::Tensor& up) {
  return gated_backward<Silu>(grad_output, gate, up);
}

at::Tensor geglu_forward_cuda(const at::Tensor& gate, const at::Tensor& up) { return gated_forward<GeluTanh>(gate, up); }

std::pair<at::Tensor, at::Tensor> geglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate,
                                                      const at::Tensor& up) {
  return gated_backward<GeluTanh>(grad_output, gate, up);
}

}  // namespace qtrain::kernels
