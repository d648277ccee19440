// Greedy generation against transformers' generate(do_sample=False), token for token, on the
// tiny-llama fixture with and without its LoRA adapter (tests/interop/generate_greedy.py).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "support.h"
#include "trainer/model/generation.h"
#include "trainer/formats/generation_config.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/peft_adapter.h"

namespace qtrain::trainer {
namespace {

using testing::fixture;

constexpr int64_t kNewTokens = 24;

std::vector<std::vector<int64_t>> prompts() {
  const auto tokenizer = data::Tokenizer::from_model_dir(fixture("tiny-llama"));
  std::vector<std::vector<int64_t>> ids;
  for (const char* text : {"The jury said that the city", "He had never", "In the morning, the committee of the"}) {
    ids.push_back(tokenizer.encode(text));
  }
  return ids;
}

std::vector<std::vector<int64_t>> our_greedy_tokens(const std::vector<std::vector<int64_t>>& prompt_ids,
                                                    const std::string& adapter_dir, const torch::Device& device) {
  ModelLoadOptions load;
  load.device = device;
  auto loaded = load_llama(fixture("tiny-llama"), load);
  if (!adapter_dir.empty()) apply_peft_adapter(*loaded.model, adapter_dir);
  auto options = read_generation_config(fixture("tiny-llama"), loaded.config);
  options.max_new_tokens = kNewTokens;
  std::vector<std::vector<int64_t>> tokens;
  for (const auto& ids : prompt_ids) tokens.push_back(generate(*loaded.model, ids, options).tokens);
  return tokens;
}

// Our greedy tokens and transformers' for every prompt, the model in fp32 on `device`, without
// and with the fixture's adapter.
void expect_transformers_greedy_tokens(const torch::Device& device) {
  const auto python = testing::find_python_with("torch transformers peft");
  if (python.empty()) GTEST_SKIP() << "no Python with transformers and peft (set QTRAIN_PYTHON)";
  testing::TempDir temp;
  const auto prompt_ids = prompts();
  std::ofstream(temp.file("prompts.json")) << nlohmann::json(prompt_ids).dump();
  const std::string command = "'" + python + "' '" + testing::source_dir() + "/tests/interop/generate_greedy.py' '" +
                              fixture("tiny-llama") + "' '" + temp.file("prompts.json") + "' " +
                              std::to_string(kNewTokens) + " " + (device.is_cuda() ? "cuda" : "cpu") + " '" +
                              temp.file("theirs.json") + "' '" + fixture("tiny-llama-lora") + "' 2>&1";
  const auto result = testing::run_command(command);
  ASSERT_EQ(result.status, 0) << command << "\n" << result.output;
  std::ifstream theirs_file(temp.file("theirs.json"));
  const auto theirs = nlohmann::json::parse(theirs_file);

  for (const std::string adapter_dir : {std::string(), fixture("tiny-llama-lora")}) {
    const auto expected =
        theirs.at(adapter_dir.empty() ? "base" : "adapter").get<std::vector<std::vector<int64_t>>>();
    const auto ours = our_greedy_tokens(prompt_ids, adapter_dir, device);
    ASSERT_EQ(ours.size(), expected.size());
    for (size_t index = 0; index < ours.size(); ++index) {
      EXPECT_EQ(ours[index], expected[index]) << (adapter_dir.empty() ? "base" : "adapter") << ", prompt " << index;
      EXPECT_GE(ours[index].size(), 8u) << "the comparison should cover more than a token or two";
    }
  }
}

TEST(GenerationInterop, GreedyEqualsTransformersGenerateWithAndWithoutAdapterOnCpu) {
  expect_transformers_greedy_tokens(torch::kCPU);
}

TEST(GenerationInterop, GreedyEqualsTransformersGenerateWithAndWithoutAdapterOnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  expect_transformers_greedy_tokens(torch::Device(torch::kCUDA, 0));
}

}  // namespace
}  // namespace qtrain::trainer
