#pragma once
// A built (4-bit) expert bank that counts what it builds: whole weights, and blocks of rows
// (qat::LinearLayer::matmul_weight_rows, train.expert_bank_block_mb) with the most rows one held.
#include <algorithm>
#include <memory>

#include "qat/linear.h"

namespace qtrain::testing {

class BlockCountingBank : public qat::LinearLayer {
 public:
  explicit BlockCountingBank(std::shared_ptr<qat::LinearLayer> inner) : inner_(register_module("inner", std::move(inner))) {}
  torch::Tensor forward(const torch::Tensor& input) override { return inner_->forward(input); }
  int64_t in_features() const override { return inner_->in_features(); }
  int64_t out_features() const override { return inner_->out_features(); }
  torch::Tensor dense_weight(torch::ScalarType dtype) const override { return inner_->dense_weight(dtype); }
  torch::Tensor bias() const override { return inner_->bias(); }
  MatmulWeight matmul_weight_kind() const override { return inner_->matmul_weight_kind(); }
  torch::Tensor matmul_weight(torch::ScalarType dtype) const override {
    ++wholes;
    return inner_->matmul_weight(dtype);
  }
  bool builds_weight_rows() const override { return inner_->builds_weight_rows(); }
  torch::Tensor matmul_weight_rows(torch::ScalarType dtype, int64_t begin, int64_t end) const override {
    ++row_blocks;
    most_rows = std::max(most_rows, end - begin);
    return inner_->matmul_weight_rows(dtype, begin, end);
  }
  void reset_counts() const { wholes = row_blocks = 0, most_rows = 0; }
  mutable int wholes = 0, row_blocks = 0;
  mutable int64_t most_rows = 0;

 private:
  std::shared_ptr<qat::LinearLayer> inner_;
};

}  // namespace qtrain::testing
