// LoRA on an FP8 base (qlora.quant_type: fp8) end to end through Finetune on the bundled tiny
// model, on the CPU's reference path: the recipe builds Float8Linear bases, and the loss curve
// follows the one over the unquantized base within FP8's error. Also qlora.fp8_compute, on a 4-bit
// and on a 16-bit base.
#include <gtest/gtest.h>

#include <cmath>

#include "json_support.h"
#include "kernels/error.h"
#include "qat/float8_linear.h"
#include "qat/four_bit_linear.h"
#include "trainer/recipe/base_quantization.h"
#include "small_llama.h"
#include "support.h"
#include "trainer/finetune.h"
#include "trainer/recipe/recipe_training.h"

namespace qtrain::trainer {
namespace {

Recipe lora_recipe(const testing::TempDir& run, const std::string& quant, const std::string& quant_type,
                   const std::string& fast_accumulation = "false", const std::string& fp8_compute = "false") {
  return load_recipe("", {"qlora.fp8_fast_accumulation=" + fast_accumulation, "qlora.fp8_compute=" + fp8_compute,
                          "model.path=" + testing::source_dir() + "/recipes/demo/tiny-llama",
                          "data.train=" + testing::source_dir() + "/recipes/demo/brown-val.jsonl", "data.eval=",
                          "quant=" + quant, "qlora.quant_type=" + quant_type, "lora.rank=8", "lora.alpha=16",
                          "lora.dropout=0", "data.max_seq_len=64", "train.micro_batch_size=2",
                          "train.grad_accum_steps=1", "train.steps=8", "train.dtype=fp32", "train.device=cpu",
                          "optim.lr=3e-3", "schedule.name=constant", "schedule.warmup_steps=0", "eval.every=0",
                          "log.every=1", "checkpoint.every=0", "train.output_dir=" + run.path()});
}

std::vector<double> train_losses(const Recipe& recipe, const std::string& run_dir) {
  Finetune finetune(recipe);
  finetune.setup();
  finetune.train();
  return testing::logged_losses(run_dir);
}

TEST(Float8Finetune, TheLossCurveFollowsTheUnquantizedBases) {
  testing::TempDir fp8_run, dense_run;
  const auto base = load_base_model(lora_recipe(fp8_run, "qlora", "fp8"), torch::kFloat32, torch::kCPU,
                                    /*quantize_base=*/true);
  int64_t fp8_layers = 0;
  for (const auto& item : base.model->named_modules()) {
    if (std::dynamic_pointer_cast<qat::Float8Linear>(item.value())) ++fp8_layers;
  }
  EXPECT_EQ(fp8_layers, 4 * 7);  // every projection; lm_head stays in qlora.skip_modules

  const auto fp8 = train_losses(lora_recipe(fp8_run, "qlora", "fp8"), fp8_run.path());
  const auto dense = train_losses(lora_recipe(dense_run, "none", "nf4"), dense_run.path());
  ASSERT_EQ(fp8.size(), 8u);
  ASSERT_EQ(dense.size(), 8u);
  double largest = 0;
  for (size_t step = 0; step < fp8.size(); ++step) largest = std::max(largest, std::abs(fp8[step] - dense[step]) / dense[step]);
  std::printf("fp8 base vs fp32 base, 8 LoRA steps: losses %.4f -> %.4f vs %.4f -> %.4f, largest relative gap %.2e\n",
              fp8.front(), fp8.back(), dense.front(), dense.back(), largest);
  // Both curves fall, and apart by FP8's error only: the tiny model's logits move by about 1% of
  // their size (e4m3's 2^-4 per value, averaged over 256 inputs).
  EXPECT_LT(fp8.back(), fp8.front());
  EXPECT_LT(largest, 0.01);
}

// The fast-accumulation key reaches every FP8 layer, and is an error on any other base.
TEST(Float8Finetune, FastAccumulationIsAnFp8KeyOnly) {
  testing::TempDir run;
  const auto base = load_base_model(lora_recipe(run, "qlora", "fp8", "true"), torch::kFloat32, torch::kCPU,
                                    /*quantize_base=*/true);
  int64_t fast_layers = 0;
  for (const auto& item : base.model->named_modules()) {
    if (const auto layer = std::dynamic_pointer_cast<qat::Float8Linear>(item.value())) fast_layers += layer->fast_accumulation();
  }
  EXPECT_EQ(fast_layers, 4 * 7);
  try {
    base_quantization(lora_recipe(run, "qlora", "nf4", "true"), torch::kBFloat16);
    FAIL() << "fast accumulation on an NF4 base was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("qlora.fp8_fast_accumulation"), std::string::npos) << error.what();
  }
}

// qlora.fp8_compute: every 4-bit projection multiplies on FP8 (here the CPU's reference path of
// the same quantized operands), and the curve follows the bf16-path NF4 run within FP8's error.
TEST(Float8Finetune, AFourBitBaseOnFloat8FollowsTheBf16Path) {
  testing::TempDir fp8_run, nf4_run;
  const auto recipe = lora_recipe(fp8_run, "qlora", "nf4", "false", "true");
  const auto base = load_base_model(recipe, torch::kFloat32, torch::kCPU, /*quantize_base=*/true);
  int64_t on_float8 = 0;
  for (const auto& item : base.model->named_modules()) {
    if (const auto layer = std::dynamic_pointer_cast<qat::FourBitLinear>(item.value())) on_float8 += layer->multiplies_itself();
  }
  EXPECT_EQ(on_float8, 4 * 7);
  const auto fp8 = train_losses(recipe, fp8_run.path());
  const auto nf4 = train_losses(lora_recipe(nf4_run, "qlora", "nf4"), nf4_run.path());
  ASSERT_EQ(fp8.size(), 8u);
  ASSERT_EQ(nf4.size(), 8u);
  double largest = 0;
  for (size_t step = 0; step < fp8.size(); ++step) largest = std::max(largest, std::abs(fp8[step] - nf4[step]) / nf4[step]);
  std::printf("nf4 on fp8 vs nf4, 8 LoRA steps: losses %.4f -> %.4f vs %.4f -> %.4f, largest relative gap %.2e\n",
              fp8.front(), fp8.back(), nf4.front(), nf4.back(), largest);
  EXPECT_LT(fp8.back(), fp8.front());
  EXPECT_LT(largest, 0.01);
  EXPECT_NO_THROW(base_quantization(lora_recipe(fp8_run, "qlora", "nf4", "true", "true"), torch::kBFloat16));
}

// qlora.fp8_compute on a 16-bit base (quant: none): its projections become the FP8 base's e4m3
// rows, so it trains as the FP8 base does, bit for bit; what merges and exports read is the 16-bit
// weight itself, kept on the host, not its e4m3 rounding.
TEST(Float8Finetune, ASixteenBitBaseOnFloat8TrainsAsTheFp8BaseAndKeepsItsWeights) {
  testing::TempDir dense_fp8_run, fp8_run, dense_run;
  const auto recipe = lora_recipe(dense_fp8_run, "none", "nf4", "false", "true");
  const auto base = load_base_model(recipe, torch::kFloat32, torch::kCPU, /*quantize_base=*/true);
  const auto dense = load_base_model(lora_recipe(dense_run, "none", "nf4"), torch::kFloat32, torch::kCPU,
                                     /*quantize_base=*/true);
  const auto dense_modules = dense.model->named_modules();
  int64_t on_float8 = 0;
  for (const auto& item : base.model->named_modules()) {
    const auto layer = std::dynamic_pointer_cast<qat::Float8Linear>(item.value());
    if (!layer) continue;
    ++on_float8;
    const auto original = std::dynamic_pointer_cast<qat::LinearLayer>(dense_modules[item.key()]);
    ASSERT_TRUE(original) << item.key();
    EXPECT_TRUE(torch::equal(layer->dense_weight(torch::kFloat32), original->dense_weight(torch::kFloat32))) << item.key();
    EXPECT_FALSE(torch::equal(layer->matmul_weight(torch::kFloat32), original->dense_weight(torch::kFloat32))) << item.key();
  }
  EXPECT_EQ(on_float8, 4 * 7);  // every projection; lm_head stays in qlora.skip_modules

  const auto dense_on_fp8 = train_losses(recipe, dense_fp8_run.path());
  const auto fp8 = train_losses(lora_recipe(fp8_run, "qlora", "fp8"), fp8_run.path());
  ASSERT_EQ(dense_on_fp8.size(), 8u);
  EXPECT_EQ(dense_on_fp8, fp8);
  EXPECT_NO_THROW(base_quantization(lora_recipe(dense_fp8_run, "none", "nf4", "true", "true"), torch::kBFloat16));
}

TEST(Float8Finetune, Fp8ComputeTakesAFourBitOrSixteenBitBaseOnly) {
  testing::TempDir run;
  auto full_finetune = lora_recipe(run, "none", "nf4", "false", "true");
  full_finetune.lora.rank = 0;
  try {
    base_quantization(full_finetune, torch::kBFloat16);
    FAIL() << "fp8_compute while training every weight was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("lora.rank: 0"), std::string::npos) << error.what();
  }
  for (const auto& [quant, quant_type] : std::vector<std::pair<std::string, std::string>>{
           {"qlora", "int8"}, {"qlora", "fp8"}, {"qat", "nf4"}}) {
    try {
      base_quantization(lora_recipe(run, quant, quant_type, "false", "true"), torch::kBFloat16);
      FAIL() << "fp8_compute with quant " << quant << ", " << quant_type << " was accepted";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("qlora.fp8_compute"), std::string::npos) << error.what();
    }
  }
}

// On a GPU, qlora.fp8_compute refuses a projection FP8 tensor cores cannot take, by its name,
// whether the base quantizes it or a pre-quantized checkpoint brought it already in 4 bits.
TEST(Float8Finetune, CudaFp8ComputeRefusesAMisfitProjectionByName) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device cuda(torch::kCUDA, 0);
  BaseQuantizationSettings settings;
  settings.kind = BaseQuantization::kNf4;
  settings.multiply_on_float8 = true;
  settings.four_bit.device = cuda;
  for (const bool pre_quantized : {false, true}) {
    auto options = testing::small_llama_options(32, 1);
    options.intermediate_size = 40;  // gate, up and down: not multiples of 16
    LlamaForCausalLM model(options, torch::kBFloat16);
    model->to(cuda);
    if (pre_quantized) qat::quantize_linear_layers(*model, settings.four_bit, settings.skip_modules);
    try {
      base_quantization_row(BaseQuantization::kNf4).quantize(*model, settings);
      FAIL() << "a [40, 32] projection was put on FP8 tensor cores (pre-quantized: " << pre_quantized << ")";
    } catch (const Error& error) {
      const std::string message = error.what();
      if (message.find("tensor cores") != std::string::npos && message.find("8.9") != std::string::npos) {
        GTEST_SKIP() << "this GPU has no FP8 tensor cores: " << message;
      }
      EXPECT_NE(message.find("model.layers.0.mlp."), std::string::npos) << message;
      EXPECT_NE(message.find("multiples of 16"), std::string::npos) << message;
    }
  }
}

}  // namespace
}  // namespace qtrain::trainer
