// The Llama model against transformers' fp32 CPU forward of the fixture model.
#include <gtest/gtest.h>

#include "support.h"
#include "tensor_support.h"
#include "trainer/model/causal_lm_loss.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {
namespace {

using testing::fixture;

struct Reference {
  torch::Tensor input_ids, logits, loss;
};

Reference base_reference() {
  auto file = SafetensorsFile::open(fixture("tiny-llama-reference.safetensors"));
  return {file.tensor("base.input_ids"), file.tensor("base.logits"), file.tensor("base.loss")};
}

using testing::max_relative_error;

// The recipe's default target_modules (written out, for the LibTorch-free parser) are the
// projections a default decoder layer's attention and feed-forward block register.
TEST(LlamaModel, DefaultProjectionNamesAreTheBlocks) {
  EXPECT_EQ(LlamaOptions{}.projection_names(), decoder_projection_names());
}

TEST(LlamaModel, LogitsEqualTransformersInFp32) {
  auto loaded = load_llama(fixture("tiny-llama"));
  const auto reference = base_reference();
  torch::NoGradGuard no_grad;
  auto logits = loaded.model->forward({reference.input_ids, {}, {}});
  ASSERT_EQ(logits.sizes(), reference.logits.sizes());
  EXPECT_LE(max_relative_error(logits, reference.logits), 1e-5);
  EXPECT_TRUE(torch::allclose(logits, reference.logits, /*rtol=*/1e-4, /*atol=*/1e-4));
}

TEST(LlamaModel, LossEqualsTransformersInFp32) {
  auto loaded = load_llama(fixture("tiny-llama"));
  const auto reference = base_reference();
  torch::NoGradGuard no_grad;
  auto hidden = loaded.model->hidden_states({reference.input_ids, {}, {}});
  // Chunked and unchunked projections must agree with each other and with transformers.
  for (int64_t chunk_tokens : {0, 7}) {
    auto loss = causal_lm_loss(*loaded.model, hidden, reference.input_ids, chunk_tokens);
    EXPECT_EQ(loss.tokens.item<int64_t>(), 2 * 47);
    const double mean = loss.loss_sum.item<double>() / 94.0;
    EXPECT_NEAR(mean, reference.loss.item<double>(), 1e-6 * reference.loss.item<double>()) << chunk_tokens;
  }
}

TEST(LlamaModel, Bf16ComputeStaysNearFp32) {
  ModelLoadOptions options;
  options.dtype = torch::kBFloat16;
  auto loaded = load_llama(fixture("tiny-llama"), options);
  const auto reference = base_reference();
  torch::NoGradGuard no_grad;
  auto hidden = loaded.model->hidden_states({reference.input_ids, {}, {}});
  auto loss = causal_lm_loss(*loaded.model, hidden, reference.input_ids, 0);
  // bf16 keeps 8 mantissa bits: the loss moves by well under 1%.
  EXPECT_NEAR(loss.loss_sum.item<double>() / 94.0, reference.loss.item<double>(), 0.01 * reference.loss.item<double>());
}

TEST(LlamaModel, PaddingAfterASequenceDoesNotChangeItsLogits) {
  auto loaded = load_llama(fixture("tiny-llama"));
  const auto reference = base_reference();
  torch::NoGradGuard no_grad;
  auto row = reference.input_ids.slice(0, 0, 1);
  auto padded = torch::cat({row, torch::zeros({1, 5}, torch::kInt64)}, 1);
  auto logits = loaded.model->forward({padded, {}, {}}).slice(1, 0, 48);
  EXPECT_LE(max_relative_error(logits, reference.logits.slice(0, 0, 1)), 1e-5);
}

TEST(LlamaModel, CudaLogitsEqualTransformersInFp32) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  ModelLoadOptions options;
  options.device = torch::Device(torch::kCUDA, 0);
  auto loaded = load_llama(fixture("tiny-llama"), options);
  const auto reference = base_reference();
  torch::NoGradGuard no_grad;
  auto logits = loaded.model->forward({reference.input_ids.to(options.device), {}, {}}).cpu();
  // cuBLAS and the fused attention kernels sum in another order than the CPU: 1e-5 still holds.
  EXPECT_LE(max_relative_error(logits, reference.logits), 1e-5);
}

TEST(LlamaModel, ParameterNamesAreHuggingFaces) {
  auto loaded = load_llama(fixture("tiny-llama"));
  auto weights = SafetensorsCheckpoint::open(fixture("tiny-llama"));
  auto parameters = loaded.model->named_parameters();
  EXPECT_EQ(parameters.size(), weights.names().size());
  for (const auto& name : weights.names()) EXPECT_TRUE(parameters.contains(name)) << name;
}

}  // namespace
}  // namespace qtrain::trainer
