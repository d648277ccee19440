// compressed-tensors both ways, against the compressed-tensors package and transformers
// (tests/interop/compressed_tensors_model.py): our post-training export is byte for byte what the
// package writes for the same model; transformers loads every preset's export with the logits
// qtrain computes from it; a QAT run's export decompresses to its trained weights bit for bit; a
// checkpoint the package made trains LoRA kept in its stored form, and peft loads the adapter on
// top of it in transformers with our logits.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "model_outputs.h"
#include "qat/compressed_linear.h"
#include "qat/compressed_weight.h"
#include "qat/qat_linear.h"
#include "qat_model.h"
#include "support.h"
#include "trainer/finetune.h"
#include "trainer/formats/compressed_tensors.h"
#include "trainer/formats/compressed_tensors_config.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/formats/safetensors.h"
#include "trainer/recipe/recipe_schema.h"
#include "trainer/trained_run.h"

namespace qtrain::trainer {
namespace {

using testing::fixture;
using testing::read_text;
using testing::TempDir;
using testing_outputs::logits_of;
using testing_outputs::max_relative_error;

constexpr const char* kPythonModules = "torch transformers compressed_tensors safetensors peft";

std::string skip_reason() { return testing::python_lacks(kPythonModules); }

torch::Tensor reference_input_ids() {
  return SafetensorsFile::open(fixture("tiny-llama-reference.safetensors")).tensor("lora.input_ids");
}

// The model of `dir` exported on `preset` in `dtype` to `out`.
void export_model(const std::string& dir, const qat::QuantPreset& preset, torch::ScalarType dtype, const std::string& out) {
  auto loaded = load_llama(dir);
  CompressedTensorsExportOptions options;
  options.preset = &preset;
  options.dtype = dtype;
  write_compressed_tensors_model(*loaded.model, BaseDirectory::read(dir, loaded.config), out, options);
}

nlohmann::json quantization_config(const std::string& dir) {
  return nlohmann::json::parse(read_text(dir + "/config.json")).at("quantization_config");
}

TEST(CompressedTensorsPacking, DensePackingRoundTripsEveryWidth) {
  for (int64_t bits = 1; bits <= 8; ++bits) {
    const int64_t low = -(int64_t{1} << (bits - 1));
    const auto codes = torch::randint(low, -low, {5, 77}, torch::kInt8);
    for (int64_t dim = 0; dim < 2; ++dim) {
      const auto packed = qat::pack_int32(codes, bits, dim);
      EXPECT_EQ(packed.size(dim), (codes.size(dim) * bits + 31) / 32) << bits;
      EXPECT_TRUE(torch::equal(qat::unpack_int32(packed, bits, codes.size(dim), dim), codes)) << bits << " bits, dim " << dim;
    }
  }
  // int4: element i in bits 4 (i % 8) of word i / 8, offset by 8.
  const auto codes = torch::tensor({-8, -7, 0, 1, 2, 3, 6, 7}, torch::kInt8).reshape({1, 8});
  EXPECT_EQ(static_cast<uint32_t>(qat::pack_int32(codes, 4, 1).item<int32_t>()), 0xFEBA9810u);
}

// Every tensor `theirs` holds, `ours` holds with the same dtype, shape and bytes, and no other.
void expect_same_tensors(const std::string& ours, const std::string& theirs, const std::string& what) {
  const auto our_weights = SafetensorsCheckpoint::open(ours);
  const auto their_weights = SafetensorsCheckpoint::open(theirs);
  const auto our_list = our_weights.names();
  const auto their_list = their_weights.names();
  const std::set<std::string> our_names(our_list.begin(), our_list.end());
  const std::set<std::string> their_names(their_list.begin(), their_list.end());
  EXPECT_EQ(our_names, their_names) << what;
  int64_t compared = 0;
  for (const auto& name : their_names) {
    if (!our_names.count(name)) continue;
    const auto mine = our_weights.tensor(name);
    const auto reference = their_weights.tensor(name);
    ASSERT_EQ(mine.scalar_type(), reference.scalar_type()) << what << " " << name;
    ASSERT_EQ(mine.sizes(), reference.sizes()) << what << " " << name;
    const auto differ = (mine.contiguous().view(torch::kUInt8).reshape(-1) != reference.contiguous().view(torch::kUInt8).reshape(-1))
                            .sum()
                            .item<int64_t>();
    EXPECT_EQ(differ, 0) << what << " " << name << ": " << differ << " of " << mine.nbytes() << " bytes differ";
    ++compared;
  }
  EXPECT_GT(compared, 20) << what;
}

// Round to nearest exactly as the package does it, for every preset: every tensor the package
// writes for the same fp32 model, with the same names, dtypes, shapes and bytes, and the same
// scheme in config.json.
TEST(CompressedTensorsExport, EveryPresetIsWhatTheCompressedTensorsPackageWrites) {
  if (const auto reason = skip_reason(); !reason.empty()) GTEST_SKIP() << reason;
  TempDir temp;
  std::string schemes;
  for (const auto& preset : qat::quant_presets()) {
    export_model(fixture("tiny-llama"), preset, torch::kFloat32, temp.file(std::string("ours-") + preset.name));
    schemes += std::string(" ") + preset.name;
  }
  const auto made = testing::run_interop_script("compressed_tensors_model.py",
                                                "quantize-many " + fixture("tiny-llama") + " " + temp.file("theirs-") + schemes);
  ASSERT_EQ(made.status, 0) << made.output;
  for (const auto& preset : qat::quant_presets()) {
    const auto ours = temp.file(std::string("ours-") + preset.name);
    const auto theirs = temp.file(std::string("theirs-") + preset.name);
    expect_same_tensors(ours, theirs, preset.name);
    // config.json's quantization_config is the package's, key for key.
    EXPECT_EQ(quantization_config(ours), quantization_config(theirs)) << preset.name;
  }
}

// In bf16, as a bf16 model is exported: the package's CPU path rounds in bf16 and so do we.
TEST(CompressedTensorsExport, Bf16ExportIsWhatThePackageWritesForABf16Model) {
  if (const auto reason = skip_reason(); !reason.empty()) GTEST_SKIP() << reason;
  TempDir temp;
  const std::vector<std::string> names = {"W4A16_ASYM", "FP8_DYNAMIC", "NVFP4A16"};
  std::string schemes;
  for (const auto& name : names) {
    export_model(fixture("tiny-llama"), qat::find_quant_preset(name, "scheme"), torch::kBFloat16, temp.file("ours-" + name));
    schemes += " " + name;
  }
  const auto made = testing::run_interop_script(
      "compressed_tensors_model.py", "quantize-many " + fixture("tiny-llama") + " " + temp.file("theirs-") + schemes + " --dtype bfloat16");
  ASSERT_EQ(made.status, 0) << made.output;
  for (const auto& name : names) expect_same_tensors(temp.file("ours-" + name), temp.file("theirs-" + name), name + " bf16");
}

// Every preset's export of the demo model and of every family fixture loads in transformers
// (with the compressed-tensors package) and computes qtrain's logits from the same file.
TEST(CompressedTensorsExport, TransformersLoadsEveryPresetWithOurLogits) {
  if (const auto reason = skip_reason(); !reason.empty()) GTEST_SKIP() << reason;
  TempDir temp;
  std::vector<std::string> models = {fixture("tiny-llama")};
  for (const char* family : {"mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"}) {
    models.push_back(fixture(std::string("families/") + family));
  }
  struct Case {
    std::string dir;
    std::string logits;
    torch::Tensor ours;
  };
  std::vector<Case> cases;
  std::string arguments = "logits-many " + fixture("tiny-llama-reference.safetensors") + " lora.input_ids";
  const auto input_ids = reference_input_ids();
  for (const auto& model : models) {
    for (const auto& preset : qat::quant_presets()) {
      Case entry;
      entry.dir = temp.file(std::filesystem::path(model).filename().string() + "-" + preset.name);
      entry.logits = entry.dir + ".logits.safetensors";
      export_model(model, preset, torch::kFloat32, entry.dir);
      auto loaded = load_llama(entry.dir);
      entry.ours = logits_of(*loaded.model, input_ids);
      arguments += " " + entry.dir + " " + entry.logits;
      cases.push_back(std::move(entry));
    }
  }
  const auto ran = testing::run_interop_script("compressed_tensors_model.py", arguments);
  ASSERT_EQ(ran.status, 0) << ran.output;
  for (const auto& entry : cases) {
    const auto theirs = SafetensorsFile::open(entry.logits).tensor("logits");
    EXPECT_LE(max_relative_error(entry.ours, theirs), 1e-4) << entry.dir;
  }
}

// A QAT layer on a preset's grid writes its own codes and scales: the package decompresses the
// file to exactly the weights the QAT forward multiplies by. W4A16 from a QAT-LoRA run of the
// recipe (its export at the end of the run); W4A16_ASYM and FP8_DYNAMIC from QAT models.
TEST(CompressedTensorsExport, QatCodesDecompressToTheTrainedWeightsBitForBit) {
  if (const auto reason = skip_reason(); !reason.empty()) GTEST_SKIP() << reason;
  TempDir temp;
  const auto run_dir = temp.file("run");
  const std::string demo = testing::source_dir() + "/recipes/demo";
  Finetune finetune(load_recipe(
      "", {"model.path=" + demo + "/tiny-llama", "data.train=" + demo + "/brown-val.jsonl", "quant=qat",
           "qat.weights.scheme=W4A16", "lora.rank=4", "lora.alpha=8", "lora.dropout=0", "data.max_seq_len=64",
           "train.micro_batch_size=2", "train.steps=2", "train.dtype=fp32", "train.device=cpu", "optim.lr=1e-2",
           "schedule.warmup_steps=0", "eval.every=0", "log.every=1", "export.formats=[compressed-tensors]",
           "train.output_dir=" + run_dir}));
  finetune.setup();
  finetune.train();
  struct Case {
    std::string name;
    LoadedModel model;
    std::string dir;
  };
  std::vector<Case> cases;
  cases.push_back({"W4A16 run", load_trained_run(run_dir, "", /*quantize_base=*/true).loaded, run_dir + "/export/compressed-tensors"});
  for (const char* name : {"W4A16_ASYM", "FP8_DYNAMIC"}) {
    const auto& preset = qat::find_quant_preset(name, "scheme");
    const auto activations = preset.quantizes_activations
                                 ? std::optional<qat::QuantSpec>(qat::QuantSpec::compressed_tensors_activations(preset))
                                 : std::nullopt;
    auto model = testing_qat::tiny_qat_llama(qat::QuantSpec::compressed_tensors_weights(preset), activations);
    CompressedTensorsExportOptions options;
    options.preset = &preset;
    options.dtype = torch::kFloat32;
    write_compressed_tensors_model(*model.model, BaseDirectory::read(fixture("tiny-llama"), model.config), temp.file(name), options);
    cases.push_back({name, std::move(model), temp.file(name)});
  }
  std::string arguments = "decompress";
  for (const auto& entry : cases) arguments += " " + entry.dir + " " + entry.dir + ".decompressed.safetensors";
  const auto ran = testing::run_interop_script("compressed_tensors_model.py", arguments);
  ASSERT_EQ(ran.status, 0) << ran.output;
  for (const auto& entry : cases) {
    const auto decompressed = SafetensorsFile::open(entry.dir + ".decompressed.safetensors");
    int64_t layers = 0;
    for (const auto& [layer_name, layer] : qat::find_qat_layers(*entry.model.model)) {
      const auto trained = layer->dense_weight(torch::kFloat32);
      const auto file = decompressed.tensor(layer_name + ".weight").to(torch::kFloat32);
      EXPECT_TRUE(torch::equal(file, trained)) << entry.name << " " << layer_name << ": "
                                               << (file != trained).sum().item<int64_t>() << " values differ";
      ++layers;
    }
    EXPECT_EQ(layers, 28) << entry.name;
  }
}

// A W4A16 checkpoint the package made trains LoRA with quant: none, its projections kept packed
// (about a quarter of bf16's bytes); peft loads the adapter on it in transformers with our logits.
TEST(CompressedTensorsImport, PackageMadeW4A16TrainsLoraKeptPackedAndPeftLoadsTheAdapter) {
  if (const auto reason = skip_reason(); !reason.empty()) GTEST_SKIP() << reason;
  TempDir temp;
  const auto base = temp.file("w4a16");
  const auto made = testing::run_interop_script("compressed_tensors_model.py",
                                                "quantize " + fixture("tiny-llama") + " W4A16 " + base);
  ASSERT_EQ(made.status, 0) << made.output;

  auto loaded = load_llama(base);
  const auto parsed = parse_compressed_tensors_config(loaded.config.json, loaded.config.path);
  int64_t packed_bytes = 0;
  int64_t dense_bytes = 0;
  for (const auto& found : qat::find_linear_layers(
           *loaded.model, [](const std::string&, const qat::LinearLayer&) { return true; },
           [](const qat::LinearLayer&) { return true; })) {
    if (found.name == "lm_head") continue;
    const auto* compressed = dynamic_cast<const qat::CompressedLinear*>(found.layer.get());
    ASSERT_NE(compressed, nullptr) << found.name << " is not kept compressed";
    packed_bytes += compressed->compressed_weight().stored_bytes();
    // The memory estimate (qtrain inspect) counts what the layer holds (fp32 scales here).
    EXPECT_EQ(compressed_tensors_stored_bytes(parsed, found.name, found.layer->out_features(), found.layer->in_features(), 4),
              static_cast<double>(compressed->compressed_weight().stored_bytes()))
        << found.name;
    dense_bytes += 2 * found.layer->in_features() * found.layer->out_features();
  }
  EXPECT_LT(static_cast<double>(packed_bytes), 0.3 * static_cast<double>(dense_bytes));

  const auto run = temp.file("run");
  const std::vector<std::string> overrides = {
      "model.path=" + base, "data.train=" + testing::source_dir() + "/recipes/demo/brown-val.jsonl",
      "quant=none", "lora.rank=4", "lora.alpha=8", "lora.dropout=0", "data.max_seq_len=64",
      "train.micro_batch_size=2", "train.grad_accum_steps=1", "train.steps=3", "train.dtype=fp32", "train.device=cpu",
      "optim.lr=1e-2", "schedule.warmup_steps=0", "eval.every=0", "log.every=1", "train.output_dir=" + run};
  Finetune finetune(load_recipe("", overrides));
  finetune.setup();
  const auto summary = finetune.train();

  apply_peft_adapter(*loaded.model, summary.adapter_dir);
  const auto input_ids = reference_input_ids();
  const auto ours = logits_of(*loaded.model, input_ids);
  const auto logits_file = temp.file("peft-logits.safetensors");
  const auto ran = testing::run_interop_script(
      "compressed_tensors_model.py", "logits " + base + " " + fixture("tiny-llama-reference.safetensors") +
                                         " lora.input_ids " + logits_file + " --adapter " + summary.adapter_dir);
  ASSERT_EQ(ran.status, 0) << ran.output;
  const auto theirs = SafetensorsFile::open(logits_file).tensor("logits");
  EXPECT_LE(max_relative_error(ours, theirs), 1e-4);
  // The adapter trained: the base alone computes other logits.
  auto plain = load_llama(base);
  EXPECT_GT((logits_of(*plain.model, input_ids) - ours).abs().max().item<float>(), 1e-3);
}

// quant: qlora / qat start from the checkpoint's values: every stored layer, with its input
// quantization (W8A8), becomes a dense layer of its dequantized weight.
TEST(CompressedTensorsImport, StoredLayersDecompressToDenseOnesOfTheSameWeights) {
  TempDir temp;
  const auto dir = temp.file("w8a8");
  export_model(fixture("tiny-llama"), qat::find_quant_preset("W8A8", "scheme"), torch::kFloat32, dir);
  auto loaded = load_llama(dir);
  std::map<std::string, torch::Tensor> stored;
  const auto all = [](const auto&...) { return true; };
  for (const auto& found : qat::find_linear_layers(*loaded.model, all, all)) {
    if (qat::stored_compressed_layer(*found.layer) != nullptr) stored[found.name] = found.layer->dense_weight(torch::kFloat32);
  }
  ASSERT_EQ(stored.size(), 28u);
  EXPECT_EQ(qat::decompress_stored_linear_layers(*loaded.model, torch::kFloat32).size(), 28u);
  for (const auto& found : qat::find_linear_layers(*loaded.model, all, all)) {
    ASSERT_NE(dynamic_cast<const qat::DenseLinear*>(found.layer.get()), nullptr) << found.name;
    if (stored.count(found.name)) EXPECT_TRUE(torch::equal(found.layer->dense_weight(torch::kFloat32), stored[found.name])) << found.name;
  }
}

// Errors name the tensor or the key.
TEST(CompressedTensorsImport, BadCheckpointsAreErrorsNamingTheTensorOrKey) {
  TempDir temp;
  const auto& preset = qat::find_quant_preset("W4A16", "scheme");
  const auto dir = temp.file("w4a16");
  export_model(fixture("tiny-llama"), preset, torch::kFloat32, dir);
  const std::string scale = "model.layers.1.mlp.down_proj.weight_scale";
  {
    const auto file = SafetensorsFile::open(dir + "/model.safetensors");
    std::vector<std::pair<std::string, torch::Tensor>> tensors;
    for (const auto& name : file.names()) {
      if (name != scale) tensors.emplace_back(name, file.tensor(name).clone());
    }
    write_safetensors(dir + "/model.safetensors", tensors, file.metadata());
  }
  EXPECT_NE(testing::error_message([&] { load_llama(dir); }).find(scale), std::string::npos);

  auto config = nlohmann::json::parse(read_text(dir + "/config.json"));
  config["quantization_config"]["config_groups"]["group_0"]["format"] = "marlin-24";
  temp.write("w4a16/config.json", config.dump());
  EXPECT_NE(testing::error_message([&] { load_llama(dir); }).find("marlin-24"), std::string::npos);
  // A quantization_config of a kind no row reads names the kinds that are read.
  auto other = config;
  other["quantization_config"] = {{"quant_method", "awq"}, {"bits", 4}};
  temp.write("w4a16/config.json", other.dump());
  const auto unknown = testing::error_message([&] { load_llama(dir); });
  EXPECT_NE(unknown.find("quantization_config"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("compressed-tensors"), std::string::npos) << unknown;
  config["quantization_config"]["kv_cache_scheme"] = {{"num_bits", 8}};
  EXPECT_NE(testing::error_message([&] { parse_compressed_tensors_config(config.dump(), "config.json"); }).find("kv_cache_scheme"),
            std::string::npos);
}

}  // namespace
}  // namespace qtrain::trainer
