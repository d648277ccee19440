// Generation: decoding with the key/value cache gives the logits of the full forward pass, each
// logits processor is its definition in transformers, and generate() stops where it should.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>
#include <set>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include "kernels/error.h"
#include "support.h"
#include "trainer/model/generation.h"
#include "trainer/formats/generation_config.h"
#include "trainer/formats/hf_config.h"
#include "trainer/model/llama.h"
#include "small_llama.h"

namespace qtrain::trainer {
namespace {

// A fresh random Llama with GQA, biases and a non-trivial norm, fp32 on the CPU.
LlamaForCausalLM random_llama(uint64_t seed) {
  torch::manual_seed(seed);
  auto options = testing::small_llama_options(/*hidden_size=*/64, /*layers=*/3);
  options.attention_bias = true;
  options.rope.theta = 500000.0;
  LlamaForCausalLM model(options, torch::kFloat32);
  torch::NoGradGuard no_grad;
  for (auto& parameter : model->parameters()) parameter.normal_(0.0, 0.3);
  model->eval();
  return model;
}

torch::Tensor logits_with_cache(LlamaForCausalLMImpl& model, const torch::Tensor& input_ids, KeyValueCache& cache) {
  LlamaInputs inputs;
  inputs.input_ids = input_ids;
  inputs.cache = &cache;
  return model.forward(inputs);
}

TEST(KeyValueCache, DecodingTokenByTokenGivesTheFullForwardLogits) {
  auto model = random_llama(3);
  torch::NoGradGuard no_grad;
  const auto ids = torch::randint(0, 97, {1, 21}, torch::kInt64);
  LlamaInputs full_inputs;
  full_inputs.input_ids = ids;
  const auto full = model->forward(full_inputs);  // [1, 21, vocab]

  // A prompt of 9 (prefill), one token at a time up to 17, then a chunk of 4 after the cache
  // (the masked path a chunked prefill takes).
  KeyValueCache cache(3);
  std::vector<torch::Tensor> pieces = {logits_with_cache(*model, ids.narrow(1, 0, 9), cache)};
  for (int64_t position = 9; position < 17; ++position) {
    pieces.push_back(logits_with_cache(*model, ids.narrow(1, position, 1), cache));
  }
  pieces.push_back(logits_with_cache(*model, ids.narrow(1, 17, 4), cache));
  EXPECT_EQ(cache.length(), 21);
  const auto cached = torch::cat(pieces, 1);
  const double error = (cached - full).abs().max().item<double>() / full.abs().max().item<double>();
  std::printf("[ measured ] KV-cache decoding vs full forward: %.3g relative\n", error);
  EXPECT_LE(error, 1e-5);
}

// What generate() runs on a GPU in bf16: the cache's growing key lengths through flash attention
// (cuDNN's attention set aside), against the fp32 full forward on the CPU. Tolerance: bf16 keeps
// 8 bits of mantissa, and three layers of bf16 matmuls and activations compound to a few 1e-2.
TEST(KeyValueCache, DecodingInBf16OnCudaStaysWithinBf16RoundingOfTheFp32Forward) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  auto model = random_llama(5);
  torch::NoGradGuard no_grad;
  const auto ids = torch::randint(0, 97, {1, 40}, torch::kInt64);
  LlamaInputs full_inputs;
  full_inputs.input_ids = ids;
  const auto full = model->forward(full_inputs);
  model->to(torch::Device(torch::kCUDA, 0), torch::kBFloat16);
  const WithoutCudnnAttention attention_for_growing_lengths;
  KeyValueCache cache(3);
  const auto on_gpu = ids.to(torch::kCUDA);
  std::vector<torch::Tensor> pieces = {logits_with_cache(*model, on_gpu.narrow(1, 0, 7), cache)};
  for (int64_t position = 7; position < 40; ++position) {
    pieces.push_back(logits_with_cache(*model, on_gpu.narrow(1, position, 1), cache));
  }
  const auto cached = torch::cat(pieces, 1).to(torch::kCPU, torch::kFloat32);
  const double error = (cached - full).abs().max().item<double>() / full.abs().max().item<double>();
  std::printf("[ measured ] bf16 KV-cache decoding on CUDA vs fp32 full forward: %.3g relative\n", error);
  EXPECT_LE(error, 5e-2);
}

TEST(Generate, PutsCudnnAttentionBackAsItFoundIt) {
  auto model = random_llama(6);
  GenerationOptions options;
  options.max_new_tokens = 3;
  const bool before = at::globalContext().userEnabledCuDNNSDP();
  for (const bool enabled : {true, false}) {
    at::globalContext().setSDPUseCuDNN(enabled);
    {
      const WithoutCudnnAttention inside;
      EXPECT_FALSE(at::globalContext().userEnabledCuDNNSDP());
    }
    generate(*model, {3, 14, 15}, options);
    EXPECT_EQ(at::globalContext().userEnabledCuDNNSDP(), enabled);
  }
  at::globalContext().setSDPUseCuDNN(before);
}

TEST(KeyValueCache, RefusesAnAttentionMask) {
  auto model = random_llama(4);
  torch::NoGradGuard no_grad;
  KeyValueCache cache(3);
  LlamaInputs inputs;
  inputs.input_ids = torch::zeros({1, 3}, torch::kInt64);
  inputs.attention_mask = AttentionMask::written_out(torch::ones({1, 1, 3, 3}, torch::kBool));
  inputs.cache = &cache;
  EXPECT_THROW(model->forward(inputs), Error);
}

// The processors' definitions, element by element in double precision.
std::vector<double> values_of(const torch::Tensor& row) {
  auto as_double = row.to(torch::kFloat64).contiguous();
  return std::vector<double>(as_double.data_ptr<double>(), as_double.data_ptr<double>() + as_double.numel());
}

const double kMinusInfinity = -std::numeric_limits<double>::infinity();

TEST(LogitsProcessors, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogitsOfSeenTokens) {
  const auto logits = torch::tensor({{2.0, -1.0, 0.5, -3.0, 4.0}});
  const auto previous = torch::tensor({{0, 1, 1, 3}}, torch::kInt64);  // token 1 twice: penalised once
  const auto result = values_of(apply_repetition_penalty(logits, previous, 2.0)[0]);
  const std::vector<double> expected = {1.0, -2.0, 0.5, -6.0, 4.0};
  for (size_t index = 0; index < expected.size(); ++index) EXPECT_DOUBLE_EQ(result[index], expected[index]) << index;
}

TEST(LogitsProcessors, TopKKeepsTheKLargestAndTheirTies) {
  const auto logits = torch::tensor({{1.0, 5.0, 3.0, 3.0, -2.0, 0.0}});
  const auto result = values_of(apply_top_k(logits, 2)[0]);
  // The 2nd largest is 3.0; both 3.0s stay.
  const std::vector<double> expected = {kMinusInfinity, 5.0, 3.0, 3.0, kMinusInfinity, kMinusInfinity};
  EXPECT_EQ(result, expected);
  EXPECT_EQ(values_of(apply_top_k(logits, 100)[0]), values_of(logits[0]));
}

TEST(LogitsProcessors, TopPKeepsTheSmallestSetReachingThatProbability) {
  torch::manual_seed(5);
  const auto logits = torch::randn({1, 40}, torch::kFloat32) * 2;
  for (const double top_p : {0.05, 0.5, 0.9, 0.999}) {
    const auto result = values_of(apply_top_p(logits, top_p)[0]);
    // Definition: sorted ascending, a token goes when the probability of it and every less
    // likely token is at most 1 - top_p; the most likely token always stays.
    auto values = values_of(logits[0]);
    std::vector<size_t> order(values.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return values[a] < values[b]; });
    double normaliser = 0;
    for (double value : values) normaliser += std::exp(value);
    double cumulative = 0;
    for (size_t rank = 0; rank < order.size(); ++rank) {
      cumulative += std::exp(values[order[rank]]) / normaliser;
      const bool removed = cumulative <= 1.0 - top_p + 1e-6 && rank + 1 < order.size();
      if (std::abs(cumulative - (1.0 - top_p)) < 1e-5) continue;  // too close to call in fp32
      EXPECT_EQ(result[order[rank]] == kMinusInfinity, removed) << "top_p " << top_p << " rank " << rank;
    }
  }
}

TEST(LogitsProcessors, GreedyAppliesOnlyTheRepetitionPenalty) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(0);
  const auto logits = torch::tensor({{1.0, 3.0, 2.5}});
  const auto previous = torch::tensor({{1}}, torch::kInt64);
  SamplingOptions greedy;
  greedy.temperature = 0.01;  // ignored without sampling, as transformers ignores it
  greedy.top_k = 1;
  EXPECT_EQ(choose_next_tokens(logits, previous, greedy, generator).item<int64_t>(), 1);
  greedy.repetition_penalty = 1.5;  // 3.0 / 1.5 = 2.0 < 2.5
  EXPECT_EQ(choose_next_tokens(logits, previous, greedy, generator).item<int64_t>(), 2);
}

TEST(LogitsProcessors, SamplingDrawsOnlyKeptTokensAndRepeatsWithTheSeed) {
  const auto logits = torch::tensor({{0.0, 2.0, 1.9, 1.8, -1.0}});
  const auto previous = torch::tensor({{0}}, torch::kInt64);
  SamplingOptions sampling;
  sampling.do_sample = true;
  sampling.temperature = 0.7;
  sampling.top_k = 3;
  sampling.top_p = 0.9;
  auto draw = [&](uint64_t seed) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
    std::vector<int64_t> tokens;
    for (int index = 0; index < 300; ++index) {
      tokens.push_back(choose_next_tokens(logits, previous, sampling, generator).item<int64_t>());
    }
    return tokens;
  };
  const auto tokens = draw(7);
  std::set<int64_t> distinct(tokens.begin(), tokens.end());
  EXPECT_EQ(distinct, (std::set<int64_t>{1, 2, 3}));
  EXPECT_EQ(draw(7), tokens);
  EXPECT_NE(draw(8), tokens);
}

TEST(Generate, GreedyTokensAreTheFullForwardArgmaxes) {
  auto model = random_llama(6);
  GenerationOptions options;
  options.max_new_tokens = 12;
  const std::vector<int64_t> prompt = {3, 14, 15, 92, 65};
  const auto result = generate(*model, prompt, options);
  ASSERT_EQ(result.tokens.size(), 12u);
  EXPECT_FALSE(result.stopped_at_eos);

  std::vector<int64_t> sequence = prompt;
  sequence.insert(sequence.end(), result.tokens.begin(), result.tokens.end());
  torch::NoGradGuard no_grad;
  LlamaInputs inputs;
  inputs.input_ids = torch::tensor(sequence, torch::kInt64).unsqueeze(0);
  const auto full = model->forward(inputs)[0];
  for (size_t step = 0; step < result.tokens.size(); ++step) {
    EXPECT_EQ(full[static_cast<int64_t>(prompt.size() + step) - 1].argmax().item<int64_t>(), result.tokens[step]) << step;
  }
}

TEST(Generate, StopsAfterAnEndOfSequenceTokenAndStreamsEachToken) {
  auto model = random_llama(6);
  GenerationOptions options;
  options.max_new_tokens = 12;
  const auto free_run = generate(*model, {3, 14, 15}, options);
  options.eos_token_ids = {999, free_run.tokens.at(2)};
  std::vector<int64_t> streamed;
  const auto stopped = generate(*model, {3, 14, 15}, options, [&](int64_t token) { streamed.push_back(token); });
  EXPECT_TRUE(stopped.stopped_at_eos);
  EXPECT_EQ(stopped.tokens, std::vector<int64_t>(free_run.tokens.begin(), free_run.tokens.begin() + 3));
  EXPECT_EQ(streamed, stopped.tokens);
  EXPECT_THROW(generate(*model, {}, options), Error);
  EXPECT_THROW(generate(*model, {97}, options), Error);
}

TEST(GenerationConfig, ReadsTransformersKeysOverItsDefaults) {
  testing::TempDir temp;
  const auto config = read_hf_config(testing::fixture("tiny-llama"));
  const auto defaults = read_generation_config(testing::fixture("tiny-llama"), config);
  EXPECT_FALSE(defaults.sampling.do_sample);
  EXPECT_EQ(defaults.sampling.top_k, 50);
  EXPECT_EQ(defaults.eos_token_ids, std::vector<int64_t>{4});

  temp.write("generation_config.json",
             R"({"do_sample": true, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [128001, 128009]})");
  const auto read = read_generation_config(temp.path(), config);
  EXPECT_TRUE(read.sampling.do_sample);
  EXPECT_DOUBLE_EQ(read.sampling.temperature, 0.6);
  EXPECT_DOUBLE_EQ(read.sampling.top_p, 0.9);
  EXPECT_EQ(read.eos_token_ids, (std::vector<int64_t>{128001, 128009}));

  temp.write("generation_config.json", R"({"top_k": -3})");
  try {
    read_generation_config(temp.path(), config);
    FAIL() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("generation_config.json: key 'top_k'"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace qtrain::trainer
