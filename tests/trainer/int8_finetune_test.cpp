// LoRA on an LLM.int8 base with 8-bit AdamW, end to end through Finetune on the bundled tiny
// model: the recipe's quant_type int8 builds Int8Linear bases, training lowers the loss, and a
// run resumed from a checkpoint (whose optimizer file keeps the 8-bit codes as they are)
// continues bitwise exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "json_support.h"
#include "optim/optimizer.h"
#include "qat/int8_linear.h"
#include "support.h"
#include "trainer/finetune.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/recipe/recipe_training.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {
namespace {

// Rank 16 makes every adapter matrix at least 4096 elements, so all of them get 8-bit state.
Recipe int8_recipe(const testing::TempDir& run, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> overrides = {
      "model.path=" + testing::source_dir() + "/recipes/demo/tiny-llama",
      "data.train=" + testing::source_dir() + "/recipes/demo/brown-val.jsonl",
      "data.eval=",
      "quant=qlora", "qlora.quant_type=int8", "optim.name=adamw8bit", "lora.rank=16", "lora.alpha=32",
      "lora.dropout=0", "data.max_seq_len=64", "train.micro_batch_size=2", "train.grad_accum_steps=1",
      "train.steps=6", "train.dtype=fp32", "train.device=cpu", "optim.lr=3e-3", "schedule.name=constant",
      "schedule.warmup_steps=0", "eval.every=0", "log.every=1", "checkpoint.every=3", "checkpoint.keep_last=0",
      "train.output_dir=" + run.path()};
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  return load_recipe("", overrides);
}

using testing::logged_losses;

TEST(Int8Finetune, TrainsLoraOnAnInt8BaseWithAdamW8bitAndResumesExactly) {
  testing::TempDir whole_run, resumed_run;
  // The base Finetune builds for the recipe.
  const auto base = load_base_model(int8_recipe(whole_run), torch::kFloat32, torch::kCPU, /*quantize_base=*/true);
  int64_t int8_layers = 0;
  for (const auto& item : base.model->named_modules()) {
    if (std::dynamic_pointer_cast<qat::Int8Linear>(item.value())) ++int8_layers;
  }
  EXPECT_EQ(int8_layers, 4 * 7);
  {
    Finetune finetune(int8_recipe(whole_run));
    finetune.setup();
    finetune.train();
  }
  const auto whole = logged_losses(whole_run.path());
  ASSERT_EQ(whole.size(), 6u);
  for (const double loss : whole) EXPECT_TRUE(std::isfinite(loss));

  // The optimizer state on disk: uint8 codes and fp32 absmax, as the optimizer holds them.
  const auto optimizer = SafetensorsFile::open(whole_run.file("checkpoints/step-000003/optimizer.safetensors"));
  int64_t code_tensors = 0;
  for (const auto& name : optimizer.names()) {
    if (name.size() > 7 && name.substr(name.size() - 7) == ".state1") {
      ++code_tensors;
      EXPECT_EQ(optimizer.tensor(name).scalar_type(), torch::kUInt8) << name;
    }
  }
  // Per layer 7 adapters x (A, B); k_proj's and v_proj's B [64, 16] are under 4096 elements.
  EXPECT_EQ(code_tensors, 4 * (2 * 7 - 2));

  std::filesystem::create_directories(resumed_run.file("checkpoints"));
  std::filesystem::copy(whole_run.file("checkpoints/step-000003"), resumed_run.file("checkpoints/step-000003"),
                        std::filesystem::copy_options::recursive);
  Finetune resumed(int8_recipe(resumed_run), "auto");
  resumed.setup();
  resumed.train();
  const auto continued = logged_losses(resumed_run.path());
  ASSERT_EQ(continued.size(), 3u);
  for (size_t step = 0; step < 3; ++step) EXPECT_EQ(continued[step], whole[3 + step]) << "step " << step + 4;
}

// Optimizer state of a full fine-tune of tiny-llama (every weight trains, fp32): AdamW keeps two
// fp32 moments; 8-bit AdamW one byte each plus an fp32 absmax per 256, except for tensors under
// 4096 elements (the norms), which keep fp32 moments.
TEST(Int8Finetune, AdamW8bitStateOfATinyLlamaFullFinetuneIsAboutAQuarterOfAdamWs) {
  std::map<std::string, double> state_bytes;
  int64_t parameters = 0;
  for (const std::string name : {"adamw", "adamw8bit"}) {
    auto loaded = load_llama(testing::source_dir() + "/recipes/demo/tiny-llama");
    std::vector<torch::Tensor> trainable;
    for (auto& parameter : loaded.model->parameters()) {
      parameter.set_requires_grad(true);
      parameter.mutable_grad() = torch::randn_like(parameter) * 1e-3;
      trainable.push_back(parameter);
    }
    auto optimizer = optim::make_optimizer(name, trainable, 1e-4, 0.0, {0.9, 0.999}, 1e-8);
    optimizer->step();
    parameters = 0;
    for (const auto& parameter : trainable) parameters += parameter.numel();
    for (const auto& [field, tensor] : optimizer->state()) {
      if (field.find(".step") == std::string::npos) state_bytes[name] += static_cast<double>(tensor.nbytes());
    }
  }
  std::printf("tiny-llama full fine-tune (%.2fM parameters): optimizer state AdamW %.2f MiB, AdamW8bit %.2f MiB "
              "(%.2fx less)\n",
              parameters / 1e6, state_bytes["adamw"] / (1 << 20), state_bytes["adamw8bit"] / (1 << 20),
              state_bytes["adamw"] / state_bytes["adamw8bit"]);
  EXPECT_DOUBLE_EQ(state_bytes["adamw"], 8.0 * static_cast<double>(parameters));
  EXPECT_LT(state_bytes["adamw8bit"], state_bytes["adamw"] / 3.9);
  EXPECT_GT(state_bytes["adamw8bit"], 2.0 * static_cast<double>(parameters));
}

}  // namespace
}  // namespace qtrain::trainer
