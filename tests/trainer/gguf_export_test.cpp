// GGUF export of a QAT model: the file holds the fake-quant weights exactly (as Q4_0 / Q8_0
// blocks, q / k rows in llama.cpp's order), gguf-py reads it to the same values, and llama.cpp
// runs it to our logits (up to its own activation quantization).
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "kernels/error.h"
#include "model_outputs.h"
#include "qat/gguf_block.h"
#include "qat/gguf_file_types.h"
#include "qat_model.h"
#include "support.h"
#include "trainer/formats/gguf_export.h"
#include "trainer/base/file_system.h"
#include "trainer/formats/gguf_file.h"
#include "trainer/formats/merged_export.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/formats/safetensors.h"
#include "trainer/finetune.h"
#include "trainer/recipe/recipe.h"
#include "trainer/trained_run.h"
#include "qat/four_bit_linear.h"

namespace qtrain::trainer {
namespace {

using testing::fixture;
using testing::TempDir;
using testing_qat::qat_model_of;
using testing_qat::tiny_qat_llama;

// convert_hf_to_gguf's LlamaModel.permute, written out on the tensor as it is there:
// w.reshape(heads, 2, rows / heads / 2, *rest).swapaxes(1, 2).reshape(w.shape)
torch::Tensor llama_cpp_permute(const torch::Tensor& weight, int64_t heads) {
  auto shape = weight.sizes().vec();
  std::vector<int64_t> split = {heads, 2, weight.size(0) / heads / 2};
  split.insert(split.end(), shape.begin() + 1, shape.end());
  return weight.reshape(split).transpose(1, 2).reshape(shape);
}

// Every tensor the GGUF file should hold, under its GGUF name, as fp32 values (QAT weights: the
// fake-quant weights the forward uses), with the type it should have.
struct ExpectedTensor {
  torch::Tensor values;
  qat::GgufBlockType type;
};
std::map<std::string, ExpectedTensor> expected_tensors(LoadedModel& loaded, qat::GgufBlockType quantized_type) {
  torch::NoGradGuard no_grad;
  const auto& options = loaded.config.llama;
  std::map<std::string, ExpectedTensor> expected;
  std::map<std::string, std::shared_ptr<qat::QatLinear>> qat_layers;
  for (const auto& [name, layer] : qat::find_qat_layers(*loaded.model)) qat_layers[name + ".weight"] = layer;
  for (const auto& [name, value] : merged_weights(*loaded.model, torch::kFloat32)) {
    auto values = value;
    auto type = qat::GgufBlockType::kF32;
    if (auto layer = qat_layers.find(name); layer != qat_layers.end()) {
      // The weight the QAT forward multiplies by: the fake quantizer applied to the float weight,
      // or, for QAT-LoRA's one-pass node, the values it builds (not the codes the export reads).
      auto& quantizer = layer->second->weight_fake_quant();
      const auto lora = std::dynamic_pointer_cast<qat::LoraLinear>(layer->second->inner());
      values = lora && qat::fuses_merged_fake_quant(*lora, quantizer.options())
                   ? qat::fake_quantize_merged(*lora, quantizer.spec(), torch::kFloat32, true, false, false).values
                   : quantizer.forward(layer->second->inner()->dense_weight(torch::kFloat32));
      type = quantized_type;
    }
    // llama.cpp's Qwen, Phi-3 and Gemma architectures rotate halves, as transformers does: their rows stay.
    const auto& architecture = loaded.config.family->gguf.name;
    const bool permuted = architecture == "llama";
    if (permuted && name.find("q_proj") != std::string::npos) values = llama_cpp_permute(values, options.num_attention_heads);
    if (permuted && name.find("k_proj") != std::string::npos) values = llama_cpp_permute(values, options.num_key_value_heads);
    // Gemma's norms as llama.cpp multiplies them: 1 + w (convert_hf_to_gguf adds the 1).
    const bool norm = name.size() > 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0;
    if (options.norm_style == NormStyle::kUnitOffset && norm) values = values + 1;
    expected[gguf_tensor_name(name, architecture)] = {values.contiguous(), type};
  }
  return expected;
}

class GgufExportScheme : public ::testing::TestWithParam<bool> {
 protected:
  bool q8() const { return GetParam(); }
  qat::QuantSpec spec() const { return q8() ? qat::QuantSpec::gguf_q8_0() : qat::QuantSpec::gguf_q4_0(); }
  qat::GgufBlockType block_type() const { return q8() ? qat::GgufBlockType::kQ8_0 : qat::GgufBlockType::kQ4_0; }
};

// Checks that every tensor of `file` holds `expected`'s values exactly (blocks decoded); returns
// how many were quantized.
int expect_tensors_equal(const GgufFile& file, const std::map<std::string, ExpectedTensor>& expected,
                         qat::GgufBlockType block_type) {
  EXPECT_EQ(file.tensors().size(), expected.size());
  int quantized = 0;
  for (const auto& info : file.tensors()) {
    if (!expected.count(info.name)) {
      ADD_FAILURE() << "unexpected tensor " << info.name;
      continue;
    }
    const auto& want = expected.at(info.name);
    EXPECT_EQ(info.shape, want.values.sizes().vec()) << info.name;
    if (info.type != want.type) {
      ADD_FAILURE() << info.name << ": type " << qat::gguf_block_format(info.type).name;
      continue;
    }
    torch::Tensor values;
    if (info.type == qat::GgufBlockType::kF32) {
      auto bytes = file.tensor_bytes(info.name);
      values = torch::from_blob(bytes.data(), info.shape, torch::kFloat32).clone();
    } else {
      values = qat::decode_gguf_blocks(file.tensor_bytes(info.name), block_type, info.shape);
      ++quantized;
    }
    EXPECT_TRUE(torch::equal(values, want.values)) << info.name << ": max |difference| "
                                                   << (values - want.values).abs().max().item<float>();
  }
  return quantized;
}

TEST_P(GgufExportScheme, BlocksDecodeToTheFakeQuantWeightsExactly) {
  TempDir temp;
  auto loaded = tiny_qat_llama(spec());
  const auto path = temp.file("model.gguf");
  write_gguf_model(*loaded.model, BaseDirectory::read(fixture("tiny-llama"), loaded.config), path);
  const auto file = GgufFile::open(path);
  const auto expected = expected_tensors(loaded, block_type());
  EXPECT_EQ(expected.size(), 4u * 9 + 3);  // 4 layers x 9 + embeddings, final norm, output
  const int quantized = expect_tensors_equal(file, expected, block_type());
  EXPECT_EQ(quantized, 4 * 7);
  EXPECT_EQ(file.value("general.architecture").as<std::string>("arch"), "llama");
  EXPECT_EQ(file.value("general.file_type").as<uint32_t>("ftype"), q8() ? 7u : 2u);
  EXPECT_EQ(file.value("llama.block_count").as<uint32_t>("blocks"), 4u);
  EXPECT_EQ(file.value("llama.embedding_length").as<uint32_t>("embd"), 256u);
  EXPECT_EQ(file.value("llama.feed_forward_length").as<uint32_t>("ffn"), 768u);
  EXPECT_EQ(file.value("llama.attention.head_count").as<uint32_t>("heads"), 8u);
  EXPECT_EQ(file.value("llama.attention.head_count_kv").as<uint32_t>("kv heads"), 2u);
  EXPECT_EQ(file.value("llama.rope.dimension_count").as<uint32_t>("rope dims"), 32u);
  EXPECT_EQ(file.value("llama.rope.freq_base").as<float>("theta"), 500000.0f);
  EXPECT_EQ(file.value("llama.attention.layer_norm_rms_epsilon").as<float>("eps"), 1e-5f);
  EXPECT_EQ(file.value("llama.context_length").as<uint32_t>("ctx"), 2048u);
  EXPECT_EQ(file.value("tokenizer.ggml.pre").as<std::string>("pre"), "llama-bpe");
  EXPECT_EQ(file.value("tokenizer.ggml.bos_token_id").as<uint32_t>("bos"), 0u);
  EXPECT_EQ(file.value("tokenizer.ggml.eos_token_id").as<uint32_t>("eos"), 4u);
  EXPECT_EQ(file.value("tokenizer.ggml.padding_token_id").as<uint32_t>("pad"), 5u);
  EXPECT_TRUE(file.value("tokenizer.ggml.add_bos_token").as<bool>("add_bos"));
  EXPECT_EQ(file.value("tokenizer.ggml.tokens").array_as<std::string>("tokens").size(), 8192u);
}

TEST_P(GgufExportScheme, GgufPyDequantizesToOurValuesAndReadsTheTokenizer) {
  const auto python = testing::find_python_with("gguf numpy safetensors tokenizers");
  if (python.empty()) GTEST_SKIP() << "no Python with gguf, safetensors and tokenizers (set QTRAIN_PYTHON)";
  TempDir temp;
  auto loaded = tiny_qat_llama(spec());
  const auto path = temp.file("model.gguf");
  write_gguf_model(*loaded.model, BaseDirectory::read(fixture("tiny-llama"), loaded.config), path);
  std::vector<std::pair<std::string, torch::Tensor>> values;
  std::map<std::string, std::string> types;
  for (const auto& [name, want] : expected_tensors(loaded, block_type())) {
    values.emplace_back(name, want.values);
    types[name] = qat::gguf_block_format(want.type).name;
  }
  write_safetensors(temp.file("expected.safetensors"), values, types);
  const std::string command = "'" + python + "' '" + testing::source_dir() + "/tests/interop/gguf_model.py' check '" +
                              path + "' '" + temp.file("expected.safetensors") + "' '" + fixture("tiny-llama") + "' llama 2>&1";
  const auto result = testing::run_command(command);
  EXPECT_EQ(result.status, 0) << command << "\n" << result.output;
  std::printf("[ measured ] %s", result.output.c_str());
}

INSTANTIATE_TEST_SUITE_P(Q4AndQ8, GgufExportScheme, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("Q8_0") : std::string("Q4_0"); });

TEST(GgufExport, SchemesGgufCannotHoldAreErrorsNamingQatWeights) {
  TempDir temp;
  auto asymmetric = qat::QuantSpec::gguf_q4_0();
  asymmetric.symmetric = false;
  auto group_64 = qat::QuantSpec::gguf_q4_0();
  group_64.group_size = 64;
  auto fp32_scales = qat::QuantSpec::gguf_q8_0();
  fp32_scales.scale_dtype = torch::kFloat32;
  for (const auto& spec : {asymmetric, group_64, fp32_scales}) {
    auto loaded = tiny_qat_llama(spec);
    try {
      write_gguf_model(*loaded.model, BaseDirectory::read(fixture("tiny-llama"), loaded.config), temp.file("bad.gguf"));
      ADD_FAILURE() << spec.describe() << " was written as GGUF";
    } catch (const Error& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find("qat.weights"), std::string::npos) << message;
      if (!spec.symmetric) {
        EXPECT_NE(message.find("safetensors-int"), std::string::npos) << message;
      }
    }
  }
}

TEST(GgufExport, TensorNamesAndRowOrderAreLlamaCpps) {
  EXPECT_EQ(gguf_tensor_name("model.embed_tokens.weight"), "token_embd.weight");
  EXPECT_EQ(gguf_tensor_name("model.layers.12.self_attn.o_proj.weight"), "blk.12.attn_output.weight");
  EXPECT_EQ(gguf_tensor_name("model.layers.0.mlp.down_proj.weight"), "blk.0.ffn_down.weight");
  EXPECT_EQ(gguf_tensor_name("model.layers.3.post_attention_layernorm.weight"), "blk.3.ffn_norm.weight");
  EXPECT_EQ(gguf_tensor_name("model.norm.weight"), "output_norm.weight");
  EXPECT_EQ(gguf_tensor_name("lm_head.weight"), "output.weight");
  EXPECT_THROW(gguf_tensor_name("model.layers.0.self_attn.rotary.weight"), Error);
  // One head of 8 rows: HF's halves [0 1 2 3 | 4 5 6 7] become llama.cpp's pairs (0 4)(1 5)(2 6)(3 7).
  const auto order = gguf_rope_row_order(16, 2);
  const std::vector<int64_t> want = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};
  EXPECT_TRUE(torch::equal(order, torch::tensor(want)));
}

// Each family GGUF export writes, as llama.cpp's architecture for it: a fixture checkpoint and
// the general.architecture llama.cpp runs it as (Mistral as llama, with its rows reordered;
// Qwen2 with q / k / v biases and Qwen3 with q / k norms, rows as transformers has them).
struct GgufModel {
  std::string fixture_dir;
  std::string architecture;
};
std::ostream& operator<<(std::ostream& out, const GgufModel& model) { return out << model.fixture_dir; }

class GgufExportFamily : public ::testing::TestWithParam<GgufModel> {
 protected:
  std::string model_dir() const { return fixture(GetParam().fixture_dir); }
};

TEST_P(GgufExportFamily, TensorsAndHyperparametersAreTheArchitecturesOwn) {
  TempDir temp;
  auto loaded = qat_model_of(model_dir(), qat::QuantSpec::gguf_q4_0());
  const auto path = temp.file("model.gguf");
  write_gguf_model(*loaded.model, BaseDirectory::read(model_dir(), loaded.config), path);
  const auto file = GgufFile::open(path);
  const auto& options = loaded.config.llama;
  const auto expected = expected_tensors(loaded, qat::GgufBlockType::kQ4_0);
  EXPECT_EQ(expect_tensors_equal(file, expected, qat::GgufBlockType::kQ4_0),
            static_cast<int64_t>(options.projection_names().size()) * options.num_hidden_layers);
  const auto& architecture = GetParam().architecture;
  EXPECT_EQ(file.value("general.architecture").as<std::string>("arch"), architecture);
  EXPECT_EQ(file.value(architecture + ".block_count").as<uint32_t>("blocks"), options.num_hidden_layers);
  EXPECT_EQ(file.value(architecture + ".attention.key_length").as<uint32_t>("head dim"), options.head_dim);
  EXPECT_EQ(file.value(architecture + ".rope.freq_base").as<float>("theta"), static_cast<float>(options.rope.theta));
  const bool has_bias = expected.count("blk.0.attn_q.bias") > 0, has_norm = expected.count("blk.0.attn_q_norm.weight") > 0;
  EXPECT_EQ(has_bias, architecture == "qwen2");
  EXPECT_EQ(has_norm, architecture == "qwen3" || architecture == "gemma3");
  // Phi-3's fused projections stay fused; Gemma's sandwich norms take llama.cpp's names.
  EXPECT_EQ(expected.count("blk.0.attn_qkv.weight") > 0, architecture == "phi3");
  EXPECT_EQ(expected.count("blk.0.post_ffw_norm.weight") > 0, architecture == "gemma2" || architecture == "gemma3");
  if (architecture == "gemma2") {
    EXPECT_EQ(file.value("gemma2.attn_logit_softcapping").as<float>("cap"), static_cast<float>(options.attention_softcap));
    EXPECT_EQ(file.value("gemma2.final_logit_softcapping").as<float>("cap"), static_cast<float>(options.final_logit_softcap));
  }
  if (architecture == "gemma2" || architecture == "gemma3") {
    EXPECT_EQ(file.value(architecture + ".attention.sliding_window").as<uint32_t>("window"), options.sliding_window);
    EXPECT_EQ(file.value(architecture + ".attention.sliding_window_pattern").as<uint32_t>("pattern"), 2u);  // slide, full
  }
}

TEST_P(GgufExportFamily, GgufPyReadsTheArchitecturesTensors) {
  const auto python = testing::find_python_with("gguf numpy safetensors tokenizers");
  if (python.empty()) GTEST_SKIP() << "no Python with gguf, safetensors and tokenizers (set QTRAIN_PYTHON)";
  TempDir temp;
  auto loaded = qat_model_of(model_dir(), qat::QuantSpec::gguf_q4_0());
  const auto path = temp.file("model.gguf");
  write_gguf_model(*loaded.model, BaseDirectory::read(model_dir(), loaded.config), path);
  std::vector<std::pair<std::string, torch::Tensor>> values;
  std::map<std::string, std::string> types;
  for (const auto& [name, want] : expected_tensors(loaded, qat::GgufBlockType::kQ4_0)) {
    values.emplace_back(name, want.values);
    types[name] = qat::gguf_block_format(want.type).name;
  }
  write_safetensors(temp.file("expected.safetensors"), values, types);
  const std::string command = "'" + python + "' '" + testing::source_dir() + "/tests/interop/gguf_model.py' check '" + path +
                              "' '" + temp.file("expected.safetensors") + "' '" + model_dir() + "' " + GetParam().architecture +
                              " 2>&1";
  const auto result = testing::run_command(command);
  EXPECT_EQ(result.status, 0) << command << "\n" << result.output;
}

const char* const kNoLlamaCpp =
    "no Python with llama_cpp: tools/setup.sh installs it (builds llama.cpp from source, several minutes); "
    "QTRAIN_LLAMA_CPP=0 skips it";

// llama.cpp (`python`'s llama_cpp) runs the GGUF file at `path` on a sentence; its logits are
// `loaded`'s (the model the file was written from, `model_dir` its tokenizer's directory) up to
// llama.cpp's Q8_0 activations.
void expect_llama_cpp_runs_our_logits(const std::string& python, LoadedModel& loaded, const std::string& path,
                                      const std::string& model_dir, const std::string& what) {
  TempDir temp;
  const std::string text =
      "The jury further said in term-end presentments that the City Executive Committee, which had over-all charge "
      "of the election, deserves the praise and thanks of the City of Atlanta.";
  const std::string command = "'" + python + "' '" + testing::source_dir() + "/tests/interop/gguf_model.py' llama-cpp '" +
                              path + "' '" + text + "' '" + temp.file("llama_cpp.safetensors") + "' 2>&1";
  const auto result = testing::run_command(command);
  ASSERT_EQ(result.status, 0) << command << "\n" << result.output;
  const auto theirs = SafetensorsCheckpoint::open(temp.file("llama_cpp.safetensors"));
  const auto input_ids = theirs.tensor("input_ids");
  // llama.cpp tokenized the text from the file's tokenizer metadata: the same ids as ours.
  const auto ours_ids = data::Tokenizer::from_model_dir(model_dir).encode(text);
  EXPECT_EQ(std::vector<int64_t>(input_ids.data_ptr<int64_t>(), input_ids.data_ptr<int64_t>() + input_ids.numel()),
            ours_ids);

  const auto ours = testing_outputs::logits_of(*loaded.model, input_ids);
  const auto llama_cpp = theirs.tensor("logits");
  ASSERT_EQ(ours.sizes(), llama_cpp.sizes());
  const double max_abs = (ours - llama_cpp).abs().max().item<double>();
  const double relative = testing_outputs::max_relative_error(llama_cpp, ours);
  const double top1 = ours.argmax(-1).eq(llama_cpp.argmax(-1)).to(torch::kFloat64).mean().item<double>();
  std::printf("[ measured ] llama.cpp vs our QAT %s, %ld tokens: max |logit difference| %.4f (%.3g of the largest "
              "logit), top-1 agreement %.1f%%\n",
              what.c_str(), static_cast<long>(input_ids.size(1)), max_abs, relative, 100 * top1);
  // Q8_0 activations (8-bit blocks of 32) move logits by about 1% of their range; a wrong row
  // order, tensor or rope layout moves them by tens of percent and breaks the top-1 agreement.
  EXPECT_LT(relative, 0.05);
  EXPECT_GE(top1, 0.9);
}

// llama.cpp itself (through llama-cpp-python, which tools/setup.sh installs) runs the file. Its
// Q4_0 / Q8_0 matmuls quantize the activations to Q8_0 blocks, so the logits are close to ours,
// not equal.
TEST_P(GgufExportFamily, LlamaCppRunsItWithOurLogits) {
  const auto python = testing::find_python_with("llama_cpp safetensors torch");
  if (python.empty()) GTEST_SKIP() << kNoLlamaCpp;
  TempDir temp;
  // The trained tiny-llama as it is; the random family fixtures with sharper attention, except
  // Gemma's: llama.cpp's Q8_0 activations move Gemma's logits more the sharper its attention is
  // (2% of the range as they are, 25-40% with queries and keys x6), where its F32 export below
  // agrees with ours to 1e-3 with them x6.
  const bool gemma = GetParam().architecture.rfind("gemma", 0) == 0;
  const double query_key_scale = GetParam().fixture_dir == "tiny-llama" || gemma ? 1.0 : 6.0;
  auto loaded = qat_model_of(model_dir(), qat::QuantSpec::gguf_q4_0(), std::nullopt, query_key_scale);
  const auto path = temp.file("model.gguf");
  write_gguf_model(*loaded.model, BaseDirectory::read(model_dir(), loaded.config), path);
  expect_llama_cpp_runs_our_logits(python, loaded, path, model_dir(), "QAT " + GetParam().fixture_dir);
}

// A QAT-LoRA run of the bundled tiny model on the CPU in fp32 (`scheme`: its qat.* keys) that
// exports GGUF at its end, rebuilt from its run directory.
TrainedRun trained_qat_lora_run(const TempDir& run, const std::vector<std::string>& scheme, int64_t steps) {
  const std::string demo = testing::source_dir() + "/recipes/demo";
  std::vector<std::string> settings = {
      "model.path=" + demo + "/tiny-llama", "data.train=" + demo + "/brown-train.jsonl", "quant=qat", "lora.rank=8",
      "lora.alpha=16", "lora.dropout=0", "export.formats=[gguf]", "data.max_seq_len=64", "train.micro_batch_size=2",
      "train.steps=" + std::to_string(steps), "train.dtype=fp32", "train.device=cpu", "optim.lr=2e-3",
      "schedule.warmup_steps=1", "eval.every=0", "log.every=1", "train.output_dir=" + run.path()};
  settings.insert(settings.end(), scheme.begin(), scheme.end());
  Finetune finetune(load_recipe("", settings));
  finetune.setup();
  finetune.train();
  return load_trained_run(run.path(), "", /*quantize_base=*/true);
}

// QAT-LoRA on a frozen NF4 base (quant: qat, qat.base: nf4), trained on the bundled tiny model:
// the base stays 4-bit, the run's own GGUF export holds exactly the weights its forward multiplies
// by (rebuilt from the run directory), and llama.cpp runs it with the agreement above.
TEST(GgufExport, QatLoraOnAnNf4BaseExportsTheWeightsItTrained) {
  TempDir run;
  auto rebuilt = trained_qat_lora_run(run, {"qat.base=nf4", "qat.weights.scale_dtype=fp16"}, 6);
  const auto& recipe = rebuilt.recipe;
  const auto layers = qat::find_qat_layers(*rebuilt.loaded.model);
  ASSERT_EQ(layers.size(), 4u * 7u);
  for (const auto& [name, layer] : layers) {
    const auto lora = std::dynamic_pointer_cast<qat::LoraLinear>(layer->inner());
    ASSERT_TRUE(lora) << name;
    EXPECT_TRUE(std::dynamic_pointer_cast<qat::FourBitLinear>(lora->base_layer())) << name << ": the base left NF4";
    EXPECT_GT(lora->lora_B().abs().max().item<float>(), 0.0f) << name << ": the adapter did not train";
  }
  const auto path = run.file("export/model.gguf");
  const auto file = GgufFile::open(path);
  EXPECT_EQ(expect_tensors_equal(file, expected_tensors(rebuilt.loaded, qat::GgufBlockType::kQ4_0), qat::GgufBlockType::kQ4_0),
            4 * 7);
  const auto python = testing::find_python_with("llama_cpp safetensors torch");
  if (python.empty()) GTEST_SKIP() << kNoLlamaCpp;
  rebuilt.loaded.model->eval();
  expect_llama_cpp_runs_our_logits(python, rebuilt.loaded, path, recipe.model.path, "QAT-LoRA on NF4 (tiny-llama)");
}

// QAT on llama.cpp's Q4_K_M (qat.weights.format: gguf): each layer trains on the block type
// llama-quantize gives its tensor (Q4_K, Q6_K for half the attn_v / ffn_down), and the run's GGUF
// export holds those blocks as the last forward rounded them: gguf-py dequantizes every QAT tensor
// to the weights the model multiplies by, bit for bit, and llama.cpp's loss on held-out text is
// within 1% of ours (its activations are Q8_K blocks in its k-quant matmuls).
TEST(GgufExport, QatOnQ4KmExportsTheBlocksItTrainedOn) {
  TempDir run;
  auto rebuilt = trained_qat_lora_run(run, {"qat.weights.format=gguf", "qat.weights.gguf_type=Q4_K_M"}, 4);
  const auto& recipe = rebuilt.recipe;
  rebuilt.loaded.model->eval();
  std::map<std::string, qat::GgufBlockType> trained;  // GGUF name -> the block type the layer trained on
  for (const auto& [name, layer] : qat::find_qat_layers(*rebuilt.loaded.model)) {
    trained[gguf_tensor_name(name + ".weight", "llama")] = layer->weight_fake_quant().spec().gguf_block;
  }
  ASSERT_EQ(trained.size(), 4u * 7u);
  std::map<std::string, int> trained_types;
  for (const auto& [name, type] : trained) ++trained_types[qat::gguf_block_format(type).name];
  EXPECT_GT(trained_types["Q4_K"], 0);
  EXPECT_GT(trained_types["Q6_K"], 0);  // Q4_K_M's more bits for some attn_v / ffn_down

  // Expected values: the fake-quant weights for the QAT layers, our ggml port's dequantization
  // for the tensors llama-quantize's way quantized (embeddings, output), F32 as they are.
  const auto path = run.file("export/model.gguf");
  const auto file = GgufFile::open(path);
  std::vector<std::pair<std::string, torch::Tensor>> values;
  std::map<std::string, std::string> types;
  const auto expected = expected_tensors(rebuilt.loaded, qat::GgufBlockType::kF32);
  for (const auto& info : file.tensors()) {
    const auto& format = qat::gguf_block_format(info.type);
    types[info.name] = format.name;
    if (trained.count(info.name)) {
      EXPECT_EQ(info.type, trained.at(info.name)) << info.name;
      values.emplace_back(info.name, expected.at(info.name).values);
    } else if (format.dequantize != nullptr) {
      const auto bytes = file.tensor_bytes(info.name);
      auto decoded = torch::empty(info.shape, torch::kFloat32);
      format.dequantize(bytes.data(), decoded.data_ptr<float>(), decoded.numel());
      values.emplace_back(info.name, decoded);
    } else {
      values.emplace_back(info.name, expected.at(info.name).values);
    }
  }
  EXPECT_EQ(file.value("general.file_type").as<uint32_t>("file_type"), qat::find_gguf_file_type("Q4_K_M", "test").llama_ftype);
  const auto python = testing::find_python_with("llama_cpp gguf numpy safetensors tokenizers torch");
  if (python.empty()) GTEST_SKIP() << kNoLlamaCpp;
  TempDir temp;
  write_safetensors(temp.file("expected.safetensors"), values, types);
  const std::string check = "'" + python + "' '" + testing::source_dir() + "/tests/interop/gguf_model.py' check '" + path +
                            "' '" + temp.file("expected.safetensors") + "' '" + recipe.model.path + "' llama 2>&1";
  const auto checked = testing::run_command(check);
  EXPECT_EQ(checked.status, 0) << check << "\n" << checked.output;

  // Held-out text (the Brown validation split's first lines): the loss llama.cpp's logits give
  // against ours on the same ids.
  const std::string text = "Vincent G. Ierulli has been appointed temporary assistant district attorney, it was announced "
                           "Monday by Charles E. Raymond, District Attorney. Ierulli will replace Desmond D. Connall who has "
                           "been called to active military service but is expected back on the job by March 31.";
  const std::string command = "'" + python + "' '" + testing::source_dir() + "/tests/interop/gguf_model.py' llama-cpp '" + path +
                              "' '" + text + "' '" + temp.file("llama_cpp.safetensors") + "' 2>&1";
  const auto result = testing::run_command(command);
  ASSERT_EQ(result.status, 0) << command << "\n" << result.output;
  const auto theirs = SafetensorsCheckpoint::open(temp.file("llama_cpp.safetensors"));
  const auto input_ids = theirs.tensor("input_ids");
  const auto loss_of = [&](const torch::Tensor& logits) {
    const auto length = input_ids.size(1);
    return torch::nn::functional::cross_entropy(logits[0].slice(0, 0, length - 1), input_ids[0].slice(0, 1, length)).item<double>();
  };
  const double ours = loss_of(testing_outputs::logits_of(*rebuilt.loaded.model, input_ids));
  const double llama_cpp = loss_of(theirs.tensor("logits"));
  std::printf("[ measured ] Q4_K_M QAT-LoRA run, held-out loss: ours %.5f, llama.cpp on its GGUF %.5f (%.3f%%)\n", ours, llama_cpp,
              100 * std::abs(llama_cpp / ours - 1));
  EXPECT_LT(std::abs(llama_cpp / ours - 1), 0.01);
}

// The layout alone, without llama.cpp's Q8_0 activations: the model unquantized, written F32,
// attention sharpened so that a wrong rope layout, norm or score scale shows (tens of percent).
// llama.cpp's F32 matmuls and F16 KV cache round differently from ours: 2e-4 to 4e-4 of the logits'
// range. Gemma's GeGLU adds llama.cpp's CPU GELU, which rounds its input to fp16 and reads a table
// (ggml-cpu's GGML_GELU_FP16): 6.5e-3 (Gemma 2) and 1.3e-2 (Gemma 3) here, 6e-4 unsharpened.
TEST_P(GgufExportFamily, LlamaCppRunsTheF32ExportWithOurLogits) {
  const auto python = testing::find_python_with("llama_cpp safetensors torch");
  if (python.empty()) GTEST_SKIP() << "no Python with llama_cpp (tools/run-tests.sh installs it)";
  TempDir temp;
  auto loaded = load_llama(model_dir());
  testing_qat::sharpen_attention(loaded, GetParam().fixture_dir == "tiny-llama" ? 1.0 : 6.0);
  loaded.model->eval();
  write_gguf_model(*loaded.model, BaseDirectory::read(model_dir(), loaded.config), temp.file("model.gguf"));
  const std::string text = "The jury further said in term-end presentments that the City Executive Committee, which had "
                           "over-all charge of the election, deserves the praise and thanks of the City of Atlanta.";
  const std::string command = "'" + python + "' '" + testing::source_dir() + "/tests/interop/gguf_model.py' llama-cpp '" +
                              temp.file("model.gguf") + "' '" + text + "' '" + temp.file("llama_cpp.safetensors") + "' 2>&1";
  const auto result = testing::run_command(command);
  ASSERT_EQ(result.status, 0) << command << "\n" << result.output;
  const auto theirs = SafetensorsCheckpoint::open(temp.file("llama_cpp.safetensors"));
  const auto ours = testing_outputs::logits_of(*loaded.model, theirs.tensor("input_ids"));
  const double relative = testing_outputs::max_relative_error(theirs.tensor("logits"), ours);
  std::printf("[ measured ] llama.cpp vs ours, F32 export of %s: %.3g of the largest logit\n", GetParam().fixture_dir.c_str(),
              relative);
  EXPECT_LT(relative, GetParam().architecture.rfind("gemma", 0) == 0 ? 2e-2 : 3e-3);
}

// Post-training quantization of a LoRA-merged model, as a QLoRA or LoRA run exports it: for each
// llama.cpp file type, every tensor of our file has the type and the bytes that llama.cpp's own
// quantizer (llama_model_quantize, no importance matrix) gives the F32 export of the same model,
// and llama.cpp runs the file. tiny-llama's rows are multiples of 256 (the k-quants' own blocks);
// the family fixtures' 64 are not (llama.cpp's fallback types).
TEST_P(GgufExportFamily, QuantizedTypesAreTheBytesOfLlamaQuantize) {
  const auto python = testing::find_python_with("llama_cpp gguf numpy");
  if (python.empty()) GTEST_SKIP() << kNoLlamaCpp;
  TempDir temp;
  auto loaded = load_llama(model_dir());
  apply_peft_adapter(*loaded.model, model_dir() + "-lora");
  const auto base = BaseDirectory::read(model_dir(), loaded.config);
  const bool every_type = GetParam().fixture_dir == "tiny-llama";
  std::string type_names;
  for (const auto& file_type : qat::gguf_file_types()) {
    const std::string name = file_type.name;
    const bool asked = every_type || name == "F32" || name == "Q8_0" || name == "Q4_0" || name == "Q4_K_M" ||
                       name == "Q5_K_M" || name == "Q6_K";
    if (!asked) continue;
    GgufExportOptions options;
    options.file_type = &file_type;
    write_gguf_model(*loaded.model, base, temp.file(name + ".gguf"), options);
    if (name != "F32") type_names += " " + name;
  }
  const std::string command = "'" + python + "' '" + testing::source_dir() + "/tests/interop/gguf_model.py' quantize-compare '" +
                              temp.file("F32.gguf") + "' '" + temp.file("") + "'" + type_names + " 2>&1";
  const auto result = testing::run_command(command);
  EXPECT_EQ(result.status, 0) << command << "\n" << result.output;
  size_t line = 0;  // the script's summary lines ("Q4_K_M: 39 of 39 tensors byte for byte ...")
  while ((line = result.output.find(" byte for byte", line)) != std::string::npos) {
    const auto start = result.output.rfind('\n', line);
    std::printf("[ measured ] %s %s\n", GetParam().fixture_dir.c_str(),
                result.output.substr(start == std::string::npos ? 0 : start + 1, result.output.find('\n', line) - start - 1).c_str());
    line = result.output.find('\n', line);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, GgufExportFamily,
                         ::testing::Values(GgufModel{"tiny-llama", "llama"}, GgufModel{"families/mistral", "llama"},
                                           GgufModel{"families/qwen2", "qwen2"}, GgufModel{"families/qwen3", "qwen3"},
                                           GgufModel{"families/phi3", "phi3"}, GgufModel{"families/gemma2", "gemma2"},
                                           GgufModel{"families/gemma3", "gemma3"}),
                         [](const auto& info) {
                           const auto& dir = info.param.fixture_dir;
                           return dir == "tiny-llama" ? std::string("Llama") : dir.substr(dir.find('/') + 1);
                         });

// Qwen's tokenizers split digits one by one (Llama 3's regex takes up to three): the file names
// llama.cpp's "qwen2" pre-tokenizer, and llama.cpp tokenizes as qtrain does.
TEST(GgufExport, QwenPreTokenizerIsLlamaCppsQwen2) {
  TempDir temp;
  std::filesystem::create_directories(temp.file("qwen"));
  for (const auto& entry : std::filesystem::directory_iterator(fixture("families/qwen2"))) {
    std::filesystem::copy_file(entry.path(), temp.file("qwen/" + entry.path().filename().string()),
                               std::filesystem::copy_options::none);
  }
  auto tokenizer_json = nlohmann::json::parse(testing::read_text(temp.file("qwen/tokenizer.json")));
  auto& regex = tokenizer_json["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"];
  const auto llama3_regex = regex.get<std::string>();
  const auto digits = llama3_regex.find("\\p{N}{1,3}");
  ASSERT_NE(digits, std::string::npos);
  regex = llama3_regex.substr(0, digits) + "\\p{N}" + llama3_regex.substr(digits + std::string("\\p{N}{1,3}").size());
  tokenizer_json["model"]["ignore_merges"] = false;  // llama.cpp's qwen2 runs the merges on whole words too
  temp.write("qwen/tokenizer.json", tokenizer_json.dump());

  const std::string model_dir = temp.file("qwen");
  auto loaded = qat_model_of(model_dir, qat::QuantSpec::gguf_q4_0());
  write_gguf_model(*loaded.model, BaseDirectory::read(model_dir, loaded.config), temp.file("model.gguf"));
  EXPECT_EQ(GgufFile::open(temp.file("model.gguf")).value("tokenizer.ggml.pre").as<std::string>("pre"), "qwen2");

  const auto python = testing::find_python_with("llama_cpp safetensors torch");
  if (python.empty()) GTEST_SKIP() << "no Python with llama_cpp (tools/run-tests.sh installs it)";
  const std::string text = "In 1961, 12345 of the 67890 voters said 2024 would come.";
  const std::string command = "'" + python + "' '" + testing::source_dir() + "/tests/interop/gguf_model.py' llama-cpp '" +
                              temp.file("model.gguf") + "' '" + text + "' '" + temp.file("llama_cpp.safetensors") + "' 2>&1";
  const auto result = testing::run_command(command);
  ASSERT_EQ(result.status, 0) << command << "\n" << result.output;
  const auto ids = SafetensorsCheckpoint::open(temp.file("llama_cpp.safetensors")).tensor("input_ids");
  const std::vector<int64_t> theirs(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
  EXPECT_EQ(theirs, data::Tokenizer::from_model_dir(model_dir).encode(text));
  EXPECT_NE(theirs, data::Tokenizer::from_model_dir(fixture("families/qwen2")).encode(text));  // the regex mattered
}

// What llama.cpp's architectures cannot hold is refused, naming it.
TEST(GgufExport, ASlidingWindowShorterThanTheContextIsRefused) {
  TempDir temp;
  auto loaded = qat_model_of(fixture("families/mistral"), qat::QuantSpec::gguf_q4_0());
  loaded.config.llama.sliding_window = 16;
  try {
    write_gguf_model(*loaded.model, BaseDirectory::read(fixture("families/mistral"), loaded.config), temp.file("model.gguf"));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("sliding_window 16"), std::string::npos) << error.what();
  }
  EXPECT_FALSE(is_regular_file(temp.file("model.gguf")));
}

}  // namespace
}  // namespace qtrain::trainer
