// safetensors-int: a QAT model written as integer weights + scales (+ zero points) loads back as
// a model with the QAT model's logits, for schemes GGUF cannot hold and with quantized
// activations; bad files are errors naming the tensor.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "model_outputs.h"
#include "qat_model.h"
#include "qat/qat_linear.h"
#include "support.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/safetensors_int.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {
namespace {

using testing::fixture;
using testing::TempDir;
using testing_outputs::logits_of;
using testing_qat::tiny_qat_llama;

torch::Tensor reference_input_ids() {
  return SafetensorsFile::open(fixture("tiny-llama-reference.safetensors")).tensor("lora.input_ids");
}

qat::QuantSpec asymmetric_int4_group_64() {
  auto spec = qat::QuantSpec::gguf_q4_0();
  spec.symmetric = false;
  spec.group_size = 64;
  spec.scale_dtype = torch::kFloat32;
  return spec;
}

struct Scheme {
  std::string name;
  qat::QuantSpec weights;
  std::optional<qat::QuantSpec> activations;
};

class QuantizedCheckpointRoundTrip : public ::testing::TestWithParam<Scheme> {};

// The loaded model computes with exactly the weights the QAT forward used (stored codes and
// scales, dequantized as convert does: bit for bit) and quantizes activations the same way, so
// in fp32 on the CPU its logits are the QAT model's.
TEST_P(QuantizedCheckpointRoundTrip, LoadedModelGivesTheQatModelsLogits) {
  TempDir temp;
  const auto& scheme = GetParam();
  auto qat_model = tiny_qat_llama(scheme.weights, scheme.activations);
  const auto out = temp.file("int");
  write_quantized_model(*qat_model.model, BaseDirectory::read(fixture("tiny-llama"), qat_model.config), out);

  const auto weights = SafetensorsCheckpoint::open(out);
  const std::string q_proj = "model.layers.0.self_attn.q_proj";
  EXPECT_EQ(weights.info(q_proj + ".weight").dtype, "I8");
  EXPECT_EQ(weights.info(q_proj + ".weight_scale").dtype, scheme.weights.scale_dtype == torch::kFloat16 ? "F16" : "F32");
  EXPECT_EQ(weights.info(q_proj + ".weight_scale").shape,
            (std::vector<int64_t>{256, 256 / scheme.weights.group_size}));
  EXPECT_EQ(weights.contains(q_proj + ".weight_zero_point"), !scheme.weights.symmetric);
  EXPECT_EQ(weights.info("model.norm.weight").dtype, "F32");
  const auto metadata = weights.files().front().metadata();
  ASSERT_TRUE(metadata.count("qtrain.quantization"));
  const auto scheme_json = nlohmann::json::parse(metadata.at("qtrain.quantization"));
  EXPECT_EQ(scheme_json.at("weights").at("bits"), 4);
  EXPECT_EQ(scheme_json.at("weights").at("symmetric"), scheme.weights.symmetric);
  EXPECT_EQ(scheme_json.at("activations").is_null(), !scheme.activations);

  auto loaded = load_llama(out);
  // The loaded weights are the fake-quantized weights the QAT forward multiplies by.
  const auto loaded_parameters = loaded.model->named_parameters();
  for (const auto& [name, layer] : qat::find_qat_layers(*qat_model.model)) {
    const auto* weight = loaded_parameters.find(name + ".weight");
    ASSERT_NE(weight, nullptr) << name;
    const auto fake_quantized = layer->dense_weight(torch::kFloat32);
    EXPECT_TRUE(torch::equal(*weight, fake_quantized))
        << name << ": max |difference| " << (*weight - fake_quantized).abs().max().item<float>() << " in "
        << (*weight != fake_quantized).sum().item<int64_t>() << " of " << weight->numel() << " values";
  }
  const auto input_ids = reference_input_ids();
  const auto want = logits_of(*qat_model.model, input_ids);
  const auto got = logits_of(*loaded.model, input_ids);
  // Same weights, same inputs; the only freedom left is the order in which CPU kernels add up.
  // Usually bit-equal; once 4e-5 apart on an H100 host's Xeon under a parallel ctest, with the
  // weights above bit-equal (MKL may pick its thread count by load).
  EXPECT_LE(testing_outputs::max_relative_error(got, want), 1e-4)
      << "max |difference| " << (got - want).abs().max().item<float>();
  // The quantization mattered: the unquantized model's logits are not these.
  auto plain = load_llama(fixture("tiny-llama"));
  EXPECT_GT((logits_of(*plain.model, input_ids) - want).abs().max().item<float>(), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(
    Schemes, QuantizedCheckpointRoundTrip,
    ::testing::Values(Scheme{"Q4_0", qat::QuantSpec::gguf_q4_0(), std::nullopt},
                      Scheme{"AsymmetricInt4Group64", asymmetric_int4_group_64(), std::nullopt},
                      Scheme{"Int4WeightInt8DynamicActivation", qat::QuantSpec::int4_weight(32),
                             qat::QuantSpec::int8_dynamic_per_token_activation()},
                      Scheme{"Int4WeightOnlyFloatZeroPoint", qat::QuantSpec::int4_weight_only(32), std::nullopt}),
    [](const auto& info) { return info.param.name; });

// Rewrites DIR/model.safetensors without `drop` (and with `replace` swapped in).
void rewrite_weights(const std::string& dir, const std::string& drop,
                     const std::pair<std::string, torch::Tensor>& replace = {}) {
  const auto file = SafetensorsFile::open(dir + "/model.safetensors");
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& name : file.names()) {
    if (name == drop) continue;
    tensors.emplace_back(name, name == replace.first ? replace.second : file.tensor(name).clone());
  }
  write_safetensors(dir + "/model.safetensors", tensors, file.metadata());
}

void expect_load_error(const std::string& dir, const std::string& needle) {
  try {
    load_llama(dir);
    ADD_FAILURE() << "loaded; expected an error mentioning '" << needle << "'";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
  }
}

// Format gguf (QAT on llama.cpp's block types): each layer's blocks as the GGUF file holds them,
// with their type, load back (qtrain eval --model) to exactly the weights the QAT forward used.
TEST(QuantizedCheckpoint, GgufBlockLayersLoadToTheWeightsTheyTrainedOn) {
  TempDir temp;
  auto qat_model = tiny_qat_llama(qat::QuantSpec::gguf_block_type(qat::GgufBlockType::kQ4_K));
  const auto out = temp.file("int");
  write_quantized_model(*qat_model.model, BaseDirectory::read(fixture("tiny-llama"), qat_model.config), out);
  const auto weights = SafetensorsCheckpoint::open(out);
  const std::string q_proj = "model.layers.0.self_attn.q_proj";
  EXPECT_EQ(weights.info(q_proj + ".weight").dtype, "U8");
  EXPECT_EQ(weights.info(q_proj + ".weight").shape, (std::vector<int64_t>{256, 144}));  // one 144-byte Q4_K block a row
  EXPECT_EQ(weights.tensor(q_proj + ".weight_gguf_type").item<int32_t>(), 12);            // ggml's Q4_K

  auto loaded = load_llama(out);
  const auto loaded_parameters = loaded.model->named_parameters();
  for (const auto& [name, layer] : qat::find_qat_layers(*qat_model.model)) {
    const auto* weight = loaded_parameters.find(name + ".weight");
    ASSERT_NE(weight, nullptr) << name;
    EXPECT_TRUE(torch::equal(*weight, layer->dense_weight(torch::kFloat32))) << name;
  }
  const auto input_ids = reference_input_ids();
  EXPECT_LE(testing_outputs::max_relative_error(logits_of(*loaded.model, input_ids), logits_of(*qat_model.model, input_ids)), 1e-4);

  // A block type id that is not one, and bytes of the wrong size, are errors naming the tensor.
  rewrite_weights(out, "", {q_proj + ".weight_gguf_type", torch::full({1}, 99, torch::kInt32)});
  expect_load_error(out, "'" + q_proj + ".weight_gguf_type' should hold the int32 ggml id");
  rewrite_weights(out, "", {q_proj + ".weight_gguf_type", torch::full({1}, 12, torch::kInt32)});
  rewrite_weights(out, "", {q_proj + ".weight", torch::zeros({256, 143}, torch::kUInt8)});
  expect_load_error(out, "'" + q_proj + ".weight' should hold the Q4_K blocks");
}

TEST(QuantizedCheckpoint, BrokenFilesAreErrorsNamingTheTensor) {
  TempDir temp;
  auto qat_model = tiny_qat_llama(asymmetric_int4_group_64());
  const std::string layer = "model.layers.1.mlp.up_proj";
  for (const char* broken : {"no-zero-point", "scale-shape", "codes-dtype"}) {
    const auto out = temp.file(broken);
    write_quantized_model(*qat_model.model, BaseDirectory::read(fixture("tiny-llama"), qat_model.config), out);
    if (std::string(broken) == "no-zero-point") {
      rewrite_weights(out, layer + ".weight_zero_point");
      expect_load_error(out, "'" + layer + ".weight_zero_point' is missing");
    } else if (std::string(broken) == "scale-shape") {
      rewrite_weights(out, "", {layer + ".weight_scale", torch::ones({768, 2})});
      expect_load_error(out, "'" + layer + ".weight_scale' has shape [768, 2]");
    } else {
      rewrite_weights(out, "", {layer + ".weight", torch::zeros({768, 256})});
      expect_load_error(out, "'" + layer + ".weight' should hold Char codes");
    }
  }
}

TEST(QuantizedCheckpoint, ModelWithoutQatLayersIsAnError) {
  TempDir temp;
  auto plain = load_llama(fixture("tiny-llama"));
  EXPECT_THROW(write_quantized_model(*plain.model, BaseDirectory::read(fixture("tiny-llama"), plain.config), temp.file("out")), Error);
}

}  // namespace
}  // namespace qtrain::trainer
