// Memory switches must not change what is learned: gradients with per-layer checkpointing and
// with the chunked loss equal those of the plain path bitwise on a CPU in fp32 (tiny-llama with
// LoRA and dropout, dense and NF4 bases).
#include "trainer/model/activation_checkpoint.h"

#include <gtest/gtest.h>

#include "qat/four_bit_linear.h"
#include "qat/lora_linear.h"
#include "support.h"
#include "trainer/model/causal_lm_loss.h"
#include "trainer/formats/hf_checkpoint.h"

namespace qtrain::trainer {
namespace {

struct Gradients {
  double loss = 0;
  std::vector<torch::Tensor> lora;  // the gradient of every LoRA weight, in parameter order
};

LlamaForCausalLM tiny_llama_with_lora(bool four_bit) {
  auto loaded = load_llama(qtrain::testing::fixture("tiny-llama"));
  if (four_bit) qat::quantize_linear_layers(*loaded.model, qat::FourBitOptions{}, {"lm_head"});
  qat::LoraOptions lora;
  lora.rank = 4;
  lora.alpha = 8;
  lora.dropout = 0.2;  // the recomputation must draw the same masks
  qat::LoraTargets targets;
  targets.include.names = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  torch::manual_seed(11);
  qat::apply_lora(*loaded.model, targets, lora);
  for (auto& item : loaded.model->named_parameters()) {
    const bool lora_weight = item.key().find("lora_") != std::string::npos;
    item.value().set_requires_grad(lora_weight);
    // B starts at zero; make it non-zero so that A's gradient is too.
    if (item.key().find("lora_B") != std::string::npos) {
      torch::NoGradGuard no_grad;
      item.value().normal_(0, 0.02);
    }
  }
  loaded.model->train();
  return loaded.model;
}

Gradients gradients_of(LlamaForCausalLM model, int64_t checkpoint_every, int64_t loss_chunk_tokens) {
  torch::manual_seed(5);
  const auto input_ids = torch::randint(model->options().vocab_size, {2, 40}, torch::kInt64);
  auto labels = input_ids.clone();
  labels.index_put_({0, torch::indexing::Slice(0, 10)}, -100);
  model->model->set_gradient_checkpointing(checkpoint_every);
  torch::manual_seed(9);  // dropout
  auto hidden = model->hidden_states({input_ids, {}, {}});
  auto loss = causal_lm_loss(*model, hidden, labels, loss_chunk_tokens);
  (loss.loss_sum / loss.tokens.to(torch::kFloat32)).backward();
  Gradients result;
  result.loss = loss.loss_sum.item<double>();
  for (auto& parameter : model->parameters()) {
    if (!parameter.requires_grad()) continue;
    result.lora.push_back(parameter.grad().clone());
    parameter.mutable_grad() = torch::Tensor();
  }
  return result;
}

void expect_bitwise_equal(const Gradients& a, const Gradients& b, const std::string& what) {
  EXPECT_EQ(a.loss, b.loss) << what;
  ASSERT_EQ(a.lora.size(), b.lora.size()) << what;
  for (size_t index = 0; index < a.lora.size(); ++index) {
    ASSERT_TRUE(a.lora[index].abs().sum().item<double>() > 0) << what << ": gradient " << index << " is zero";
    EXPECT_TRUE(torch::equal(a.lora[index], b.lora[index]))
        << what << ": gradient " << index << " differs by " << (a.lora[index] - b.lora[index]).abs().max().item<double>();
  }
}

TEST(ActivationCheckpointing, GradientsEqualThePlainPathBitwise) {
  for (const bool four_bit : {false, true}) {
    auto model = tiny_llama_with_lora(four_bit);
    const auto plain = gradients_of(model, 0, 0);
    expect_bitwise_equal(plain, gradients_of(model, 1, 0), std::string(four_bit ? "nf4" : "dense") + ", every layer");
    expect_bitwise_equal(plain, gradients_of(model, 2, 0), std::string(four_bit ? "nf4" : "dense") + ", every 2nd layer");
  }
}

TEST(ChunkedLoss, LossAndGradientsEqualThePlainPath) {
  auto model = tiny_llama_with_lora(false);
  const auto plain = gradients_of(model, 0, 0);
  for (const int64_t chunk : {16, 33}) {
    const auto chunked = gradients_of(model, 0, chunk);
    EXPECT_NEAR(chunked.loss, plain.loss, 1e-6 * plain.loss) << "chunks of " << chunk;
    for (size_t index = 0; index < plain.lora.size(); ++index) {
      EXPECT_TRUE(torch::allclose(chunked.lora[index], plain.lora[index], /*rtol=*/1e-5, /*atol=*/1e-7))
          << "chunks of " << chunk << ", gradient " << index;
    }
  }
  const auto both = gradients_of(model, 1, 16);
  EXPECT_NEAR(both.loss, plain.loss, 1e-6 * plain.loss);
}

TEST(ChunkedLoss, AutomaticChunksHoldAbout512MiBOfLogits) {
  EXPECT_EQ(auto_loss_chunk_tokens(128256), 1024);  // 512 MiB / (128256 x 4 bytes) = 1046 -> 1024
  EXPECT_EQ(auto_loss_chunk_tokens(32000), 4096);
  EXPECT_EQ(auto_loss_chunk_tokens(10000000), 256);
}

TEST(ActivationCheckpointing, WithoutGradModeItJustRuns) {
  torch::NoGradGuard no_grad;
  auto x = torch::ones({3});
  auto y = checkpoint([](const std::vector<torch::Tensor>& inputs) { return inputs[0] * 2; }, {x}, {});
  EXPECT_TRUE(torch::equal(y, torch::full({3}, 2.0f)));
  EXPECT_FALSE(y.requires_grad());
}

}  // namespace
}  // namespace qtrain::trainer
