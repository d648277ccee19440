// A few QLoRA steps on each new family's fixture through the qtrain CLI: the adapter they write,
// loaded by peft onto transformers' model of that family, and their merged export, loaded by
// transformers, give the same logits as qtrain. A few QAT steps: their GGUF export runs in
// llama.cpp with the logits of their safetensors-int export (the QAT model, exactly) in qtrain.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "support.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/formats/safetensors.h"

namespace qtrain {
namespace {

class FamilyTraining : public ::testing::TestWithParam<std::string> {};

// The demo recipes target Llama's seven projections; Phi-3 has four, two of them fused.
std::string family_targets(const std::string& family) {
  if (family != "phi3") return "";
  return " --set 'lora.target_modules=[qkv_proj, o_proj, gate_up_proj, down_proj]'"
         " --set 'qat.target_modules=[qkv_proj, o_proj, gate_up_proj, down_proj]'";
}

// The qtrain CLI on recipes/`recipe` with model.path `model_dir`, then `flags`, writing its run to
// `run_dir`; its output holds stderr too.
testing::CommandResult run_recipe(const std::string& recipe, const std::string& model_dir, const std::string& flags,
                                  const std::string& run_dir) {
  return testing::run_command(testing::qtrain_binary() + " --recipe " + testing::source_dir() + "/recipes/" + recipe +
                              " --set model.path=" + model_dir + flags + " --set train.output_dir=" + run_dir + " 2>&1");
}

// True when `run` exited 0 having trained all `steps` steps.
bool trained_all_steps(const testing::CommandResult& run, int steps) {
  return run.status == 0 && run.output.find("done: " + std::to_string(steps) + " steps") != std::string::npos;
}

// A few QLoRA steps through the CLI on `model_dir` (with `flags`), then: peft on the adapter they
// wrote gives our logits, and transformers on their merged export gives ours for it.
// `reference` holds the inputs under `input_key` and the base's logits under `logits_key`.
void expect_trained_adapter_and_merge_match_peft(const std::string& name, const std::string& model_dir,
                                                 const std::string& reference, const std::string& flags,
                                                 const std::string& input_key = "input_ids",
                                                 const std::string& logits_key = "logits") {
  const auto python = testing::find_python_with("peft transformers safetensors");
  if (python.empty()) GTEST_SKIP() << "no Python with peft and transformers (set QTRAIN_PYTHON)";
  testing::TempDir temp;
  const auto trained = run_recipe("demo_tiny.yaml", model_dir,
                                  flags + " --set train.steps=3 --set schedule.warmup_steps=0 --set eval.every=0 "
                                          "--set data.eval= --set checkpoint.every=0",
                                  temp.file("run"));
  ASSERT_TRUE(trained_all_steps(trained, 3)) << trained.output;

  const std::string command = "'" + python + "' '" + testing::source_dir() + "/tests/interop/peft_logits.py' '" +
                              model_dir + "' '" + temp.file("run/adapter") + "' '" + reference + "' " + input_key + " '" +
                              temp.file("peft_logits.safetensors") + "' 2>&1";
  const auto peft = testing::run_command(command);
  ASSERT_EQ(peft.status, 0) << command << "\n" << peft.output;

  auto loaded = trainer::load_llama(model_dir);
  trainer::apply_peft_adapter(*loaded.model, temp.file("run/adapter"));
  torch::NoGradGuard no_grad;
  trainer::LlamaInputs inputs;
  inputs.input_ids = trainer::SafetensorsFile::open(reference).tensor(input_key);
  const auto ours = loaded.model->forward(inputs);
  const auto theirs = trainer::SafetensorsFile::open(temp.file("peft_logits.safetensors")).tensor("logits");
  const double error = (ours - theirs).abs().max().item<double>() / theirs.abs().max().item<double>();
  std::printf("[ measured ] %s: peft on the trained adapter vs ours: %.3g relative\n", name.c_str(), error);
  EXPECT_LE(error, 1e-5);
  // Training moved the adapter away from its zero B: the logits are not the base's.
  const auto base = trainer::SafetensorsFile::open(reference).tensor(logits_key);
  EXPECT_GT((ours - base).abs().max().item<double>(), 1e-4);

  // The merged export (the adapter merged into the NF4 base the run trained on) is a plain
  // checkpoint of the family: transformers loads it with every weight in place and gives the
  // logits qtrain gives for it.
  const auto merged = testing::run_command(testing::qtrain_binary() + " export --run " + temp.file("run") +
                                           " --format merged --dtype fp32 --out " + temp.file("merged") + " 2>&1");
  ASSERT_EQ(merged.status, 0) << merged.output;
  const std::string load = "'" + python + "' '" + testing::source_dir() + "/tests/interop/merged_model.py' logits '" +
                           temp.file("merged") + "' '" + reference + "' " + input_key + " '" +
                           temp.file("merged_logits.safetensors") + "' 2>&1";
  const auto transformers = testing::run_command(load);
  ASSERT_EQ(transformers.status, 0) << load << "\n" << transformers.output;
  auto merged_model = trainer::load_llama(temp.file("merged"));
  const auto our_merged = merged_model.model->forward(inputs);
  const auto their_merged = trainer::SafetensorsFile::open(temp.file("merged_logits.safetensors")).tensor("logits");
  const double merged_error =
      (our_merged - their_merged).abs().max().item<double>() / their_merged.abs().max().item<double>();
  std::printf("[ measured ] %s: transformers on the merged export vs ours: %.3g relative\n", name.c_str(), merged_error);
  EXPECT_LE(merged_error, 1e-5);

  // The run as GGUF files: Q4_K_M holds the bytes llama.cpp's quantizer gives the F32 file of the
  // same run, and llama.cpp runs it.
  const auto llama_cpp = testing::find_python_with("llama_cpp gguf numpy");
  if (llama_cpp.empty()) return;
  for (const std::string type : {"F32", "Q4_K_M"}) {
    const auto exported = testing::run_command(testing::qtrain_binary() + " export --run " + temp.file("run") +
                                               " --format gguf --gguf-type " + type + " --out " + temp.file(type + ".gguf") +
                                               " 2>&1");
    ASSERT_EQ(exported.status, 0) << exported.output;
  }
  const auto compared = testing::compare_with_llama_quantize(llama_cpp, temp.file("F32.gguf"), temp.file(""), "Q4_K_M");
  EXPECT_EQ(compared.result.status, 0) << compared.command << "\n" << compared.result.output;
  ASSERT_FALSE(compared.summary.empty()) << compared.result.output;
  std::printf("[ measured ] %s: GGUF of the run, %s\n", name.c_str(), compared.summary.c_str());
}

TEST_P(FamilyTraining, QloraStepsWriteAnAdapterPeftLoadsWithOurLogits) {
  const std::string name = GetParam();
  expect_trained_adapter_and_merge_match_peft(name, testing::fixture("families/" + name),
                                              testing::fixture("families/" + name + "-reference.safetensors"),
                                              family_targets(name));
}

// DoRA (lora.use_dora): peft builds its DoRA layers from the adapter's use_dora and magnitude
// vectors, on Llama and on Phi-3's fused projections.
TEST(DoraRuns, QloraStepsWriteADoraAdapterPeftLoadsWithOurLogits) {
  expect_trained_adapter_and_merge_match_peft("tiny-llama DoRA", testing::fixture("tiny-llama"),
                                              testing::fixture("tiny-llama-reference.safetensors"),
                                              " --set lora.use_dora=true", "base.input_ids", "base.logits");
  expect_trained_adapter_and_merge_match_peft("phi3 DoRA", testing::fixture("families/phi3"),
                                              testing::fixture("families/phi3-reference.safetensors"),
                                              family_targets("phi3") + " --set lora.use_dora=true");
}

// The families llama.cpp has a row for in trainer/formats/gguf_export.cpp.
class FamilyGgufTraining : public ::testing::TestWithParam<std::string> {};

TEST_P(FamilyGgufTraining, QatStepsExportAGgufLlamaCppRunsWithOurLogits) {
  const auto python = testing::find_python_with("llama_cpp safetensors torch");
  if (python.empty()) GTEST_SKIP() << "no Python with llama_cpp (tools/run-tests.sh installs it)";
  const std::string name = GetParam();
  testing::TempDir temp;
  const auto trained = run_recipe("demo_qat_tiny.yaml", testing::fixture("families/" + name),
                                  family_targets(name) +
                                      " --set train.steps=3 --set eval.every=0 --set data.eval= --set checkpoint.every=0 "
                                      "--set 'export.formats=[gguf, safetensors-int]'",
                                  temp.file("run"));
  ASSERT_TRUE(trained_all_steps(trained, 3)) << trained.output;

  const std::string text = "The Fulton County Grand Jury said Friday an investigation of the recent primary election in Atlanta "
                           "produced no evidence that any irregularities took place.";
  const std::string command = "'" + python + "' '" + testing::source_dir() + "/tests/interop/gguf_model.py' llama-cpp '" +
                              temp.file("run/export/model.gguf") + "' '" + text + "' '" + temp.file("llama_cpp.safetensors") +
                              "' 2>&1";
  const auto result = testing::run_command(command);
  ASSERT_EQ(result.status, 0) << command << "\n" << result.output;
  const auto theirs = trainer::SafetensorsFile::open(temp.file("llama_cpp.safetensors"));
  auto quantized = trainer::load_llama(temp.file("run/export/safetensors-int"));
  torch::NoGradGuard no_grad;
  trainer::LlamaInputs inputs;
  inputs.input_ids = theirs.tensor("input_ids");
  const auto ours = quantized.model->forward(inputs);
  const auto llama_cpp = theirs.tensor("logits");
  ASSERT_EQ(ours.sizes(), llama_cpp.sizes());
  const double relative = (ours - llama_cpp).abs().max().item<double>() / llama_cpp.abs().max().item<double>();
  const double top1 = ours.argmax(-1).eq(llama_cpp.argmax(-1)).to(torch::kFloat64).mean().item<double>();
  std::printf("[ measured ] %s: llama.cpp on the QAT run's GGUF vs qtrain on its safetensors-int: %.3g relative, top-1 "
              "%.1f%%\n", name.c_str(), relative, 100 * top1);
  // llama.cpp quantizes the activations to Q8_0 blocks; everything else is the same model.
  EXPECT_LT(relative, 0.05);
  EXPECT_GE(top1, 0.9);
}

// A run of `recipe` (in recipes/) on `model_dir` with `flags` stops before its first step with an
// error holding every one of `needles`.
void expect_refused_before_training(const std::string& recipe, const std::string& model_dir, const std::string& flags,
                                    const std::vector<std::string>& needles) {
  testing::TempDir temp;
  const auto run = run_recipe(recipe, model_dir, flags + " --set train.steps=3", temp.file("run"));
  EXPECT_NE(run.status, 0) << run.output;
  for (const auto& needle : needles) EXPECT_NE(run.output.find(needle), std::string::npos) << needle << "\n" << run.output;
  EXPECT_EQ(run.output.find("step 1/"), std::string::npos) << run.output;
}

// A run whose export.formats holds a format the model cannot take stops before it trains: here a
// Gemma 2 whose query_pre_attn_scalar is not the one llama.cpp's gemma2 fixes for its shape.
TEST(FamilyRuns, AGgufExportLlamaCppCannotHoldIsRefusedBeforeTheFirstStep) {
  testing::TempDir temp;
  std::filesystem::copy(testing::fixture("families/gemma2"), temp.file("gemma2"));
  auto config = nlohmann::json::parse(testing::read_text(temp.file("gemma2/config.json")));
  config["query_pre_attn_scalar"] = 20;
  temp.write("gemma2/config.json", config.dump());
  expect_refused_before_training("demo_qat_tiny.yaml", temp.file("gemma2"), "",
                                 {"GGUF export: Gemma2ForCausalLM with query_pre_attn_scalar 20"});
}

// Llama's target names on Phi-3 would leave q, k, v, gate and up unadapted: the run stops and
// names the fused projections.
TEST(FamilyRuns, LlamaTargetNamesOnPhi3AreRefusedNamingTheFusedProjections) {
  expect_refused_before_training("demo_tiny.yaml", testing::fixture("families/phi3"), "",
                                 {"lora.target_modules names 'q_proj'", "[qkv_proj, o_proj, gate_up_proj, down_proj]"});
}

// Gemma 3 in fp16 overflows; the run says so before it trains.
TEST(FamilyRuns, Gemma3InFp16IsRefusedNamingTrainDtype) {
  expect_refused_before_training("demo_tiny.yaml", testing::fixture("families/gemma3"), " --set train.dtype=fp16",
                                 {"train.dtype: fp16 with Gemma3ForCausalLM"});
}

// Five bf16 QLoRA steps on CUDA, checkpointed: finite losses, none skipped.
void expect_cuda_bf16_steps_finite(const std::string& model_dir, const std::string& flags) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  testing::TempDir temp;
  const auto trained = run_recipe("demo_tiny.yaml", model_dir,
                                  flags + " --set train.device=cuda --set train.dtype=bf16 --set train.steps=5 "
                                          "--set log.every=1 --set eval.every=0 --set eval.max_batches=2 "
                                          "--set checkpoint.every=0 --set train.gradient_checkpointing=true",
                                  temp.file("run"));
  ASSERT_TRUE(trained_all_steps(trained, 5)) << trained.output;
  EXPECT_EQ(trained.output.find("nan"), std::string::npos) << trained.output;
  EXPECT_EQ(trained.output.find("skipped"), std::string::npos) << trained.output;
}

TEST_P(FamilyTraining, QloraStepsOnCudaInBf16RunWithFiniteLosses) {
  expect_cuda_bf16_steps_finite(testing::fixture("families/" + GetParam()), family_targets(GetParam()));
}

TEST(DoraRuns, QloraStepsOnCudaInBf16RunWithFiniteLosses) {
  expect_cuda_bf16_steps_finite(testing::fixture("tiny-llama"), " --set lora.use_dora=true");
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyTraining,
                         ::testing::Values("mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"));
INSTANTIATE_TEST_SUITE_P(Families, FamilyGgufTraining,
                         ::testing::Values("mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"));

// The loss of the first step (before any update), as the progress line prints it.
double first_step_loss(const std::string& output) {
  const auto at = output.find("step 1/");
  const auto loss = output.find("| loss ", at);
  if (at == std::string::npos || loss == std::string::npos) return std::nan("");
  return std::stod(output.substr(loss + 7));
}

// A Mistral whose window (16) is shorter than the sequences (64): on CUDA in bf16 its sliding
// layers run flash attention's window (trainer/model/flash_attention.h), in fp32 SDPA over the
// written-out mask; both train, and their first losses agree to bf16's precision.
TEST(FamilySlidingWindow, CudaBf16FlashWindowTrainsWithTheMaskedPathsLoss) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  testing::TempDir temp;
  std::filesystem::create_directories(temp.file("mistral"));
  for (const auto& entry : std::filesystem::directory_iterator(testing::fixture("families/mistral"))) {
    std::filesystem::copy_file(entry.path(), temp.file("mistral/" + entry.path().filename().string()));
  }
  auto config = nlohmann::json::parse(testing::read_text(temp.file("mistral/config.json")));
  config["sliding_window"] = 16;
  temp.write("mistral/config.json", config.dump());
  double losses[2];
  int index = 0;
  for (const std::string dtype : {"bf16", "fp32"}) {
    const auto trained = run_recipe("demo_tiny.yaml", temp.file("mistral"),
                                    " --set train.device=cuda --set train.dtype=" + dtype +
                                        " --set train.steps=3 --set log.every=1 --set eval.every=0 --set data.eval= "
                                        "--set checkpoint.every=0 --set train.micro_batch_size=1 --set data.max_seq_len=64 "
                                        "--set lora.dropout=0",
                                    temp.file("run-" + dtype));
    ASSERT_TRUE(trained_all_steps(trained, 3)) << trained.output;
    losses[index++] = first_step_loss(trained.output);
  }
  std::printf("[ measured ] first loss, window 16 over 64 tokens: bf16 flash window %.5f, fp32 masked %.5f\n", losses[0],
              losses[1]);
  EXPECT_NEAR(losses[0], losses[1], 0.02 * losses[1]);
}

}  // namespace
}  // namespace qtrain
