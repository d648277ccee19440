// The decoder layer's feed-forward seam (trainer/model/feed_forward.h): the layer runs whatever
// block it holds, and what the rest of the code base reads of a block (its row) is what it builds.
#include <gtest/gtest.h>

#include "kernels/error.h"
#include "small_llama.h"
#include "trainer/model/dense_mlp.h"
#include "trainer/model/llama.h"
#include "trainer/model/sparse_moe.h"
#include "trainer/recipe/recipe_training.h"

namespace qtrain::trainer {
namespace {

LlamaOptions fused_options() {
  auto options = testing::small_llama_options(32, 2);
  options.fused_projections = true;
  options.mlp_bias = true;
  return options;
}

// The linear layers `module` registered directly, as shapes in registration order.
std::vector<ProjectionShape> registered_projections(const torch::nn::Module& module) {
  std::vector<ProjectionShape> shapes;
  for (const auto& child : module.named_children()) {
    const auto linear = std::dynamic_pointer_cast<qat::LinearLayer>(child.value());
    if (!linear) continue;
    shapes.push_back({child.key(), linear->in_features(), linear->out_features(), linear->bias().defined()});
  }
  return shapes;
}

void expect_same_shapes(const std::vector<ProjectionShape>& built, const std::vector<ProjectionShape>& reported) {
  ASSERT_EQ(built.size(), reported.size());
  for (size_t index = 0; index < built.size(); ++index) {
    SCOPED_TRACE(reported[index].name);
    EXPECT_EQ(built[index].name, reported[index].name);
    EXPECT_EQ(built[index].in, reported[index].in);
    EXPECT_EQ(built[index].out, reported[index].out);
    EXPECT_EQ(built[index].bias, reported[index].bias);
  }
}

TEST(FeedForward, DenseBlockBuildsTheProjectionsItsRowReports) {
  for (const auto& options : {testing::small_llama_options(32, 2), fused_options()}) {
    SCOPED_TRACE(options.fused_projections ? "fused" : "separate");
    const auto& row = feed_forward_row(options);
    EXPECT_EQ(row.kind, FeedForwardKind::kDense);
    EXPECT_STREQ(row.module_name, "mlp");
    auto block = row.make(options, "model.layers.0.mlp", dense_linear_factory(), torch::kFloat32);
    ASSERT_NE(block->as<DenseMlp>(), nullptr);
    expect_same_shapes(registered_projections(*block), row.projections(options));
  }
  const auto shapes = feed_forward_row(fused_options()).projections(fused_options());
  EXPECT_EQ(shapes.front().out, 2 * fused_options().intermediate_size);  // gate's rows, then up's
}

TEST(FeedForward, ExpertBlockBuildsTheRouterAndBanksItsRowReports) {
  auto options = testing::small_llama_options(32, 2);
  options.feed_forward = FeedForwardKind::kExperts;
  options.experts.num_experts = 4;
  options.experts.experts_per_token = 2;
  options.experts.intermediate_size = 24;
  for (const bool biased : {false, true}) {
    options.experts.biases = biased;
    options.experts.router = biased ? "router" : "gate";
    const auto& row = feed_forward_row(options);
    EXPECT_EQ(row.kind, FeedForwardKind::kExperts);
    auto block = row.make(options, "model.layers.0.mlp", dense_linear_factory(), torch::kFloat32);
    auto* moe = block->as<SparseMoeBlock>();
    ASSERT_NE(moe, nullptr);
    // The router, then the banks under `experts.`.
    auto built = registered_projections(*block);
    for (auto bank : registered_projections(*moe->experts)) {
      bank.name = "experts." + bank.name;
      built.push_back(bank);
    }
    expect_same_shapes(built, row.projections(options));
    EXPECT_EQ(dense_base_projections(options), std::vector<std::string>{"mlp." + options.experts.router});
    // Its output has the input's shape, through the router and the banks.
    const auto hidden = torch::randn({2, 5, options.hidden_size});
    EXPECT_EQ(block->forward(hidden).sizes(), hidden.sizes());
  }
}

TEST(FeedForward, AttentionBuildsTheProjectionsItReports) {
  for (const auto& options : {testing::small_llama_options(32, 2), fused_options()}) {
    SCOPED_TRACE(options.fused_projections ? "fused" : "separate");
    LlamaAttention attention(options, "model.layers.0.self_attn", dense_linear_factory(), torch::kFloat32);
    expect_same_shapes(registered_projections(*attention), attention_projections(options));
  }
}

// LoRA's and QAT's default targets, and the memory estimate's list: the attention's and then the
// block's names, as the layer registers them (the fixed lists these replaced).
TEST(FeedForward, ProjectionNamesAreTheDecoderLayersLinearLayers) {
  EXPECT_EQ(testing::small_llama_options(32, 2).projection_names(),
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));
  EXPECT_EQ(decoder_projection_names(), testing::small_llama_options(32, 2).projection_names());
  EXPECT_EQ(fused_options().projection_names(),
            (std::vector<std::string>{"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}));
  for (const auto& options : {testing::small_llama_options(32, 2), fused_options()}) {
    LlamaDecoderLayer layer(options, 0, dense_linear_factory(), torch::kFloat32);
    std::vector<std::string> linear_names;
    for (const auto& module : layer->named_modules()) {
      if (std::dynamic_pointer_cast<qat::LinearLayer>(module.value())) {
        linear_names.push_back(module.key().substr(module.key().rfind('.') + 1));
      }
    }
    EXPECT_EQ(linear_names, options.projection_names());
  }
}

// A stand-in block: the normed input itself, counting its calls.
class PassThroughBlock : public FeedForwardImpl {
 public:
  torch::Tensor forward(const torch::Tensor& hidden, const qat::LinearLayer::InputRebuild&) override {
    ++calls;
    return hidden * 1.0;
  }
  void replace_linear(const std::string& child_name, std::shared_ptr<qat::LinearLayer>) override {
    throw Error(ErrorCode::kInternal, "the pass-through block has no projection '" + child_name + "'");
  }
  int calls = 0;
};

TEST(FeedForward, DecoderLayerRunsTheBlockItHoldsWholeAndInChunks) {
  torch::manual_seed(0);
  const auto options = testing::small_llama_options(32, 1);
  LlamaDecoderLayer layer(options, 0, dense_linear_factory(), torch::kFloat32);
  auto block = std::make_shared<PassThroughBlock>();
  layer->mlp = layer->replace_module("mlp", FeedForward(std::shared_ptr<FeedForwardImpl>(block)));
  EXPECT_EQ(layer->named_parameters().find("mlp.down_proj.weight"), nullptr);

  const auto hidden = torch::randn({2, 5, options.hidden_size});
  const auto position_ids = torch::arange(5).unsqueeze(0).expand({2, -1});
  const auto [cos, sin] = RotaryEmbedding(options, options.rope).tables(position_ids, torch::kFloat32);
  torch::NoGradGuard no_grad;
  const auto residual = hidden + layer->self_attn->forward(layer->input_layernorm->forward(hidden), cos, sin, {});
  const auto expected = residual + layer->post_attention_layernorm->forward(residual);

  EXPECT_TRUE(torch::allclose(layer->forward(hidden, cos, sin, {}), expected, 1e-6, 1e-6));
  EXPECT_EQ(block->calls, 1);
  layer->set_mlp_chunk_tokens(4);  // 10 tokens: slices of 4, 4 and 2
  EXPECT_TRUE(torch::allclose(layer->forward(hidden, cos, sin, {}), expected, 1e-6, 1e-6));
  EXPECT_EQ(block->calls, 1 + 3);
}

TEST(FeedForward, TargetsNamingProjectionsTheBlocksFusedAreRefused) {
  EXPECT_NO_THROW(require_model_projections(testing::small_llama_options(32, 2), {"q_proj", "mlp.up_proj"},
                                            "lora.target_modules"));
  EXPECT_NO_THROW(require_model_projections(fused_options(), {"qkv_proj", "gate_up_proj", "down_proj"},
                                            "lora.target_modules"));
  for (const std::string entry : {"q_proj", "mlp.up_proj", "gate_proj"}) {
    try {
      require_model_projections(fused_options(), {"o_proj", entry}, "qat.target_modules");
      ADD_FAILURE() << entry << " was accepted";
    } catch (const Error& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find("qat.target_modules names '" + entry + "'"), std::string::npos) << message;
      EXPECT_NE(message.find("[qkv_proj, o_proj, gate_up_proj, down_proj]"), std::string::npos) << message;
    }
  }
}

// The experts' rows gathered from their tokens and summed back (sparse_moe.h): the sum equals
// index_add_ of the rows into zeros on the CPU bit for bit, in bf16 (where the order of the adds
// shows) and fp32, on the CPU and CUDA; each one's gradient is autograd's for the index_select /
// index_add it replaces, bit for bit.
void expect_rows_route_as_index_add(const torch::Device& device) {
  torch::manual_seed(3);
  const int64_t tokens = 37, k = 4, hidden = 24, experts = 9;
  std::vector<torch::Tensor> choices;
  for (int64_t token = 0; token < tokens; ++token) choices.push_back(torch::randperm(experts).narrow(0, 0, k));
  const auto flat = torch::stack(choices).reshape(-1);
  const auto order = std::get<1>(flat.sort(/*stable=*/true, 0, false));
  const auto token_of_row = order.div(k, "floor");
  const auto routing = route_rows(order.to(device), k);
  EXPECT_TRUE(torch::equal(routing.token_of_row.cpu(), token_of_row));
  // Each token's rows in row order, as a stable sort by token gives them.
  EXPECT_TRUE(torch::equal(routing.by_token.cpu(), std::get<1>(token_of_row.sort(/*stable=*/true, 0, false))));
  for (const auto dtype : {torch::kBFloat16, torch::kFloat32}) {
    const auto values = torch::randn({tokens * k, hidden}).to(dtype);
    const auto rows = values.to(device).detach().clone().requires_grad_(true);
    const auto reference_rows = values.clone().requires_grad_(true);
    const auto sum = sum_rows_by_token(rows, routing);
    const auto reference = torch::zeros({tokens, hidden}, values.options()).index_add(0, token_of_row, reference_rows);
    EXPECT_TRUE(torch::equal(sum.cpu(), reference)) << dtype << " on " << device;
    const auto grad = torch::randn({tokens, hidden}).to(dtype);
    sum.backward(grad.to(device));
    reference.backward(grad);
    EXPECT_TRUE(torch::equal(rows.grad().cpu(), reference_rows.grad())) << dtype << " on " << device;

    const auto states = torch::randn({tokens, hidden}).to(dtype);
    const auto x = states.to(device).detach().clone().requires_grad_(true);
    const auto reference_x = states.clone().requires_grad_(true);
    const auto gathered = gather_token_rows(x, routing);
    const auto reference_gathered = reference_x.index_select(0, token_of_row);
    EXPECT_TRUE(torch::equal(gathered.cpu(), reference_gathered)) << dtype << " on " << device;
    const auto row_grad = torch::randn({tokens * k, hidden}).to(dtype);
    gathered.backward(row_grad.to(device));
    reference_gathered.backward(row_grad);
    EXPECT_TRUE(torch::equal(x.grad().cpu(), reference_x.grad())) << dtype << " on " << device;
  }
}

TEST(SparseMoe, RowsSumAndGatherAsIndexAddAndIndexSelectBitwise) { expect_rows_route_as_index_add(torch::kCPU); }

TEST(SparseMoe, CudaRowsSumAndGatherAsTheCpusIndexAddBitwise) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  expect_rows_route_as_index_add(torch::Device(torch::kCUDA, 0));
}

}  // namespace
}  // namespace qtrain::trainer
