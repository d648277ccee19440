// The training loop end to end on the bundled tiny model: QLoRA on a CPU, seeded, evaluated,
// exported as a PEFT adapter.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "support.h"
#include "trainer/evaluate.h"
#include "trainer/finetune.h"

namespace qtrain::trainer {
namespace {

// A few short steps on the demo's model and data.
Recipe small_recipe(const testing::TempDir& run, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> overrides = {
      "model.path=" + testing::source_dir() + "/recipes/demo/tiny-llama",
      "data.train=" + testing::source_dir() + "/recipes/demo/brown-val.jsonl",
      "data.eval=" + testing::source_dir() + "/recipes/demo/brown-val.jsonl",
      "quant=qlora", "lora.rank=4", "lora.alpha=8", "lora.dropout=0.1", "data.max_seq_len=64",
      "train.micro_batch_size=2", "train.grad_accum_steps=2", "train.steps=4", "train.dtype=fp32",
      "train.device=cpu", "optim.lr=1e-3", "schedule.warmup_steps=1", "eval.every=0", "eval.max_batches=2",
      "log.every=1", "train.output_dir=" + run.path()};
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  return load_recipe("", overrides);
}

std::vector<double> logged_losses(const std::string& run_dir) {
  std::ifstream metrics(run_dir + "/metrics.jsonl");
  std::vector<double> losses;
  std::string line;
  while (std::getline(metrics, line)) {
    auto value = nlohmann::json::parse(line);
    if (value.contains("loss")) losses.push_back(value["loss"].get<double>());
  }
  return losses;
}

TEST(Finetune, SameRecipeAndSeedGiveBitwiseEqualLosses) {
  testing::TempDir first_run, second_run;
  for (const auto* run : {&first_run, &second_run}) {
    Finetune finetune(small_recipe(*run));
    finetune.setup();
    finetune.train();
  }
  const auto first = logged_losses(first_run.path());
  ASSERT_EQ(first.size(), 4u);
  EXPECT_EQ(first, logged_losses(second_run.path()));

  testing::TempDir other_seed;
  Finetune finetune(small_recipe(other_seed, {"train.seed=7"}));
  finetune.setup();
  finetune.train();
  EXPECT_NE(first, logged_losses(other_seed.path()));
}

// The loss of an accumulation window is the mean over all its learned tokens, as if it were
// one batch, not the mean of per-micro-batch means: 2 micro-batches of 2 equal 1 batch of 4.
TEST(Finetune, GradientAccumulationAveragesOverTheWholeWindow) {
  const std::string chats = testing::source_dir() + "/recipes/demo/chat-val.jsonl";
  std::vector<std::vector<double>> losses;
  for (const auto& batching : {std::vector<std::string>{"train.micro_batch_size=2", "train.grad_accum_steps=2"},
                               std::vector<std::string>{"train.micro_batch_size=4", "train.grad_accum_steps=1"}}) {
    testing::TempDir run;
    auto overrides = batching;
    for (const char* key : {"data.format=chat", "data.eval=", "lora.dropout=0", "train.steps=2", "data.max_seq_len=128"}) {
      overrides.push_back(key);
    }
    overrides.push_back("data.train=" + chats);
    Finetune finetune(small_recipe(run, overrides));
    finetune.setup();
    finetune.train();
    losses.push_back(logged_losses(run.path()));
  }
  ASSERT_EQ(losses[0].size(), 2u);
  for (size_t step = 0; step < 2; ++step) EXPECT_NEAR(losses[0][step], losses[1][step], 1e-5) << "step " << step + 1;
}

TEST(Finetune, TrainingLowersTheEvalLossAndWritesTheRunDirectory) {
  testing::TempDir run;
  Finetune finetune(small_recipe(run, {"train.steps=12", "lora.dropout=0"}));
  finetune.setup();
  const auto summary = finetune.train();
  EXPECT_LT(summary.last_eval_loss, summary.first_eval_loss);
  for (const char* file : {"recipe.yaml", "metrics.jsonl", "adapter/adapter_config.json",
                           "adapter/adapter_model.safetensors"}) {
    EXPECT_TRUE(std::ifstream(run.file(file)).good()) << file;
  }
  std::ifstream metrics(run.file("metrics.jsonl"));
  std::string line;
  std::getline(metrics, line);
  EXPECT_TRUE(nlohmann::json::parse(line).contains("eval_loss")) << line;
  std::getline(metrics, line);
  const auto step = nlohmann::json::parse(line);
  for (const char* key : {"step", "loss", "lr", "grad_norm", "tokens_per_second", "memory"}) {
    EXPECT_TRUE(step.contains(key)) << key << " in " << line;
  }
  // The recipe written to the run parses back to the recipe that ran.
  EXPECT_EQ(load_recipe(run.file("recipe.yaml"), {}), small_recipe(run, {"train.steps=12", "lora.dropout=0"}));
}

TEST(Finetune, TheSavedAdapterReproducesTheFinalEvalLoss) {
  testing::TempDir run;
  Finetune finetune(small_recipe(run, {"lora.dropout=0"}));
  finetune.setup();
  const auto summary = finetune.train();
  // A fresh QLoRA model with the adapter from disk: the same loss as the run's last evaluation.
  testing::TempDir again;
  Finetune reloaded(small_recipe(again, {"lora.init_from=" + summary.adapter_dir, "train.steps=1"}));
  reloaded.setup();
  const auto check = reloaded.train();
  EXPECT_NEAR(check.first_eval_loss, summary.last_eval_loss, 1e-6 * summary.last_eval_loss);
}

TEST(Finetune, ATargetThatMatchesNothingIsAnError) {
  testing::TempDir run;
  Finetune finetune(small_recipe(run, {"lora.target_modules=[qproj]"}));
  try {
    finetune.setup();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("qproj"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace qtrain::trainer
