// The fused linear + cross-entropy loss (trainer/model/fused_linear_cross_entropy.h) against a
// float64 log_softmax reference and against the logits path it replaces: the loss, the gradient
// of the states, ignored labels, ragged chunks and tiles, Gemma 2's cap, the fallback for a
// projection that trains, whole training runs, and on a GPU the memory it saves and the per-tile
// CUDA kernels (kernels/cross_entropy_tiles.h) against the torch operations they replace.
#include "json_support.h"
#include "trainer/model/fused_linear_cross_entropy.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "kernels/cuda_build.h"
#include "qat/four_bit_linear.h"
#include "qat/lora_linear.h"
#include "small_llama.h"
#include "support.h"
#include "tensor_support.h"
#include "trainer/base/memory_stats.h"
#include "trainer/finetune.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/model/causal_lm_loss.h"
#include "trainer/model/evaluate.h"
#include "trainer/model/host_resident_weight.h"
#include "trainer/recipe/recipe.h"

namespace qtrain::trainer {
namespace {

using testing::fixture;

using testing::max_relative_error;

struct LossAndGradient {
  double loss = 0;
  torch::Tensor grad;  // of the states
};

// causal_lm_loss of `hidden` (a leaf that requires grad) and its gradient.
LossAndGradient loss_through_model(LlamaForCausalLMImpl& model, torch::Tensor& hidden, const torch::Tensor& labels,
                                   const LossOptions& options) {
  hidden.mutable_grad() = torch::Tensor();
  auto loss = causal_lm_loss(model, hidden, labels, options);
  loss.loss_sum.backward();
  return LossAndGradient{loss.loss_sum.item<double>(), hidden.grad().clone()};
}

// The reference: float64 logits of the same (rounded) inputs, log_softmax, the sum over learned
// targets, times g; autograd in float64 for the gradient.
LossAndGradient reference_loss(const torch::Tensor& states, const torch::Tensor& weight, const torch::Tensor& targets,
                               double softcap, double loss_grad) {
  auto states64 = states.detach().to(torch::kFloat64).requires_grad_(true);
  auto logits = torch::matmul(states64, weight.to(torch::kFloat64).t());
  if (softcap > 0) logits = torch::tanh(logits / softcap) * softcap;
  const auto log_probabilities = torch::log_softmax(logits, 1);
  const auto learned = targets.ne(kIgnoreLabel);
  const auto picked = log_probabilities.gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1);
  const auto loss = -(picked * learned.to(torch::kFloat64)).sum();
  (loss * loss_grad).backward();
  return {loss.item<double>(), states64.grad()};
}

LossAndGradient fused_loss(const torch::Tensor& states, const torch::Tensor& weight, const torch::Tensor& targets,
                           double softcap, double loss_grad, const FusedLossOptions& options = {}) {
  auto leaf = states.detach().requires_grad_(true);
  OutputProjection projection;
  projection.weight = weight;
  projection.softcap = softcap;
  const auto loss = fused_linear_cross_entropy(leaf, targets, projection, options);
  EXPECT_EQ(loss.scalar_type(), torch::kFloat32);
  EXPECT_EQ(loss.dim(), 0);
  (loss * loss_grad).backward();
  return {loss.item<double>(), leaf.grad()};
}

struct RandomProblem {
  torch::Tensor states;   // [tokens, hidden]
  torch::Tensor weight;   // [vocab, hidden]
  torch::Tensor targets;  // [tokens], some ignored
};

// Logits of standard deviation `logit_scale`; every fifth target ignored.
RandomProblem random_problem(int64_t tokens, int64_t hidden, int64_t vocab, torch::ScalarType dtype,
                             double logit_scale = 3.0, const torch::Device& device = torch::kCPU) {
  const auto options = torch::TensorOptions().device(device);
  RandomProblem problem;
  problem.states = torch::randn({tokens, hidden}, options).to(dtype);
  const double weight_scale = logit_scale / std::sqrt(static_cast<double>(hidden));
  problem.weight = (torch::randn({vocab, hidden}, options) * weight_scale).to(dtype);
  problem.targets = torch::randint(vocab, {tokens}, options.dtype(torch::kInt64));
  problem.targets.index_put_({torch::arange(0, tokens, 5, options.dtype(torch::kInt64))}, kIgnoreLabel);
  return problem;
}

// The fused loss and its gradient against float64, chunks of 48 and tiles of `tile_columns` over
// 1000 columns (both ragged): the loss within `loss_bound` (relative), the gradient within
// `grad_bound` (max error over max). With a cap, logits of standard deviation 8, which it bends.
// `declared`: the loss's gradient declared before the forward (FusedLossOptions::gradient, as the
// training step declares it); else computed for 1 in fp32 and scaled in backward.
void expect_float64_reference(torch::ScalarType dtype, uint64_t seed, double loss_bound, double grad_bound,
                              const torch::Device& device = torch::kCPU, int64_t tile_columns = 256,
                              double softcap = 0.0, bool declared = false) {
  torch::manual_seed(seed);
  const auto problem = random_problem(200, 64, 1000, dtype, softcap > 0 ? 8.0 : 3.0, device);
  const double loss_grad = 0.37;
  const auto expected = reference_loss(problem.states, problem.weight, problem.targets, softcap, loss_grad);
  FusedLossOptions options;
  options.chunk_tokens = 48;
  options.tile_columns = tile_columns;
  if (declared) options.gradient = loss_grad;
  const auto actual = fused_loss(problem.states, problem.weight, problem.targets, softcap, loss_grad, options);
  std::printf("%s %s, tiles of %lld, cap %g, gradient %s: loss relative error %.3g, gradient %.3g\n",
              device.str().c_str(), c10::toString(dtype), static_cast<long long>(tile_columns), softcap,
              declared ? "declared" : "scaled in backward",
              std::abs(actual.loss - expected.loss) / expected.loss, max_relative_error(actual.grad, expected.grad));
  EXPECT_NEAR(actual.loss, expected.loss, loss_bound * expected.loss);
  EXPECT_LE(max_relative_error(actual.grad, expected.grad), grad_bound);
  EXPECT_EQ(actual.grad.scalar_type(), dtype);
}

// fp32: measured 6e-8 (loss) and 7e-7 (gradient).
TEST(FusedLoss, LossAndGradientEqualAFloat64ReferenceInFp32) { expect_float64_reference(torch::kFloat32, 1, 2e-6, 1e-5); }

// bf16 logits and gradients carry 8 mantissa bits: measured 2e-5 and 6.4e-3.
TEST(FusedLoss, LossAndGradientEqualAFloat64ReferenceInBf16) { expect_float64_reference(torch::kBFloat16, 2, 2e-3, 2e-2); }

// The gradient declared before the forward (FusedLossOptions::gradient, as the training step
// declares it), ragged chunks and tiles, under the same bounds. Measured: fp32 7.5e-7 and 6.8e-7
// (tiles of 256, 333), bf16 4.6e-3.
TEST(FusedLoss, AGradientDeclaredBeforeTheForwardEqualsAFloat64Reference) {
  for (const int64_t tile : {256, 333}) {
    SCOPED_TRACE("tile " + std::to_string(tile));
    expect_float64_reference(torch::kFloat32, 1, 2e-6, 1e-5, torch::kCPU, tile, 0.0, /*declared=*/true);
    expect_float64_reference(torch::kBFloat16, 2, 2e-3, 2e-2, torch::kCPU, tile, 0.0, /*declared=*/true);
  }
}

// Backward scales the gradient the forward computed by (the gradient the loss gets) / (the one
// declared): the declared one gives the undeclared one's (computed for 1 in fp32, fp32: within
// its rounding), another the reference's for it. Ignored rows get none. Under Gemma 2's cap too.
TEST(FusedLoss, AForwardGradientIsScaledToTheGradientTheLossGets) {
  torch::manual_seed(7);
  const auto problem = random_problem(90, 48, 700, torch::kFloat32);
  FusedLossOptions undeclared;
  undeclared.chunk_tokens = 32;
  undeclared.tile_columns = 256;
  FusedLossOptions declared = undeclared;
  declared.gradient = 0.25;
  const auto scaled = fused_loss(problem.states, problem.weight, problem.targets, 0.0, 0.25, undeclared);
  const auto exact = fused_loss(problem.states, problem.weight, problem.targets, 0.0, 0.25, declared);
  EXPECT_EQ(exact.loss, scaled.loss);
  EXPECT_LE(max_relative_error(exact.grad, scaled.grad), 5e-6);
  const auto ignored = problem.targets.eq(kIgnoreLabel);
  EXPECT_EQ(exact.grad.index({ignored}).abs().max().item<double>(), 0.0);
  EXPECT_GT(exact.grad.index({ignored.logical_not()}).abs().min().item<double>(), 0.0);

  const auto other = fused_loss(problem.states, problem.weight, problem.targets, 0.0, -1.5, declared);
  const auto expected = reference_loss(problem.states, problem.weight, problem.targets, 0.0, -1.5);
  EXPECT_LE(max_relative_error(other.grad, expected.grad), 1e-5);

  const auto capped = fused_loss(problem.states, problem.weight, problem.targets, 5.0, 0.25, declared);
  const auto capped_scaled = fused_loss(problem.states, problem.weight, problem.targets, 5.0, 0.25, undeclared);
  EXPECT_EQ(capped.loss, capped_scaled.loss);
  EXPECT_LE(max_relative_error(capped.grad, capped_scaled.grad), 5e-6);
}

// Per-token losses (a preference objective's log-probabilities) against float64: each loss, and
// the states' gradient under a gradient of its own for each token (random, of both signs), which
// the forward computes for a gradient of 1 and backward weighs row by row; capped logits too.
// Bounds as the summed loss's; measured: fp32 4.0e-7, bf16 4.1e-3, capped fp32 1.2e-7.
void expect_per_token_float64_reference(const torch::Device& device) {
  struct Case {
    torch::ScalarType dtype;
    double softcap, loss_bound, grad_bound;
  };
  for (const auto& c : {Case{torch::kFloat32, 0.0, 2e-6, 1e-5}, Case{torch::kBFloat16, 0.0, 2e-3, 2e-2},
                        Case{torch::kFloat32, 5.0, 2e-6, 1e-5}}) {
    SCOPED_TRACE(std::string(c10::toString(c.dtype)) + ", cap " + std::to_string(c.softcap));
    torch::manual_seed(9);
    const auto problem = random_problem(120, 48, 700, c.dtype, c.softcap > 0 ? 8.0 : 3.0, device);
    const auto row_grads = torch::randn({120}, torch::TensorOptions().device(device).dtype(torch::kFloat64));
    auto states64 = problem.states.detach().to(torch::kFloat64).requires_grad_(true);
    auto logits = torch::matmul(states64, problem.weight.to(torch::kFloat64).t());
    if (c.softcap > 0) logits = torch::tanh(logits / c.softcap) * c.softcap;
    const auto learned = problem.targets.ne(kIgnoreLabel).to(torch::kFloat64);
    const auto expected =
        -torch::log_softmax(logits, 1).gather(1, problem.targets.clamp_min(0).unsqueeze(1)).squeeze(1) * learned;
    expected.backward(row_grads);

    auto leaf = problem.states.detach().requires_grad_(true);
    OutputProjection projection;
    projection.weight = problem.weight;
    projection.softcap = c.softcap;
    FusedLossOptions options;
    options.chunk_tokens = 50;
    options.tile_columns = 256;
    const auto losses = fused_linear_token_losses(leaf, problem.targets, projection, options);
    ASSERT_EQ(losses.sizes(), expected.sizes());
    losses.backward(row_grads.to(torch::kFloat32));
    const double loss_error = max_relative_error(losses, expected.detach());
    const double grad_error = max_relative_error(leaf.grad(), states64.grad());
    std::printf("%s per-token %s, cap %g: losses %.3g, gradient %.3g\n", device.str().c_str(), c10::toString(c.dtype),
                c.softcap, loss_error, grad_error);
    EXPECT_LE(loss_error, c.loss_bound);
    EXPECT_LE(grad_error, c.grad_bound);
    EXPECT_EQ(leaf.grad().scalar_type(), c.dtype);
  }
}

TEST(FusedLoss, PerTokenLossesAndTheirGradientsEqualAFloat64Reference) { expect_per_token_float64_reference(torch::kCPU); }

TEST(FusedLoss, IgnoredLabelsTakeNoPartAndGetNoGradient) {
  torch::manual_seed(3);
  auto problem = random_problem(30, 32, 300, torch::kFloat32);
  FusedLossOptions options;
  options.tile_columns = 128;
  const auto actual = fused_loss(problem.states, problem.weight, problem.targets, 0.0, 1.0, options);
  const auto ignored = problem.targets.eq(kIgnoreLabel);
  EXPECT_EQ(actual.grad.index({ignored}).abs().max().item<double>(), 0.0);
  EXPECT_GT(actual.grad.index({ignored.logical_not()}).abs().min().item<double>(), 0.0);
  // Only the learned rows: the same loss.
  const auto learned = ignored.logical_not();
  const auto only_learned =
      fused_loss(problem.states.index({learned}), problem.weight, problem.targets.index({learned}), 0.0, 1.0, options);
  EXPECT_NEAR(actual.loss, only_learned.loss, 1e-6 * actual.loss);
  // Nothing learned: zero loss, zero gradient.
  const auto none = fused_loss(problem.states, problem.weight, torch::full_like(problem.targets, kIgnoreLabel), 0.0,
                               1.0, options);
  EXPECT_EQ(none.loss, 0.0);
  EXPECT_EQ(none.grad.abs().max().item<double>(), 0.0);
}

// A weight handed in as a tensor (lm_head's copy from the host, train.lm_head_on_host) is let go
// of once the loss's forward is done, while the loss itself still lives (its backward needs no
// weight): its device memory returns before the backward. The gradient declared or not; the bias
// beside the weight applies as a layer's would.
TEST(FusedLoss, AWeightHandedInIsLetGoOfAfterTheForward) {
  torch::manual_seed(6);
  auto problem = random_problem(20, 16, 100, torch::kFloat32);
  const auto bias = torch::randn({100});
  auto reference_leaf = problem.states.detach().requires_grad_(true);
  const auto logits = torch::nn::functional::linear(reference_leaf, problem.weight, bias);
  const auto reference = torch::nn::functional::cross_entropy(
      logits, problem.targets, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kIgnoreLabel).reduction(torch::kSum));
  reference.backward();
  for (const double gradient : {0.0, 1.0}) {
    SCOPED_TRACE("declared gradient " + std::to_string(gradient));
    auto leaf = problem.states.detach().requires_grad_(true);
    OutputProjection projection;
    projection.weight = problem.weight.clone();
    projection.weight_bias = bias.clone();
    const auto weight = projection.weight;
    FusedLossOptions options;
    options.gradient = gradient;
    const auto loss = fused_linear_cross_entropy(leaf, problem.targets, projection, options);
    projection = OutputProjection();
    EXPECT_EQ(weight.use_count(), 1);  // here only
    loss.backward();
    EXPECT_NEAR(loss.item<double>(), reference.item<double>(), 1e-5 * reference.item<double>());
    EXPECT_TRUE(torch::allclose(leaf.grad(), reference_leaf.grad(), 1e-5, 1e-6));
  }
}

// Chunks and tiles that do not divide the tokens or the vocabulary: the same loss and gradient
// as one chunk and one tile, up to fp32 rounding (measured: loss 1e-7, gradient 1e-6 with 143
// tiles of 7 columns).
TEST(FusedLoss, RaggedChunksAndTilesGiveTheSameResult) {
  torch::manual_seed(4);
  const auto problem = random_problem(37, 48, 1000, torch::kFloat32);
  FusedLossOptions whole;
  whole.tile_columns = 1000;
  const auto expected = fused_loss(problem.states, problem.weight, problem.targets, 0.0, 1.0, whole);
  for (const auto& [chunk, tile] : std::vector<std::pair<int64_t, int64_t>>{{16, 256}, {5, 333}, {37, 999}, {100, 7}}) {
    for (const double gradient : {0.0, 1.0}) {  // computed in backward, or in the forward
      FusedLossOptions options;
      options.chunk_tokens = chunk;
      options.tile_columns = tile;
      options.gradient = gradient;
      const auto actual = fused_loss(problem.states, problem.weight, problem.targets, 0.0, 1.0, options);
      const std::string where = "chunk " + std::to_string(chunk) + ", tile " + std::to_string(tile) +
                                (gradient != 0 ? ", gradient in the forward" : "");
      EXPECT_NEAR(actual.loss, expected.loss, 2e-6 * expected.loss) << where;
      EXPECT_LE(max_relative_error(actual.grad, expected.grad), 5e-6) << where;
    }
  }
}

// Gemma 2's cap: tanh(z / cap) cap in the compute dtype, and its derivative, in backward's pass or
// in the forward's (1 - (z / cap)^2 from the capped logit). Logits of standard deviation 8 against
// a cap of 5, so that the cap bends most of them. Measured: fp32 loss 6e-8, gradient 5.6e-7 /
// 1.4e-7 (in the forward); bf16 loss 2.2e-4, gradient 7.3e-3 both.
TEST(FusedLoss, Gemma2SoftcapEqualsAFloat64Reference) {
  torch::manual_seed(5);
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const auto problem = random_problem(64, 32, 700, dtype, /*logit_scale=*/8.0);
    const auto expected = reference_loss(problem.states, problem.weight, problem.targets, 5.0, 0.5);
    for (const double gradient : {0.0, 0.5}) {  // in backward, in the forward
      FusedLossOptions options;
      options.tile_columns = 256;
      options.gradient = gradient;
      const auto actual = fused_loss(problem.states, problem.weight, problem.targets, 5.0, 0.5, options);
      const bool fp32 = dtype == torch::kFloat32;
      std::printf("softcap %s, gradient in the %s: loss relative error %.3g, gradient %.3g\n", fp32 ? "fp32" : "bf16",
                  gradient != 0 ? "forward" : "backward", std::abs(actual.loss - expected.loss) / expected.loss,
                  max_relative_error(actual.grad, expected.grad));
      EXPECT_NEAR(actual.loss, expected.loss, (fp32 ? 2e-6 : 2e-3) * expected.loss) << dtype;
      EXPECT_LE(max_relative_error(actual.grad, expected.grad), fp32 ? 1e-5 : 2e-2) << dtype << ", " << gradient;
    }
  }
}

TEST(FusedLoss, TilesHoldAbout64MiBInMultiplesOf256) {
  EXPECT_EQ(fused_loss_tile_columns(1024, 128256), 16384);  // 64 MiB / (1024 x 4 bytes)
  EXPECT_EQ(fused_loss_tile_columns(4096, 128256), 4096);
  EXPECT_EQ(fused_loss_tile_columns(3000, 128256), 5376);   // 5592 -> 21 x 256
  EXPECT_EQ(fused_loss_tile_columns(1 << 20, 128256), 256);  // at least 256
  EXPECT_EQ(fused_loss_tile_columns(16, 8192), 8192);        // at most the vocabulary
}

// The tiny model with LoRA on every decoder projection, lm_head frozen (as Finetune trains it).
LlamaForCausalLM tiny_llama_with_lora(torch::ScalarType dtype, const std::vector<std::string>& targets) {
  ModelLoadOptions load;
  load.dtype = dtype;
  auto model = load_llama(fixture("tiny-llama"), load).model;
  qat::LoraOptions lora;
  lora.rank = 4;
  lora.alpha = 8;
  qat::LoraTargets lora_targets;
  lora_targets.include.names = targets;
  torch::manual_seed(11);
  qat::apply_lora(*model, lora_targets, lora);
  for (auto& item : model->named_parameters()) {
    const bool lora_weight = item.key().find("lora_") != std::string::npos;
    item.value().set_requires_grad(lora_weight);
    if (item.key().find("lora_B") != std::string::npos) {  // B starts at zero: A's gradient would too
      torch::NoGradGuard no_grad;
      item.value().normal_(0, 0.02);
    }
  }
  model->train();
  return model;
}

const std::vector<std::string> kDecoderProjections = {"q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"};

struct ModelGradients {
  double loss = 0;
  std::vector<torch::Tensor> trainable;  // every trainable parameter's gradient, in order
};

// With `declared`, the fused loss is told the gradient backward gives it (1 / tokens). `labels`
// undefined: every token's, the first 10 of row 0 ignored. `host_labels`: they are handed in as the
// training step hands them, so that only the kept targets' states are projected.
ModelGradients model_gradients(LlamaForCausalLMImpl& model, LossOptions options, bool declared = false,
                               torch::Tensor labels = {}, bool host_labels = false) {
  torch::manual_seed(5);
  const auto input_ids = torch::randint(model.options().vocab_size, {2, 40}, torch::kInt64);
  if (!labels.defined()) {
    labels = input_ids.clone();
    labels.index_put_({0, torch::indexing::Slice(0, 10)}, kIgnoreLabel);
  }
  if (declared) {
    options.gradient = 1.0 / labels.narrow(1, 1, 39).ne(kIgnoreLabel).sum().item<double>();
  }
  auto loss = causal_lm_loss(model, model.hidden_states({input_ids, {}, {}}), labels, options,
                             host_labels ? labels : torch::Tensor());
  (loss.loss_sum / loss.tokens.to(torch::kFloat32)).backward();
  ModelGradients result;
  result.loss = loss.loss_sum.item<double>();
  for (auto& parameter : model.parameters()) {
    if (!parameter.requires_grad()) continue;
    result.trainable.push_back(parameter.grad().clone());
    parameter.mutable_grad() = torch::Tensor();
  }
  return result;
}

LossOptions loss_options(int64_t chunk_tokens, bool fused, int64_t vocabulary_tile = 0) {
  LossOptions options;
  options.chunk_tokens = chunk_tokens;
  options.fused = fused;
  options.vocabulary_tile = vocabulary_tile;
  return options;
}

double worst_relative_error(const ModelGradients& ours, const ModelGradients& theirs) {
  EXPECT_EQ(ours.trainable.size(), theirs.trainable.size());
  double worst = 0;
  for (size_t index = 0; index < std::min(ours.trainable.size(), theirs.trainable.size()); ++index) {
    worst = std::max(worst, max_relative_error(ours.trainable[index], theirs.trainable[index]));
  }
  return worst;
}

// The LoRA gradients through the fused loss against those through the logits path (chunked by
// 16), with tiles of 1000 over 8192 columns and 33-token chunks over 78 tokens (both ragged).
// fp32: within 1e-5 (measured 1.1e-6). bf16: the tiles' partial products are rounded to bf16
// once each, so the two differ by up to 1.8% (one tile: 0.7%, the flips of bf16 rounding that
// any fp32-ulp difference causes); against the same model in fp32 the fused path's error
// (2.9%) is no larger than the logits path's (3.2%).
TEST(FusedLoss, LoraGradientsEqualTheChunkedLogitsPathOnTheTinyModel) {
  auto fp32_model = tiny_llama_with_lora(torch::kFloat32, kDecoderProjections);
  ASSERT_TRUE(fused_loss_applies(*fp32_model));
  const auto fp32_chunked = model_gradients(*fp32_model, loss_options(16, false));
  const auto fp32_fused = model_gradients(*fp32_model, loss_options(33, true, 1000));
  EXPECT_NEAR(fp32_fused.loss, fp32_chunked.loss, 1e-6 * fp32_chunked.loss);
  EXPECT_LE(worst_relative_error(fp32_fused, fp32_chunked), 1e-5);
  // The loss's gradient declared, as the training step declares it.
  const auto fp32_one_pass = model_gradients(*fp32_model, loss_options(33, true, 1000), /*declared=*/true);
  EXPECT_NEAR(fp32_one_pass.loss, fp32_chunked.loss, 1e-6 * fp32_chunked.loss);
  EXPECT_LE(worst_relative_error(fp32_one_pass, fp32_chunked), 1e-5);

  auto bf16_model = tiny_llama_with_lora(torch::kBFloat16, kDecoderProjections);
  const auto bf16_chunked = model_gradients(*bf16_model, loss_options(16, false));
  const auto bf16_fused = model_gradients(*bf16_model, loss_options(33, true, 1000));
  EXPECT_NEAR(bf16_fused.loss, bf16_chunked.loss, 1e-5 * bf16_chunked.loss);
  const double fused_vs_chunked = worst_relative_error(bf16_fused, bf16_chunked);
  const double fused_vs_fp32 = worst_relative_error(bf16_fused, fp32_chunked);
  const double chunked_vs_fp32 = worst_relative_error(bf16_chunked, fp32_chunked);
  std::printf("bf16 LoRA gradients: fused vs chunked %.3g; against fp32: fused %.3g, chunked %.3g\n", fused_vs_chunked,
              fused_vs_fp32, chunked_vs_fp32);
  EXPECT_LE(fused_vs_chunked, 3e-2);
  EXPECT_LE(fused_vs_fp32, 1.25 * chunked_vs_fp32);
  const auto bf16_one_pass = model_gradients(*bf16_model, loss_options(33, true, 1000), /*declared=*/true);
  const double one_pass_vs_fp32 = worst_relative_error(bf16_one_pass, fp32_chunked);
  std::printf("bf16 LoRA gradients, the loss's gradient declared: against fp32 %.3g\n", one_pass_vs_fp32);
  EXPECT_LE(worst_relative_error(bf16_one_pass, bf16_chunked), 3e-2);
  EXPECT_LE(one_pass_vs_fp32, 1.25 * chunked_vs_fp32);
}

// Labels handed in on the host: where at least 1 in 32 targets is ignored (a prompt, padding),
// only the others' states are projected. The loss and the LoRA gradients equal projecting every
// state, fused and on the logits path, with the gradient declared or not (fp32, within 1e-6 /
// 1e-5: the projection's rows in another batch). With nothing ignored, fewer than 1 in 32 (a
// packed document's boundary) or everything, it is the same path bit for bit.
TEST(FusedLoss, OnlyTheKeptTargetsStatesAreProjectedWithTheSameLossAndGradients) {
  auto model = tiny_llama_with_lora(torch::kFloat32, kDecoderProjections);
  torch::manual_seed(5);
  const auto ids = torch::randint(model->options().vocab_size, {2, 40}, torch::kInt64);
  auto prompted = ids.clone();
  prompted.index_put_({0, torch::indexing::Slice(0, 17)}, kIgnoreLabel);  // a prompt
  prompted.index_put_({1, torch::indexing::Slice(0, 5)}, kIgnoreLabel);
  prompted.index_put_({1, torch::indexing::Slice(31, 40)}, kIgnoreLabel);  // padding
  for (const auto& options : {loss_options(16, true, 1000), loss_options(33, false), loss_options(0, true)}) {
    for (const bool declared : {false, true}) {
      const auto every = model_gradients(*model, options, declared, prompted, false);
      const auto kept = model_gradients(*model, options, declared, prompted, true);
      EXPECT_NEAR(kept.loss, every.loss, 1e-6 * every.loss);
      EXPECT_LE(worst_relative_error(kept, every), 1e-5);
    }
  }
  auto one_ignored = ids.clone();
  one_ignored.index_put_({1, 20}, kIgnoreLabel);  // 1 of 78 targets
  for (const auto& labels : {ids, one_ignored}) {
    const auto every = model_gradients(*model, loss_options(16, true, 1000), false, labels, false);
    const auto kept = model_gradients(*model, loss_options(16, true, 1000), false, labels, true);
    EXPECT_EQ(kept.loss, every.loss);
    for (size_t index = 0; index < every.trainable.size(); ++index) {
      EXPECT_TRUE(torch::equal(kept.trainable[index], every.trainable[index])) << "gradient " << index;
    }
  }
  torch::NoGradGuard no_grad;
  const auto all_ignored = ids.clone().fill_(kIgnoreLabel);
  const auto none = causal_lm_loss(*model, model->hidden_states({ids, {}, {}}), all_ignored, loss_options(16, true), all_ignored);
  EXPECT_EQ(none.loss_sum.item<double>(), 0.0);
  EXPECT_EQ(none.tokens.item<int64_t>(), 0);
}

// Gemma 2 (tied, frozen embeddings; final_logit_softcapping 30): the fused loss equals the
// logits path, fp32: the loss within 1e-6 (measured 1.2e-7), the gradient within 1e-5 (6.8e-7).
TEST(FusedLoss, Gemma2TiedEmbeddingsEqualTheLogitsPath) {
  auto model = load_llama(fixture("families/gemma2")).model;
  ASSERT_FALSE(model->lm_head);
  ASSERT_GT(model->options().final_logit_softcap, 0);
  for (auto& parameter : model->parameters()) parameter.set_requires_grad(false);
  torch::manual_seed(6);
  const auto input_ids = torch::randint(model->options().vocab_size, {2, 30}, torch::kInt64);
  auto hidden = model->hidden_states({input_ids, {}, {}}).detach().requires_grad_(true);
  ASSERT_TRUE(fused_loss_applies(*model));
  const auto logits_path = loss_through_model(*model, hidden, input_ids, loss_options(0, false));
  const auto fused = loss_through_model(*model, hidden, input_ids, loss_options(20, true, 3000));
  EXPECT_NEAR(fused.loss, logits_path.loss, 1e-6 * logits_path.loss);
  EXPECT_LE(max_relative_error(fused.grad, logits_path.grad), 1e-5);
  // Trained embeddings need autograd's gradient: the logits path, whatever the option says.
  model->model->embed_tokens->weight.set_requires_grad(true);
  EXPECT_FALSE(fused_loss_applies(*model));
  {
    torch::NoGradGuard no_grad;  // evaluation differentiates nothing: fused again
    EXPECT_TRUE(fused_loss_applies(*model));
  }
}

// A LoRA'd lm_head is not a frozen weight: causal_lm_loss takes the logits path, and the
// gradient reaches lm_head's adapter as it does with fused_loss off.
TEST(FusedLoss, ALoraLmHeadFallsBackToTheLogitsPath) {
  auto targets = kDecoderProjections;
  targets.push_back("lm_head");
  auto model = tiny_llama_with_lora(torch::kFloat32, targets);
  ASSERT_TRUE(std::dynamic_pointer_cast<qat::LoraLinear>(model->lm_head));
  EXPECT_FALSE(fused_loss_applies(*model));
  const auto fused = model_gradients(*model, loss_options(16, true));
  const auto logits_path = model_gradients(*model, loss_options(16, false));
  EXPECT_EQ(fused.loss, logits_path.loss);
  ASSERT_EQ(fused.trainable.size(), logits_path.trainable.size());
  size_t lm_head_gradients = 0;
  const auto named = model->named_parameters();
  size_t index = 0;
  for (const auto& item : named) {
    if (!item.value().requires_grad()) continue;
    EXPECT_TRUE(torch::equal(fused.trainable[index], logits_path.trainable[index])) << item.key();
    if (item.key().rfind("lm_head.", 0) == 0) {
      EXPECT_GT(fused.trainable[index].abs().max().item<double>(), 0.0) << item.key();
      ++lm_head_gradients;
    }
    ++index;
  }
  EXPECT_EQ(lm_head_gradients, 2u);  // lora_A and lora_B
}

// A 4-bit lm_head (qlora without skip_modules) hands out its dequantized weight: fused, and
// equal to the logits path through its own forward, fp32 within 1e-5 (measured 2.7e-6).
TEST(FusedLoss, AFourBitLmHeadMultipliesByItsDequantizedWeight) {
  auto model = load_llama(fixture("tiny-llama")).model;
  qat::FourBitOptions four_bit;
  four_bit.compute_dtype = torch::kFloat32;
  qat::quantize_linear_layers(*model, four_bit, {});
  ASSERT_TRUE(std::dynamic_pointer_cast<qat::FourBitLinear>(model->lm_head));
  for (auto& parameter : model->parameters()) parameter.set_requires_grad(false);
  ASSERT_TRUE(fused_loss_applies(*model));
  torch::manual_seed(9);
  const auto input_ids = torch::randint(model->options().vocab_size, {2, 24}, torch::kInt64);
  auto hidden = model->hidden_states({input_ids, {}, {}}).detach().requires_grad_(true);
  const auto logits_path = loss_through_model(*model, hidden, input_ids, loss_options(0, false));
  const auto fused = loss_through_model(*model, hidden, input_ids, loss_options(16, true, 3000));
  EXPECT_NEAR(fused.loss, logits_path.loss, 1e-6 * logits_path.loss);
  EXPECT_LE(max_relative_error(fused.grad, logits_path.grad), 1e-5);
}

// Held-out evaluation (no grad) through the fused forward equals the logits path's (measured 1e-7).
TEST(FusedLoss, EvaluationEqualsTheLogitsPath) {
  auto model = load_llama(fixture("tiny-llama")).model;
  torch::manual_seed(7);
  std::vector<data::Example> examples;
  for (int64_t length : {20, 33, 7, 50}) {
    const auto ids = torch::randint(model->options().vocab_size, {length}, torch::kInt64);
    data::Example example;
    example.input_ids.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + length);
    example.labels = example.input_ids;
    for (size_t position = 0; position < 3; ++position) example.labels[position] = kIgnoreLabel;
    examples.push_back(example);
  }
  EvalOptions options;
  options.batch_size = 2;
  options.loss_chunk_tokens = 16;
  options.fused_loss = false;
  const auto logits_path = evaluate(*model, examples, options);
  options.fused_loss = true;
  const auto fused = evaluate(*model, examples, options);
  EXPECT_EQ(fused.tokens, logits_path.tokens);
  EXPECT_NEAR(fused.loss, logits_path.loss, 1e-6 * logits_path.loss);
}

// A few QLoRA steps of the demo's tiny model on the CPU (fp32): the logged losses with
// train.fused_loss true and false agree within 1e-5 relative (measured 2e-7).
TEST(FusedLoss, TrainingLossesEqualTheLogitsPath) {
  std::vector<std::vector<double>> losses;
  for (const char* fused : {"train.fused_loss=true", "train.fused_loss=false"}) {
    testing::TempDir run;
    const auto recipe = load_recipe(
        "", {"model.path=" + testing::source_dir() + "/recipes/demo/tiny-llama",
             "data.train=" + testing::source_dir() + "/recipes/demo/brown-val.jsonl", "data.eval=", "quant=qlora",
             "lora.rank=4", "lora.alpha=8", "lora.dropout=0.1", "data.max_seq_len=64", "train.micro_batch_size=2",
             "train.grad_accum_steps=2", "train.steps=6", "train.dtype=fp32", "train.device=cpu",
             "train.loss_chunk_tokens=48", "optim.lr=1e-3", "schedule.warmup_steps=1", "eval.every=0",
             "log.every=1", "train.output_dir=" + run.path(), fused});
    Finetune finetune(recipe);
    finetune.setup();
    finetune.train();
    losses.push_back(testing::logged_losses(run.path()));
  }
  ASSERT_EQ(losses[0].size(), 6u);
  ASSERT_EQ(losses[1].size(), 6u);
  double worst = 0;
  for (size_t step = 0; step < 6; ++step) {
    worst = std::max(worst, std::abs(losses[0][step] - losses[1][step]) / losses[1][step]);
    EXPECT_NEAR(losses[0][step], losses[1][step], 1e-5 * losses[1][step]) << "step " << step + 1;
  }
  std::printf("training losses fused vs logits path: worst relative difference %.3g\n", worst);
}

// On a GPU in bf16: the fused loss against float64 as on the CPU, and the bytes the loss's
// forward and backward add at their peak well below the chunked logits path's (three fp32
// [1024, 32768] blocks, 384 MiB, against about 120 MiB with the torch operations: an fp32 and a
// bf16 [1024, 16384] tile, the [1024, 1024] sums, the states and their gradient; the CUDA
// kernels hold two bf16 tiles, the logits and their gradient, in place of the first two).
TEST(FusedLoss, CudaBf16EqualsAFloat64ReferenceAndHoldsLessMemory) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const torch::Device cuda(torch::kCUDA, 0);
  torch::manual_seed(8);
  {
    const auto problem = random_problem(512, 256, 32768, torch::kBFloat16, 3.0, cuda);
    const auto expected = reference_loss(problem.states, problem.weight, problem.targets, 0.0, 0.37);
    FusedLossOptions options;
    options.chunk_tokens = 200;
    options.tile_columns = 5000;
    const auto actual = fused_loss(problem.states, problem.weight, problem.targets, 0.0, 0.37, options);
    std::printf("cuda bf16: loss relative error %.3g, gradient %.3g\n",
                std::abs(actual.loss - expected.loss) / expected.loss, max_relative_error(actual.grad, expected.grad));
    EXPECT_NEAR(actual.loss, expected.loss, 2e-3 * expected.loss);
    EXPECT_LE(max_relative_error(actual.grad, expected.grad), 2e-2);
  }

  auto options = testing::small_llama_options(1024, 1);
  options.vocab_size = 32768;
  LlamaForCausalLM model(options, torch::kBFloat16);
  model->to(cuda);
  for (auto& parameter : model->parameters()) parameter.set_requires_grad(false);
  ASSERT_TRUE(fused_loss_applies(*model));
  const auto input_ids =
      torch::randint(options.vocab_size, {4, 1025}, torch::TensorOptions().dtype(torch::kInt64).device(cuda));
  const auto hidden = torch::randn({4, 1025, 1024}, torch::TensorOptions().device(cuda)).to(torch::kBFloat16);
  const auto peak_bytes = [&](bool fused) {
    auto leaf = hidden.detach().requires_grad_(true);
    torch::cuda::synchronize();
    reset_peak_memory(cuda);
    const double before = memory_usage(cuda).current_bytes;
    auto loss = causal_lm_loss(*model, leaf, input_ids, loss_options(1024, fused));
    loss.loss_sum.backward();
    torch::cuda::synchronize();
    return std::make_pair(memory_usage(cuda).peak_bytes - before, leaf.grad().clone());
  };
  const auto [chunked_peak, chunked_grad] = peak_bytes(false);
  const auto [fused_peak, fused_grad] = peak_bytes(true);
  std::printf("cuda loss peak: fused %s, chunked %s; gradient relative difference %.3g\n",
              format_bytes(fused_peak).c_str(), format_bytes(chunked_peak).c_str(),
              max_relative_error(fused_grad, chunked_grad));
  EXPECT_LT(fused_peak, 0.5 * chunked_peak);
  EXPECT_LE(max_relative_error(fused_grad, chunked_grad), 3e-2);
}

// A host-kept weight's tiles (train.lm_head_block_mb) taken in the loss's order are its rows, and
// at most `ahead` wait queued after each; a tile of another width is copied when asked, the queued
// ones dropped. On the CPU the copies are made at once, so the bookkeeping is what is tested.
TEST(HostTiles, TakenInOrderTheyAreTheWeightsRowsWithAtMostAheadQueued) {
  torch::manual_seed(21);
  const auto weight = torch::randn({10, 4});
  HostResidentWeight host(weight, torch::kCPU, "the test's weight");
  host.prefetch_tiles(torch::kCPU, 3, 2);
  EXPECT_EQ(host.queued_tiles(), 2);
  for (int64_t begin = 0; begin < 10; begin += 3) {
    const int64_t end = std::min<int64_t>(10, begin + 3);
    EXPECT_TRUE(torch::equal(host.take_rows(torch::kCPU, begin, end, 2), weight.slice(0, begin, end))) << begin;
    EXPECT_EQ(host.queued_tiles(), std::min<int64_t>(2, (10 - end + 2) / 3)) << begin;
  }
  EXPECT_EQ(host.queued_tiles(), 0);
  host.prefetch_tiles(torch::kCPU, 4, 2);  // then asked for tiles of 5
  EXPECT_TRUE(torch::equal(host.take_rows(torch::kCPU, 0, 5, 1), weight.slice(0, 0, 5)));
  EXPECT_EQ(host.queued_tiles(), 1);
  EXPECT_TRUE(torch::equal(host.take_rows(torch::kCPU, 5, 10, 1), weight.slice(0, 5, 10)));
  EXPECT_EQ(host.queued_tiles(), 0);
  host.prefetch_tiles(torch::kCPU, 2, 3);  // then asked for rows further on: those before are dropped
  EXPECT_TRUE(torch::equal(host.take_rows(torch::kCPU, 4, 6, 0), weight.slice(0, 4, 6)));
  EXPECT_EQ(host.queued_tiles(), 0);
  EXPECT_THROW(host.take_rows(torch::kCPU, 8, 11, 0), Error);
}

// The fused loss over a host weight's tiles walks it once, every token in one chunk, and equals
// the loss over the whole weight in one chunk of the same tiles bit for bit: the summed loss and
// its gradient computed in the forward (declared), the per-token losses and theirs, with and
// without the cap, one tile on the device at a time or three, the gradient declared or not. No tile
// is left queued after the loss.
TEST(FusedLoss, OverAHostWeightsTilesEqualsTheWholeWeightBitForBit) {
  torch::manual_seed(22);
  const auto problem = random_problem(90, 32, 1000, torch::kFloat32);
  HostResidentWeight host(problem.weight, torch::kCPU, "the test's weight");
  const int64_t tile = 256, tile_bytes = tile * 32 * 4;
  const auto run = [&](const OutputProjection& projection, double declared, bool per_token) {
    auto leaf = problem.states.detach().requires_grad_(true);
    FusedLossOptions options;
    options.chunk_tokens = 90;
    options.tile_columns = tile;
    options.gradient = declared;
    auto losses = per_token ? fused_linear_token_losses(leaf, problem.targets, projection, options)
                            : fused_linear_cross_entropy(leaf, problem.targets, projection, options);
    (per_token ? losses.sum() * 0.37 : losses * 0.37).backward();
    return std::make_pair(losses.detach(), leaf.grad());
  };
  for (const double softcap : {0.0, 5.0}) {
    OutputProjection whole;
    whole.weight = problem.weight;
    whole.softcap = softcap;
    for (const int64_t block : {int64_t{1}, 3 * tile_bytes}) {
      SCOPED_TRACE("cap " + std::to_string(softcap) + ", block " + std::to_string(block));
      OutputProjection tiles;
      tiles.host_tiles = &host;
      tiles.host_block_bytes = block;
      tiles.softcap = softcap;
      EXPECT_EQ(tiles.vocab_size(), 1000);
      for (const bool per_token : {false, true}) {
        const auto [expected_loss, expected_grad] = run(whole, 0.37, per_token);
        const auto [loss, grad] = run(tiles, 0.37, per_token);
        EXPECT_TRUE(torch::equal(loss, expected_loss)) << "per token " << per_token;
        EXPECT_TRUE(torch::equal(grad, expected_grad)) << "per token " << per_token;
        EXPECT_EQ(host.queued_tiles(), 0);
      }
      const auto [undeclared_loss, undeclared_grad] = run(whole, 0.0, false);
      const auto [loss, grad] = run(tiles, 0.0, false);
      EXPECT_TRUE(torch::equal(loss, undeclared_loss));
      EXPECT_TRUE(torch::equal(grad, undeclared_grad));
    }
  }
  EXPECT_EQ(host_tiles_on_device(3 * tile_bytes + 5, tile_bytes), 3);
  EXPECT_EQ(host_tiles_on_device(1, tile_bytes), 1);  // at least the tile in use
}

// train.lm_head_block_mb on a GPU: the loss over lm_head's tiles from the host equals it over
// the whole weight on the device in one chunk bit for bit, prefetched or not, and at its peak it
// holds its block of lm_head (2 tiles of 7.5 MiB here, of a 64 MiB head) beside what the whole
// weight's loss holds (one tile more allowed, for copies still in flight when a tile is freed).
// Measured on an H200: 24 MiB more (three tiles of 8 MiB as allocated).
TEST(FusedLoss, CudaHostTilesEqualTheWholeWeightAndHoldTheirBlock) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const torch::Device cuda(torch::kCUDA, 0);
  torch::manual_seed(23);
  const auto problem = random_problem(4097, 1024, 32768, torch::kBFloat16, 3.0, cuda);
  HostResidentWeight host(problem.weight, cuda, "the test's weight");
  const int64_t tile = fused_loss_tile_columns(4097, 32768);
  const int64_t tile_bytes = tile * 1024 * 2;
  const auto run = [&](const OutputProjection& projection, bool prefetch) {
    auto leaf = problem.states.detach().requires_grad_(true);
    torch::cuda::synchronize();
    const double before = memory_usage(cuda).current_bytes;
    reset_peak_memory(cuda);
    if (prefetch) host.prefetch_tiles(cuda, tile, host_tiles_on_device(projection.host_block_bytes, tile_bytes));
    FusedLossOptions options;
    options.chunk_tokens = 4097;
    options.gradient = 1.0;
    auto loss = fused_linear_cross_entropy(leaf, problem.targets, projection, options);
    loss.backward();
    torch::cuda::synchronize();
    return std::make_tuple(loss.item<double>(), leaf.grad().clone(), memory_usage(cuda).peak_bytes - before);
  };
  OutputProjection whole;
  whole.weight = problem.weight;
  run(whole, false);  // once before: cuBLAS's first matmul allocates its workspace (32 MiB on an H200)
  const auto [loss, grad, whole_peak] = run(whole, false);
  OutputProjection tiles;
  tiles.host_tiles = &host;
  tiles.host_block_bytes = 2 * tile_bytes;
  for (const bool prefetch : {false, true}) {
    const auto [tile_loss, tile_grad, peak] = run(tiles, prefetch);
    EXPECT_EQ(tile_loss, loss) << "prefetched " << prefetch;
    EXPECT_TRUE(torch::equal(tile_grad, grad)) << "prefetched " << prefetch;
    // The whole path's weight was already on the device; the tiles' peak holds three of them at
    // most, each rounded up to the caching allocator's 2 MiB.
    const int64_t allocated_tile = (tile_bytes + (int64_t{2} << 20) - 1) / (int64_t{2} << 20) * (int64_t{2} << 20);
    EXPECT_LE(peak, whole_peak + 3 * allocated_tile) << "prefetched " << prefetch;
    EXPECT_EQ(host.queued_tiles(), 0);
    std::printf("cuda host tiles (%s): peak %s beside the whole weight's %s (weight %s)\n",
                prefetch ? "prefetched" : "on demand", format_bytes(peak).c_str(), format_bytes(whole_peak).c_str(),
                format_bytes(32768.0 * 1024 * 2).c_str());
  }
}

// A one-layer bf16 model of hidden 1024 and a 32,768-token vocabulary (a 64 MiB lm_head) on the
// GPU, every weight frozen.
LlamaForCausalLM frozen_model_on_cuda(uint64_t seed, int64_t layers = 1) {
  torch::manual_seed(seed);
  auto options = testing::small_llama_options(1024, layers);
  options.vocab_size = 32768;
  LlamaForCausalLM model(options, torch::kBFloat16);
  model->to(torch::Device(torch::kCUDA, 0));
  for (auto& parameter : model->parameters()) parameter.set_requires_grad(false);
  return model;
}

// train.lm_head_on_host on a GPU: the loss and the states' gradient equal those of lm_head on the
// device bitwise, and so do the logits generation reads; the device holds no lm_head between
// uses, and the copy a loss took is gone once its backward has run (64 MiB here).
TEST(FusedLoss, CudaLmHeadOnTheHostEqualsItOnTheDeviceAndLeavesAfterTheBackward) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const torch::Device cuda(torch::kCUDA, 0);
  auto model = frozen_model_on_cuda(12);
  const auto& options = model->options();
  const double lm_head_bytes = 32768.0 * 1024 * 2;
  const auto input_ids =
      torch::randint(options.vocab_size, {2, 513}, torch::TensorOptions().dtype(torch::kInt64).device(cuda));
  const auto hidden = torch::randn({2, 513, 1024}, torch::TensorOptions().device(cuda)).to(torch::kBFloat16);
  // The loss and gradient, and the device bytes the loss still holds after its backward.
  const auto run = [&](bool prefetch) {
    auto leaf = hidden.detach().requires_grad_(true);
    torch::cuda::synchronize();
    const double before = memory_usage(cuda).current_bytes;
    if (prefetch) model->prefetch_lm_head();
    auto loss = causal_lm_loss(*model, leaf, input_ids, loss_options(256, true));
    loss.loss_sum.backward();
    torch::cuda::synchronize();
    const double held = memory_usage(cuda).current_bytes - before - leaf.grad().numel() * 2.0;
    return std::make_tuple(loss.loss_sum.item<double>(), leaf.grad().clone(), held);
  };
  const auto [loss, grad, held_on_device] = run(false);
  const auto logits = model->logits(hidden.slice(1, 0, 8));
  torch::cuda::synchronize();
  const double resident = memory_usage(cuda).current_bytes;
  model->keep_lm_head_on_host();
  ASSERT_TRUE(model->lm_head_on_host());
  torch::cuda::synchronize();
  EXPECT_GE(resident - memory_usage(cuda).current_bytes, lm_head_bytes);
  for (const bool prefetch : {false, true}) {
    const auto [host_loss, host_grad, held] = run(prefetch);
    EXPECT_EQ(host_loss, loss) << "prefetched " << prefetch;
    EXPECT_TRUE(torch::equal(host_grad, grad)) << "prefetched " << prefetch;
    EXPECT_LT(held, 0.25 * lm_head_bytes) << "prefetched " << prefetch;
  }
  EXPECT_TRUE(torch::equal(model->logits(hidden.slice(1, 0, 8)), logits));
  std::printf("cuda lm_head on the host: the loss holds %s after its backward (on the device: %s)\n",
              format_bytes(std::get<2>(run(true))).c_str(), format_bytes(held_on_device).c_str());
}

// The loss after the model's forward (lm_head's prefetch asked for first where `prefetch`), and
// the hidden states' gradient, as a training step declares it: one chunk of every token.
std::pair<double, torch::Tensor> loss_after_the_forward(LlamaForCausalLMImpl& model, const torch::Tensor& input_ids,
                                                        bool prefetch) {
  LossOptions loss;
  loss.gradient = 1.0;
  if (prefetch) model.prefetch_lm_head();
  torch::Tensor hidden;
  {
    torch::NoGradGuard no_grad;
    hidden = model.hidden_states(LlamaInputs{input_ids});
  }
  auto leaf = hidden.detach().requires_grad_(true);
  auto result = causal_lm_loss(model, leaf, input_ids, loss);
  result.loss_sum.backward();
  return {result.loss_sum.item<double>(), leaf.grad().clone()};
}

// train.lm_head_block_mb through the model on a GPU: the loss over lm_head's tiles from the host
// equals the loss with lm_head on the device (one chunk, the gradient declared) bit for bit, the
// first tiles prefetched by the forward (hidden_states, after prefetch_lm_head) or not, and no
// tile is left on the device after it.
TEST(FusedLoss, CudaLmHeadTilesFromTheHostThroughTheModelEqualTheHeadOnTheDevice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const torch::Device cuda(torch::kCUDA, 0);
  auto model = frozen_model_on_cuda(24);
  const auto& options = model->options();
  const auto input_ids =
      torch::randint(options.vocab_size, {2, 513}, torch::TensorOptions().dtype(torch::kInt64).device(cuda));
  const auto run = [&](bool prefetch) { return loss_after_the_forward(*model, input_ids, prefetch); };
  const auto [expected_loss, expected_grad] = run(false);
  model->keep_lm_head_on_host();
  model->set_lm_head_block_bytes(int64_t{8} << 20);
  ASSERT_NE(model->host_lm_head(), nullptr);
  for (const bool prefetch : {false, true}) {
    const auto [tile_loss, tile_grad] = run(prefetch);
    EXPECT_EQ(tile_loss, expected_loss) << "prefetched " << prefetch;
    EXPECT_TRUE(torch::equal(tile_grad, expected_grad)) << "prefetched " << prefetch;
    EXPECT_EQ(model->host_lm_head()->queued_tiles(), 0) << "prefetched " << prefetch;
  }
}

// A whole lm_head from the host travels in pieces of rows, the next one as each decoder layer
// starts: take() hands over the host's rows however many pieces were queued before it, and the
// loss after the model's forward (3 layers, 3 pieces) equals lm_head on the device bit for bit.
TEST(FusedLoss, CudaLmHeadFromTheHostInPiecesEqualsTheHeadOnTheDevice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const torch::Device cuda(torch::kCUDA, 0);
  const auto weight = torch::randn({10, 24}).to(torch::kBFloat16);
  for (const int continued : {0, 1, 2, 5}) {  // pieces of 3, 3, 3 and 1 rows
    HostResidentWeight host(weight, cuda, "train.lm_head_on_host");
    host.prefetch(cuda, 4);
    for (int piece = 0; piece < continued; ++piece) host.continue_prefetch();
    EXPECT_TRUE(torch::equal(host.take(cuda).cpu(), weight)) << continued << " pieces continued";
  }
  auto model = frozen_model_on_cuda(31, 3);
  const auto input_ids =
      torch::randint(model->options().vocab_size, {2, 257}, torch::TensorOptions().dtype(torch::kInt64).device(cuda));
  const auto run = [&] { return loss_after_the_forward(*model, input_ids, true); };
  const auto [expected_loss, expected_grad] = run();
  model->keep_lm_head_on_host();
  ASSERT_NE(model->host_lm_head(), nullptr);
  for (int repeat = 0; repeat < 2; ++repeat) {
    const auto [host_loss, host_grad] = run();
    EXPECT_EQ(host_loss, expected_loss) << "run " << repeat;
    EXPECT_TRUE(torch::equal(host_grad, expected_grad)) << "run " << repeat;
  }
}

// Why the per-tile CUDA kernels cannot run here, or empty.
std::string cuda_kernels_missing() {
  if (!kernels::kCudaKernelsBuilt) return "built without the CUDA kernels";
  if (!torch::cuda::is_available()) return "no CUDA GPU on this machine";
  return "";
}

const torch::ScalarType kTileDtypes[] = {torch::kBFloat16, torch::kHalf, torch::kFloat32};

// One vocabulary tile as the loss hands it to the kernels, on the GPU.
struct LogitTile {
  torch::Tensor logits;   // [rows, tile] in the compute dtype: columns begin .. begin + tile - 1
  torch::Tensor targets;  // [rows] int64
  int64_t begin = 0;
};

// Logits of standard deviation 3 with column 7 at -inf (a masked token); targets by row r:
// r % 5 == 0 ignored, 1 before the tile, 2 after it, 3 and 4 in it, among them the tile's first
// column (row 3), its last (row 4) and the -inf column (row 8). begin > 0, rows >= 9.
LogitTile random_logit_tile(int64_t rows, int64_t tile, int64_t begin, torch::ScalarType dtype) {
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const auto int64 = cuda.dtype(torch::kInt64);
  LogitTile t;
  t.begin = begin;
  auto logits = torch::randn({rows, tile}, cuda) * 3;
  logits.select(1, 7).fill_(-std::numeric_limits<float>::infinity());
  t.logits = logits.to(dtype);
  const auto kind = torch::arange(rows, int64).remainder(5);
  const auto in_tile = torch::randint(begin, begin + tile, {rows}, int64);
  const auto before = torch::randint(0, begin, {rows}, int64);
  const auto after = torch::randint(begin + tile, begin + 2 * tile, {rows}, int64);
  t.targets = torch::where(kind.eq(0), torch::full({rows}, kIgnoreLabel, int64),
                           torch::where(kind.eq(1), before, torch::where(kind.eq(2), after, in_tile)));
  t.targets[3] = begin;
  t.targets[4] = begin + tile - 1;
  t.targets[8] = begin + 7;
  return t;
}

// Within `relative` of `expected` plus `absolute` at every finite value (0 and 0: equal), and NaN
// and the infinities at the same places.
void expect_close_values(const torch::Tensor& actual, const torch::Tensor& expected, double relative,
                         const std::string& what, double absolute = 0) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const auto a = actual.to(torch::kFloat64).cpu();
  const auto e = expected.to(torch::kFloat64).cpu();
  EXPECT_TRUE(torch::equal(a.isnan(), e.isnan())) << what << ": NaN at other places";
  const auto infinite = e.isinf();
  EXPECT_TRUE(torch::equal(a.isinf(), infinite)) << what << ": infinities at other places";
  EXPECT_TRUE(torch::equal(a.index({infinite}), e.index({infinite}))) << what << ": infinities of another sign";
  const auto finite = e.isfinite();
  const auto excess = (a - e).abs().index({finite}) - relative * e.abs().index({finite}) - absolute;
  if (excess.numel() > 0) {
    EXPECT_LE(excess.max().item<double>(), 0.0) << what << ": max |difference| "
                                                << (a - e).abs().index({finite}).max().item<double>();
  }
}

// The tile kernels' cases: 77 rows, each dtype, tiles of 1000 columns (16-byte packs, not a
// multiple of 32) and 333 (one value at a time), each case from `seed`.
constexpr int64_t kTileRows = 77;

template <typename Case>
void for_each_tile_case(uint64_t seed, const Case& run_case) {
  for (const auto dtype : kTileDtypes) {
    for (const int64_t tile : {1000, 333}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + ", tile " + std::to_string(tile));
      torch::manual_seed(seed);
      run_case(dtype, tile);
    }
  }
}

// The statistics kernel folds a tile into the running max, sum of exp and target logit as the
// torch operations do: the max and the target logit equal, the sum within 1e-6 relative (its fp32
// sum over the tile taken in another order). Two tiles in turn, the first from the empty
// statistics (max -inf); 77 rows, tiles of 1000 columns (16-byte packs, not a multiple of 32) and
// 333 (one value at a time). A row all -inf in the first tile keeps a -inf max and gets a NaN sum
// (exp(-inf - -inf)) from both.
TEST(FusedLossCuda, TileStatisticsKernelEqualsTheTorchOperations) {
  if (const auto missing = cuda_kernels_missing(); !missing.empty()) GTEST_SKIP() << missing;
  const auto fp32 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32);
  for_each_tile_case(13, [&](torch::ScalarType dtype, int64_t tile) {
    auto seen = unfolded_statistics(kTileRows, fp32);
    for (int64_t step = 0; step < 2; ++step) {
      SCOPED_TRACE("tile " + std::to_string(step + 1) + " of 2");
      auto t = random_logit_tile(kTileRows, tile, 500 + step * tile, dtype);
      if (step == 0) t.logits[1].fill_(-std::numeric_limits<float>::infinity());
      const auto kernel = kernels::cross_entropy_tile_statistics_cuda(seen, t.logits, t.targets, t.begin);
      // The reference works in place on fp32 logits: a copy.
      const auto reference = fold_tile_statistics_reference(seen, t.logits.clone(), t.targets, t.begin);
      expect_close_values(kernel.max, reference.max, 0.0, "max");
      expect_close_values(kernel.sum, reference.sum, 1e-6, "sum");
      expect_close_values(kernel.target_logit, reference.target_logit, 0.0, "target logit");
      EXPECT_TRUE(reference.sum[1].isnan().item<bool>());
      EXPECT_GT(reference.target_logit.abs().max().item<double>(), 0.0);
      seen = reference;
    }
  });
}

// The exponentials kernel folds the statistics as the statistics kernel does (the same bits) and
// writes exp(z - max) over the tile in its dtype, 0 at the target: within one rounding of the
// dtype of the torch operations' (expf against torch's exp), two tiles in turn as above. Under a
// cap each value also carries 1 - (z / cap)^2, which cancels where |z| nears the cap: the two
// compute it in fp32 in another order, so they may differ by two fp32 roundings of 1 (2^-22)
// times exp(z - max) <= 1, absolute (on the H200: 1.2e-7 where the factor was near 0).
TEST(FusedLossCuda, TileExponentialsKernelEqualsTheTorchOperations) {
  if (const auto missing = cuda_kernels_missing(); !missing.empty()) GTEST_SKIP() << missing;
  const auto fp32 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32);
  for (const double softcap : {0.0, 5.0}) {  // with a cap, the logits capped: cap tanh(x / cap)
  SCOPED_TRACE("cap " + std::to_string(softcap));
  for_each_tile_case(15, [&](torch::ScalarType dtype, int64_t tile) {
    auto seen = unfolded_statistics(kTileRows, fp32);
    const double rounding = dtype == torch::kBFloat16 ? 1.0 / 128 : dtype == torch::kHalf ? 1.0 / 1024 : 1e-6;
    for (int64_t step = 0; step < 2; ++step) {
      SCOPED_TRACE("tile " + std::to_string(step + 1) + " of 2");
      auto t = random_logit_tile(kTileRows, tile, 500 + step * tile, dtype);
      if (softcap > 0) t.logits = (torch::tanh(t.logits.to(torch::kFloat32) / softcap) * softcap).to(dtype);
      const auto statistics = kernels::cross_entropy_tile_statistics_cuda(seen, t.logits, t.targets, t.begin);
      auto kernel_tile = t.logits.clone();
      const auto kernel =
          kernels::cross_entropy_tile_exponentials_cuda(seen, kernel_tile, t.targets, t.begin, softcap);
      auto reference_tile = t.logits.clone();
      const auto reference = fold_tile_exponentials_reference(seen, reference_tile, t.targets, t.begin, softcap);
      EXPECT_TRUE(testing::same_bits(kernel.max, statistics.max));
      EXPECT_TRUE(testing::same_bits(kernel.sum, statistics.sum));
      EXPECT_TRUE(testing::same_bits(kernel.target_logit, statistics.target_logit));
      expect_close_values(kernel.sum, reference.sum, 1e-6, "sum");
      expect_close_values(kernel.target_logit, reference.target_logit, 0.0, "target logit");
      expect_close_values(kernel_tile, reference_tile, rounding, "exponentials", softcap > 0 ? std::ldexp(1.0, -22) : 0.0);
      // 0 at a target in the tile (rows 3, 4 and 8 hold one).
      for (const int64_t row : {3, 4, 8}) {
        EXPECT_EQ(kernel_tile[row][t.targets[row].item<int64_t>() - t.begin].item<double>(), 0.0) << "row " << row;
      }
      seen = statistics;
    }
  });
  }
}

// On a GPU the kernels take every tile, so the torch-operation path no longer runs there (the
// tests above hold the kernels to it tile by tile): the loss and the states' gradient against
// float64 in each dtype, tiles of 256 (16-byte packs; the last, 232 columns, ragged) and 250 (one
// value at a time), without and with Gemma 2's cap of 5. Bounds: the CPU tests' for fp32 and
// bf16; fp16, with three more mantissa bits than bf16, a quarter of bf16's. And fp32 against the
// torch operations on the CPU, on the same inputs: the loss within 1e-6, the gradient within
// 1e-5 (the matmuls' sums in another order).
TEST(FusedLossCuda, KernelPathEqualsAFloat64ReferenceAndTheCpuPath) {
  if (const auto missing = cuda_kernels_missing(); !missing.empty()) GTEST_SKIP() << missing;
  const torch::Device cuda(torch::kCUDA, 0);
  struct Bounds {
    torch::ScalarType dtype;
    double loss, grad;
  };
  for (const auto& bounds : {Bounds{torch::kFloat32, 2e-6, 1e-5}, Bounds{torch::kBFloat16, 2e-3, 2e-2},
                             Bounds{torch::kHalf, 5e-4, 5e-3}}) {
    for (const int64_t tile : {256, 250}) {
      for (const double softcap : {0.0, 5.0}) {
        SCOPED_TRACE(std::string(c10::toString(bounds.dtype)) + ", tile " + std::to_string(tile) + ", cap " +
                     std::to_string(softcap));
        expect_float64_reference(bounds.dtype, 21, bounds.loss, bounds.grad, cuda, tile, softcap);
        expect_float64_reference(bounds.dtype, 21, bounds.loss, bounds.grad, cuda, tile, softcap, /*declared=*/true);
      }
    }
  }
  torch::manual_seed(22);
  const auto problem = random_problem(200, 64, 1000, torch::kFloat32, 3.0, cuda);
  FusedLossOptions options;
  options.chunk_tokens = 48;
  options.tile_columns = 250;
  const auto on_gpu = fused_loss(problem.states, problem.weight, problem.targets, 0.0, 0.37, options);
  const auto on_cpu = fused_loss(problem.states.cpu(), problem.weight.cpu(), problem.targets.cpu(), 0.0, 0.37, options);
  EXPECT_NEAR(on_gpu.loss, on_cpu.loss, 1e-6 * on_cpu.loss);
  EXPECT_LE(max_relative_error(on_gpu.grad, on_cpu.grad), 1e-5);
  options.gradient = 0.37;  // declared, on each
  const auto forward_on_gpu = fused_loss(problem.states, problem.weight, problem.targets, 0.0, 0.37, options);
  const auto forward_on_cpu =
      fused_loss(problem.states.cpu(), problem.weight.cpu(), problem.targets.cpu(), 0.0, 0.37, options);
  EXPECT_LE(max_relative_error(forward_on_gpu.grad, forward_on_cpu.grad), 1e-5);
  EXPECT_LE(max_relative_error(forward_on_gpu.grad, on_cpu.grad), 1e-5);
}

// The per-token losses (the preference objectives') on the kernels, each token's gradient computed
// in the forward (the exponentials kernel, with and without the cap), within the CPU's bounds.
TEST(FusedLossCuda, PerTokenLossesEqualAFloat64Reference) {
  if (const auto missing = cuda_kernels_missing(); !missing.empty()) GTEST_SKIP() << missing;
  expect_per_token_float64_reference(torch::kCUDA);
}

}  // namespace
}  // namespace qtrain::trainer
