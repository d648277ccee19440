#pragma once
// A frozen weight kept in MXFP4 (the OCP microscaling format gpt-oss publishes its experts in):
// every 32 consecutive weights of a row share one power-of-two scale, each weight a 4-bit e2m1
// code. The bytes are transformers' (integrations/mxfp4.py): `blocks` [out, in / 32, 16] uint8,
// weight 2j of a block in byte j's low nibble and 2j + 1 in its high one, and `scales`
// [out, in / 32] uint8, the block's exponent + 127. dense_weight gives code value × 2^(scale − 127)
// exactly as transformers' dequantization does (every such value is exact in bf16 and fp32).
#include <torch/torch.h>

#include "qat/linear.h"

namespace qtrain::qat {

class Mxfp4Linear : public LinearLayer {
 public:
  // bias [out] or undefined, kept in `dtype`.
  Mxfp4Linear(const torch::Tensor& blocks, const torch::Tensor& scales, const torch::Tensor& bias, torch::ScalarType dtype);
  torch::Tensor forward(const torch::Tensor& input) override;
  int64_t in_features() const override { return blocks_.size(1) * 32; }
  int64_t out_features() const override { return blocks_.size(0); }
  torch::Tensor dense_weight(torch::ScalarType dtype) const override;
  torch::Tensor bias() const override { return bias_; }
  MatmulWeight matmul_weight_kind() const override { return MatmulWeight::kBuilt; }
  torch::Tensor matmul_weight(torch::ScalarType dtype) const override { return dense_weight(dtype); }
  // Every row's blocks and scales are its own: any rows build alone (an expert bank a few experts
  // at a time, train.expert_bank_block_mb).
  bool builds_weight_rows() const override { return true; }
  torch::Tensor matmul_weight_rows(torch::ScalarType dtype, int64_t begin, int64_t end) const override;
  void pretty_print(std::ostream& stream) const override;

  const torch::Tensor& blocks() const { return blocks_; }
  const torch::Tensor& scales() const { return scales_; }

 private:
  torch::Tensor blocks_, scales_, bias_;  // buffers `blocks`, `scales`, `bias`
};

}  // namespace qtrain::qat
