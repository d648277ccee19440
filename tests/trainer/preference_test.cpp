// Preference objectives against TRL 1.16 itself (tests/interop/trl_preference.py runs DPOTrainer,
// the experimental ORPOTrainer and CPOTrainer): on the fixture model with the fixture adapter, the
// pairs of a JSONL file tokenised by data.format preference and one batch of them through
// qtrain's training step give TRL's token ids, loss, metrics and the gradient of every LoRA
// weight (fp32; 1e-5 relative).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "data/dataset.h"
#include "optim/sgd.h"
#include "qat/adapter_switch.h"
#include "support.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/formats/safetensors.h"
#include "trainer/objectives/pair_log_probs.h"
#include "trainer/training_step.h"

namespace qtrain::trainer {
namespace {

using qtrain::testing::fixture;
using qtrain::testing::TempDir;

const char* const kPlainPairs =
    R"({"prompt": "The cat sat on the", "chosen": " mat.", "rejected": " dog and barked at the moon all night."}
{"prompt": "Name a colour:", "chosen": " Blue, like the sky.", "rejected": " Seven."}
{"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " a large city somewhere."}
)";
// Messages with an explicit prompt (a system and a user turn).
const char* const kChatPairs =
    R"({"prompt": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}], "chosen": [{"role": "assistant", "content": "Blue."}], "rejected": [{"role": "assistant", "content": "Seven, or maybe eight."}]}
{"prompt": [{"role": "user", "content": "Say hi."}], "chosen": [{"role": "assistant", "content": "Hi there!"}], "rejected": [{"role": "assistant", "content": "No."}]}
)";
// Whole chats that share their first turns: the prompt is what they share (TRL's extract_prompt).
const char* const kImplicitPromptPairs =
    R"({"chosen": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there!"}], "rejected": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "No."}]}
{"chosen": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two."}], "rejected": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "Zero"}]}
)";

struct Case {
  std::string name;      // the output's name
  std::string trl_case;  // trl_preference.py's CASES
  std::string data;      // plain | chat | implicit
  PreferenceOptions options;
  bool fused_loss = true;
};

void PrintTo(const Case& item, std::ostream* out) { *out << item.name; }

PreferenceOptions preference(Objective objective, double beta, const std::string& loss_type = "sigmoid",
                             double label_smoothing = 0, double gamma = 0.5, double cpo_alpha = 1.0) {
  PreferenceOptions options;
  options.objective = objective;
  options.beta = beta;
  options.loss_type = loss_type;
  options.label_smoothing = label_smoothing;
  options.simpo_gamma = gamma;
  options.cpo_alpha = cpo_alpha;
  return options;
}

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"dpo_sigmoid", "dpo_sigmoid", "plain", preference(Objective::kDpo, 0.1)},
      {"dpo_sigmoid_logits", "dpo_sigmoid", "plain", preference(Objective::kDpo, 0.1), /*fused_loss=*/false},
      {"dpo_ipo", "dpo_ipo", "plain", preference(Objective::kDpo, 0.1, "ipo")},
      {"dpo_hinge", "dpo_hinge", "plain", preference(Objective::kDpo, 0.3, "hinge")},
      {"dpo_robust", "dpo_robust", "plain", preference(Objective::kDpo, 0.1, "robust", 0.1)},
      {"orpo", "orpo", "plain", preference(Objective::kOrpo, 0.2)},
      {"simpo", "simpo", "plain", preference(Objective::kSimpo, 0.1, "sigmoid", 0, 0.5, 1.0)},
      {"simpo_pure", "simpo_pure", "plain", preference(Objective::kSimpo, 2.0, "sigmoid", 0.1, 1.0, 0.0)},
      {"dpo_chat", "dpo_sigmoid", "chat", preference(Objective::kDpo, 0.1)},
      {"orpo_chat", "orpo", "chat", preference(Objective::kOrpo, 0.2)},
      {"dpo_implicit_prompt", "dpo_sigmoid", "implicit", preference(Objective::kDpo, 0.1)},
  };
  return all;
}

// TRL's outputs for every case, made once (one Python process: importing TRL takes seconds). The
// cases run in one test, so that ctest starts that process once.
class PreferenceVsTrl : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    skip_reason_ = new std::string(testing::python_lacks("trl peft transformers datasets safetensors"));
    if (!skip_reason_->empty()) return;
    temp_ = new TempDir();
    data_files_ = new std::map<std::string, std::string>{{"plain", temp_->write("plain.jsonl", kPlainPairs)},
                                                         {"chat", temp_->write("chat.jsonl", kChatPairs)},
                                                         {"implicit", temp_->write("implicit.jsonl", kImplicitPromptPairs)}};
    std::string arguments = fixture("tiny-llama") + " " + fixture("tiny-llama-lora") + " " + temp_->file("trl");
    for (const auto& item : cases()) arguments += " " + item.name + ":" + item.trl_case + ":" + data_files_->at(item.data);
    const auto result = testing::run_interop_script("trl_preference.py", arguments);
    script_output_ = new std::string(result.status == 0 ? "" : result.output);
  }
  static void TearDownTestSuite() {
    delete temp_;
    temp_ = nullptr;
  }

  static std::string* skip_reason_;
  static std::string* script_output_;
  static TempDir* temp_;
  static std::map<std::string, std::string>* data_files_;
};

std::string* PreferenceVsTrl::skip_reason_ = nullptr;
std::string* PreferenceVsTrl::script_output_ = nullptr;
TempDir* PreferenceVsTrl::temp_ = nullptr;
std::map<std::string, std::string>* PreferenceVsTrl::data_files_ = nullptr;

double relative_error(const torch::Tensor& ours, const torch::Tensor& theirs) {
  const auto a = ours.to(torch::kFloat64), b = theirs.to(torch::kFloat64);
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

void expect_equal_to_trl(const Case& item, const TempDir& temp, const std::map<std::string, std::string>& data_files) {
  const auto* temp_ = &temp;
  const auto* data_files_ = &data_files;
  const auto expected = SafetensorsCheckpoint::open(temp_->file("trl/" + item.name + ".safetensors"));
  nlohmann::json trl_metrics;
  std::ifstream(temp_->file("trl/" + item.name + ".json")) >> trl_metrics;

  // The pairs as a run reads them.
  const auto tokenizer = data::Tokenizer::from_model_dir(fixture("tiny-llama"));
  data::DataOptions data_options;
  data_options.records.format = "preference";
  data_options.max_seq_len = 1024;
  const auto dataset = data::load_dataset({data_files_->at(item.data)}, data_options, tokenizer, fixture("tiny-llama"));
  const auto trl_ids = expected.tensor("input_ids");
  const int64_t pairs = static_cast<int64_t>(dataset.examples.size());
  ASSERT_EQ(trl_ids.size(0), 2 * pairs);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const auto& example = dataset.examples[static_cast<size_t>(pair)];
    ASSERT_EQ(example.sample_lengths.size(), 2u);
    int64_t begin = 0;
    for (int64_t side = 0; side < 2; ++side) {
      const int64_t length = example.sample_lengths[static_cast<size_t>(side)];
      const std::vector<int64_t> ours(example.input_ids.begin() + begin, example.input_ids.begin() + begin + length);
      const auto row = trl_ids[side * pairs + pair];
      const std::vector<int64_t> theirs(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + length);
      EXPECT_EQ(ours, theirs) << "pair " << pair << (side == 0 ? " chosen" : " rejected");
      for (int64_t rest = length; rest < row.size(0); ++rest) EXPECT_EQ(row[rest].item<int64_t>(), *tokenizer.pad_id());
      begin += length;
    }
  }

  ModelLoadOptions load;
  load.dtype = torch::kFloat32;
  auto model = load_llama(fixture("tiny-llama"), load).model;
  apply_peft_adapter(*model, fixture("tiny-llama-lora"));
  model->train();
  std::vector<torch::Tensor> trainable;
  std::vector<std::string> names;
  for (const auto& parameter : model->named_parameters()) {
    if (parameter.key().find(".lora_") == std::string::npos) {
      parameter.value().set_requires_grad(false);  // the base is frozen, as peft freezes it
      continue;
    }
    trainable.push_back(parameter.value());
    names.push_back(parameter.key());
  }
  optim::SgdOptions sgd;
  sgd.lr = 0.0;
  optim::Sgd optimizer(trainable, sgd);
  LossScaler scaler(false);
  TrainingStepOptions options;
  options.fused_loss = item.fused_loss;
  options.loss_chunk_tokens = 16;  // several chunks of the batch's tokens
  options.max_grad_norm = 0;
  options.preference = item.options;
  TrainingStep step(*model, trainable, optimizer, scaler, options);
  std::vector<const data::Example*> rows;
  for (const auto& example : dataset.examples) rows.push_back(&example);
  std::vector<torch::Tensor> gradients;
  const auto result = step.run({data::collate(rows, *tokenizer.pad_id())}, 0,
                               [&](int64_t, const std::vector<torch::Tensor>& tensors) {
                                 for (const auto& tensor : tensors) gradients.push_back(tensor.grad().clone());
                               });
  ASSERT_FALSE(result.skipped) << result.skip_reason;

  const double trl_loss = expected.tensor("loss").item<double>();
  std::printf("[ measured ] %s: loss %.9f, TRL %.9f\n", item.name.c_str(), result.loss, trl_loss);
  EXPECT_NEAR(result.loss, trl_loss, 1e-5 * std::abs(trl_loss));
  for (const auto& [name, value] : result.metrics) {
    ASSERT_TRUE(trl_metrics.contains(name)) << name << " is not among TRL's metrics: " << trl_metrics.dump();
    const double theirs = trl_metrics[name].get<double>();
    EXPECT_NEAR(value, theirs, 1e-5 * std::max(std::abs(theirs), 1e-2)) << name;
  }
  ASSERT_EQ(gradients.size(), names.size());
  double worst = 0;
  for (size_t index = 0; index < names.size(); ++index) {
    const auto theirs = expected.tensor("grad." + names[index]);
    const double error = relative_error(gradients[index], theirs);
    worst = std::max(worst, error);
    EXPECT_LT(error, 1e-5) << names[index];
  }
  std::printf("[ measured ] %s: %zu LoRA gradients, worst max|ours - TRL| / max|TRL| %.3g\n", item.name.c_str(),
              names.size(), worst);
}

TEST_F(PreferenceVsTrl, EveryObjectivesLossMetricsAndLoraGradientsEqualTrl) {
  if (!skip_reason_->empty()) GTEST_SKIP() << *skip_reason_;
  ASSERT_TRUE(script_output_->empty()) << *script_output_;
  for (const auto& item : cases()) {
    SCOPED_TRACE(item.name);
    expect_equal_to_trl(item, *temp_, *data_files_);
  }
}

// The reference is the base: switched-off adapters give the base's log-probabilities exactly.
TEST(Preference, AdaptersOffGiveTheBaseModel) {
  ModelLoadOptions load;
  load.dtype = torch::kFloat32;
  auto base = load_llama(fixture("tiny-llama"), load).model;
  auto adapted = load_llama(fixture("tiny-llama"), load).model;
  apply_peft_adapter(*adapted, fixture("tiny-llama-lora"));
  torch::NoGradGuard no_grad;
  const auto ids = torch::randint(0, 1000, {2, 12}, torch::kInt64);
  LlamaInputs inputs;
  inputs.input_ids = ids;
  const auto expected = base->logits(base->hidden_states(inputs));
  const auto with_adapter = adapted->logits(adapted->hidden_states(inputs));
  EXPECT_GT((with_adapter - expected).abs().max().item<double>(), 1e-3) << "the fixture adapter changes the logits";
  torch::Tensor without;
  {
    qat::AdaptersOff off;
    without = adapted->logits(adapted->hidden_states(inputs));
  }
  EXPECT_TRUE(torch::equal(without, expected));
  EXPECT_TRUE(torch::equal(adapted->logits(adapted->hidden_states(inputs)), with_adapter)) << "back on after the scope";
}

}  // namespace
}  // namespace qtrain::trainer
