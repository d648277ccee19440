// FourBitLinear against its definition y = x dequantize(W)^T + b, the dequantized weight coming
// from the codec (checked bit for bit against bitsandbytes elsewhere), and the module swap.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "kernels/error.h"
#include "qat/four_bit_linear.h"

namespace qtrain::qat {
namespace {

FourBitOptions options(const std::string& type = "nf4", int64_t blocksize = 64, bool double_quant = true) {
  FourBitOptions result;
  result.quant_type = type;
  result.blocksize = blocksize;
  result.double_quant = double_quant;
  result.compute_dtype = torch::kFloat32;
  return result;
}

TEST(FourBitLinear, ForwardIsInputTimesDequantizedWeightPlusBias) {
  torch::manual_seed(1);
  const auto weight = torch::randn({48, 96});
  const auto bias = torch::randn({48});
  for (const std::string type : {"nf4", "fp4"}) {
    auto layer = FourBitLinear::from_dense(weight, bias, options(type, 128, type == "nf4"));
    const auto input = torch::randn({2, 5, 96}, torch::kFloat64);
    const auto expected = torch::matmul(input, layer->dense_weight(torch::kFloat64).t()) + bias.to(torch::kFloat64);
    const auto output = layer->forward(input);
    EXPECT_EQ(output.scalar_type(), torch::kFloat64);
    EXPECT_TRUE(torch::allclose(output, expected, 1e-12, 1e-12));
    // bf16 input: computed in bf16.
    EXPECT_EQ(layer->forward(input.to(torch::kBFloat16)).scalar_type(), torch::kBFloat16);
    // The dequantized weight is within the 4-bit grid's resolution of the original.
    EXPECT_LT((layer->dense_weight(torch::kFloat32) - weight).abs().max().item<float>(),
              0.25f * weight.abs().max().item<float>());
  }
}

TEST(FourBitLinear, HoldsOnlyFrozenBuffersAndNoDenseCopy) {
  auto layer = FourBitLinear::from_dense(torch::randn({64, 128}), torch::randn({64}), options());
  EXPECT_TRUE(layer->parameters().empty());
  std::vector<std::string> names;
  int64_t bytes = 0;
  for (const auto& buffer : layer->named_buffers()) {
    names.push_back(buffer.key());
    bytes += buffer.value().numel() * buffer.value().element_size();
  }
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "absmax", "quant_map", "nested_absmax", "nested_quant_map", "bias"}));
  EXPECT_EQ(layer->packed_weight().scalar_type(), torch::kUInt8);
  EXPECT_EQ(layer->packed_weight().sizes(), (std::vector<int64_t>{64 * 128 / 2, 1}));
  EXPECT_LT(bytes, 64 * 128);  // well under one byte per weight: no dense copy kept
}

TEST(FourBitLinear, GradientsReachTheInputNotTheBase) {
  auto layer = FourBitLinear::from_dense(torch::randn({32, 64}), torch::Tensor(), options("fp4", 64, false));
  const auto input = torch::randn({3, 64}, torch::requires_grad());
  layer->forward(input).sum().backward();
  ASSERT_TRUE(input.grad().defined());
  const auto expected = layer->dense_weight(torch::kFloat32).sum(0).expand({3, 64});
  EXPECT_TRUE(torch::allclose(input.grad(), expected, 1e-5, 1e-5));
  EXPECT_FALSE(layer->packed_weight().requires_grad());
}

// The backward dequantizes again instead of keeping the dense weight from the forward, and its
// input gradient equals the dense layer's bit for bit.
TEST(FourBitLinear, BackwardDequantizesAgainAndMatchesTheDenseGradient) {
  torch::manual_seed(4);
  auto layer = FourBitLinear::from_dense(torch::randn({40, 72}), torch::Tensor(), options());
  const auto upstream = torch::randn({2, 6, 40});
  const auto input = torch::randn({2, 6, 72}, torch::requires_grad());
  const auto output = layer->forward(input);
  EXPECT_EQ(output.grad_fn()->name(), "qtrain::FourBitMatmulBackward");
  output.backward(upstream);
  const auto reference_input = input.detach().clone().requires_grad_(true);
  torch::nn::functional::linear(reference_input, layer->dense_weight(torch::kFloat32)).backward(upstream);
  EXPECT_TRUE(torch::equal(input.grad(), reference_input.grad()));
  EXPECT_TRUE(torch::equal(output, torch::nn::functional::linear(input.detach(), layer->dense_weight(torch::kFloat32))));
}

// The rows a bank built a few experts at a time builds (LinearLayer::matmul_weight_rows) are the
// whole weight's, bit for bit, for each format, with and without double quantization, where the
// rows start and end inside a nested block of absmax codes (256 quantization blocks); rows outside
// the weight are refused.
void expect_rows_of_the_whole_weight(torch::Device device, torch::ScalarType dtype) {
  torch::manual_seed(12);
  for (const std::string type : {"nf4", "fp4"}) {
    for (const bool double_quant : {true, false}) {
      FourBitOptions options;
      options.quant_type = type;
      options.double_quant = double_quant;
      const auto weight = torch::randn({80, 512}, torch::TensorOptions().device(device)) * 0.05;  // 8 blocks a row
      const auto layer = FourBitLinear::from_dense(weight, torch::Tensor(), options);
      const std::string what = type + (double_quant ? ", double-quantized" : "");
      ASSERT_TRUE(layer->builds_weight_rows()) << what;
      const auto whole = layer->matmul_weight(dtype);
      for (const auto& [begin, end] : std::vector<std::pair<int64_t, int64_t>>{{0, 80}, {33, 70}, {79, 80}, {0, 1}, {32, 64}}) {
        EXPECT_TRUE(torch::equal(layer->matmul_weight_rows(dtype, begin, end), whole.narrow(0, begin, end - begin)))
            << what << ", rows " << begin << " to " << end;
      }
      EXPECT_THROW(layer->matmul_weight_rows(dtype, 5, 5), Error) << what;
      EXPECT_THROW(layer->matmul_weight_rows(dtype, 70, 81), Error) << what;
    }
  }
  // A row that does not hold whole blocks builds only whole weights.
  FourBitOptions options;
  options.blocksize = 128;
  const auto odd = FourBitLinear::from_dense(torch::randn({8, 192}, torch::TensorOptions().device(device)), torch::Tensor(), options);
  EXPECT_FALSE(odd->builds_weight_rows());
  EXPECT_THROW(odd->matmul_weight_rows(dtype, 0, 4), Error);
}

TEST(FourBitLinear, BuildsRowsAsTheWholeWeight) { expect_rows_of_the_whole_weight(torch::kCPU, torch::kFloat32); }

TEST(FourBitLinear, CudaBuildsRowsAsTheWholeWeight) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  expect_rows_of_the_whole_weight(torch::kCUDA, torch::kBFloat16);
}

TEST(FourBitLinear, ModuleToDtypeConvertsOnlyTheBias) {
  auto layer = FourBitLinear::from_dense(torch::randn({16, 64}), torch::randn({16}), options());
  const auto before = layer->dense_weight(torch::kFloat32);
  layer->to(torch::kBFloat16);
  EXPECT_EQ(layer->packed_weight().scalar_type(), torch::kUInt8);
  EXPECT_EQ(layer->quant_state().absmax.scalar_type(), torch::kUInt8);
  EXPECT_EQ(layer->quant_state().nested_absmax.scalar_type(), torch::kFloat32);
  EXPECT_EQ(layer->bias().scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(layer->dense_weight(torch::kFloat32), before));
}

TEST(FourBitLinear, RejectsUnsupportedOptions) {
  EXPECT_THROW(FourBitLinear::from_dense(torch::randn({4, 64}), {}, options("int4")), Error);
  EXPECT_THROW(FourBitLinear::from_dense(torch::randn({4, 64}), {}, options("nf4", 96)), Error);
}

// A parent that keeps typed pointers, as the Llama blocks do.
class FourBitBlock : public torch::nn::Module, public LinearLayerOwner {
 public:
  FourBitBlock() {
    DenseLinearOptions dense;
    dense.in_features = 64;
    dense.out_features = 64;
    q_proj = register_module("q_proj", std::make_shared<DenseLinear>(dense));
    lm_head = register_module("lm_head", std::make_shared<DenseLinear>(dense));
  }
  void replace_linear(const std::string& child_name, std::shared_ptr<LinearLayer> layer) override {
    replace_module(child_name, layer);
    (child_name == "q_proj" ? q_proj : lm_head) = layer;
  }
  std::shared_ptr<LinearLayer> q_proj, lm_head;
};

TEST(QuantizeLinearLayers, ReplacesDenseLayersExceptSkippedOnesThroughTheirOwner) {
  auto root = std::make_shared<torch::nn::Module>();
  auto block = root->register_module("block", std::make_shared<FourBitBlock>());
  DenseLinearOptions dense;
  dense.in_features = 128;
  dense.out_features = 32;
  dense.bias = true;
  root->register_module("out", std::make_shared<DenseLinear>(dense));
  const auto replaced = quantize_linear_layers(*root, options(), {"lm_head"});
  EXPECT_EQ(replaced, (std::vector<std::string>{"block.q_proj", "out"}));
  EXPECT_TRUE(std::dynamic_pointer_cast<FourBitLinear>(block->q_proj));
  EXPECT_TRUE(std::dynamic_pointer_cast<DenseLinear>(block->lm_head));
  EXPECT_TRUE(std::dynamic_pointer_cast<FourBitLinear>(root->named_children()["out"]));
  EXPECT_TRUE(root->named_parameters().contains("block.lm_head.weight"));
  EXPECT_FALSE(root->named_parameters().contains("out.bias"));
  EXPECT_TRUE(module_name_matches("model.layers.0.mlp.down_proj", {"mlp.down_proj"}));
  EXPECT_FALSE(module_name_matches("model.layers.0.mlp.xdown_proj", {"down_proj"}));
}

}  // namespace
}  // namespace qtrain::qat
