// The base-quantization rows: one per kind, each with the layer `qtrain bench` makes from random
// values, which must be the layer the row's `quantize` makes from a real weight.
#include "trainer/recipe/base_quantization.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "support.h"
#include "trainer/formats/hf_checkpoint.h"

namespace qtrain::trainer {
namespace {

// A module's tensors by name: their shapes and dtypes.
std::map<std::string, std::pair<std::vector<int64_t>, torch::ScalarType>> tensor_layout(const torch::nn::Module& module) {
  std::map<std::string, std::pair<std::vector<int64_t>, torch::ScalarType>> layout;
  for (const auto& item : module.named_parameters()) layout[item.key()] = {item.value().sizes().vec(), item.value().scalar_type()};
  for (const auto& item : module.named_buffers()) layout[item.key()] = {item.value().sizes().vec(), item.value().scalar_type()};
  return layout;
}

TEST(BaseQuantization, OneRowPerKindEachNamedOnce) {
  const std::vector<std::string> names = {"none", "nf4", "fp4", "int8", "fp8"};
  ASSERT_EQ(base_quantizations().size(), names.size());
  for (size_t index = 0; index < names.size(); ++index) {
    const auto& row = base_quantizations()[index];
    EXPECT_EQ(base_quantization_name(row.kind), names[index]);
    EXPECT_EQ(&base_quantization_row(row.kind), &row);
    EXPECT_EQ(&base_quantization_named(names[index], "--quant"), &row);
  }
}

// Every kind's random layer has the tensors (names, shapes, dtypes) of the layer its `quantize`
// makes from the tiny model's down_proj, on a 16-bit base also multiplying on FP8 (fp8_compute).
TEST(BaseQuantization, RandomLayersAreTheLayersQuantizingMakes) {
  torch::manual_seed(0);
  RandomLayerOptions random;
  random.four_bit_tables = qat::quantize_4bit(torch::randn({4096}) * 0.02, qat::FourBitType::kNf4, 64, true);
  for (const auto& row : base_quantizations()) {
    for (const bool on_float8 : {false, true}) {
      if (on_float8 && row.kind != BaseQuantization::kNone) continue;
      auto qlora = default_recipe().qlora;
      qlora.fp8_compute = on_float8;
      const auto settings = base_quantization_settings(row.kind, qlora, torch::kBFloat16, torch::kCPU);
      ModelLoadOptions options;
      options.dtype = torch::kBFloat16;
      auto model = load_llama(testing::fixture("tiny-llama"), options).model;
      row.quantize(*model, settings);
      const auto quantized = model->named_modules()["model.layers.0.mlp.down_proj"];
      const auto& layer = dynamic_cast<const qat::LinearLayer&>(*quantized);
      random.linear = {layer.in_features(), layer.out_features(), /*bias=*/false, torch::kBFloat16};
      const auto made = row.random_layer(random, settings);
      const std::string what = std::string(base_quantization_name(row.kind)) + (on_float8 ? " on FP8" : "");
      const auto& made_layer = *made;
      EXPECT_EQ(typeid(made_layer), typeid(layer)) << what;
      EXPECT_EQ(tensor_layout(*made), tensor_layout(*quantized)) << what;
    }
  }
}

}  // namespace
}  // namespace qtrain::trainer
