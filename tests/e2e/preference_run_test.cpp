// Preference training through the CLI: the DPO demo (recipes/demo_dpo_tiny.yaml) learns to prefer
// the held-out true continuations, logs TRL's metrics, resumes, and leaves an adapter that peft
// loads with our logits.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "support.h"
#include "json_support.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/formats/safetensors.h"

namespace qtrain {
namespace {

using testing::CommandResult;
using testing::run_command;

using testing::qtrain;

std::string dpo_recipe() { return testing::source_dir() + "/recipes/demo_dpo_tiny.yaml"; }

using testing::metrics_lines;
using testing::logged;
// {step: value} of a metrics key.

TEST(PreferenceRun, TwentyDpoStepsOfTheDemoRaiseHeldOutRewardAccuracyAndPeftLoadsTheAdapter) {
  testing::TempDir temp;
  const auto run = temp.file("run");
  const auto trained = qtrain("--recipe " + dpo_recipe() + " --set train.output_dir=" + run);
  ASSERT_EQ(trained.status, 0) << trained.output;
  const auto lines = metrics_lines(run);
  const auto accuracy = logged(lines, "eval_rewards/accuracies");
  const auto margin = logged(lines, "eval_rewards/margins");
  ASSERT_TRUE(accuracy.count(0) && accuracy.count(20)) << trained.output;
  std::printf("[ measured ] held-out rewards/accuracies %.3f -> %.3f, margins %.4f -> %.4f\n", accuracy.at(0),
              accuracy.at(20), margin.at(0), margin.at(20));
  // Before the first step the policy is the reference: every reward is 0, no pair is won.
  EXPECT_EQ(accuracy.at(0), 0.0);
  EXPECT_GT(accuracy.at(20), 0.75);
  EXPECT_GT(margin.at(20), 0.0);
  // The train lines carry TRL's metrics.
  for (const char* key : {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                          "logps/rejected"}) {
    EXPECT_EQ(logged(lines, key).size(), 4u) << key;
  }

  const auto python = testing::find_python_with("peft transformers safetensors");
  if (python.empty()) GTEST_SKIP() << "no Python with peft and transformers (set QTRAIN_PYTHON)";
  const auto model_dir = testing::source_dir() + "/recipes/demo/tiny-llama";
  auto loaded = trainer::load_llama(model_dir);
  trainer::apply_peft_adapter(*loaded.model, run + "/adapter");
  const auto input_ids = torch::randint(8192, {2, 24}, torch::kInt64);
  const auto inputs = temp.file("inputs.safetensors");
  trainer::write_safetensors(inputs, {{"input_ids", input_ids}});
  torch::Tensor ours;
  {
    torch::NoGradGuard no_grad;
    ours = loaded.model->forward({input_ids, {}, {}});
  }
  const auto logits = temp.file("logits.safetensors");
  const auto ran = run_command("'" + python + "' '" + testing::source_dir() + "/tests/interop/peft_logits.py' '" +
                               model_dir + "' '" + run + "/adapter' '" + inputs + "' input_ids '" + logits + "' 2>&1");
  ASSERT_EQ(ran.status, 0) << ran.output;
  const auto theirs = trainer::SafetensorsFile::open(logits).tensor("logits");
  EXPECT_LE(((ours - theirs).abs().max() / theirs.abs().max()).item<double>(), 1e-4);
}

TEST(PreferenceRun, ShowsPairsAndRefusesWhatItDoesNotDo) {
  const auto shown = qtrain("data --recipe " + dpo_recipe() + " -n 1");
  ASSERT_EQ(shown.status, 0) << shown.output;
  EXPECT_NE(shown.output.find("[chosen, "), std::string::npos) << shown.output;
  EXPECT_NE(shown.output.find("[rejected, "), std::string::npos) << shown.output;
  const auto packed = qtrain("--recipe " + dpo_recipe() + " --set data.pack=true --print-recipe");
  EXPECT_NE(packed.status, 0);
  EXPECT_NE(packed.output.find("data.pack"), std::string::npos) << packed.output;
  const auto sft = qtrain("--recipe " + dpo_recipe() + " --set train.objective=sft --print-recipe");
  EXPECT_NE(sft.status, 0);
  EXPECT_NE(sft.output.find("train.objective"), std::string::npos) << sft.output;
  const auto smoothing = qtrain("--recipe " + dpo_recipe() + " --set dpo.label_smoothing=0.1 --print-recipe");
  EXPECT_NE(smoothing.status, 0);
  EXPECT_NE(smoothing.output.find("robust"), std::string::npos) << smoothing.output;
}

// A DPO run resumed from its step-2 checkpoint takes steps 3 and 4 as the whole run took them.
TEST(PreferenceRun, AResumedDpoRunTakesTheSameSteps) {
  testing::TempDir temp;
  const std::string common = "--recipe " + dpo_recipe() + " --set train.steps=4 --set eval.every=0 --set data.eval= "
                             "--set log.every=1 --set checkpoint.every=2 --set checkpoint.keep_last=0 --set train.output_dir=" +
                             temp.path();
  const auto whole = qtrain(common);
  ASSERT_EQ(whole.status, 0) << whole.output;
  const auto first = logged(metrics_lines(temp.path()), "loss");
  const auto resumed = qtrain(common + " --resume " + temp.file("checkpoints/step-000002"));
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  const auto again = logged(metrics_lines(temp.path()), "loss");
  ASSERT_EQ(first.size(), 4u);
  EXPECT_EQ(again, first);
  EXPECT_EQ(logged(metrics_lines(temp.path()), "rewards/margins").size(), 4u);
}

// Full-weight DPO has no adapters to switch off: the reference's log-probabilities are taken from
// the model as loaded, before the first step; the first step's policy is that model, so its loss
// is log 2. ORPO and SimPO need no reference.
TEST(PreferenceRun, FullWeightDpoTakesTheReferenceBeforeTraining) {
  testing::TempDir temp;
  // The demo's first 24 train and 8 eval pairs: the reference pass reads every pair of both.
  const auto first_lines = [&](const std::string& name, int count) {
    std::ifstream in(testing::source_dir() + "/recipes/demo/" + name);
    std::ofstream out(temp.file(name));
    std::string line;
    for (int i = 0; i < count && std::getline(in, line); ++i) out << line << "\n";
    return temp.file(name);
  };
  const std::string common = "--recipe " + dpo_recipe() + " --set quant=none --set lora.rank=0 --set optim.lr=1e-5 "
                             "--set train.steps=2 --set eval.every=0 --set eval.max_batches=2 --set log.every=1" +
                             " --set data.train=" + first_lines("pairs-train.jsonl", 24) +
                             " --set data.eval=" + first_lines("pairs-val.jsonl", 8);
  const auto trained = qtrain(common + " --set train.output_dir=" + temp.file("dpo"));
  ASSERT_EQ(trained.status, 0) << trained.output;
  EXPECT_NE(trained.output.find("reference log-probabilities of 24 train pairs"), std::string::npos) << trained.output;
  EXPECT_NE(trained.output.find("reference log-probabilities of 8 eval pairs"), std::string::npos) << trained.output;
  const auto losses = logged(metrics_lines(temp.file("dpo")), "loss");
  ASSERT_EQ(losses.size(), 2u);
  EXPECT_NEAR(losses.at(1), std::log(2.0), 1e-5);
  for (const char* objective : {"orpo", "simpo"}) {
    const auto other = qtrain(common + " --set train.objective=" + objective + " --set train.output_dir=" +
                              temp.file(objective));
    ASSERT_EQ(other.status, 0) << other.output;
    EXPECT_EQ(other.output.find("reference log-probabilities"), std::string::npos) << other.output;
    EXPECT_EQ(logged(metrics_lines(temp.file(objective)), "nll_loss").size(), 2u) << objective;
  }
}

// QAT-LoRA: the reference is the fake-quantized base with the adapters off; the first step's
// adapter has B = 0, so the policy is that same model and the loss is log 2.
TEST(PreferenceRun, QatLoraDpoTakesTheQuantizedBaseAsTheReference) {
  testing::TempDir temp;
  const auto trained = qtrain("--recipe " + dpo_recipe() +
                              " --set quant=qat --set qat.base=nf4 --set qat.weights.bits=4 --set qat.weights.granularity=per_group"
                              " --set qat.weights.group_size=32 --set qat.weights.observer=dynamic --set lora.dropout=0"
                              " --set train.steps=2 --set schedule.warmup_steps=0 --set eval.every=0 --set data.eval= --set log.every=1"
                              " --set train.output_dir=" +
                              temp.path());
  ASSERT_EQ(trained.status, 0) << trained.output;
  const auto losses = logged(metrics_lines(temp.path()), "loss");
  ASSERT_EQ(losses.size(), 2u);
  EXPECT_NEAR(losses.at(1), std::log(2.0), 1e-6);
  EXPECT_LT(losses.at(2), std::log(2.0));
}

}  // namespace
}  // namespace qtrain
