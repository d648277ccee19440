// Fine-grained FP8 checkpoints (Qwen3-FP8's and DeepSeek's format) as frozen bases: the demo's
// tiny model written as one (F8_E4M3 projections with a scale per 32 x 48 block, ragged at the
// edges), loaded back. Every weight equals fp8 x scale computed in float64 and rounded once;
// the loaded model's logits equal those of the same values loaded as a plain checkpoint; a QLoRA
// run trains on it; malformed files are errors naming the key or tensor.
#include "json_support.h"
#include "trainer/formats/fp8_checkpoint.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "qat/compressed_linear.h"
#include "support.h"
#include "trainer/finetune.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/formats/safetensors.h"
#include "trainer/recipe/recipe.h"

namespace qtrain::trainer {
namespace {

constexpr int64_t kBlockRows = 32;
constexpr int64_t kBlockColumns = 48;  // 256 = 5 x 48 + 16: ragged last blocks

bool is_projection(const std::string& name) {
  for (const char* projection : {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}) {
    if (name.find(std::string(projection) + ".weight") != std::string::npos) return true;
  }
  return false;
}

// The demo model as an FP8 checkpoint in `dir`: each projection's blocks scaled to e4m3's 448,
// as Qwen3-FP8 stores them. Returns the float64 dequantization of every FP8 weight.
std::map<std::string, torch::Tensor> write_fp8_tiny_llama(const std::string& dir, const std::string& format = "e4m3",
                                                          bool drop_a_scale = false, int64_t rows_per_block = kBlockRows,
                                                          int64_t columns_per_block = kBlockColumns) {
  const std::string source = testing::source_dir() + "/recipes/demo/tiny-llama";
  const auto weights = SafetensorsCheckpoint::open(source);
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  std::map<std::string, torch::Tensor> expected;
  for (const auto& name : weights.names()) {
    const auto weight = weights.tensor(name);
    if (!is_projection(name)) {
      tensors.emplace_back(name, weight);
      continue;
    }
    const int64_t rows = weight.size(0), columns = weight.size(1);
    const int64_t block_rows = (rows + rows_per_block - 1) / rows_per_block, block_columns = (columns + columns_per_block - 1) / columns_per_block;
    auto scale = torch::empty({block_rows, block_columns}, torch::kFloat32);
    auto fp8 = torch::empty({rows, columns}, torch::kFloat8_e4m3fn);
    for (int64_t r = 0; r < block_rows; ++r) {
      for (int64_t c = 0; c < block_columns; ++c) {
        const auto block = weight.to(torch::kFloat32)
                               .narrow(0, r * rows_per_block, std::min(rows_per_block, rows - r * rows_per_block))
                               .narrow(1, c * columns_per_block, std::min(columns_per_block, columns - c * columns_per_block));
        const float block_scale = std::max(block.abs().max().item<float>() / 448.0f, 1e-12f);
        scale[r][c] = block_scale;
        fp8.narrow(0, r * rows_per_block, block.size(0)).narrow(1, c * columns_per_block, block.size(1)).copy_((block / block_scale).to(torch::kFloat8_e4m3fn));
      }
    }
    tensors.emplace_back(name, fp8);
    if (!(drop_a_scale && name == "model.layers.1.mlp.up_proj.weight")) tensors.emplace_back(name + "_scale_inv", scale);
    const auto expanded = scale.to(torch::kFloat64).repeat_interleave(rows_per_block, 0).repeat_interleave(columns_per_block, 1);
    expected[name] = fp8.to(torch::kFloat64) * expanded.narrow(0, 0, rows).narrow(1, 0, columns);
  }
  write_safetensors(dir + "/model.safetensors", tensors);
  std::ifstream config_file(source + "/config.json");
  auto config = nlohmann::json::parse(config_file);
  config["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", format}, {"activation_scheme", "dynamic"},
                                   {"weight_block_size", {rows_per_block, columns_per_block}}};
  std::ofstream(dir + "/config.json") << config.dump(1);
  for (const char* file : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}) {
    std::filesystem::copy_file(source + "/" + file, dir + "/" + file);
  }
  return expected;
}

TEST(Fp8Checkpoint, WeightsAreFp8TimesTheirBlocksScaleRoundedOnce) {
  testing::TempDir dir;
  const auto expected = write_fp8_tiny_llama(dir.path());
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    ModelLoadOptions options;
    options.dtype = dtype;
    const auto loaded = load_llama(dir.path(), options);
    std::map<std::string, std::shared_ptr<qat::LinearLayer>> layers;
    for (const auto& found : qat::find_linear_layers(
             *loaded.model, [](const std::string&, const qat::LinearLayer&) { return true; },
             [](const qat::LinearLayer&) { return true; })) {
      layers[found.name + ".weight"] = found.layer;
    }
    ASSERT_EQ(expected.size(), 28u);
    for (const auto& [name, values] : expected) {
      // Kept as stored: one byte a weight, dequantized by each product.
      const auto* stored = dynamic_cast<const qat::CompressedLinear*>(layers.at(name).get());
      ASSERT_NE(stored, nullptr) << name;
      EXPECT_EQ(stored->compressed_weight().data.scalar_type(), torch::kFloat8_e4m3fn);
      EXPECT_TRUE(torch::equal(stored->matmul_weight(dtype), values.to(dtype))) << name << " in " << c10::toString(dtype);
    }
  }
}

TEST(Fp8Checkpoint, LogitsEqualThoseOfTheSameValuesInAPlainCheckpoint) {
  testing::TempDir fp8_dir, plain_dir;
  const auto expected = write_fp8_tiny_llama(fp8_dir.path());
  const std::string source = testing::source_dir() + "/recipes/demo/tiny-llama";
  const auto weights = SafetensorsCheckpoint::open(source);
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& name : weights.names()) {
    tensors.emplace_back(name, expected.count(name) ? expected.at(name).to(torch::kFloat32) : weights.tensor(name));
  }
  write_safetensors(plain_dir.path() + "/model.safetensors", tensors);
  std::filesystem::copy_file(source + "/config.json", plain_dir.path() + "/config.json");
  auto fp8 = load_llama(fp8_dir.path());
  auto plain = load_llama(plain_dir.path());
  auto original = load_llama(source);
  torch::NoGradGuard no_grad;
  const auto input_ids = torch::randint(8192, {2, 24}, torch::kInt64);
  const auto fp8_logits = fp8.model->forward({input_ids, {}, {}});
  EXPECT_TRUE(torch::equal(fp8_logits, plain.model->forward({input_ids, {}, {}})));
  // The FP8 rounding moves the logits by a few percent of their range, not more.
  const auto original_logits = original.model->forward({input_ids, {}, {}});
  const double range = (original_logits.max() - original_logits.min()).item<double>();
  EXPECT_LT((fp8_logits - original_logits).abs().max().item<double>(), 0.05 * range);
}

TEST(Fp8Checkpoint, AQloraRunTrainsOnIt) {
  testing::TempDir model, run;
  write_fp8_tiny_llama(model.path());
  const auto recipe = load_recipe(
      "", {"model.path=" + model.path(), "data.train=" + testing::source_dir() + "/recipes/demo/brown-val.jsonl",
           "data.eval=", "quant=qlora", "lora.rank=4", "lora.alpha=8", "data.max_seq_len=64",
           "train.micro_batch_size=2", "train.steps=3", "train.dtype=fp32", "train.device=cpu", "optim.lr=1e-3",
           "schedule.warmup_steps=0", "eval.every=0", "log.every=1", "train.output_dir=" + run.path()});
  Finetune finetune(recipe);
  finetune.setup();
  finetune.train();
  const auto losses = testing::logged_losses(run.path());
  ASSERT_EQ(losses.size(), 3u);
  for (const double loss : losses) EXPECT_TRUE(std::isfinite(loss) && loss > 0 && loss < 20) << loss;
}

// LoRA on the FP8 base kept as stored (quant: none), in blocks transformers reads (128 x 128,
// dividing every projection): peft loads the adapter on the same checkpoint in transformers
// (which dequantizes FP8 on a CPU) with our logits.
TEST(Fp8Checkpoint, LoraTrainsOnItKeptAsFp8AndPeftLoadsTheAdapter) {
  if (const auto reason = testing::python_lacks("torch transformers peft safetensors"); !reason.empty()) GTEST_SKIP() << reason;
  testing::TempDir model, run, outputs;
  write_fp8_tiny_llama(model.path(), "e4m3", false, 128, 128);
  const auto recipe = load_recipe(
      "", {"model.path=" + model.path(), "data.train=" + testing::source_dir() + "/recipes/demo/brown-val.jsonl",
           "data.eval=", "quant=none", "lora.rank=4", "lora.alpha=8", "lora.dropout=0", "data.max_seq_len=64",
           "train.micro_batch_size=2", "train.steps=3", "train.dtype=fp32", "train.device=cpu", "optim.lr=1e-2",
           "schedule.warmup_steps=0", "eval.every=0", "log.every=1", "train.output_dir=" + run.path()});
  Finetune finetune(recipe);
  finetune.setup();
  const auto summary = finetune.train();

  auto loaded = load_llama(model.path());
  apply_peft_adapter(*loaded.model, summary.adapter_dir);
  const auto input_ids = torch::randint(8192, {2, 24}, torch::kInt64);
  const auto inputs = outputs.file("inputs.safetensors");
  write_safetensors(inputs, {{"input_ids", input_ids}});
  torch::Tensor ours;
  {
    torch::NoGradGuard no_grad;
    ours = loaded.model->forward({input_ids, {}, {}});
  }
  const auto logits = outputs.file("logits.safetensors");
  const auto ran = testing::run_interop_script("peft_logits.py", model.path() + " " + summary.adapter_dir + " " + inputs +
                                                                     " input_ids " + logits);
  ASSERT_EQ(ran.status, 0) << ran.output;
  const auto theirs = SafetensorsFile::open(logits).tensor("logits");
  const auto relative = ((ours - theirs).abs().max() / theirs.abs().max()).item<double>();
  EXPECT_LE(relative, 1e-4);
}

TEST(Fp8Checkpoint, MalformedFilesAreErrorsNamingTheKeyOrTensor) {
  const auto error_of = [](const std::string& dir) {
    try {
      load_llama(dir);
    } catch (const Error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  testing::TempDir other_format, missing_scale;
  write_fp8_tiny_llama(other_format.path(), "e5m2");
  EXPECT_NE(error_of(other_format.path()).find("quantization_config.fmt"), std::string::npos) << error_of(other_format.path());
  write_fp8_tiny_llama(missing_scale.path(), "e4m3", /*drop_a_scale=*/true);
  EXPECT_NE(error_of(missing_scale.path()).find("model.layers.1.mlp.up_proj.weight_scale_inv"), std::string::npos)
      << error_of(missing_scale.path());
}

}  // namespace
}  // namespace qtrain::trainer
