// Packing must not change what is learned: a packed batch (positions restarting per sample,
// block-diagonal causal attention, the first token of each sample not a label) has the loss of
// the same samples batched apart, on tiny-llama in fp32 (tolerance 1e-5 relative).
#include <gtest/gtest.h>

#include "data/packing.h"
#include "support.h"
#include "trainer/model/batch_inputs.h"
#include "trainer/model/causal_lm_loss.h"
#include "trainer/formats/hf_checkpoint.h"

namespace qtrain::trainer {
namespace {

std::vector<data::Example> random_samples(const std::vector<int64_t>& lengths, int64_t vocab_size) {
  std::vector<data::Example> samples;
  for (const int64_t length : lengths) {
    const auto ids = torch::randint(vocab_size, {length}, torch::kInt64);
    data::Example sample;
    sample.input_ids.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + length);
    sample.labels = sample.input_ids;
    // Part of each sample is a prompt that is not learned, as in instruction data.
    for (int64_t position = 0; position < length / 3; ++position) sample.labels[position] = data::kIgnoreLabel;
    samples.push_back(sample);
  }
  return samples;
}

std::pair<double, int64_t> loss_of(LlamaForCausalLMImpl& model, const std::vector<const data::Example*>& rows,
                                   torch::Device device) {
  const auto batch = data::collate(rows, /*pad_id=*/0);
  auto hidden = model.hidden_states(model_inputs(batch, device));
  const auto loss = causal_lm_loss(model, hidden, batch.labels.to(device), /*chunk_tokens=*/0);
  EXPECT_EQ(loss.tokens.item<int64_t>(), batch.predicted_tokens);
  return {loss.loss_sum.item<double>(), batch.predicted_tokens};
}

void expect_packed_loss_equals_apart(torch::Device device) {
  torch::manual_seed(3);
  torch::NoGradGuard no_grad;
  ModelLoadOptions options;
  options.device = device;
  auto loaded = load_llama(qtrain::testing::fixture("tiny-llama"), options);
  auto& model = *loaded.model;
  model.eval();
  const auto samples = random_samples({7, 13, 20, 5, 31, 9, 17}, model.options().vocab_size);
  const auto packed = data::pack_examples(samples, 48);
  ASSERT_LT(packed.size(), samples.size());

  std::vector<const data::Example*> apart;
  for (const auto& sample : samples) apart.push_back(&sample);
  const auto [apart_sum, apart_tokens] = loss_of(model, apart, device);

  std::vector<const data::Example*> together;
  for (const auto& window : packed) together.push_back(&window);
  const auto [packed_sum, packed_tokens] = loss_of(model, together, device);

  EXPECT_EQ(packed_tokens, apart_tokens);
  EXPECT_NEAR(packed_sum / packed_tokens, apart_sum / apart_tokens, 1e-5 * apart_sum / apart_tokens);
}

TEST(Packing, PackedBatchHasTheLossOfItsSamplesApart) { expect_packed_loss_equals_apart(torch::kCPU); }

TEST(Packing, PackedBatchHasTheLossOfItsSamplesApartOnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  expect_packed_loss_equals_apart(torch::Device(torch::kCUDA));
}

// On CUDA in bf16 a packed batch runs flash attention over its samples' spans: the loss and the
// gradients equal those of SDPA over the written-out block-causal mask to bf16 rounding, with the
// layers checkpointed (their recomputation sees the same spans). Two samples fill a row each:
// those rows lead the batch and take plain causal attention.
TEST(Packing, CudaSpansGiveTheLossAndGradientsOfTheWrittenOutMask) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(5);
  const torch::Device device(torch::kCUDA);
  ModelLoadOptions options;
  options.device = device;
  options.dtype = torch::kBFloat16;
  auto loaded = load_llama(qtrain::testing::fixture("tiny-llama"), options);
  auto& model = *loaded.model;
  model.train();
  model.model->set_gradient_checkpointing(1);
  const auto samples = random_samples({70, 512, 130, 200, 50, 310, 512, 90, 170}, model.options().vocab_size);
  const auto packed = data::pack_examples(samples, 512);
  std::vector<const data::Example*> rows;
  for (const auto& window : packed) rows.push_back(&window);
  const auto batch = data::collate(rows, /*pad_id=*/0);
  ASSERT_EQ(AttentionMask::packed(batch.sample_ids, device).spans()->whole_rows, 2);
  const auto weight = model.model->layers[0]->as<LlamaDecoderLayer>()->self_attn->q_proj->parameters()[0];
  auto loss_and_gradient = [&](PackedAttention how) {
    model.zero_grad();
    auto hidden = model.hidden_states(model_inputs(batch, device, how));
    const auto loss = causal_lm_loss(model, hidden, batch.labels.to(device), /*chunk_tokens=*/0);
    (loss.loss_sum / batch.predicted_tokens).backward();
    return std::make_pair(loss.loss_sum.item<double>() / batch.predicted_tokens, weight.grad().to(torch::kFloat32));
  };
  const auto [spans_loss, spans_gradient] = loss_and_gradient(PackedAttention::kSpans);
  const auto [mask_loss, mask_gradient] = loss_and_gradient(PackedAttention::kWrittenOutMask);
  const double gradient_error =
      (spans_gradient - mask_gradient).abs().max().item<double>() / mask_gradient.abs().max().item<double>();
  std::printf("[ measured ] bf16 loss %.6f over spans, %.6f over the mask; q_proj gradient differs by %.3g relative\n",
              spans_loss, mask_loss, gradient_error);
  EXPECT_NEAR(spans_loss, mask_loss, 1e-2 * mask_loss);
  EXPECT_LE(gradient_error, 3e-2);
}

TEST(Packing, BlockCausalMaskKeepsAttentionInsideEachSample) {
  const auto mask = block_causal_mask(torch::tensor({0, 0, 1, 1, 1, -1}, torch::kInt64).view({1, 6}));
  const auto expected = torch::tensor({1, 0, 0, 0, 0, 0,  //
                                       1, 1, 0, 0, 0, 0,  //
                                       0, 0, 1, 0, 0, 0,  //
                                       0, 0, 1, 1, 0, 0,  //
                                       0, 0, 1, 1, 1, 0,  //
                                       0, 0, 0, 0, 0, 1},
                                      torch::kBool)
                            .view({1, 1, 6, 6});
  EXPECT_TRUE(torch::equal(mask, expected));
}

}  // namespace
}  // namespace qtrain::trainer
