// A mixture of experts' training step adds the load-balancing loss as transformers adds it to the
// mean token loss: router_aux_loss_coef · aux, per micro-batch, weighted by its predicted tokens.
// The step reads aux back only after backward is queued; the loss it reports is the one it trains.
#include <gtest/gtest.h>

#include "optim/sgd.h"
#include "small_llama.h"
#include "trainer/loss_scaler.h"
#include "trainer/model/batch_inputs.h"
#include "trainer/model/causal_lm_loss.h"
#include "trainer/model/llama.h"
#include "trainer/model/router_loss.h"
#include "trainer/training_step.h"

namespace qtrain::trainer {
namespace {

TEST(RouterLossStep, TheStepsLossIsTheTokenLossPlusTheWeightedAuxOfEachMicroBatch) {
  torch::manual_seed(11);
  auto options = testing::small_llama_options(32, 2);
  options.feed_forward = FeedForwardKind::kExperts;
  options.experts.num_experts = 4;
  options.experts.experts_per_token = 2;
  options.experts.intermediate_size = 24;
  options.experts.output_router_logits = true;
  options.experts.router_aux_loss_coef = 0.25;  // large, so that a missing term shows
  LlamaForCausalLM model(options, torch::kFloat32);
  ASSERT_NE(model->router_loss(), nullptr);
  const std::vector<data::Batch> micro_batches = {testing::small_llama_batch(2, 9), testing::small_llama_batch(1, 7)};

  // Expected: Σ (token loss sum + coef · predicted · aux) / Σ predicted, each forward on its own.
  double expected = 0, token_only = 0, predicted = 0;
  {
    torch::NoGradGuard no_grad;
    for (const auto& batch : micro_batches) {
      model->router_loss()->begin();
      const auto hidden = model->hidden_states(model_inputs(batch, torch::kCPU));
      const double token_sum = causal_lm_loss(*model, hidden, batch.labels, LossOptions{}).loss_sum.item<double>();
      const double aux = model->router_loss()->value();
      EXPECT_GT(aux, 0.5);  // E · Σ f·P is about 1 for a near-uniform router
      EXPECT_NEAR(model->router_loss()->aux().item<double>(), aux, 0);
      expected += token_sum + options.experts.router_aux_loss_coef * static_cast<double>(batch.predicted_tokens) * aux;
      token_only += token_sum;
      predicted += static_cast<double>(batch.predicted_tokens);
    }
  }
  expected /= predicted;
  token_only /= predicted;

  auto trainable = model->parameters();
  optim::SgdOptions sgd;
  sgd.lr = 0.0;
  optim::Sgd optimizer(trainable, sgd);
  LossScaler scaler(false);
  TrainingStepOptions step_options;
  step_options.max_grad_norm = 0;
  TrainingStep step(*model, trainable, optimizer, scaler, step_options);
  const auto result = step.run(micro_batches, 0);
  ASSERT_FALSE(result.skipped) << result.skip_reason;
  std::printf("[ measured ] step loss %.9f, expected %.9f (token loss alone %.9f)\n", result.loss, expected, token_only);
  EXPECT_NEAR(result.loss, expected, 1e-6 * expected);
  EXPECT_GT(result.loss - token_only, 0.1);
}

TEST(RouterLossStep, NoRouterRanMeansNoAux) {
  RouterLoss loss(4);
  loss.begin();
  EXPECT_FALSE(loss.aux().defined());
  EXPECT_EQ(loss.value(), 0.0);
}

}  // namespace
}  // namespace qtrain::trainer
