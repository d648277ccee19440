// PEFT adapters in and out, against peft itself: the fixture adapter made by
// get_peft_model(...).save_pretrained must give the logits and loss peft computed
// (tiny-llama-reference.safetensors, `lora.*`), and what qtrain writes must load in
// PeftModel.from_pretrained with the same logits.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "support.h"
#include "model_outputs.h"
#include "trainer/model/causal_lm_loss.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/model/dense_mlp.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {
namespace {

namespace fs = std::filesystem;
using qtrain::testing::fixture;

using qtrain::testing::TempDir;

LlamaForCausalLM load_base() {
  ModelLoadOptions options;
  options.dtype = torch::kFloat32;
  options.device = torch::kCPU;
  return load_llama(fixture("tiny-llama"), options).model;
}

torch::Tensor reference(const std::string& name) {
  return SafetensorsCheckpoint::open(fixture("tiny-llama-reference.safetensors")).tensor(name);
}

std::vector<std::pair<std::string, std::shared_ptr<qat::LoraLinear>>> lora_layers_of(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, std::shared_ptr<qat::LoraLinear>>> layers;
  for (const auto& item : model.named_modules("", false)) {
    if (auto lora = std::dynamic_pointer_cast<qat::LoraLinear>(item.value())) layers.emplace_back(item.key(), lora);
  }
  return layers;
}

using testing_outputs::logits_of;
using testing_outputs::max_relative_error;

// A copy of the fixture adapter with its config or tensors changed, for the error cases.
std::string edited_adapter(const TempDir& temp, const std::function<void(nlohmann::json&)>& edit_config,
                           const std::function<void(std::vector<std::pair<std::string, torch::Tensor>>&)>& edit_tensors) {
  const std::string dir = temp.file("edited");
  fs::create_directories(dir);
  std::ifstream in(fixture("tiny-llama-lora/adapter_config.json"));
  auto config = nlohmann::json::parse(in);
  edit_config(config);
  std::ofstream(dir + "/adapter_config.json") << config.dump(2);
  auto original = SafetensorsCheckpoint::open(fixture("tiny-llama-lora/adapter_model.safetensors"));
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& name : original.names()) tensors.emplace_back(name, original.tensor(name));
  edit_tensors(tensors);
  write_safetensors(dir + "/adapter_model.safetensors", tensors, {{"format", "pt"}});
  return dir;
}

void keep_config(nlohmann::json&) {}
void keep_tensors(std::vector<std::pair<std::string, torch::Tensor>>&) {}

// Expects apply_peft_adapter to throw an Error mentioning `needle`, leaving the model plain.
void expect_adapter_error(const std::string& adapter_dir, const std::string& needle) {
  auto model = load_base();
  try {
    apply_peft_adapter(*model, adapter_dir);
    ADD_FAILURE() << "expected an Error mentioning " << needle;
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
  }
  EXPECT_TRUE(lora_layers_of(*model).empty()) << "a rejected adapter must leave the model untouched";
}

TEST(PeftAdapter, ReadsTheFixtureConfig) {
  const auto config = read_peft_adapter_config(fixture("tiny-llama-lora"));
  EXPECT_EQ(config.lora.rank, 8);
  EXPECT_DOUBLE_EQ(config.lora.alpha, 16.0);
  EXPECT_DOUBLE_EQ(config.lora.dropout, 0.0);
  EXPECT_FALSE(config.lora.rslora);
  EXPECT_EQ(config.targets.include.names,
            (std::vector<std::string>{"gate_proj", "v_proj", "q_proj", "up_proj", "k_proj", "down_proj", "o_proj"}));
  EXPECT_FALSE(config.targets.include.regex);
  EXPECT_TRUE(config.targets.exclude.empty());
}

TEST(PeftAdapter, WrapsEveryTargetProjectionAndNothingElse) {
  auto model = load_base();
  apply_peft_adapter(*model, fixture("tiny-llama-lora"));
  EXPECT_EQ(lora_layers_of(*model).size(), 4u * 7u);
  EXPECT_FALSE(std::dynamic_pointer_cast<qat::LoraLinear>(model->lm_head));
  // The blocks' own pointers (what forward() calls) follow the swap.
  auto layer = model->model->layers->ptr<LlamaDecoderLayerImpl>(2);
  EXPECT_TRUE(std::dynamic_pointer_cast<qat::LoraLinear>(layer->self_attn->q_proj));
  EXPECT_TRUE(std::dynamic_pointer_cast<qat::LoraLinear>(layer->mlp->as<DenseMlp>()->down_proj));
  EXPECT_FALSE(lora_layers_of(*model).front().second->is_training()) << "an eval-mode model stays in eval mode";
  // A and B train in fp32; the projections they wrap are frozen (other weights are the trainer's call).
  for (const auto& item : model->named_parameters()) {
    const auto& name = item.key();
    if (name.find(".lora_") != std::string::npos) {
      EXPECT_TRUE(item.value().requires_grad()) << name;
      EXPECT_EQ(item.value().scalar_type(), torch::kFloat32) << name;
    } else if (name.find(".base_layer.") != std::string::npos) {
      EXPECT_FALSE(item.value().requires_grad()) << name;
    }
  }
}

TEST(PeftAdapter, LogitsAndLossEqualPeft) {
  auto model = load_base();
  apply_peft_adapter(*model, fixture("tiny-llama-lora"));
  const auto input_ids = reference("lora.input_ids");
  const auto logits = logits_of(*model, input_ids);
  const auto expected = reference("lora.logits");
  ASSERT_EQ(logits.sizes(), expected.sizes());
  const double error = max_relative_error(logits, expected);
  std::printf("[ measured ] logits: max |ours - peft| / max |peft| = %.3g\n", error);
  EXPECT_LT(error, 1e-5);

  torch::NoGradGuard no_grad;
  LlamaInputs inputs;
  inputs.input_ids = input_ids;
  const auto token_loss = causal_lm_loss(*model, model->hidden_states(inputs), input_ids, /*chunk_tokens=*/0);
  const double loss = (token_loss.loss_sum / token_loss.tokens).item<double>();
  const double expected_loss = reference("lora.loss").item<double>();
  std::printf("[ measured ] loss: ours %.8f, peft %.8f, |difference| %.3g\n", loss, expected_loss,
              std::abs(loss - expected_loss));
  EXPECT_NEAR(loss, expected_loss, 1e-6 * expected_loss);
  // The adapter does something: the base model's logits are far from these.
  EXPECT_GT(max_relative_error(reference("base.logits"), expected), 1e-3);
}

TEST(PeftAdapter, WriteThenReadRoundTripsExactly) {
  TempDir temp;
  auto model = load_base();
  apply_peft_adapter(*model, fixture("tiny-llama-lora"));
  const auto config = read_peft_adapter_config(fixture("tiny-llama-lora"));
  write_peft_adapter(*model, config, temp.file("adapter"), "tiny-llama");

  auto reloaded = load_base();
  apply_peft_adapter(*reloaded, temp.file("adapter"));
  const auto written = lora_layers_of(*model);
  const auto read = lora_layers_of(*reloaded);
  ASSERT_EQ(written.size(), read.size());
  for (size_t index = 0; index < written.size(); ++index) {
    EXPECT_EQ(written[index].first, read[index].first);
    EXPECT_TRUE(torch::equal(written[index].second->lora_A(), read[index].second->lora_A())) << read[index].first;
    EXPECT_TRUE(torch::equal(written[index].second->lora_B(), read[index].second->lora_B())) << read[index].first;
  }
  // Bit for bit the same tensors as peft's own file.
  auto ours = SafetensorsCheckpoint::open(temp.file("adapter/adapter_model.safetensors"));
  auto peft = SafetensorsCheckpoint::open(fixture("tiny-llama-lora/adapter_model.safetensors"));
  auto our_names = ours.names(), peft_names = peft.names();
  std::sort(our_names.begin(), our_names.end());
  std::sort(peft_names.begin(), peft_names.end());
  ASSERT_EQ(our_names, peft_names);
  for (const auto& name : peft_names) {
    EXPECT_EQ(ours.tensor(name).scalar_type(), torch::kFloat32) << name;
    EXPECT_TRUE(torch::equal(ours.tensor(name), peft.tensor(name))) << name;
  }
}

TEST(PeftAdapter, WrittenConfigHasPeftsKeys) {
  TempDir temp;
  auto model = load_base();
  apply_peft_adapter(*model, fixture("tiny-llama-lora"));
  auto config = read_peft_adapter_config(fixture("tiny-llama-lora"));
  write_peft_adapter(*model, config, temp.file("adapter"), "meta-llama/Tiny");
  std::ifstream in(temp.file("adapter/adapter_config.json"));
  const auto json = nlohmann::json::parse(in);
  EXPECT_EQ(json.at("peft_type"), "LORA");
  EXPECT_EQ(json.at("task_type"), "CAUSAL_LM");
  EXPECT_EQ(json.at("r"), 8);
  EXPECT_TRUE(json.at("lora_alpha").is_number_integer());
  EXPECT_EQ(json.at("lora_alpha"), 16);
  EXPECT_EQ(json.at("lora_dropout"), 0.0);
  EXPECT_EQ(json.at("use_rslora"), false);
  EXPECT_EQ(json.at("use_dora"), false);
  EXPECT_EQ(json.at("bias"), "none");
  EXPECT_EQ(json.at("fan_in_fan_out"), false);
  EXPECT_EQ(json.at("inference_mode"), true);
  EXPECT_EQ(json.at("base_model_name_or_path"), "meta-llama/Tiny");
  EXPECT_TRUE(json.at("modules_to_save").is_null());
  EXPECT_EQ(json.at("target_modules").get<std::vector<std::string>>(), config.targets.include.names);
  EXPECT_TRUE(json.at("rank_pattern").empty());
  EXPECT_TRUE(json.at("alpha_pattern").empty());
  // Nothing but the two files, no staging directory left behind.
  std::vector<std::string> entries;
  for (const auto& entry : fs::directory_iterator(temp.path())) entries.push_back(entry.path().filename().string());
  EXPECT_EQ(entries, (std::vector<std::string>{"adapter"}));
}

TEST(PeftAdapter, RecipeConveniencesAreWrittenAsExplicitModuleNames) {
  TempDir temp;
  auto model = load_base();
  PeftAdapterConfig config;
  config.lora.rank = 4;
  config.lora.alpha = 8;
  config.lora.rslora = true;
  // A regex entry (the whole name must match), which peft's list form would read literally.
  config.targets.include.names = {"model\\.layers\\.[01]\\.self_attn\\.(q|v)_proj"};
  qat::apply_lora(*model, config.targets, config.lora);
  write_peft_adapter(*model, config, temp.file("adapter"), "tiny-llama");
  std::ifstream in(temp.file("adapter/adapter_config.json"));
  const auto json = nlohmann::json::parse(in);
  EXPECT_EQ(json.at("target_modules").get<std::vector<std::string>>(),
            (std::vector<std::string>{"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                                      "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"}));
  EXPECT_EQ(json.at("use_rslora"), true);
  const auto read = read_peft_adapter_config(temp.file("adapter"));
  EXPECT_TRUE(read.lora.rslora);
  EXPECT_EQ(read.lora.rank, 4);
  auto reloaded = load_base();
  apply_peft_adapter(*reloaded, temp.file("adapter"));
  EXPECT_EQ(lora_layers_of(*reloaded).size(), 4u);
}

TEST(PeftAdapter, WriteRefusesAnExistingDirectoryAndAMismatchedConfig) {
  TempDir temp;
  auto model = load_base();
  apply_peft_adapter(*model, fixture("tiny-llama-lora"));
  auto config = read_peft_adapter_config(fixture("tiny-llama-lora"));
  fs::create_directories(temp.file("taken"));
  std::ofstream(temp.file("taken/keep.txt")) << "precious";
  EXPECT_THROW(write_peft_adapter(*model, config, temp.file("taken"), "tiny-llama"), Error);
  EXPECT_TRUE(fs::exists(temp.file("taken/keep.txt")));

  config.lora.rank = 16;  // the model's layers have r = 8
  EXPECT_THROW(write_peft_adapter(*model, config, temp.file("fresh"), "tiny-llama"), Error);
  config.lora.rank = 8;
  config.targets.include.names = {"q_proj"};  // the model also adapts k_proj, ...
  EXPECT_THROW(write_peft_adapter(*model, config, temp.file("fresh"), "tiny-llama"), Error);
  EXPECT_FALSE(fs::exists(temp.file("fresh")));
  EXPECT_THROW(write_peft_adapter(*load_base(), config, temp.file("fresh"), "tiny-llama"), Error);  // no LoRA at all
}

TEST(PeftAdapter, RankAndAlphaPatternsFollowPeft) {
  TempDir temp;
  const auto dir = edited_adapter(
      temp,
      [](nlohmann::json& config) {
        config["rank_pattern"] = {{"self_attn.q_proj", 4}};
        config["alpha_pattern"] = {{"layers\\.0\\.mlp\\.up_proj", 32}};
      },
      [](std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
        for (auto& [name, tensor] : tensors) {
          if (name.find("q_proj.lora_A") != std::string::npos) tensor = tensor.slice(0, 0, 4).contiguous();
          if (name.find("q_proj.lora_B") != std::string::npos) tensor = tensor.slice(1, 0, 4).contiguous();
        }
      });
  const auto config = read_peft_adapter_config(dir);
  EXPECT_EQ(config.options_for("model.layers.3.self_attn.q_proj").rank, 4);
  EXPECT_EQ(config.options_for("model.layers.3.self_attn.k_proj").rank, 8);
  EXPECT_DOUBLE_EQ(config.options_for("model.layers.0.mlp.up_proj").alpha, 32.0);
  EXPECT_DOUBLE_EQ(config.options_for("model.layers.1.mlp.up_proj").alpha, 16.0);

  auto model = load_base();
  apply_peft_adapter(*model, dir);
  for (const auto& [name, lora] : lora_layers_of(*model)) {
    EXPECT_EQ(lora->options().rank, name.find("q_proj") != std::string::npos ? 4 : 8) << name;
  }
  // Patterns round-trip through write_peft_adapter.
  write_peft_adapter(*model, config, temp.file("written"), "tiny-llama");
  const auto reread = read_peft_adapter_config(temp.file("written"));
  EXPECT_EQ(reread.rank_pattern, config.rank_pattern);
  EXPECT_EQ(reread.alpha_pattern, config.alpha_pattern);
}

TEST(PeftAdapter, AMissingTensorIsAnErrorNamingIt) {
  TempDir temp;
  const std::string dropped = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight";
  expect_adapter_error(edited_adapter(temp, keep_config,
                                      [&](std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
                                        tensors.erase(std::remove_if(tensors.begin(), tensors.end(),
                                                                     [&](const auto& item) { return item.first == dropped; }),
                                                      tensors.end());
                                      }),
                       "'" + dropped + "' is missing");
}

TEST(PeftAdapter, AWrongShapeIsAnErrorNamingTheTensor) {
  TempDir temp;
  // r = 4 in the config, r = 8 in the file.
  expect_adapter_error(edited_adapter(temp, [](nlohmann::json& config) { config["r"] = 4; }, keep_tensors),
                       "lora_A.weight' has shape [8, ");
}

TEST(PeftAdapter, AnUnexpectedTensorIsAnError) {
  TempDir temp;
  expect_adapter_error(edited_adapter(temp, keep_config,
                                      [](std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
                                        tensors.emplace_back("base_model.model.lm_head.lora_A.weight", torch::zeros({8, 256}));
                                      }),
                       "base_model.model.lm_head.lora_A.weight");
}

TEST(PeftAdapter, UnsupportedSettingsAreErrorsNamingTheKey) {
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> cases = {
      // DoRA reads; an adapter that says use_dora without its magnitudes is an error naming them.
      {[](nlohmann::json& c) { c["use_dora"] = true; }, "lora_magnitude_vector' is missing"},
      {[](nlohmann::json& c) { c["bias"] = "all"; }, "'bias'"},
      {[](nlohmann::json& c) { c["modules_to_save"] = {"lm_head"}; }, "'modules_to_save'"},
      {[](nlohmann::json& c) { c["peft_type"] = "IA3"; }, "'peft_type'"},
      {[](nlohmann::json& c) { c["r"] = -1; }, "'r'"},
      {[](nlohmann::json& c) { c["lora_alpha"] = "16"; }, "'lora_alpha'"},
      {[](nlohmann::json& c) { c.erase("target_modules"); }, "'target_modules'"},
      {[](nlohmann::json& c) { c["layers_to_transform"] = {0, 1}; }, "'layers_to_transform'"},
      {[](nlohmann::json& c) { c["init_lora_weights"] = "pissa"; }, "'init_lora_weights'"},
      {[](nlohmann::json& c) { c["target_modules"] = {"gate"}; }, "matches no linear layer"},
  };
  for (const auto& [edit, needle] : cases) {
    TempDir temp;
    expect_adapter_error(edited_adapter(temp, edit, keep_tensors), needle);
  }
}

TEST(PeftAdapter, MissingFilesAndBadJsonAreErrors) {
  TempDir temp;
  expect_adapter_error(temp.file("nowhere"), "no such adapter directory");
  fs::create_directories(temp.file("empty"));
  expect_adapter_error(temp.file("empty"), "adapter_config.json: not found");
  fs::create_directories(temp.file("bad-json"));
  std::ofstream(temp.file("bad-json/adapter_config.json")) << "{\"r\": 8,";
  expect_adapter_error(temp.file("bad-json"), "not valid JSON");
  fs::create_directories(temp.file("no-weights"));
  fs::copy_file(fixture("tiny-llama-lora/adapter_config.json"), temp.file("no-weights/adapter_config.json"));
  expect_adapter_error(temp.file("no-weights"), "adapter_model.safetensors: not found");
}

TEST(PeftAdapter, PeftLoadsWhatWeWriteWithTheSameLogits) {
  const auto python = qtrain::testing::find_python_with("peft transformers safetensors");
  if (python.empty()) GTEST_SKIP() << "no Python with peft and transformers (set QTRAIN_PYTHON)";
  TempDir temp;
  auto model = load_base();
  apply_peft_adapter(*model, fixture("tiny-llama-lora"));
  // Our own values, not the fixture's: every A and B redrawn.
  torch::manual_seed(11);
  {
    torch::NoGradGuard no_grad;
    for (const auto& [name, lora] : lora_layers_of(*model)) {
      lora->lora_A().normal_(0.0, 0.05);
      lora->lora_B().normal_(0.0, 0.05);
    }
  }
  write_peft_adapter(*model, read_peft_adapter_config(fixture("tiny-llama-lora")), temp.file("adapter"), "tiny-llama");

  const std::string command = "'" + python + "' '" + qtrain::testing::source_dir() + "/tests/interop/peft_logits.py' '" +
                              fixture("tiny-llama") + "' '" + temp.file("adapter") + "' '" +
                              fixture("tiny-llama-reference.safetensors") + "' lora.input_ids '" +
                              temp.file("peft_logits.safetensors") + "' 2>&1";
  const auto result = qtrain::testing::run_command(command);
  ASSERT_EQ(result.status, 0) << command << "\n" << result.output;

  const auto peft_logits = SafetensorsCheckpoint::open(temp.file("peft_logits.safetensors")).tensor("logits");
  const auto our_logits = logits_of(*model, reference("lora.input_ids"));
  const double error = max_relative_error(our_logits, peft_logits);
  std::printf("[ measured ] peft on our adapter: max |ours - peft| / max |peft| = %.3g\n", error);
  EXPECT_LT(error, 1e-5);
  EXPECT_GT(max_relative_error(reference("lora.logits"), peft_logits), 1e-3) << "the redrawn adapter must matter";
}

}  // namespace
}  // namespace qtrain::trainer
