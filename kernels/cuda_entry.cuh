#pragma once
// What the CUDA entry points share on the host side: argument checks whose errors name the entry
// point and the argument, and the dispatch over the floating-point dtypes the kernels read and write.
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <initializer_list>
#include <utility>
#include <string>

#include "kernels/error.h"

namespace qtrain::kernels {

// Launch shapes the kernel files share (one name each: with the unity build, CMakeLists.txt,
// several kernel files compile as one translation unit).
constexpr int kWarpSize = 32;
constexpr int kThreads = 256;  // a CUDA block of the one-element (pair, row) per thread kernels
constexpr int kWarpsPerCudaBlock = kThreads / kWarpSize;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool is_power_of_two(int64_t value) { return value > 0 && (value & (value - 1)) == 0; }

// kValues consecutive values of one dtype, loaded and stored as one access. The elementwise and
// per-row kernels read packs of kPackBytes (kWideValues: 8 bf16 / fp16, 4 fp32 values) where
// packs_fit, else packs of one value.
constexpr int kPackBytes = 16;
template <typename scalar_t>
constexpr int kWideValues = kPackBytes / sizeof(scalar_t);

template <typename scalar_t, int kValues>
struct alignas(sizeof(scalar_t) * kValues) ValuePack {
  scalar_t values[kValues];
};

// Whether wide packs fit: each of `counts` (lengths, widths, strides, in values) a whole number of
// packs, and each of `pointers` on kPackBytes.
template <typename scalar_t>
bool packs_fit(std::initializer_list<int64_t> counts, std::initializer_list<const void*> pointers) {
  for (const int64_t count : counts) {
    if (count % kWideValues<scalar_t> != 0) return false;
  }
  for (const void* pointer : pointers) {
    if (reinterpret_cast<uintptr_t>(pointer) % kPackBytes != 0) return false;
  }
  return true;
}

// `what` names the argument, e.g. "quantize_4bit_cuda: input".
inline void check_cuda_tensor(const at::Tensor& tensor, const std::string& what) {
  if (!tensor.defined()) throw Error(ErrorCode::kInternal, what + " is missing (an undefined tensor)");
  if (!tensor.is_cuda()) {
    throw Error(ErrorCode::kInternal, what + " is on " + tensor.device().str() + ", the CUDA kernel needs it on a CUDA device (move it with .to(torch::kCUDA))");
  }
  if (!tensor.is_contiguous()) throw Error(ErrorCode::kInternal, what + " must be contiguous (call .contiguous() first)");
}

inline void check_same_device(const at::Tensor& tensor, const at::Tensor& reference, const std::string& what) {
  if (tensor.device() != reference.device()) {
    throw Error(ErrorCode::kInternal, what + " is on " + tensor.device().str() + ", expected " + reference.device().str() +
                " like the tensor it belongs to");
  }
}

// Every operand a CUDA tensor, contiguous, on `reference`'s device; `what` + the operand's name
// in messages ("adamw8bit_step_cuda: " + "grad").
inline void check_cuda_operands(const at::Tensor& reference,
                                std::initializer_list<std::pair<const at::Tensor*, const char*>> operands,
                                const std::string& what) {
  for (const auto& [tensor, name] : operands) {
    check_cuda_tensor(*tensor, what + name);
    check_same_device(*tensor, reference, what + name);
  }
}

inline void check_scalar_type(const at::Tensor& tensor, c10::ScalarType expected, const std::string& what) {
  if (tensor.scalar_type() != expected) {
    throw Error(ErrorCode::kInternal, what + " must be " + std::string(c10::toString(expected)) + ", got " +
                std::string(c10::toString(tensor.scalar_type())));
  }
}

// Calls function(T{}) with T = float, c10::Half or c10::BFloat16 for `type`; anything else is an
// Error naming `what`.
template <typename Function>
void dispatch_float_type(c10::ScalarType type, const std::string& what, const Function& function) {
  switch (type) {
    case c10::ScalarType::Float:
      function(float{});
      return;
    case c10::ScalarType::Half:
      function(c10::Half{});
      return;
    case c10::ScalarType::BFloat16:
      function(c10::BFloat16{});
      return;
    default:
      throw Error(ErrorCode::kInternal, what + " must be fp32, fp16 or bf16, got " + std::string(c10::toString(type)));
  }
}

}  // namespace qtrain::kernels
