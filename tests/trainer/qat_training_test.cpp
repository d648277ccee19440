// quant: qat end to end on the bundled tiny model: recipes are checked when loaded, fake
// quantization starts at qat.start_step, the quantizers' state survives a resume, LoRA under
// QAT exports as a PEFT adapter, and QAT ends below post-training quantization.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "json_support.h"
#include "kernels/error.h"
#include "support.h"
#include "trainer/model/evaluate.h"
#include "trainer/finetune.h"
#include "trainer/recipe/recipe_data.h"
#include "trainer/recipe/recipe_training.h"
#include "trainer/trained_run.h"
#include "trainer/formats/training_checkpoint.h"

namespace qtrain::trainer {
namespace {

using testing::logged_losses;

const std::string kDemo = testing::source_dir() + "/recipes/demo";

// Full-weight QAT of the tiny model on the Q4_0 grid, a few short steps.
std::vector<std::string> qat_settings(const testing::TempDir& run, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> overrides = {
      "model.path=" + kDemo + "/tiny-llama", "data.train=" + kDemo + "/brown-train.jsonl",
      "data.eval=" + kDemo + "/brown-val.jsonl", "quant=qat", "lora.rank=0", "export.formats=[]",
      "qat.weights.scale_dtype=fp16", "data.max_seq_len=64", "train.micro_batch_size=2", "train.grad_accum_steps=1",
      "train.steps=4", "train.dtype=fp32", "train.device=cpu", "optim.lr=1e-4", "schedule.warmup_steps=1",
      "eval.every=0", "eval.max_batches=2", "log.every=1", "train.output_dir=" + run.path()};
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  return overrides;
}

TrainSummary train(const std::vector<std::string>& overrides, const std::string& resume = "") {
  Finetune finetune(load_recipe("", overrides), resume);
  finetune.setup();
  return finetune.train();
}

std::string qat_load_error(const std::vector<std::string>& overrides) {
  try {
    load_recipe("", overrides);
  } catch (const Error& error) {
    return error.what();
  }
  return "no error";
}

TEST(QatRecipe, SchemesThatCannotWorkAreRefusedWhenTheRecipeLoads) {
  testing::TempDir run;
  const auto with = [&](std::vector<std::string> extra) { return qat_settings(run, extra); };
  EXPECT_NE(qat_load_error(with({"qat.weights.bits=9"})).find("qat.weights.bits"), std::string::npos);
  EXPECT_NE(qat_load_error(with({"qat.weights.learned_scale=true"})).find("qat.weights.learned_scale"), std::string::npos);
  EXPECT_NE(qat_load_error(with({"qat.weights.zero_point_domain=float"})).find("qat.weights.zero_point_domain: float"),
            std::string::npos);
  EXPECT_NE(qat_load_error(with({"lora.rank=4", "lora.dropout=0.1"})).find("lora.dropout"), std::string::npos);
  EXPECT_NE(qat_load_error(with({"quant=none", "export.formats=[safetensors-int]"})).find("quant: qat"), std::string::npos);
  EXPECT_NE(qat_load_error(with({"export.formats=[merged]", "export.gguf_type=Q4_K_M"})).find("export.gguf_type"), std::string::npos);
  EXPECT_NE(qat_load_error(with({"export.formats=[gguf]", "export.gguf_type=Q4_K"})).find("export.gguf_type"), std::string::npos);
}

// Before the model loads: the quantizers' own checks, naming the key.
TEST(QatRecipe, AnImpossibleSchemeStopsTheRunBeforeTheModelLoads) {
  testing::TempDir run;
  Finetune finetune(load_recipe("", qat_settings(run, {"qat.weights.format=fp8_e4m3", "qat.weights.symmetric=false",
                                                      "model.path=/nonexistent"})));
  try {
    finetune.setup();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("qat.weights.symmetric"), std::string::npos) << error.what();
  }
  // A float format takes its own width: the int width the recipe carries does not apply.
  auto fp8 = load_recipe("", qat_settings(run, {"qat.weights.format=fp8_e4m3", "qat.weights.granularity=per_channel"}));
  EXPECT_EQ(qat_linear_options(fp8).weights.spec.bits, 8);
}

// qat.weights.scheme: compressed-tensors' preset sets both grids; anything it would silently
// override is an error naming the key, as is a preset QAT cannot train.
TEST(QatRecipe, ACompressedTensorsSchemeSetsBothGrids) {
  testing::TempDir run;
  auto settings = [&](std::vector<std::string> extra) {
    auto all = qat_settings(run, extra);
    all.erase(std::find(all.begin(), all.end(), "qat.weights.scale_dtype=fp16"));
    return all;
  };
  const auto w8a8 = qat_linear_options(load_recipe("", settings({"qat.weights.scheme=W8A8"})));
  const auto& preset = qat::find_quant_preset("W8A8", "test");
  EXPECT_EQ(w8a8.weights.spec.describe(), qat::QuantSpec::compressed_tensors_weights(preset).describe());
  ASSERT_TRUE(w8a8.activations.has_value());
  EXPECT_EQ(w8a8.activations->spec.describe(), qat::QuantSpec::compressed_tensors_activations(preset).describe());
  const auto w4a16 = load_recipe("", settings({"qat.weights.scheme=W4A16", "export.formats=[compressed-tensors]"}));
  EXPECT_FALSE(qat_linear_options(w4a16).activations.has_value());
  EXPECT_STREQ(compressed_tensors_export_scheme(w4a16).name, "W4A16");
  EXPECT_STREQ(compressed_tensors_export_scheme(load_recipe("", settings({"quant=none", "lora.rank=4",
                                                                          "export.formats=[compressed-tensors]"}))).name,
               "W4A16");
  for (const auto& bad : std::vector<std::vector<std::string>>{{"qat.weights.scheme=W4A16", "qat.weights.bits=8"},
                                                              {"qat.weights.scheme=W4A16", "qat.activations.bits=8"},
                                                              {"qat.weights.scheme=W4A16", "quant=none", "lora.rank=4"},
                                                              {"qat.weights.scheme=NVFP4A16"}}) {
    EXPECT_NE(qat_load_error(settings(bad)).find("qat.weights.scheme"), std::string::npos) << qat_load_error(settings(bad));
  }
  EXPECT_NE(qat_load_error(settings({"export.scheme=W8A8"})).find("export.scheme"), std::string::npos);
}

TEST(QatRecipe, AGroupSizeThatDoesNotDivideTheLayerNamesTheKey) {
  testing::TempDir run;
  Finetune finetune(load_recipe("", qat_settings(run, {"qat.weights.group_size=48"})));
  try {
    finetune.setup();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("qat.weights.group_size"), std::string::npos) << error.what();
  }
}

// Before qat.start_step the run is the float run, step for step; from there the rounding shows.
TEST(QatTraining, FakeQuantizationStartsAtStartStep) {
  testing::TempDir qat_run, float_run;
  train(qat_settings(qat_run, {"qat.start_step=2"}));
  train(qat_settings(float_run, {"quant=none"}));
  const auto quantized = logged_losses(qat_run.path());
  const auto plain = logged_losses(float_run.path());
  ASSERT_EQ(quantized.size(), 4u);
  ASSERT_EQ(plain.size(), 4u);
  EXPECT_EQ(quantized[0], plain[0]);
  EXPECT_EQ(quantized[1], plain[1]);
  EXPECT_NE(quantized[2], plain[2]);
}

// Learned scales (parameters), observer ranges and zero points (buffers) all continue.
TEST(QatTraining, AResumedRunContinuesWithTheQuantizersState) {
  const std::vector<std::string> settings = {
      "qat.weights.observer=minmax", "qat.weights.learned_scale=true", "qat.activations.bits=8",
      "qat.activations.symmetric=false", "qat.activations.granularity=per_tensor",
      "qat.activations.observer=moving_average", "qat.activations.momentum=0.1", "train.steps=6",
      "checkpoint.every=3", "checkpoint.keep_last=0"};
  testing::TempDir whole_run, resumed_run;
  train(qat_settings(whole_run, settings));
  const auto whole = logged_losses(whole_run.path());
  ASSERT_EQ(whole.size(), 6u);
  std::filesystem::create_directories(resumed_run.file("checkpoints"));
  std::filesystem::copy(whole_run.file("checkpoints/step-000003"), resumed_run.file("checkpoints/step-000003"),
                        std::filesystem::copy_options::recursive);
  train(qat_settings(resumed_run, settings), "auto");
  const auto continued = logged_losses(resumed_run.path());
  ASSERT_EQ(continued.size(), 3u);
  for (size_t step = 0; step < 3; ++step) EXPECT_EQ(continued[step], whole[3 + step]) << "step " << step + 4;
}

// Evaluations (before the first step and between steps) leave the calibrated ranges alone.
TEST(QatTraining, EvaluationDoesNotMoveTheObservedRanges) {
  const std::vector<std::string> settings = {"qat.activations.bits=8", "qat.activations.granularity=per_tensor",
                                             "qat.activations.observer=minmax", "train.steps=2", "eval.every=1"};
  testing::TempDir evaluated, not_evaluated;
  train(qat_settings(evaluated, settings));
  auto without_eval = qat_settings(not_evaluated, settings);
  without_eval.push_back("data.eval=");
  train(without_eval);
  const auto first = read_training_checkpoint(evaluated.file("checkpoints/step-000002")).trainable;
  const auto second = read_training_checkpoint(not_evaluated.file("checkpoints/step-000002")).trainable;
  ASSERT_EQ(first.size(), second.size());
  int ranges = 0;
  for (size_t index = 0; index < first.size(); ++index) {
    if (first[index].first.find("activation_fake_quant.observer.") == std::string::npos) continue;
    ++ranges;
    EXPECT_TRUE(torch::equal(first[index].second, second[index].second)) << first[index].first;
  }
  EXPECT_EQ(ranges, 2 * 4 * 7);
}

// LoRA (and DoRA) trains through the fake-quantized merged weight; the adapter is still peft's; the run's
// model rebuilt from its directory and its safetensors-int export evaluate as the run's last
// evaluation did; its GGUF export is written (its contents: gguf_export_test.cpp).
TEST(QatTraining, LoraUnderQatWritesItsAdapterAndExportsThatReload) {
  for (const std::string dora : {"false", "true"}) {
    SCOPED_TRACE("lora.use_dora=" + dora);
    testing::TempDir run;
    const auto overrides = qat_settings(
        run, {"lora.rank=4", "lora.alpha=8", "lora.dropout=0", "export.formats=[peft, gguf, safetensors-int]",
              "optim.lr=1e-3", "lora.use_dora=" + dora});
    const auto summary = train(overrides);
    for (const char* file : {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "export/model.gguf",
                             "export/safetensors-int/model.safetensors"}) {
      EXPECT_TRUE(std::filesystem::exists(run.file(file))) << file;
    }
    auto rebuilt = load_trained_run(run.path(), "", /*quantize_base=*/true);
    EXPECT_EQ(qat::find_qat_layers(*rebuilt.loaded.model).size(), 4u * 7u);
    const auto recipe = load_recipe("", overrides);
    const auto tokenizer = data::Tokenizer::from_model_dir(recipe.model.path);
    EvalOptions options;
    options.batch_size = recipe.train.micro_batch_size;
    options.max_batches = recipe.eval.max_batches;
    const auto examples = load_eval_examples(recipe, tokenizer).examples;
    EXPECT_NEAR(evaluate(*rebuilt.loaded.model, examples, options).loss, summary.last_eval_loss,
                1e-6 * summary.last_eval_loss);
    // The integer export evaluates as the run did (qtrain eval --model RUN/export/safetensors-int).
    auto exported = load_llama(run.file("export/safetensors-int"));
    EXPECT_NEAR(evaluate(*exported.model, examples, options).loss, summary.last_eval_loss,
                1e-6 * summary.last_eval_loss);
  }
}

// The reason QAT exists, on a short run: the same fine-tune with and without fake quantization,
// then the float one rounded afterwards (PTQ, identical quantizers). int2 groups of 32, where
// rounding costs enough that a few steps show the difference beyond run-to-run noise (the
// int4 figures are in docs/QAT.md).
TEST(QatTraining, QatEndsBelowFineTuneThenPtq) {
  const std::vector<std::string> settings = {"train.steps=12", "optim.lr=2e-4", "eval.max_batches=4",
                                             "qat.weights.bits=2", "qat.weights.scale_dtype=fp32"};
  testing::TempDir qat_run, float_run;
  const auto qat = train(qat_settings(qat_run, settings));
  auto float_settings = settings;
  float_settings.push_back("quant=none");
  const auto plain = train(qat_settings(float_run, float_settings));

  auto fine_tuned = load_trained_run(float_run.path(), "", /*quantize_base=*/true);
  const auto qat_recipe = load_recipe("", qat_settings(qat_run, settings));
  apply_recipe_qat(*fine_tuned.loaded.model, qat_recipe, &fine_tuned.loaded.config);
  const auto tokenizer = data::Tokenizer::from_model_dir(qat_recipe.model.path);
  EvalOptions options;
  options.batch_size = qat_recipe.train.micro_batch_size;
  options.max_batches = qat_recipe.eval.max_batches;
  const double ptq = evaluate(*fine_tuned.loaded.model, load_eval_examples(qat_recipe, tokenizer).examples, options).loss;
  std::printf("eval loss: fine-tuned %.4f, then PTQ %.4f; QAT %.4f\n", plain.last_eval_loss, ptq, qat.last_eval_loss);
  EXPECT_LT(plain.last_eval_loss, ptq);
  EXPECT_LT(qat.last_eval_loss, ptq);
}

}  // namespace
}  // namespace qtrain::trainer
