// Merged export: the written directory is a plain Hugging Face model that transformers loads with
// our logits, equal to what peft's merge_and_unload makes of the same adapter.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "qat/four_bit_linear.h"
#include "support.h"
#include "model_outputs.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/merged_export.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/formats/safetensors.h"
#include "trainer/model/dense_mlp.h"

namespace qtrain::trainer {
namespace {

using testing::fixture;
using testing::TempDir;

LoadedModel base_with_adapter() {
  auto loaded = load_llama(fixture("tiny-llama"));
  apply_peft_adapter(*loaded.model, fixture("tiny-llama-lora"));
  return loaded;
}

std::string export_merged(const LoadedModel& loaded, const std::string& base_dir, const std::string& out_dir,
                          torch::ScalarType dtype, uint64_t max_shard_bytes = 5'000'000'000) {
  MergedExportOptions options;
  options.dtype = dtype;
  options.max_shard_bytes = max_shard_bytes;
  write_merged_model(*loaded.model, BaseDirectory::read(base_dir, loaded.config), out_dir, options);
  return out_dir;
}

torch::Tensor reference_input_ids() {
  return SafetensorsFile::open(fixture("tiny-llama-reference.safetensors")).tensor("lora.input_ids");
}

using testing_outputs::logits_of;
using testing_outputs::max_relative_error;

nlohmann::json read_json(const std::string& path) {
  std::ifstream file(path);
  return nlohmann::json::parse(file);
}

TEST(MergedExport, TransformersLoadsItAndGivesOurLogitsInFp32) {
  const auto python = testing::find_python_with("torch transformers safetensors");
  if (python.empty()) GTEST_SKIP() << "no Python with transformers (set QTRAIN_PYTHON)";
  TempDir temp;
  auto loaded = base_with_adapter();
  const auto out = export_merged(loaded, fixture("tiny-llama"), temp.file("merged"), torch::kFloat32);
  const std::string command = "'" + python + "' '" + testing::source_dir() + "/tests/interop/merged_model.py' logits '" +
                              out + "' '" + fixture("tiny-llama-reference.safetensors") + "' lora.input_ids '" +
                              temp.file("logits.safetensors") + "' 2>&1";
  const auto result = testing::run_command(command);
  ASSERT_EQ(result.status, 0) << command << "\n" << result.output;

  const auto theirs = SafetensorsCheckpoint::open(temp.file("logits.safetensors")).tensor("logits");
  // Ours: the base with the adapter beside it, unmerged, as training and eval run it.
  const auto ours = logits_of(*loaded.model, reference_input_ids());
  const double error = max_relative_error(ours, theirs);
  std::printf("[ measured ] transformers on the merged export vs our unmerged model: %.3g relative\n", error);
  EXPECT_LT(error, 1e-5);
}

TEST(MergedExport, EqualsPeftMergeAndUnload) {
  const auto python = testing::find_python_with("torch transformers peft safetensors");
  if (python.empty()) GTEST_SKIP() << "no Python with transformers and peft (set QTRAIN_PYTHON)";
  TempDir temp;
  const auto out = export_merged(base_with_adapter(), fixture("tiny-llama"), temp.file("merged"), torch::kFloat32);
  const std::string command = "'" + python + "' '" + testing::source_dir() +
                              "/tests/interop/merged_model.py' peft-merge '" + fixture("tiny-llama") + "' '" +
                              fixture("tiny-llama-lora") + "' '" + temp.file("peft.safetensors") + "' 2>&1";
  const auto result = testing::run_command(command);
  ASSERT_EQ(result.status, 0) << command << "\n" << result.output;

  const auto peft = SafetensorsCheckpoint::open(temp.file("peft.safetensors"));
  const auto ours = SafetensorsCheckpoint::open(out);
  auto peft_names = peft.names();
  auto our_names = ours.names();
  std::sort(peft_names.begin(), peft_names.end());
  std::sort(our_names.begin(), our_names.end());
  ASSERT_EQ(our_names, peft_names);
  double worst = 0;
  for (const auto& name : our_names) {
    ASSERT_EQ(ours.info(name).dtype, "F32") << name;
    const double error = (ours.tensor(name) - peft.tensor(name)).abs().max().item<double>();
    worst = std::max(worst, error);
    EXPECT_LE(error, 1e-6) << name;
  }
  std::printf("[ measured ] merged export vs peft merge_and_unload: max |difference| %.3g\n", worst);
}

TEST(MergedExport, WritesConfigGenerationConfigAndTokenizer) {
  TempDir temp;
  const auto out = export_merged(base_with_adapter(), fixture("tiny-llama"), temp.file("merged"), torch::kBFloat16);
  const auto config = read_json(out + "/config.json");
  EXPECT_EQ(config.at("dtype"), "bfloat16");
  EXPECT_FALSE(config.contains("quantization_config"));
  EXPECT_EQ(config.at("rope_parameters"), read_json(fixture("tiny-llama/config.json")).at("rope_parameters"));
  EXPECT_EQ(read_json(out + "/generation_config.json"), read_json(fixture("tiny-llama/generation_config.json")));
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}) {
    std::ifstream copy(out + "/" + name), original(fixture("tiny-llama/") + name);
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(copy), {}),
              std::string(std::istreambuf_iterator<char>(original), {}))
        << name;
  }
  const auto weights = SafetensorsCheckpoint::open(out);
  EXPECT_EQ(weights.info("model.layers.0.self_attn.q_proj.weight").dtype, "BF16");
  EXPECT_FALSE(weights.contains("model.layers.0.self_attn.q_proj.lora_A.weight"));
  EXPECT_FALSE(weights.contains("model.layers.0.self_attn.q_proj.base_layer.weight"));
  // It loads back as a plain model whose fp32 logits are the bf16 rounding of the merge.
  auto reloaded = load_llama(out);
  EXPECT_LT(max_relative_error(logits_of(*reloaded.model, reference_input_ids()),
                               logits_of(*base_with_adapter().model, reference_input_ids())),
            2e-2);
}

// The export writes what the base directory held when it was read: its files are read once,
// not again by each writer.
TEST(MergedExport, TakesTheBaseDirectoryAsItWasReadOnce) {
  TempDir temp;
  const std::vector<std::string> names = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                          "generation_config.json"};
  const auto text_of = [](const std::string& path) {
    std::ifstream file(path);
    return std::string(std::istreambuf_iterator<char>(file), {});
  };
  for (const auto& name : names) temp.write("base/" + name, text_of(fixture("tiny-llama/") + name));
  const auto loaded = base_with_adapter();
  const auto base = BaseDirectory::read(temp.file("base"), loaded.config);
  std::vector<std::string> read;
  for (const auto& [name, text] : base.tokenizer_files) read.push_back(name);
  EXPECT_EQ(read, (std::vector<std::string>{"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}));
  for (const auto& name : names) std::filesystem::remove(temp.file("base/" + name));
  MergedExportOptions options;
  write_merged_model(*loaded.model, base, temp.file("merged"), options);
  for (const auto& name : names) EXPECT_EQ(text_of(temp.file("merged/" + name)), text_of(fixture("tiny-llama/") + name)) << name;
}

TEST(MergedExport, ShardsWithAnIndexBeyondTheShardSize) {
  TempDir temp;
  auto loaded = base_with_adapter();
  const auto single = export_merged(loaded, fixture("tiny-llama"), temp.file("single"), torch::kFloat32);
  const auto sharded =
      export_merged(loaded, fixture("tiny-llama"), temp.file("sharded"), torch::kFloat32, /*max_shard_bytes=*/8'000'000);
  const auto index = read_json(sharded + "/model.safetensors.index.json");
  std::set<std::string> shard_files;
  for (const auto& entry : index.at("weight_map").items()) shard_files.insert(entry.value().get<std::string>());
  EXPECT_GT(shard_files.size(), 1u);
  EXPECT_FALSE(std::ifstream(sharded + "/model.safetensors").good());
  const auto one = SafetensorsCheckpoint::open(single);
  const auto many = SafetensorsCheckpoint::open(sharded);
  ASSERT_EQ(one.names(), many.names());
  for (const auto& name : one.names()) EXPECT_TRUE(torch::equal(one.tensor(name), many.tensor(name))) << name;
}

TEST(MergedExport, FourBitBaseIsDequantizedAndLosesItsQuantizationConfig) {
  TempDir temp;
  auto loaded = load_llama(fixture("tiny-llama-bnb-nf4"));
  const auto out = export_merged(loaded, fixture("tiny-llama-bnb-nf4"), temp.file("merged"), torch::kFloat32);
  const auto config = read_json(out + "/config.json");
  EXPECT_FALSE(config.contains("quantization_config"));
  EXPECT_EQ(config.at("dtype"), "float32");
  const auto weights = SafetensorsCheckpoint::open(out);
  EXPECT_FALSE(weights.contains("model.layers.0.mlp.up_proj.weight.absmax"));
  auto* up_proj = loaded.model->model->layers[0]->as<LlamaDecoderLayer>()->mlp->as<DenseMlp>()->up_proj.get();
  ASSERT_NE(dynamic_cast<qat::FourBitLinear*>(up_proj), nullptr);
  EXPECT_TRUE(torch::equal(weights.tensor("model.layers.0.mlp.up_proj.weight"), up_proj->dense_weight(torch::kFloat32)));
  auto reloaded = load_llama(out);
  EXPECT_LT(max_relative_error(logits_of(*reloaded.model, reference_input_ids()),
                               logits_of(*loaded.model, reference_input_ids())),
            1e-5);
}

TEST(MergedExport, ShardSizesReadAsSavePretrainedReadsThem) {
  EXPECT_EQ(parse_byte_size("5GB", "--shard-size"), 5'000'000'000u);
  EXPECT_EQ(parse_byte_size("2GiB", "--shard-size"), 2ull << 30);
  EXPECT_EQ(parse_byte_size("500mb", "--shard-size"), 500'000'000u);
  EXPECT_EQ(parse_byte_size("1000", "--shard-size"), 1000u);
  try {
    parse_byte_size("five gigs", "--shard-size");
    FAIL() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("--shard-size: 'five gigs' is not a size"), std::string::npos);
  }
}

}  // namespace
}  // namespace qtrain::trainer
