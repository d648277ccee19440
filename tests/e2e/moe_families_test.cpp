// Mixture-of-experts families against transformers: tiny random checkpoints that transformers
// makes in the test (tests/interop/moe_model.py: routers, top-k, Qwen3-MoE's dense layers and
// renormalisation switch, Mixtral's sliding window), in the layout transformers 5 saves (one
// tensor per expert) and in its fused in-memory one. fp32 logits and the load-balancing loss equal
// transformers'; a peft adapter on the experts (target_parameters) gives peft's logits; a few QLoRA
// steps through the CLI write an adapter peft loads with our logits, and a merged export
// transformers loads with them.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "support.h"
#include "tensor_support.h"
#include "qat/expert_linear.h"
#include "qat/mxfp4_linear.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/formats/safetensors.h"

namespace qtrain {
namespace {

namespace fs = std::filesystem;

constexpr const char* kIds = "[[1, 17, 250, 3, 99, 4, 100, 200, 31, 7, 8, 300, 12, 55, 2, 19], "
                             "[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]";

// Made once per family for every test of this file: transformers' import is most of a call's time.
const std::string& family_fixture(const std::string& family) {
  static std::map<std::string, std::string> made;
  static testing::TempDir temp;
  auto found = made.find(family);
  if (found != made.end()) return found->second;
  const std::string dir = temp.file(family);
  const auto run = testing::run_interop_script("moe_model.py", "fixture " + family + " " + dir + " '" + kIds + "'");
  if (run.status != 0) throw std::runtime_error("moe_model.py fixture " + family + " failed:\n" + run.output);
  return made.emplace(family, dir).first->second;
}

using testing::max_relative_error;
// Sets config.json's output_router_logits, so that the model computes the load-balancing loss.
void ask_for_router_loss(const std::string& model_dir) {
  const auto path = model_dir + "/config.json";
  auto config = nlohmann::json::parse(std::ifstream(path));
  config["output_router_logits"] = true;
  std::ofstream(path) << config.dump(2);
}

class MoeFamily : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!testing::python_has("transformers peft safetensors")) GTEST_SKIP() << testing::python_lacks("transformers peft safetensors");
  }
};

TEST_P(MoeFamily, LogitsAndLoadBalancingLossEqualTransformersInEitherLayout) {
  const auto& dir = family_fixture(GetParam());
  for (const std::string layout : {"model", "fused"}) {
    const std::string model_dir = dir + "/" + layout;
    ask_for_router_loss(model_dir);
    const auto reference = trainer::SafetensorsFile::open(model_dir + "/reference.safetensors");
    auto loaded = trainer::load_llama(model_dir);
    ASSERT_NE(loaded.model->router_loss(), nullptr);
    torch::NoGradGuard no_grad;
    trainer::LlamaInputs inputs;
    inputs.input_ids = reference.tensor("input_ids");
    loaded.model->router_loss()->begin();
    const auto logits = loaded.model->forward(inputs);
    const double error = max_relative_error(logits, reference.tensor("logits"));
    const double aux = loaded.model->router_loss()->value();
    const double their_aux = reference.tensor("aux_loss").item<double>();
    std::printf("[ measured ] %s (%s): logits %.3g relative, load-balancing loss %.8f vs transformers' %.8f\n",
                GetParam().c_str(), layout.c_str(), error, aux, their_aux);
    EXPECT_LE(error, 1e-5);
    EXPECT_NEAR(aux, their_aux, 1e-5 * their_aux);
    // Greedy tokens: the argmax of every position.
    EXPECT_TRUE(torch::equal(logits.argmax(-1), reference.tensor("logits").argmax(-1)));
  }
}

TEST_P(MoeFamily, PeftAdapterOnTheExpertsGivesPeftsLogits) {
  const auto& dir = family_fixture(GetParam());
  auto loaded = trainer::load_llama(dir + "/model");
  trainer::apply_peft_adapter(*loaded.model, dir + "/adapter");
  int64_t banks = 0;
  for (const auto& item : loaded.model->named_modules()) banks += std::dynamic_pointer_cast<qat::ExpertLora>(item.value()) != nullptr;
  EXPECT_GT(banks, 0) << "the adapter's expert tensors became no ExpertLora";
  const auto reference = trainer::SafetensorsFile::open(dir + "/adapter/reference.safetensors");
  torch::NoGradGuard no_grad;
  trainer::LlamaInputs inputs;
  inputs.input_ids = reference.tensor("input_ids");
  const auto logits = loaded.model->forward(inputs);
  const double error = max_relative_error(logits, reference.tensor("logits"));
  std::printf("[ measured ] %s: with peft's adapter on %lld expert banks, %.3g relative\n", GetParam().c_str(),
              static_cast<long long>(banks), error);
  EXPECT_LE(error, 1e-5);
  // The adapter changes the logits: the test is not of the base alone.
  EXPECT_GT((logits - trainer::SafetensorsFile::open(dir + "/model/reference.safetensors").tensor("logits")).abs().max().item<double>(), 1e-3);
}

// A tiny model of `family` with the qwen3 fixture's 8,192-token tokenizer, in `dir`.
void make_with_tokenizer(const std::string& family, const std::string& dir, const std::string& mode = "make") {
  const auto made = testing::run_command("MOE_VOCAB=8192 " + testing::python() + " " + testing::source_dir() +
                                         "/tests/interop/moe_model.py " + mode + " " + family + " " + dir + " 2>&1");
  ASSERT_EQ(made.status, 0) << made.output;
  for (const char* file : {"tokenizer.json", "tokenizer_config.json"}) {
    fs::copy_file(testing::fixture(std::string("families/qwen3/") + file), dir + "/" + file);
  }
}

// `qtrain export --model model_dir --format gguf` as F32.gguf and MXFP4_MOE.gguf in `temp`; false
// (and a test failure with its output) where one fails.
bool export_f32_and_mxfp4_moe(const std::string& model_dir, const testing::TempDir& temp) {
  for (const std::string type : {"F32", "MXFP4_MOE"}) {
    const auto exported = testing::run_command(testing::qtrain_binary() + " export --model " + model_dir +
                                               " --format gguf --gguf-type " + type + " --out " + temp.file(type + ".gguf") + " 2>&1");
    EXPECT_EQ(exported.status, 0) << exported.output;
    if (exported.status != 0) return false;
  }
  return true;
}

// The CLI on recipes/demo_tiny.yaml with model.path `model_dir` and `flags`, its run in `run_dir`.
testing::CommandResult run_demo(const std::string& model_dir, const std::string& flags, const std::string& run_dir) {
  return testing::run_command(testing::qtrain_binary() + " --recipe " + testing::source_dir() + "/recipes/demo_tiny.yaml --set model.path=" +
                              model_dir + flags + " --set train.output_dir=" + run_dir + " 2>&1");
}

TEST_P(MoeFamily, QloraStepsWriteAnAdapterPeftLoadsAndAMergeTransformersLoadsWithOurLogits) {
  testing::TempDir temp;
  const std::string model_dir = temp.file("model");
  // The family's tiny model with an 8,192-token tokenizer, so the demo's text trains it.
  make_with_tokenizer(GetParam(), model_dir);
  ask_for_router_loss(model_dir);  // its gradient joins the run's
  const auto trained = run_demo(model_dir,
                                // The router too (`gate`, gpt-oss's `router`): peft's target_parameters `...gate.weight`.
                                " --set 'lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_up_proj, down_proj, gate, router]'"
                                " --set lora.dropout=0 --set train.steps=3 --set schedule.warmup_steps=0 --set eval.every=0"
                                " --set data.eval= --set checkpoint.every=0 --set train.gradient_checkpointing=true",
                                temp.file("run"));
  ASSERT_EQ(trained.status, 0) << trained.output;
  ASSERT_NE(trained.output.find("done: 3 steps"), std::string::npos) << trained.output;

  // peft on the adapter (logits-lora also checks that peft placed every tensor of the file).
  const std::string ids = "[[1, 17, 250, 3, 99, 4, 1000, 2000, 31, 7, 8, 300, 12, 55, 2, 8000]]";
  const auto peft = testing::run_interop_script("moe_model.py", "logits-lora " + model_dir + " " + temp.file("run/adapter") +
                                                                    " '" + ids + "' " + temp.file("peft.safetensors"));
  ASSERT_EQ(peft.status, 0) << peft.output;
  const auto config = nlohmann::json::parse(std::ifstream(temp.file("run/adapter/adapter_config.json")));
  ASSERT_TRUE(config.contains("target_parameters")) << config.dump();
  const auto parameters = config.at("target_parameters").dump();
  EXPECT_NE(parameters.find(GetParam() == "gpt_oss" ? "mlp.router.weight" : "mlp.gate.weight"), std::string::npos) << parameters;
  auto loaded = trainer::load_llama(model_dir);
  trainer::apply_peft_adapter(*loaded.model, temp.file("run/adapter"));
  torch::NoGradGuard no_grad;
  const auto theirs = trainer::SafetensorsFile::open(temp.file("peft.safetensors"));
  trainer::LlamaInputs inputs;
  inputs.input_ids = theirs.tensor("input_ids");
  const auto ours = loaded.model->forward(inputs);
  const double error = max_relative_error(ours, theirs.tensor("logits"));
  std::printf("[ measured ] %s: peft on the trained adapter vs ours: %.3g relative\n", GetParam().c_str(), error);
  EXPECT_LE(error, 1e-5);

  // The merged export holds the experts one tensor each, as the family publishes them: transformers loads it.
  const auto merged = testing::run_command(testing::qtrain_binary() + " export --run " + temp.file("run") +
                                           " --format merged --dtype fp32 --out " + temp.file("merged") + " 2>&1");
  ASSERT_EQ(merged.status, 0) << merged.output;
  const auto logits = testing::run_interop_script("moe_model.py", "logits " + temp.file("merged") + " '" + ids + "' " +
                                                                      temp.file("merged.safetensors"));
  ASSERT_EQ(logits.status, 0) << logits.output;
  auto merged_model = trainer::load_llama(temp.file("merged"));
  const double merged_error = max_relative_error(merged_model.model->forward(inputs),
                                             trainer::SafetensorsFile::open(temp.file("merged.safetensors")).tensor("logits"));
  std::printf("[ measured ] %s: transformers on the merged export vs ours: %.3g relative\n", GetParam().c_str(), merged_error);
  EXPECT_LE(merged_error, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Families, MoeFamily, ::testing::Values("qwen3_moe", "qwen3_moe_step2", "mixtral", "gpt_oss"),
                         [](const auto& info) { return info.param; });

// GGUF export of the experts (ffn_gate_inp, ffn_{gate,up,down}_exps): llama.cpp runs the F32 file with our
// logits, and the MXFP4_MOE file has the bytes of its quantizer.
class MoeGguf : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeGguf, LlamaCppRunsTheExportWithOurLogits) {
  const auto llama_cpp = testing::find_python_with("llama_cpp gguf numpy");
  if (llama_cpp.empty()) GTEST_SKIP() << "no Python with llama-cpp-python and gguf";
  testing::TempDir temp;
  const std::string model_dir = temp.file("model");
  make_with_tokenizer(GetParam(), model_dir);
  if (GetParam() == "mixtral") {
    // llama.cpp's llama attends over every earlier key: the same checkpoint without its window.
    const auto path = model_dir + "/config.json";
    auto config = nlohmann::json::parse(std::ifstream(path));
    config["sliding_window"] = nullptr;
    std::ofstream(path) << config.dump(2);
  }
  // F32, and MXFP4_MOE (gpt-oss's own GGUF file type: the experts MXFP4, the other weights Q8_0).
  ASSERT_TRUE(export_f32_and_mxfp4_moe(model_dir, temp));
  const std::string run = "'" + llama_cpp + "' '" + testing::source_dir() + "/tests/interop/gguf_model.py' llama-cpp '" +
                          temp.file("F32.gguf") + "' 'The jury said it did find that the' '" + temp.file("llama.safetensors") + "' 2>&1";
  const auto ran = testing::run_command(run);
  ASSERT_EQ(ran.status, 0) << run << "\n" << ran.output;
  const auto theirs = trainer::SafetensorsFile::open(temp.file("llama.safetensors"));
  auto loaded = trainer::load_llama(model_dir);
  torch::NoGradGuard no_grad;
  trainer::LlamaInputs inputs;
  inputs.input_ids = theirs.tensor("input_ids");
  const auto ours = loaded.model->forward(inputs);
  const double error = max_relative_error(ours, theirs.tensor("logits"));
  std::printf("[ measured ] %s: llama.cpp on the F32 GGUF vs ours: %.3g relative over %lld tokens\n", GetParam().c_str(), error,
              static_cast<long long>(inputs.input_ids.size(1)));
  EXPECT_LE(error, 1e-2);  // llama.cpp's own kernels (its CPU matmuls round inputs to its vector dot types)
  EXPECT_TRUE(torch::equal(ours.argmax(-1), theirs.tensor("logits").argmax(-1)));

  // The MXFP4_MOE file: the tensors, types and bytes llama.cpp's quantizer gives the F32 one, and llama.cpp runs it.
  const auto compared = testing::compare_with_llama_quantize(llama_cpp, temp.file("F32.gguf"), temp.file(""), "MXFP4_MOE");
  EXPECT_EQ(compared.result.status, 0) << compared.command << "\n" << compared.result.output;
  ASSERT_FALSE(compared.summary.empty()) << compared.result.output;
  std::printf("[ measured ] %s: %s\n", GetParam().c_str(), compared.summary.c_str());
}

INSTANTIATE_TEST_SUITE_P(Families, MoeGguf, ::testing::Values("qwen3_moe_all", "mixtral", "gpt_oss"),
                         [](const auto& info) { return info.param; });

TEST(MoeGguf, DenseLayersAmongExpertsAreRefusedNamingWhy) {
  if (!testing::python_has("transformers safetensors")) GTEST_SKIP() << testing::python_lacks("transformers safetensors");
  const auto& dir = family_fixture("qwen3_moe");
  testing::TempDir temp;
  const auto exported = testing::run_command(testing::qtrain_binary() + " export --model " + dir + "/model --format gguf --out " +
                                             temp.file("model.gguf") + " 2>&1");
  EXPECT_NE(exported.status, 0);
  EXPECT_NE(exported.output.find("dense layers among its expert layers"), std::string::npos) << exported.output;
}

// peft cannot load LoRA with dropout on expert parameters: such a recipe stops before training, naming the key.
TEST(MoeRecipes, DropoutOnTheExpertsIsRefusedNamingTheKey) {
  if (!testing::python_has("transformers safetensors")) GTEST_SKIP() << testing::python_lacks("transformers safetensors");
  testing::TempDir temp;
  make_with_tokenizer("mixtral", temp.file("model"));
  const auto run = run_demo(temp.file("model"), " --set 'lora.target_modules=[q_proj, gate_up_proj, down_proj]' --set lora.dropout=0.05",
                            temp.file("run"));
  EXPECT_NE(run.status, 0);
  EXPECT_NE(run.output.find("lora.dropout is set, and lora.target_modules selects the experts' 'experts.gate_up_proj'"),
            std::string::npos) << run.output;
}

// inspect reads the experts from config.json and estimates a run of the shipped MoE recipe.
TEST(MoeInspect, ShowsTheExpertsAndEstimatesTheRecipe) {
  if (!testing::python_has("transformers safetensors")) GTEST_SKIP() << testing::python_lacks("transformers safetensors");
  const auto& dir = family_fixture("qwen3_moe");
  const auto result = testing::run_command(testing::qtrain_binary() + " inspect --recipe " + testing::source_dir() +
                                           "/recipes/qlora_qwen3_moe.yaml --set model.path=" + dir + "/model --set train.device=cpu 2>&1");
  ASSERT_EQ(result.status, 0) << result.output;
  for (const char* fact : {"Qwen3MoeForCausalLM", "8 experts, top 2 per token, each 24 wide, in 3 of 4 layers; router 'gate'",
                           "softmax, top-k renormalised"}) {
    EXPECT_NE(result.output.find(fact), std::string::npos) << fact << "\n" << result.output;
  }
}

// gpt-oss as published: its experts in MXFP4, kept so (the frozen base), with transformers' logits.
TEST(GptOssMxfp4, ExpertsStayMxfp4WithTransformersLogits) {
  if (!testing::python_has("transformers safetensors")) GTEST_SKIP() << testing::python_lacks("transformers safetensors");
  const auto& dir = family_fixture("gpt_oss");
  auto loaded = trainer::load_llama(dir + "/mxfp4");
  int64_t banks = 0;
  for (const auto& item : loaded.model->named_modules()) banks += std::dynamic_pointer_cast<qat::Mxfp4Linear>(item.value()) != nullptr;
  EXPECT_EQ(banks, 2 * loaded.model->options().num_hidden_layers);
  const auto reference = trainer::SafetensorsFile::open(dir + "/mxfp4/reference.safetensors");
  torch::NoGradGuard no_grad;
  trainer::LlamaInputs inputs;
  inputs.input_ids = reference.tensor("input_ids");
  const double error = max_relative_error(loaded.model->forward(inputs), reference.tensor("logits"));
  std::printf("[ measured ] gpt-oss MXFP4: %lld banks kept as MXFP4, logits %.3g relative\n", static_cast<long long>(banks), error);
  EXPECT_LE(error, 1e-5);
}

// gpt-oss's MXFP4 experts, unadapted, exported as MXFP4_MOE: each bank dequantizes to exactly the
// values the F32 export holds, the checkpoint's own (llama.cpp's quantizer gives MXFP4 values back
// unchanged: a block's largest value sets the same grid or a finer one that holds them all).
TEST(GptOssMxfp4, AnMxfp4MoeGgufKeepsTheCheckpointsExpertValues) {
  const auto python = testing::find_python_with("gguf numpy");
  if (python.empty()) GTEST_SKIP() << "no Python with gguf and numpy";
  if (!testing::python_has("transformers safetensors")) GTEST_SKIP() << testing::python_lacks("transformers safetensors");
  testing::TempDir temp;
  const auto model_dir = temp.file("model");
  make_with_tokenizer("gpt_oss", model_dir, "make-mxfp4");
  ASSERT_TRUE(export_f32_and_mxfp4_moe(model_dir, temp));
  const std::string compare = "'" + python + "' '" + testing::source_dir() + "/tests/interop/gguf_model.py' same-values '" +
                              temp.file("F32.gguf") + "' '" + temp.file("MXFP4_MOE.gguf") + "' MXFP4 2>&1";
  const auto compared = testing::run_command(compare);
  EXPECT_EQ(compared.status, 0) << compare << "\n" << compared.output;
  std::printf("[ measured ] gpt-oss MXFP4 checkpoint, %s", compared.output.c_str());
}

}  // namespace
}  // namespace qtrain
