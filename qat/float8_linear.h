#pragma once
// A frozen linear layer in FP8 (e4m3) with one fp32 scale per output row, multiplied on FP8 tensor
// cores (qat/float8_matmul.h): the base of `qlora.quant_type: fp8`, for speed on Ada and Hopper
// GPUs at one byte per weight (NF4 takes about half a byte, bf16 two); and the device's copy of a
// 16-bit base under `qlora.fp8_compute`, whose 16-bit weight waits on the host.
//
//     W ~= diag(weight_scale) weight,   y = x W^T + b  (x and the output gradient quantized per token)
//
// Buffers (no parameters), named as compressed-tensors' per-channel FP8 checkpoints name them:
//   weight        float8_e4m3fn [out, in]
//   weight_scale  fp32 [out, 1]
//   bias          compute dtype [out]  (when present)
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qat/float8_codec.h"
#include "qat/linear.h"

namespace qtrain::qat {

struct Float8Options {
  torch::ScalarType compute_dtype = torch::kBFloat16;  // of the bias
  // Where each weight is quantized and kept (unset: where it is).
  std::optional<torch::Device> device;
  bool fast_accumulation = false;  // the forward's matmuls unpromoted (qat/float8_matmul.h)
  // The 16-bit weight waits on the host for dense_weight (merges, exports): a 16-bit base that
  // multiplies on FP8 tensor cores (qlora.fp8_compute with quant: none) stays that base.
  bool keep_dense_weight_on_host = false;
};

class Float8Linear : public LinearLayer {
 public:
  // `weight`: codes [out, in] and scales [out, 1]; `bias` [out] or undefined.
  Float8Linear(Float8Rows weight, const torch::Tensor& bias, torch::ScalarType compute_dtype,
               bool fast_accumulation = false);
  // Quantizes a dense [out, in] weight (on its device), one scale per row.
  static std::shared_ptr<Float8Linear> from_dense(const torch::Tensor& weight, const torch::Tensor& bias,
                                                  const Float8Options& options);

  torch::Tensor forward(const torch::Tensor& input) override;
  int64_t in_features() const override { return weight_.codes.size(1); }
  int64_t out_features() const override { return weight_.codes.size(0); }
  // What a merge, an export or DoRA's norms read, on the codes' device: the 16-bit weight kept on
  // the host where there is one, else codes * scale in fp32, then `dtype`.
  torch::Tensor dense_weight(torch::ScalarType dtype) const override;
  torch::Tensor bias() const override { return bias_; }
  // Callers that need W itself (the fused loss, QAT's merge) get it dequantized; LoRA multiplies
  // through own_product.
  MatmulWeight matmul_weight_kind() const override { return MatmulWeight::kBuilt; }
  torch::Tensor matmul_weight(torch::ScalarType dtype) const override { return dequantize_rows_float8(weight_, dtype); }
  bool multiplies_itself() const override { return true; }
  torch::Tensor own_product(const torch::Tensor& rows, torch::Tensor onto) const override;
  torch::Tensor own_input_gradient(const torch::Tensor& grad_rows, torch::Tensor onto) const override;
  void pretty_print(std::ostream& stream) const override;

  const Float8Rows& weight() const { return weight_; }
  bool fast_accumulation() const { return fast_accumulation_; }

  // Module::to converts every buffer; only the bias may change dtype here.
  using torch::nn::Module::to;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;

 private:
  Float8Rows weight_;
  torch::Tensor bias_;
  bool fast_accumulation_;
  torch::Tensor dense_on_host_;  // Float8Options::keep_dense_weight_on_host; not a buffer: Module::to leaves it
};

// Replaces every DenseLinear under `root` whose name does not match `skip_modules` (as
// module_name_matches) by a Float8Linear quantized from its weight. Returns the replaced names.
std::vector<std::string> quantize_linear_layers_float8(torch::nn::Module& root, const Float8Options& options,
                                                       const std::vector<std::string>& skip_modules);

}  // namespace qtrain::qat
