// The training loop end to end on the bundled tiny model: QLoRA on a CPU, seeded, evaluated,
// exported as a PEFT adapter.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <nlohmann/json.hpp>

#include "json_support.h"
#include "kernels/error.h"
#include "support.h"
#include "trainer/model/evaluate.h"
#include "trainer/finetune.h"
#include "trainer/recipe/recipe_schema.h"

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

using testing::logged_losses;

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

// A NaN in one step's gradients skips that step: no weight ever holds a non-finite value, the
// schedule does not advance, the metrics record the skip, and training goes on.
TEST(Finetune, ANonFiniteGradientSkipsTheStepAndTrainingGoesOn) {
  testing::TempDir run;
  Finetune finetune(small_recipe(run, {"train.steps=5"}));
  finetune.setup();
  std::vector<torch::Tensor> weights;
  finetune.set_after_backward([&weights](int64_t step, const std::vector<torch::Tensor>& trainable) {
    if (step == 2) trainable.front().mutable_grad().view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
    weights = trainable;
  });
  finetune.train();
  for (const auto& weight : weights) EXPECT_TRUE(torch::isfinite(weight).all().item<bool>());
  std::ifstream metrics(run.path() + "/metrics.jsonl");
  std::vector<int64_t> skipped;
  std::string line;
  double lr_step3 = -1, lr_step4 = -1;
  while (std::getline(metrics, line)) {
    const auto value = nlohmann::json::parse(line);
    if (value.value("skipped", false)) skipped.push_back(value["step"].get<int64_t>());
    if (value.contains("lr") && value["step"] == 3) lr_step3 = value["lr"].get<double>();
    if (value.contains("lr") && value["step"] == 4) lr_step4 = value["lr"].get<double>();
  }
  EXPECT_EQ(skipped, std::vector<int64_t>{3});
  EXPECT_EQ(lr_step3, lr_step4);  // the skipped step 3 did not advance the schedule
  EXPECT_EQ(logged_losses(run.path()).size(), 5u);
}

TEST(Finetune, NonFiniteStepsStopTheRunWhenAbortOrTooManyInARow) {
  const auto poison = [](int64_t, const std::vector<torch::Tensor>& trainable) {
    trainable.front().mutable_grad().view(-1)[0] = std::numeric_limits<float>::infinity();
  };
  for (const std::vector<std::string>& policy : {std::vector<std::string>{"train.nonfinite=abort"},
                                                std::vector<std::string>{"train.max_skipped_steps=3"}}) {
    testing::TempDir run;
    auto overrides = policy;
    overrides.push_back("train.steps=6");
    Finetune finetune(small_recipe(run, overrides));
    finetune.setup();
    finetune.set_after_backward(poison);
    try {
      finetune.train();
      FAIL() << "expected the run to stop with " << policy[0];
    } catch (const Error& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find(policy[0] == "train.nonfinite=abort" ? "step 1 " : "step 3 "), std::string::npos)
          << message;
      EXPECT_NE(message.find("lower optim.lr"), std::string::npos) << message;
      EXPECT_EQ(error.code(), ErrorCode::kNumerics) << "documented in docs/ERRORS.md as QT-NUMERICS";
    }
  }
}

// Stopping at a checkpoint and resuming from it gives the losses of an uninterrupted run, bit for
// bit: shuffled packed chat data, dropout, gradient accumulation, in fp32 and bf16; and with the
// optimizer's state on the host between steps (the checkpoint reads it there), the same losses.
// bf16 runs a micro-batch of one: a CPU without AVX-512 multiplies bf16 in torch's reference loops,
// ten times fp32's time.
TEST(Finetune, AResumedRunContinuesBitwiseExactly) {
  std::vector<double> fp32_losses;
  for (const std::string variant : {"fp32", "bf16", "fp32, state on the host"}) {
    const std::string dtype = variant.substr(0, 4);
    const bool state_on_host = variant.size() > 4;
    const std::vector<std::string> settings = {
        "data.format=chat", "data.train=" + testing::source_dir() + "/recipes/demo/chat-val.jsonl", "data.eval=",
        "data.pack=true", "data.max_seq_len=64", "train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=0",
        "train.dtype=" + dtype, std::string("train.optimizer_states_on_host=") + (state_on_host ? "true" : "false"),
        std::string("train.micro_batch_size=") + (dtype == "bf16" ? "1" : "2")};
    testing::TempDir whole_run, resumed_run;
    {
      Finetune finetune(small_recipe(whole_run, settings));
      finetune.setup();
      finetune.train();
    }
    const auto whole = logged_losses(whole_run.path());
    ASSERT_EQ(whole.size(), 4u);
    if (variant == "fp32") fp32_losses = whole;
    if (state_on_host) EXPECT_EQ(whole, fp32_losses);
    // The resumed run starts from a copy of the first run's step-2 checkpoint.
    std::filesystem::create_directories(resumed_run.file("checkpoints"));
    std::filesystem::copy(whole_run.file("checkpoints/step-000002"), resumed_run.file("checkpoints/step-000002"),
                          std::filesystem::copy_options::recursive);
    Finetune resumed(small_recipe(resumed_run, settings), "auto");
    resumed.setup();
    resumed.train();
    const auto continued = logged_losses(resumed_run.path());
    ASSERT_EQ(continued.size(), 2u) << variant;
    for (size_t step = 0; step < 2; ++step) EXPECT_EQ(continued[step], whole[2 + step]) << variant << ", step " << step + 3;
  }
}

// A checkpoint holds one model: a key the schema marks as shaping it (the base, its
// quantization, the adapters' rank, the QAT schemes) must be what the checkpoint was written
// with; any other key may change on resume and is reported.
TEST(Finetune, ResumingUnderAnotherModelIsRefusedAndOtherChangesReported) {
  testing::TempDir run;
  Finetune first(small_recipe(run, {"train.steps=2", "checkpoint.every=2"}));
  first.setup();
  first.train();
  Finetune other_rank(small_recipe(run, {"train.steps=4", "checkpoint.every=2", "lora.rank=8"}), "auto");
  try {
    other_rank.setup();
    other_rank.train();
    FAIL() << "a checkpoint of another lora.rank was resumed";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("another model (lora.rank: "), std::string::npos) << error.what();
  }
  std::set<std::string> shaping;
  for (const auto& key : recipe_keys()) {
    if (key.model_shaping) shaping.insert(key.name);
  }
  for (const char* name : {"model.path", "quant", "qlora.quant_type", "lora.rank", "qat.weights.bits", "qat.target_modules"}) {
    EXPECT_TRUE(shaping.count(name)) << name;
  }
  for (const char* name : {"optim.lr", "train.steps", "lora.alpha", "lora.dropout", "data.train", "checkpoint.every"}) {
    EXPECT_FALSE(shaping.count(name)) << name;
  }
  Finetune other_lr(small_recipe(run, {"train.steps=4", "checkpoint.every=2", "optim.lr=1e-4"}), "auto");
  other_lr.setup();
  EXPECT_EQ(other_lr.train().steps, 4);
}

TEST(Finetune, DamagedCheckpointsAreSkippedAndKeepLastPrunes) {
  testing::TempDir run;
  {
    Finetune finetune(small_recipe(run, {"train.steps=6", "checkpoint.every=2", "checkpoint.keep_last=2"}));
    finetune.setup();
    finetune.train();
  }
  EXPECT_FALSE(std::filesystem::exists(run.file("checkpoints/step-000002")));
  EXPECT_TRUE(std::filesystem::exists(run.file("checkpoints/step-000004")));
  // Damage the newest: resuming takes the one before it.
  std::ofstream(run.file("checkpoints/step-000006/trainable.safetensors"), std::ios::app) << "x";
  Finetune resumed(small_recipe(run, {"train.steps=6", "checkpoint.every=2", "checkpoint.keep_last=2"}), "auto");
  resumed.setup();
  const auto summary = resumed.train();
  EXPECT_EQ(summary.steps, 6);
  // The first run's steps 1-4, then 5 and 6 again: what was logged after the checkpoint is dropped.
  EXPECT_EQ(logged_losses(run.path()).size(), 6u);
  // A checkpoint of another LoRA shape is refused, naming the key.
  Finetune other(small_recipe(run, {"train.steps=6", "lora.rank=8"}), run.file("checkpoints/step-000004"));
  try {
    other.setup();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("lora.rank"), std::string::npos) << error.what();
  }
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
