#pragma once
// A built (4-bit) expert bank that counts what it builds: whole weights, blocks of rows and blocks
// of columns (qat::LinearLayer::matmul_weight_rows / _columns, train.expert_bank_block_mb).
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
  int64_t weight_block_columns() const override { return inner_->weight_block_columns(); }
  torch::Tensor matmul_weight_rows(torch::ScalarType dtype, const torch::Tensor& rows) const override {
    ++row_blocks;
    return inner_->matmul_weight_rows(dtype, rows);
  }
  torch::Tensor matmul_weight_columns(torch::ScalarType dtype, int64_t begin, int64_t end) const override {
    ++column_blocks;
    return inner_->matmul_weight_columns(dtype, begin, end);
  }
  mutable int wholes = 0, row_blocks = 0, column_blocks = 0;

 private:
  std::shared_ptr<qat::LinearLayer> inner_;
};

}  // namespace qtrain::testing
