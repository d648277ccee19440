// LoraLinear against peft's definition, computed independently in float64:
//   y = x W^T + b + scale * (x A^T) B^T,  scale = alpha / r (rsLoRA: alpha / sqrt(r)).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "kernels/error.h"
#include "lora_layers.h"
#include "qat/lora_linear.h"
#include "tensor_support.h"

namespace qtrain::qat {
namespace {

using test_layers::dense;
using test_layers::lora_options;
using test_layers::randomise_B;

// x W^T + b + scale * x A^T B^T in float64, from the layer's own tensors.
torch::Tensor reference_forward(const LoraLinear& lora, const DenseLinear& base, const torch::Tensor& x) {
  auto x64 = x.to(torch::kFloat64);
  auto result = torch::matmul(x64, base.weight().to(torch::kFloat64).t());
  if (base.bias().defined()) result = result + base.bias().to(torch::kFloat64);
  auto update = torch::matmul(torch::matmul(x64, lora.lora_A().to(torch::kFloat64).t()), lora.lora_B().to(torch::kFloat64).t());
  return result + lora.scale() * update;
}

using testing::max_relative_error;
TEST(LoraLinear, FreshAdapterLeavesTheBaseOutputUnchanged) {
  torch::manual_seed(1);
  auto base = dense(64, 48);
  LoraLinear lora(base, lora_options(8, 16));
  EXPECT_TRUE(torch::equal(lora.lora_B(), torch::zeros({48, 8})));
  auto x = torch::randn({3, 5, 64});
  EXPECT_TRUE(torch::equal(lora.forward(x), base->forward(x)));
}

TEST(LoraLinear, AIsKaimingUniformWithBoundOneOverSqrtInLikePeft) {
  // kaiming_uniform(a = sqrt(5)): gain sqrt(2 / (1 + 5)), bound = gain * sqrt(3 / fan_in) = 1 / sqrt(in).
  torch::manual_seed(2);
  const int64_t in = 512, rank = 64;
  LoraLinear lora(dense(in, 32), lora_options(rank, 16));
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  const auto A = lora.lora_A();
  ASSERT_EQ(A.sizes(), (std::vector<int64_t>{rank, in}));
  EXPECT_EQ(A.scalar_type(), torch::kFloat32);
  EXPECT_LE(A.abs().max().item<double>(), bound);
  EXPECT_GT(A.abs().max().item<double>(), 0.99 * bound);  // 32768 draws reach the bound
  // Uniform(-bound, bound) has variance bound^2 / 3; 32768 draws give it to ~1%.
  EXPECT_NEAR(A.to(torch::kFloat64).var().item<double>(), bound * bound / 3.0, 0.03 * bound * bound / 3.0);
  EXPECT_NEAR(A.mean().item<double>(), 0.0, 0.02 * bound);
}

TEST(LoraLinear, ForwardEqualsFloat64Reference) {
  torch::manual_seed(3);
  auto base = dense(96, 80);
  LoraLinear lora(base, lora_options(8, 16));
  randomise_B(lora, 0.5);
  auto x = torch::randn({4, 7, 96});
  // fp32 accumulation over 96 inputs: a few ulps of the largest output.
  const double error = max_relative_error(lora.forward(x), reference_forward(lora, *base, x));
  EXPECT_LT(error, 1e-6) << "max error relative to the largest output";
  EXPECT_DOUBLE_EQ(lora.scale(), 2.0);
}

TEST(LoraLinear, RsloraScalesByAlphaOverSqrtRank) {
  torch::manual_seed(4);
  auto base = dense(64, 64, /*bias=*/false);
  LoraLinear lora(base, lora_options(16, 8, 0.0, /*rslora=*/true));
  EXPECT_DOUBLE_EQ(lora.scale(), 8.0 / 4.0);
  randomise_B(lora, 0.5);
  auto x = torch::randn({10, 64});
  EXPECT_LT(max_relative_error(lora.forward(x), reference_forward(lora, *base, x)), 1e-6);
}

TEST(LoraLinear, GradientsReachAAndBOnly) {
  torch::manual_seed(5);
  auto base = dense(32, 24);
  LoraLinear lora(base, lora_options(4, 8));
  randomise_B(lora, 0.5);
  EXPECT_FALSE(base->weight().requires_grad());
  EXPECT_FALSE(base->bias().requires_grad());
  std::vector<std::string> trainable;
  for (const auto& item : lora.named_parameters()) {
    if (item.value().requires_grad()) trainable.push_back(item.key());
  }
  EXPECT_EQ(trainable, (std::vector<std::string>{"lora_A.weight", "lora_B.weight"}));

  auto x = torch::randn({6, 32});
  lora.forward(x).pow(2).sum().backward();
  EXPECT_FALSE(base->weight().grad().defined());
  ASSERT_TRUE(lora.lora_A().grad().defined());
  ASSERT_TRUE(lora.lora_B().grad().defined());
  EXPECT_GT(lora.lora_A().grad().abs().sum().item<double>(), 0.0);
  EXPECT_GT(lora.lora_B().grad().abs().sum().item<double>(), 0.0);

  // dL/dB = scale * dY^T (x A^T) with dY = 2 y, in float64.
  auto y64 = reference_forward(lora, *base, x);
  auto expected_grad_B = lora.scale() * torch::matmul((2 * y64).t(), torch::matmul(x.to(torch::kFloat64), lora.lora_A().to(torch::kFloat64).t()));
  EXPECT_LT(max_relative_error(lora.lora_B().grad(), expected_grad_B), 1e-5);
}

TEST(LoraLinear, MergedWeightEqualsBasePlusScaledBA) {
  torch::manual_seed(6);
  auto base = dense(40, 56);
  LoraLinear lora(base, lora_options(8, 32));
  randomise_B(lora, 0.5);
  auto expected = base->weight().to(torch::kFloat64) +
                  lora.scale() * torch::matmul(lora.lora_B().to(torch::kFloat64), lora.lora_A().to(torch::kFloat64));
  auto merged = lora.dense_weight(torch::kFloat32);
  EXPECT_EQ(merged.scalar_type(), torch::kFloat32);
  EXPECT_LT(max_relative_error(merged, expected), 1e-6);
  EXPECT_EQ(lora.dense_weight(torch::kBFloat16).scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(lora.bias(), base->bias()));
  // The merged layer computes what the adapter does.
  auto x = torch::randn({5, 40});
  EXPECT_LT(max_relative_error(torch::nn::functional::linear(x, merged, lora.bias()), lora.forward(x)), 1e-5);
}

TEST(LoraLinear, DropoutActsOnTheLoraBranchInTrainingOnly) {
  torch::manual_seed(7);
  auto base = dense(64, 32);
  LoraLinear lora(base, lora_options(8, 16, /*dropout=*/0.5));
  randomise_B(lora, 0.5);
  auto x = torch::randn({16, 64});
  lora.eval();
  EXPECT_LT(max_relative_error(lora.forward(x), reference_forward(lora, *base, x)), 1e-6);
  lora.train();
  auto first = lora.forward(x);
  auto second = lora.forward(x);
  EXPECT_FALSE(torch::allclose(first, second));
  EXPECT_FALSE(torch::allclose(first, reference_forward(lora, *base, x).to(torch::kFloat32)));
  // With B zero the branch contributes nothing: dropout never touches the base path.
  {
    torch::NoGradGuard no_grad;
    lora.lora_B().zero_();
  }
  EXPECT_TRUE(torch::equal(lora.forward(x), base->forward(x)));
}

TEST(LoraLinear, BranchRunsInTheInputDtypeWithFp32MasterWeights) {
  torch::manual_seed(8);
  auto base = dense(64, 64, /*bias=*/false, torch::kBFloat16);
  LoraLinear lora(base, lora_options(8, 16));
  randomise_B(lora, 0.5);
  auto x = torch::randn({4, 64}).to(torch::kBFloat16);
  auto y = lora.forward(x);
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(lora.lora_A().scalar_type(), torch::kFloat32);
  // bf16 has 8 bits of mantissa: a few 2^-8 of the largest output.
  EXPECT_LT(max_relative_error(y, reference_forward(lora, *base, x)), 2e-2);
  y.to(torch::kFloat32).sum().backward();
  EXPECT_EQ(lora.lora_A().grad().scalar_type(), torch::kFloat32);
  EXPECT_EQ(lora.lora_B().grad().scalar_type(), torch::kFloat32);
}

TEST(LoraLinear, RejectsANonPositiveRank) {
  EXPECT_THROW(LoraLinear(dense(8, 8), lora_options(0, 16)), Error);
}

// A toy model: a block that keeps typed pointers to its projections (like the Llama attention
// block), a plain module that only registers them, and an output layer.
class Block : public torch::nn::Module, public LinearLayerOwner {
 public:
  Block() {
    q_proj = register_module("q_proj", dense(16, 16));
    v_proj = register_module("v_proj", dense(16, 8));
  }
  void replace_linear(const std::string& child_name, std::shared_ptr<LinearLayer> layer) override {
    if (child_name == "q_proj") q_proj = replace_module(child_name, layer);
    else if (child_name == "v_proj") v_proj = replace_module(child_name, layer);
    else throw Error(ErrorCode::kInternal, "Block has no linear child '" + child_name + "'");
  }
  std::shared_ptr<LinearLayer> q_proj, v_proj;
};

class ToyModel : public torch::nn::Module {
 public:
  ToyModel() {
    block = register_module("block", std::make_shared<Block>());
    auto plain = register_module("plain", std::make_shared<torch::nn::Module>());
    plain->register_module("q_proj", dense(16, 16));
    lm_head = register_module("lm_head", dense(16, 32, /*bias=*/false));
  }
  std::shared_ptr<Block> block;
  std::shared_ptr<LinearLayer> lm_head;
};

std::vector<std::string> names_of(const std::vector<LoraTarget>& targets) {
  std::vector<std::string> names;
  for (const auto& target : targets) names.push_back(target.name);
  return names;
}

LoraTargets targets_of(std::vector<std::string> names) {
  LoraTargets targets;
  targets.include.names = std::move(names);
  return targets;
}

// DoRA, from peft's DoraLinearLayer written out in float64: the magnitude m starts at the row
// norms of W (B = 0), then y = x W^T + b + (m / n - 1) x W^T + (m / n) scale x A^T B^T with
// n = ||W + scale B A||_row, the merged weight (m / n)(W + scale B A).
LoraOptions dora_options(int64_t rank, double alpha, double dropout = 0.0) {
  auto options = lora_options(rank, alpha, dropout);
  options.dora = true;
  return options;
}

TEST(DoraLinear, MagnitudeStartsAtTheRowNormsAndTheOutputAtTheBases) {
  torch::manual_seed(11);
  auto base = dense(64, 48);
  LoraLinear lora(base, dora_options(8, 16));
  ASSERT_TRUE(lora.lora_magnitude().defined());
  EXPECT_LT(max_relative_error(lora.lora_magnitude(), base->weight().to(torch::kFloat64).norm(2, {1})), 1e-6);
  const auto x = torch::randn({3, 5, 64});
  EXPECT_LT(max_relative_error(lora.forward(x), base->forward(x)), 1e-6);
}

TEST(DoraLinear, ForwardAndMergedWeightEqualFloat64Reference) {
  torch::manual_seed(12);
  auto base = dense(96, 80);
  LoraLinear lora(base, dora_options(8, 16));
  randomise_B(lora, 0.5);
  {
    torch::NoGradGuard no_grad;
    lora.lora_magnitude().mul_(torch::rand({80}) + 0.5);  // a trained magnitude
  }
  const auto x = torch::randn({4, 7, 96});
  const auto W = base->weight().to(torch::kFloat64), A = lora.lora_A().to(torch::kFloat64),
             B = lora.lora_B().to(torch::kFloat64), m = lora.lora_magnitude().to(torch::kFloat64);
  const auto adapted = W + lora.scale() * torch::matmul(B, A);
  const auto factor = m / adapted.norm(2, {1});
  const auto x64 = x.to(torch::kFloat64);
  const auto expected = torch::matmul(x64, (factor.unsqueeze(1) * adapted).t()) + base->bias().to(torch::kFloat64);
  EXPECT_LT(max_relative_error(lora.forward(x), expected), 1e-6);
  EXPECT_LT(max_relative_error(lora.dense_weight(torch::kFloat32), factor.unsqueeze(1) * adapted), 1e-6);
}

TEST(DoraLinear, GradientsReachTheMagnitudeAAndBButNotTheNorm) {
  torch::manual_seed(13);
  auto base = dense(32, 24, /*bias=*/false);
  LoraLinear lora(base, dora_options(4, 8));
  randomise_B(lora, 0.5);
  const auto x = torch::randn({6, 32});
  lora.forward(x).sum().backward();
  for (const auto* tensor : {&lora.lora_A(), &lora.lora_B(), &lora.lora_magnitude()}) {
    ASSERT_TRUE(tensor->grad().defined());
    EXPECT_GT(tensor->grad().abs().max().item<double>(), 0.0);
  }
  EXPECT_FALSE(base->weight().grad().defined());
  // With n detached, y is linear in m: dL/dm_o = sum over rows of (x (W + scale B A)^T)_o / n_o.
  const auto adapted = base->weight() + lora.scale() * torch::matmul(lora.lora_B(), lora.lora_A());
  const auto expected = (torch::matmul(x, adapted.t()) / adapted.norm(2, {1})).sum(0);
  EXPECT_LT(max_relative_error(lora.lora_magnitude().grad(), expected.detach()), 1e-5);
}

// With dropout in training, peft's DoRA multiplies the dropped input by W for the rescaled part:
// y = x W^T + b + (m / n - 1) d W^T + (m / n) scale d A^T B^T, d = dropout(x), one mask (the
// layer's only random draw: the same seed gives the reference the same d).
TEST(DoraLinear, DropoutRescalesTheDroppedInputsProductAsPeft) {
  torch::manual_seed(14);
  auto base = dense(40, 24);
  LoraLinear lora(base, dora_options(4, 8, /*dropout=*/0.5));
  randomise_B(lora, 0.5);
  lora.train();
  const auto x = torch::randn({5, 40});
  torch::manual_seed(99);
  const auto ours = lora.forward(x);
  torch::manual_seed(99);
  const auto dropped = torch::nn::functional::dropout(x, torch::nn::functional::DropoutFuncOptions().p(0.5).training(true));
  const auto W = base->weight().to(torch::kFloat64), A = lora.lora_A().to(torch::kFloat64),
             B = lora.lora_B().to(torch::kFloat64), m = lora.lora_magnitude().to(torch::kFloat64);
  const auto factor = m / (W + lora.scale() * torch::matmul(B, A)).norm(2, {1});
  const auto x64 = x.to(torch::kFloat64), d64 = dropped.to(torch::kFloat64);
  const auto expected = torch::matmul(x64, W.t()) + base->bias().to(torch::kFloat64) +
                         (factor - 1) * torch::matmul(d64, W.t()) +
                         factor * lora.scale() * torch::matmul(torch::matmul(d64, A.t()), B.t());
  EXPECT_LT(max_relative_error(ours, expected), 1e-6);
  EXPECT_GT((dropped - x).abs().max().item<double>(), 0.0);  // the mask dropped something
}

TEST(ApplyLora, ListEntriesMatchTheNameOrADottedSuffix) {
  ToyModel model;
  EXPECT_EQ(names_of(find_lora_targets(model, targets_of({"q_proj"}))),
            (std::vector<std::string>{"block.q_proj", "plain.q_proj"}));
  EXPECT_EQ(names_of(find_lora_targets(model, targets_of({"block.q_proj", "lm_head"}))),
            (std::vector<std::string>{"block.q_proj", "lm_head"}));
  EXPECT_TRUE(find_lora_targets(model, targets_of({"proj"})).empty());  // no partial components
}

TEST(ApplyLora, ARegexStringMustMatchTheWholeName) {
  ToyModel model;
  LoraTargets targets;
  targets.include.regex = "block\\..*_proj";
  EXPECT_EQ(names_of(find_lora_targets(model, targets)), (std::vector<std::string>{"block.q_proj", "block.v_proj"}));
  targets.include.regex = "q_proj";  // peft: re.fullmatch, so a bare name matches nothing nested
  EXPECT_TRUE(find_lora_targets(model, targets).empty());
  // A list entry with regex characters is a full-name regex too.
  EXPECT_EQ(names_of(find_lora_targets(model, targets_of({".*\\.v_proj"}))), (std::vector<std::string>{"block.v_proj"}));
}

// Patterns come from recipes and downloaded adapter configs: a pattern nested too deeply or
// one that backtracks exponentially is an Error naming it, never a stack overflow or a hang.
TEST(ApplyLora, ADeeplyNestedOrRunawayPatternIsAnErrorNamingIt) {
  const auto expect_error = [](const std::string& pattern, const std::string& module_name, const std::string& why) {
    ModuleSelector selector;
    selector.regex = pattern;
    try {
      selector.matches(module_name);
      ADD_FAILURE() << "no error for " << pattern.substr(0, 40);
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kRecipe);
      EXPECT_NE(std::string(error.what()).find("target_modules pattern '" + pattern.substr(0, 20)), std::string::npos)
          << error.what();
      EXPECT_NE(std::string(error.what()).find(why), std::string::npos) << error.what();
    }
  };
  expect_error(std::string(20000, '(') + "q_proj" + std::string(20000, ')'), "model.layers.0.self_attn.q_proj",
               "does not compile");
  // Exponential backtracking: PCRE2's match limit stops it.
  const std::string runaway = "(a|aa)*[bc]";
  const std::string long_name(64, 'a');
  expect_error(runaway, long_name, "simplify it");
  // std::regex hung on this one; PCRE2 answers at once.
  ModuleSelector nested;
  nested.regex = "(.*)*x";
  EXPECT_TRUE(nested.matches("model.layers.0.self_attn.xq_proj_with_a_long_suffix"));
  // A list entry with regex characters takes the same path.
  ModuleSelector listed;
  listed.names = {"q_proj", runaway};
  EXPECT_TRUE(listed.matches("model.layers.0.self_attn.q_proj"));
  EXPECT_THROW(listed.matches(long_name), Error);
}

TEST(ApplyLora, AllLinearSkipsTheOutputLayerAndExcludeModulesApply) {
  ToyModel model;
  auto targets = targets_of({"all-linear"});
  EXPECT_EQ(names_of(find_lora_targets(model, targets)),
            (std::vector<std::string>{"block.q_proj", "block.v_proj", "plain.q_proj"}));
  targets.exclude.names = {"plain.q_proj"};
  EXPECT_EQ(names_of(find_lora_targets(model, targets)), (std::vector<std::string>{"block.q_proj", "block.v_proj"}));
}

TEST(ApplyLora, WrapsTargetsAndKeepsOwnersPointersInStep) {
  torch::manual_seed(9);
  ToyModel model;
  model.eval();
  auto original_q = model.block->q_proj;
  const auto wrapped = apply_lora(model, targets_of({"q_proj", "v_proj"}), lora_options(4, 8));
  EXPECT_EQ(wrapped, (std::vector<std::string>{"block.q_proj", "block.v_proj", "plain.q_proj"}));
  auto lora_q = std::dynamic_pointer_cast<LoraLinear>(model.block->q_proj);
  ASSERT_TRUE(lora_q) << "the block's own pointer must point at the adapter";
  EXPECT_EQ(lora_q->base_layer(), original_q);
  EXPECT_FALSE(lora_q->is_training()) << "a model in eval mode stays in eval mode";
  EXPECT_TRUE(std::dynamic_pointer_cast<LoraLinear>(model.block->v_proj));

  std::vector<std::string> trainable;
  for (const auto& item : model.named_parameters()) {
    if (item.value().requires_grad()) trainable.push_back(item.key());
  }
  EXPECT_EQ(trainable, (std::vector<std::string>{"block.q_proj.lora_A.weight", "block.q_proj.lora_B.weight",
                                                 "block.v_proj.lora_A.weight", "block.v_proj.lora_B.weight",
                                                 "plain.q_proj.lora_A.weight", "plain.q_proj.lora_B.weight",
                                                 "lm_head.weight"}));
  EXPECT_TRUE(model.named_parameters().contains("block.q_proj.base_layer.weight"));
  // Applying again finds nothing new to wrap (the wrapped bases are not targets).
  EXPECT_THROW(apply_lora(model, targets_of({"q_proj", "v_proj"}), lora_options(4, 8)), Error);
}

TEST(ApplyLora, PerModuleOptions) {
  ToyModel model;
  apply_lora(model, targets_of({"q_proj", "v_proj"}), [](const std::string& name) {
    return lora_options(name == "block.v_proj" ? 2 : 4, 8);
  });
  EXPECT_EQ(std::dynamic_pointer_cast<LoraLinear>(model.block->v_proj)->lora_A().size(0), 2);
  EXPECT_EQ(std::dynamic_pointer_cast<LoraLinear>(model.block->q_proj)->lora_A().size(0), 4);
}

TEST(ApplyLora, NoMatchingModuleIsAnErrorNamingTheTargets) {
  ToyModel model;
  try {
    apply_lora(model, targets_of({"gate_proj"}), lora_options(4, 8));
    FAIL() << "expected an Error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("\"gate_proj\""), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace qtrain::qat
