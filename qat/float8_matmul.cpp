#include "qat/float8_matmul.h"

#include <ATen/ops/_scaled_mm.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <torch/csrc/autograd/function.h>

#include "kernels/cuda_build.h"
#include "kernels/error.h"
#include "kernels/float8_gemm.h"
#include "kernels/float8_rows.h"

namespace qtrain::qat {

namespace {

// The product of two row-quantized operands, left [m, k] and right_t the right operand's transpose
// [n, k] (both row-major), right_scales [1, n], in `dtype`, added onto `onto` in place if defined.
// On the tensor cores: with `onto`, cuBLASLt's FP8 matmul accumulates onto it (beta = 1; where
// this cuBLASLt cannot, torch's scaled matmul and an add); without, torch's scaled matmul.
// The reference: the codes multiplied in fp32, then both scales, then the sum with `onto`.
torch::Tensor scaled_matmul(const Float8Rows& left, const torch::Tensor& right_t, const torch::Tensor& right_scales,
                            torch::ScalarType dtype, bool fast_accumulation, bool tensor_cores, torch::Tensor onto) {
  if (tensor_cores) {
    if (onto.defined() &&
        kernels::float8_gemm_cuda(left.codes, left.scales, right_t, right_scales, onto, /*accumulate=*/true,
                                  fast_accumulation)) {
      return onto;
    }
    // right_t.t(): [k, n] column-major, as the tensor cores read a right operand.
    auto product = at::_scaled_mm(left.codes, right_t.t(), left.scales, right_scales, /*bias=*/std::nullopt,
                                  /*scale_result=*/std::nullopt, dtype, fast_accumulation);
    return onto.defined() ? onto.add_(product) : product;
  }
  const auto product =
      torch::mm(left.codes.to(torch::kFloat32), right_t.to(torch::kFloat32).t()) * left.scales * right_scales;
  return onto.defined() ? onto.copy_(product + onto.to(torch::kFloat32)) : product.to(dtype);
}

void check_onto(const torch::Tensor& onto, int64_t rows, int64_t columns, torch::ScalarType dtype, const char* what) {
  if (onto.defined() && (onto.dim() != 2 || onto.size(0) != rows || onto.size(1) != columns ||
                         onto.scalar_type() != dtype || !onto.is_contiguous())) {
    throw Error(ErrorCode::kInternal, std::string(what) + ": the tensor to accumulate onto must be a contiguous [" +
                                          std::to_string(rows) + ", " + std::to_string(columns) + "] " +
                                          c10::toString(dtype) + " tensor");
  }
}

// [1, columns] of ones on `device`: the input gradient's right-hand scales (W's own scales go into
// the gradient before it is quantized). One tensor per device, grown as needed, shared by calls.
torch::Tensor ones_row(int64_t columns, const torch::Device& device) {
  static std::mutex mutex;
  static auto* kept = new std::map<std::pair<int, int>, torch::Tensor>();  // never destroyed: no CUDA frees at exit
  const std::lock_guard<std::mutex> lock(mutex);
  auto& ones = (*kept)[{static_cast<int>(device.type()), device.index()}];
  if (!ones.defined() || ones.size(1) < columns) {
    ones = torch::ones({1, columns}, torch::TensorOptions().dtype(torch::kFloat32).device(device));
  }
  return ones.narrow(1, 0, columns);
}

class Float8MatmulBackward : public torch::autograd::Node {
 public:
  explicit Float8MatmulBackward(Float8Rows weight, std::vector<int64_t> input_shape)
      : weight_(std::move(weight)), input_shape_(std::move(input_shape)) {}
  std::string name() const override { return "qtrain::Float8MatmulBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const auto grad_rows = grads[0].reshape({-1, weight_.codes.size(0)});
    return {float8_input_gradient(grad_rows, weight_, torch::Tensor()).view(input_shape_)};
  }

 private:
  Float8Rows weight_;  // the layer's buffers, shared
  std::vector<int64_t> input_shape_;
};

// q, k and v (and gate and up) multiply the same input: its quantization is kept from one call to
// the next while the input is the same tensor, unchanged (same storage, layout and version: the
// version counter moves with every in-place write through torch), so it runs once for the three.
// One entry for the process (a mutex keeps the autograd engine's recomputation and the main
// thread apart): the last input, detached (no graph kept alive), and its codes, until a product
// with another input replaces them or an input gradient drops them (backward starts: the
// forward's last input need not outlive it).
struct LastQuantizedRows {
  std::mutex mutex;
  torch::Tensor rows;
  int64_t version = 0;  // rows' version when quantized (the tensor itself moves on with its writes)
  Float8Rows quantized;
};

LastQuantizedRows& last_quantized_rows() {
  static auto* last = new LastQuantizedRows();  // never destroyed: no CUDA frees during exit
  return *last;
}

void drop_quantized_rows() {
  auto& last = last_quantized_rows();
  const std::lock_guard<std::mutex> lock(last.mutex);
  last.rows = torch::Tensor();
  last.quantized = Float8Rows();
}

Float8Rows quantized_rows(const torch::Tensor& rows) {
  if (rows.is_inference()) return quantize_rows_float8(rows);  // no version counter to check
  auto& last = last_quantized_rows();
  const std::lock_guard<std::mutex> lock(last.mutex);
  const auto& cached = last.rows;
  if (cached.defined() && cached.data_ptr() == rows.data_ptr() && cached.sizes().equals(rows.sizes()) &&
      cached.strides().equals(rows.strides()) && cached.scalar_type() == rows.scalar_type() &&
      cached.device() == rows.device() && last.version == rows._version()) {
    return last.quantized;
  }
  last.quantized = quantize_rows_float8(rows);
  last.rows = rows.detach();  // shares the storage and the version counter, not the graph
  last.version = rows._version();
  return last.quantized;
}

// codes [out, in] -> [in, out], contiguous: the word-moving kernel where its words are aligned and
// its grid fits, torch's copy otherwise.
torch::Tensor transposed(const torch::Tensor& codes) {
  const bool words = codes.size(0) % 4 == 0 && codes.size(1) % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(codes.data_ptr()) % 4 == 0 && codes.size(0) / 64 < 65535;
  return words ? kernels::transpose_float8_cuda(codes) : codes.t().contiguous();
}

}  // namespace

void require_float8_tensor_cores(const torch::Device& device, torch::ScalarType dtype, const std::string& what,
                                 const std::string& dtype_key) {
  if (!device.is_cuda()) return;
  const int index = device.has_index() ? device.index() : -1;  // "cuda": the current device
  if (!kernels::kCudaKernelsBuilt || !kernels::float8_tensor_cores(index)) {
    throw Error(ErrorCode::kRecipe, what + " multiplies on FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
                "Blackwell), which " + device.str() + " lacks" +
                (kernels::kCudaKernelsBuilt ? "" : " (or this build has no CUDA kernels)") + "; use nf4");
  }
  if (dtype != torch::kBFloat16) {
    throw Error(ErrorCode::kRecipe, what + " computes in bf16 (the FP8 tensor cores write bf16), but " + dtype_key + " is " +
                std::string(c10::toString(dtype)) + ": set it to bf16");
  }
}

bool float8_tensor_cores(const torch::Tensor& rows, int64_t out_features) {
  return kernels::kCudaKernelsBuilt && rows.is_cuda() && rows.scalar_type() == torch::kBFloat16 &&
         rows.size(1) % 16 == 0 && out_features % 16 == 0 && kernels::float8_tensor_cores(rows.get_device());
}

torch::Tensor float8_product(const torch::Tensor& rows, const Float8Rows& weight, bool fast_accumulation,
                             torch::Tensor onto) {
  torch::NoGradGuard no_grad;
  check_onto(onto, rows.size(0), weight.codes.size(0), rows.scalar_type(), "float8_product");
  const auto quantized = quantized_rows(rows);
  return scaled_matmul(quantized, weight.codes, weight.scales.view({1, -1}), rows.scalar_type(), fast_accumulation,
                       float8_tensor_cores(rows, weight.codes.size(0)), std::move(onto));
}

torch::Tensor float8_input_gradient(const torch::Tensor& grad_rows, const Float8Rows& weight, torch::Tensor onto) {
  torch::NoGradGuard no_grad;
  check_onto(onto, grad_rows.size(0), weight.codes.size(1), grad_rows.scalar_type(), "float8_input_gradient");
  drop_quantized_rows();
  const auto quantized = quantize_rows_float8(grad_rows, weight.scales.view({-1}));
  const auto ones = ones_row(weight.codes.size(1), weight.scales.device());
  const bool tensor_cores = float8_tensor_cores(grad_rows, weight.codes.size(1));
  // W_q^T [in, out] row-major: the right operand's transpose as the tensor cores read it.
  return scaled_matmul(quantized, tensor_cores ? transposed(weight.codes) : weight.codes.t(), ones,
                       grad_rows.scalar_type(), /*fast_accumulation=*/false, tensor_cores, std::move(onto));
}

torch::Tensor float8_matmul(const torch::Tensor& input, const Float8Rows& weight, bool fast_accumulation) {
  if (input.size(-1) != weight.codes.size(1)) {
    throw Error(ErrorCode::kInternal, "float8_matmul: the input has " + std::to_string(input.size(-1)) +
                " features, the FP8 weight takes " + std::to_string(weight.codes.size(1)));
  }
  const auto rows = input.reshape({-1, weight.codes.size(1)});
  auto shape = input.sizes().vec();
  shape.back() = weight.codes.size(0);
  auto output = at::_unsafe_view(float8_product(rows, weight, fast_accumulation), shape);  // not a view: the node becomes its grad_fn
  if (torch::GradMode::is_enabled() && input.requires_grad()) {
    auto node = std::shared_ptr<Float8MatmulBackward>(new Float8MatmulBackward(weight, input.sizes().vec()),
                                                      torch::autograd::deleteNode);
    node->set_next_edges({torch::autograd::impl::gradient_edge(input)});
    torch::autograd::create_gradient_edge(output, node);
  }
  return output;
}

}  // namespace qtrain::qat
