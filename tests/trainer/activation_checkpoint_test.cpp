// Memory switches must not change what is learned: gradients with per-layer checkpointing, with
// the checkpointed inputs offloaded to the host, and with the chunked loss equal those of the
// plain path bitwise on a CPU in fp32 (tiny-llama with LoRA and dropout, dense and NF4 bases);
// the MLP in chunks of tokens equals it to fp32 rounding (the adapters' gradients sum over the
// chunks in another order).
#include "json_support.h"
#include "trainer/model/activation_checkpoint.h"

#include <gtest/gtest.h>

#include "block_counting_bank.h"
#include "kernels/error.h"
#include "qat/expert_linear.h"
#include "qat/four_bit_linear.h"
#include "qat/lora_linear.h"
#include "small_llama.h"
#include "support.h"
#include "trainer/finetune.h"
#include "trainer/model/causal_lm_loss.h"
#include "trainer/model/dense_mlp.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/recipe/recipe_training.h"

namespace qtrain::trainer {
namespace {

struct Gradients {
  double loss = 0;
  std::vector<torch::Tensor> lora;  // the gradient of every LoRA weight, in parameter order
};

// LoRA of rank 4 (alpha 8, `dropout`) on the projections of `model` named, only the adapters
// trained, B made non-zero so that A's gradient is too; the model in training mode.
void adapt_projections(LlamaForCausalLMImpl& model, double dropout, const std::vector<std::string>& names) {
  qat::LoraOptions lora;
  lora.rank = 4;
  lora.alpha = 8;
  lora.dropout = dropout;  // the recomputation must draw the same masks
  qat::LoraTargets targets;
  targets.include.names = names;
  qat::apply_lora(model, targets, lora);
  for (auto& item : model.named_parameters()) {
    item.value().set_requires_grad(item.key().find("lora_") != std::string::npos);
    if (item.key().find("lora_B") != std::string::npos) {
      torch::NoGradGuard no_grad;
      item.value().normal_(0, 0.02);
    }
  }
  model.train();
}

// The same on every projection of a Llama.
void adapt_every_projection(LlamaForCausalLMImpl& model, double dropout) {
  adapt_projections(model, dropout, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"});
}

LlamaForCausalLM tiny_llama_with_lora(bool four_bit, double dropout = 0.2) {
  auto loaded = load_llama(qtrain::testing::fixture("tiny-llama"));
  if (four_bit) qat::quantize_linear_layers(*loaded.model, qat::FourBitOptions{}, {"lm_head"});
  torch::manual_seed(11);
  adapt_every_projection(*loaded.model, dropout);
  return loaded.model;
}

struct ActivationMemory {
  bool offload = false;
  int64_t mlp_chunk_tokens = 0;
  bool keep_built_weights = true;
  bool branch_outputs = false;  // train.offload_branch_outputs
};

// `loss` with the gradient of every trained weight (on the CPU), which the model lets go of.
Gradients take_gradients(LlamaForCausalLMImpl& model, double loss) {
  Gradients result;
  result.loss = loss;
  for (auto& parameter : model.parameters()) {
    if (!parameter.requires_grad()) continue;
    result.lora.push_back(parameter.grad().to(torch::kCPU));
    parameter.mutable_grad() = torch::Tensor();
  }
  return result;
}

Gradients gradients_of(LlamaForCausalLM model, int64_t checkpoint_every, int64_t loss_chunk_tokens,
                       const ActivationMemory& memory = {}) {
  torch::manual_seed(5);
  const auto input_ids = torch::randint(model->options().vocab_size, {2, 40}, torch::kInt64);
  auto labels = input_ids.clone();
  labels.index_put_({0, torch::indexing::Slice(0, 10)}, -100);
  model->model->set_gradient_checkpointing(checkpoint_every);
  model->model->set_activation_offloading(memory.offload);
  model->model->set_mlp_chunk_tokens(memory.mlp_chunk_tokens);
  model->model->set_keep_built_weights(memory.keep_built_weights);
  model->model->set_branch_output_offloading(memory.branch_outputs);
  torch::manual_seed(9);  // dropout
  auto hidden = model->hidden_states({input_ids, {}, {}});
  auto loss = causal_lm_loss(*model, hidden, labels, loss_chunk_tokens);
  (loss.loss_sum / loss.tokens.to(torch::kFloat32)).backward();
  return take_gradients(*model, loss.loss_sum.item<double>());
}

// The loss and LoRA gradients of one fixed batch on `device`, with the model's settings as they are.
// host_ids: the inputs carry the ids on the host too, as a training batch's do (the host table
// gathers from them). lm_head's prefetch is asked first, as the training step asks it.
Gradients gradients_on(LlamaForCausalLM model, const torch::Device& device, bool host_ids = false) {
  torch::manual_seed(5);
  const auto ids_on_host = torch::randint(model->options().vocab_size, {2, 40}, torch::kInt64);
  const auto input_ids = ids_on_host.to(device);
  LlamaInputs inputs{input_ids, {}, {}};
  if (host_ids) inputs.host_input_ids = ids_on_host;
  model->prefetch_lm_head();
  auto loss = causal_lm_loss(*model, model->hidden_states(inputs), input_ids, 0);
  loss.loss_sum.backward();
  return take_gradients(*model, loss.loss_sum.item<double>());
}

void expect_bitwise_equal(const Gradients& a, const Gradients& b, const std::string& what) {
  EXPECT_EQ(a.loss, b.loss) << what;
  ASSERT_EQ(a.lora.size(), b.lora.size()) << what;
  for (size_t index = 0; index < a.lora.size(); ++index) {
    ASSERT_TRUE(a.lora[index].abs().sum().item<double>() > 0) << what << ": gradient " << index << " is zero";
    EXPECT_TRUE(torch::equal(a.lora[index], b.lora[index]))
        << what << ": gradient " << index << " differs by " << (a.lora[index] - b.lora[index]).abs().max().item<double>();
  }
}

TEST(ActivationCheckpointing, GradientsEqualThePlainPathBitwise) {
  for (const bool four_bit : {false, true}) {
    auto model = tiny_llama_with_lora(four_bit);
    const auto plain = gradients_of(model, 0, 0);
    expect_bitwise_equal(plain, gradients_of(model, 1, 0), std::string(four_bit ? "nf4" : "dense") + ", every layer");
    expect_bitwise_equal(plain, gradients_of(model, 2, 0), std::string(four_bit ? "nf4" : "dense") + ", every 2nd layer");
  }
}

TEST(ActivationOffloading, GradientsEqualKeepingTheInputsOnTheDeviceBitwise) {
  for (const bool four_bit : {false, true}) {
    auto model = tiny_llama_with_lora(four_bit);
    const auto kept = gradients_of(model, 1, 0);
    const std::string base = four_bit ? "nf4" : "dense";
    expect_bitwise_equal(kept, gradients_of(model, 1, 0, ActivationMemory{true, 0}), base + ", every layer offloaded");
    expect_bitwise_equal(kept, gradients_of(model, 2, 0, ActivationMemory{true, 0}), base + ", every 2nd layer offloaded");
    expect_bitwise_equal(kept, gradients_of(model, 1, 0, ActivationMemory{true, 0, true, true}),
                         base + ", every layer offloaded with its attention output");
  }
}

TEST(ActivationCheckpointing, RebuildingTheWeightsInBackwardGivesTheSameGradientsBitwise) {
  auto model = tiny_llama_with_lora(true);
  expect_bitwise_equal(gradients_of(model, 1, 0), gradients_of(model, 1, 0, ActivationMemory{false, 0, false}),
                       "nf4, weights dequantized again in backward");
}

// What apply_recipe_memory_settings refuses the recipe with; empty when it does not.
std::string refusal(LlamaForCausalLMImpl& model, const Recipe& recipe) {
  try {
    apply_recipe_memory_settings(model, recipe);
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

// The tiny LoRA model on the GPU and its gradients there, before the recipe's memory settings
// (a switch that moves a frozen weight to the host) are applied to it.
struct SwitchedOnCuda {
  LlamaForCausalLM model;
  Gradients before;
};
SwitchedOnCuda switched_on_cuda(const Recipe& recipe) {
  const torch::Device cuda(torch::kCUDA, 0);
  auto model = tiny_llama_with_lora(false, 0.0);
  model->to(cuda);
  auto before = gradients_on(model, cuda);
  apply_recipe_memory_settings(*model, recipe);
  return {model, before};
}

// A host switch's recipe refused on a model whose lm_head is its input embeddings; the same small
// model untied, for the switch's other refusals.
LlamaForCausalLM refused_when_tied(const Recipe& recipe) {
  auto options = qtrain::testing::small_llama_options(32, 1);
  options.tie_word_embeddings = true;
  LlamaForCausalLM tied(options, torch::kFloat32);
  EXPECT_NE(refusal(*tied, recipe).find("tie_word_embeddings"), std::string::npos);
  options.tie_word_embeddings = false;
  return LlamaForCausalLM(options, torch::kFloat32);
}

TEST(EmbeddingsOnHost, TheRecipeRefusesTiedOrTrainedTables) {
  auto recipe = default_recipe();
  recipe.train.embeddings_on_host = true;
  auto untied = refused_when_tied(recipe);
  recipe.lora.rank = 0;  // every weight trains, the embedding too
  recipe.quant = QuantMethod::kNone;
  EXPECT_NE(refusal(*untied, recipe).find("model.embed_tokens.weight"), std::string::npos);
}

// A tied table goes to the host with both switches (alone, each is refused, above); on the CPU
// nothing moves.
TEST(TiedTableOnHost, TheRecipeTakesBothSwitchesTogether) {
  auto options = qtrain::testing::small_llama_options(32, 1);
  options.tie_word_embeddings = true;
  LlamaForCausalLM tied(options, torch::kFloat32);
  auto recipe = default_recipe();
  recipe.train.embeddings_on_host = recipe.train.lm_head_on_host = true;
  EXPECT_EQ(refusal(*tied, recipe), "");
  recipe.lora.rank = 0;
  recipe.quant = QuantMethod::kNone;
  EXPECT_NE(refusal(*tied, recipe).find("model.embed_tokens.weight"), std::string::npos);
}

// A small tied model with LoRA on its projections, B made non-zero (as tiny_llama_with_lora).
LlamaForCausalLM tied_llama_with_lora() {
  torch::manual_seed(21);
  auto options = qtrain::testing::small_llama_options(64, 2);
  options.tie_word_embeddings = true;
  LlamaForCausalLM model(options, torch::kFloat32);
  adapt_every_projection(*model, 0.0);
  return model;
}

// On a GPU a tied table on the host (pinned, gathered there, visiting for the loss) gives the LoRA
// gradients of the table on the device bitwise, through the fused loss and the logits path.
TEST(TiedTableOnHost, CudaGradientsEqualATableOnTheDeviceBitwise) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device cuda(torch::kCUDA, 0);
  auto model = tied_llama_with_lora();
  model->to(cuda);
  const auto before = gradients_on(model, cuda);
  auto recipe = default_recipe();
  recipe.train.embeddings_on_host = recipe.train.lm_head_on_host = true;
  apply_recipe_memory_settings(*model, recipe);
  ASSERT_TRUE(model->lm_head_on_host());
  const auto& table = model->model->embed_tokens->weight;
  ASSERT_TRUE(table.device().is_cpu());
  EXPECT_TRUE(table.is_pinned());
  expect_bitwise_equal(before, gradients_on(model, cuda), "CUDA, tied table on the host");
  expect_bitwise_equal(before, gradients_on(model, cuda, /*host_ids=*/true), "CUDA, tied table on the host, host ids");
}

// A 2-layer model of 4 experts (top 2, `intermediate` wide) on an NF4 base, each expert bank
// wrapped to count its builds (gate_up then down, layer by layer).
struct CountedBanksModel {
  LlamaForCausalLM model{nullptr};
  std::vector<std::shared_ptr<qtrain::testing::BlockCountingBank>> banks;
};

CountedBanksModel experts_model_counting_builds(int64_t hidden, int64_t intermediate) {
  auto options = qtrain::testing::small_llama_options(hidden, 2);
  options.feed_forward = FeedForwardKind::kExperts;
  options.experts.num_experts = 4;
  options.experts.experts_per_token = 2;
  options.experts.intermediate_size = intermediate;
  CountedBanksModel counted{LlamaForCausalLM(options, torch::kFloat32)};
  qat::quantize_linear_layers(*counted.model, qat::FourBitOptions{}, {"lm_head"});
  for (const auto& item : counted.model->named_modules("", /*include_self=*/false)) {
    auto* owner = dynamic_cast<qat::ExpertBankOwner*>(item.value().get());
    auto* layers = dynamic_cast<qat::LinearLayerOwner*>(item.value().get());
    if (owner == nullptr || layers == nullptr) continue;
    for (const auto& child : item.value()->named_children()) {
      if (owner->bank_experts(child.key()) == 0) continue;
      counted.banks.push_back(
          std::make_shared<qtrain::testing::BlockCountingBank>(std::dynamic_pointer_cast<qat::LinearLayer>(child.value())));
      layers->replace_linear(child.key(), counted.banks.back());
    }
  }
  return counted;
}

// train.expert_bank_block_mb reaches the banks in the forward and in the checkpointed layers'
// recomputation (autograd's thread): NF4 banks built in blocks of experts give the gradients of
// the whole banks. The forward without grad builds a bank whole only where it is at most the block
// limit plus the trained weights' bytes plus a recomputed layer's activations (which backward
// holds and it does not).
TEST(ExpertBankBlocks, RebuiltBanksAreBuiltInBlocksWithTheSameGradients) {
  torch::manual_seed(13);
  auto counted = experts_model_counting_builds(128, 128);
  auto& model = counted.model;
  auto& banks = counted.banks;
  const auto& options = model->options();
  ASSERT_EQ(banks.size(), 4u);  // gate_up and down of 2 layers
  model->model->embed_tokens->weight.set_requires_grad(true);
  model->train();
  const auto input_ids = torch::randint(options.vocab_size, {2, 24}, torch::kInt64);
  auto gradient = [&](int64_t block_bytes, int64_t recomputed_layer_bytes = 0) {
    model->model->set_gradient_checkpointing(1);
    model->model->set_keep_built_weights(false);
    model->model->set_expert_bank_block_bytes(block_bytes, recomputed_layer_bytes);
    for (auto& bank : banks) bank->reset_counts();
    auto loss = causal_lm_loss(*model, model->hidden_states({input_ids, {}, {}}), input_ids, 0);
    loss.loss_sum.backward();
    auto grad = model->model->embed_tokens->weight.grad().clone();
    model->model->embed_tokens->weight.mutable_grad() = torch::Tensor();
    return grad;
  };
  const auto whole = gradient(0);
  for (const auto& bank : banks) EXPECT_EQ(bank->row_blocks, 0);
  // Experts of 128 KB (gate_up, fp32) and 64 KB (down): one and two a block of 128 KB, built in
  // the recomputation and its backward.
  const int64_t block_bytes = 128 << 10;
  const auto blocked = gradient(block_bytes);
  // What trains here: the table and the norms (2 a layer, and the last).
  const int64_t trained = (options.vocab_size + 2 * options.num_hidden_layers + 1) * options.hidden_size * 4;
  EXPECT_EQ(model->model->trained_weight_bytes(), trained);
  for (const auto& bank : banks) {
    EXPECT_EQ(bank->wholes, 0);  // 256 KB and 512 KB banks, more than 128 KB + 51 KB
    EXPECT_GE(bank->row_blocks, 3);  // the forward without grad, the recomputation, its backward
    EXPECT_LE(bank->most_rows * bank->in_features() * 4, block_bytes);
  }
  ASSERT_GT(whole.abs().max().item<double>(), 0);
  EXPECT_TRUE(torch::equal(blocked, whole));
  // 220 KB: down's 256 KB bank fits the block and the gradients, whole in the forward;
  // gate_up's 512 KB does not.
  const int64_t wider = 220 << 10;
  EXPECT_TRUE(torch::equal(gradient(wider), whole));
  int64_t whole_in_forward = 0;
  for (const auto& bank : banks) {
    const bool fits = bank->out_features() * bank->in_features() * 4 <= wider + trained;
    EXPECT_EQ(bank->wholes, fits ? 1 : 0) << bank->out_features() << " rows";
    EXPECT_LE(bank->most_rows * bank->in_features() * 4, wider);
    whole_in_forward += fits;
  }
  EXPECT_EQ(whole_in_forward, 2);  // down of each layer
  // A recomputed layer's 300 KB of activations beside the block: gate_up's bank fits too.
  EXPECT_TRUE(torch::equal(gradient(wider, 300 << 10), whole));
  for (const auto& bank : banks) EXPECT_EQ(bank->wholes, 1) << bank->out_features() << " rows";
}

// A frozen dense base that multiplies itself (as FP8 does: LinearLayer::multiplies_itself) and
// counts its forward products.
class CountingProducts : public qat::LinearLayer {
 public:
  explicit CountingProducts(const torch::Tensor& weight) {
    weight_ = register_parameter("weight", weight.detach().clone(), /*requires_grad=*/false);
  }
  torch::Tensor forward(const torch::Tensor& input) override { return torch::matmul(input, weight_.t()); }
  int64_t in_features() const override { return weight_.size(1); }
  int64_t out_features() const override { return weight_.size(0); }
  torch::Tensor dense_weight(torch::ScalarType dtype) const override { return weight_.to(dtype); }
  torch::Tensor bias() const override { return torch::Tensor(); }
  MatmulWeight matmul_weight_kind() const override { return MatmulWeight::kBuilt; }
  torch::Tensor matmul_weight(torch::ScalarType dtype) const override { return weight_.to(dtype); }
  bool multiplies_itself() const override { return true; }
  torch::Tensor own_product(const torch::Tensor& rows, torch::Tensor onto) const override {
    ++products;
    return onto.addmm_(rows, weight_.t());
  }
  torch::Tensor own_input_gradient(const torch::Tensor& grad_rows, torch::Tensor onto) const override {
    return onto.addmm_(grad_rows, weight_);
  }
  mutable int64_t products = 0;

 private:
  torch::Tensor weight_;
};

// A small model whose o_proj and down_proj bases count their products, with LoRA (dropout 0.1: the
// recomputation draws the masks the forward drew) on every projection.
struct CountingModel {
  LlamaForCausalLM model{nullptr};
  std::vector<std::shared_ptr<CountingProducts>> outs, downs;  // o_proj, down_proj of each layer

  // The products of each kind since the last call, summed over the layers.
  std::pair<int64_t, int64_t> products() {
    std::pair<int64_t, int64_t> sums{0, 0};
    for (auto& out : outs) sums.first += std::exchange(out->products, 0);
    for (auto& down : downs) sums.second += std::exchange(down->products, 0);
    return sums;
  }
};

CountingModel counting_model(bool sandwich_norms) {
  torch::manual_seed(17);
  auto options = qtrain::testing::small_llama_options(64, 2);
  options.sandwich_norms = sandwich_norms;
  CountingModel counting{LlamaForCausalLM(options, torch::kFloat32)};
  for (int64_t layer = 0; layer < options.num_hidden_layers; ++layer) {
    const std::string prefix = "model.layers." + std::to_string(layer);
    auto* decoder = counting.model->model->layers[layer]->as<LlamaDecoderLayer>();
    auto* mlp = decoder->mlp->as<DenseMlpImpl>();
    counting.outs.push_back(std::make_shared<CountingProducts>(decoder->self_attn->o_proj->dense_weight(torch::kFloat32)));
    counting.downs.push_back(std::make_shared<CountingProducts>(mlp->down_proj->dense_weight(torch::kFloat32)));
    qat::replace_linear_layer_at(*counting.model, prefix + ".self_attn.o_proj", counting.outs.back());
    qat::replace_linear_layer_at(*counting.model, prefix + ".mlp.down_proj", counting.downs.back());
  }
  adapt_every_projection(*counting.model, 0.1);
  return counting;
}

// A checkpointed layer's recomputation leaves out the MLP's last product (down_proj's: its output
// only joins the residual stream that is the layer's output, and no backward reads it), whole or
// in MLP chunks, with the gradients of the plain path bit for bit; with a norm after the MLP
// (Gemma's sandwich norms), which reads it, the product runs again. o_proj's output feeds the
// next sublayer: it runs again too.
TEST(ActivationCheckpointing, TheRecomputationLeavesOutTheLastProductAndKeepsTheGradients) {
  for (const bool sandwich : {false, true}) {
    auto counting = counting_model(sandwich);
    auto& model = counting.model;
    const std::string what = sandwich ? "sandwich norms" : "pre-norm";
    using Counts = std::pair<int64_t, int64_t>;  // o_proj's products, down_proj's
    const auto plain = gradients_of(model, 0, 0);
    EXPECT_EQ(counting.products(), Counts(2, 2)) << what;  // one a layer
    expect_bitwise_equal(plain, gradients_of(model, 1, 0), what + ", checkpointed");
    EXPECT_EQ(counting.products(), Counts(4, sandwich ? 4 : 2)) << what;
    expect_bitwise_equal(plain, gradients_of(model, 1, 0, ActivationMemory{false, 0, false}),
                         what + ", checkpointed, weights built again in backward");
    EXPECT_EQ(counting.products(), Counts(4, sandwich ? 4 : 2)) << what;
    // MLP chunks of 32 of the 80 tokens (each a checkpointed piece): three chunk products a layer
    // in the forward; the layer's recomputation and each chunk's own leave theirs out.
    const auto chunked = gradients_of(model, 0, 0, ActivationMemory{false, 32});
    EXPECT_EQ(counting.products().second, sandwich ? 12 : 6) << what;
    const auto chunked_layers = gradients_of(model, 1, 0, ActivationMemory{false, 32});
    EXPECT_EQ(counting.products().second, sandwich ? 18 : 6) << what;
    for (size_t index = 0; index < plain.lora.size(); ++index) {  // dropout draws its masks chunk by chunk
      EXPECT_TRUE(torch::allclose(chunked_layers.lora[index], chunked.lora[index], /*rtol=*/1e-4, /*atol=*/1e-6))
          << what << ", chunks, gradient " << index;
    }
  }
}

// An experts' block weighs down_proj's input rows by the router, so no backward reads down's
// products: a checkpointed layer's recomputation leaves them out, and its backward builds the
// NF4 down bank for the rows' gradient alone. Counted in whole builds of each bank over the 2
// layers, the weights built again in backward: gate_up 2 a layer plain, 3 checkpointed (the
// forward, the recomputation, backward); down 2 either way. The gradients of every adapter
// (attention and both banks, peft's per-expert form) are the plain path's bit for bit, with the
// weights kept or built again.
TEST(ActivationCheckpointing, AnExpertsBlocksRecomputationLeavesOutDownsProductsWithTheSameGradients) {
  torch::manual_seed(19);
  auto counted = experts_model_counting_builds(64, 64);
  auto& model = counted.model;
  auto& banks = counted.banks;
  ASSERT_EQ(banks.size(), 4u);  // gate_up and down of 2 layers
  adapt_projections(*model, 0.0, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"});
  ASSERT_EQ(qat::expert_banks(*model).size(), 4u);
  const auto builds = [&] {
    std::pair<int, int> sums{0, 0};  // gate_up's, down's
    for (size_t index = 0; index < banks.size(); ++index) {
      (index % 2 == 0 ? sums.first : sums.second) += std::exchange(banks[index]->wholes, 0);
    }
    return sums;
  };
  using Builds = std::pair<int, int>;
  const ActivationMemory rebuilt{false, 0, /*keep_built_weights=*/false};
  const auto plain = gradients_of(model, 0, 0, rebuilt);
  EXPECT_EQ(builds(), Builds(4, 4));
  expect_bitwise_equal(plain, gradients_of(model, 1, 0, rebuilt), "checkpointed, weights built again in backward");
  EXPECT_EQ(builds(), Builds(6, 4));
  expect_bitwise_equal(plain, gradients_of(model, 1, 0), "checkpointed, weights kept");
  EXPECT_EQ(builds(), Builds(4, 4));
}

// Without dropout, down_proj's adapter reads no value of its input in a checkpointed layer's
// recomputation (backward makes x A^T from the product it rebuilds), so the MLP leaves the gated
// product unwritten there (gated_activation_for_graph). The gradients stay the plain path's bit
// for bit: SwiGLU on gate and up, on a fused gate_up (Phi-3), GeGLU under Gemma's norms; dense and
// NF4 bases; weights kept or built again, MLP chunks, branch outputs on the host. With dropout the
// adapter reads its input for the mask, and the product is written as before.
TEST(ActivationCheckpointing, WithoutDropoutTheRecomputationLeavesTheGatedProductUnwritten) {
  struct Variant {
    std::string name;
    bool fused, gemma, four_bit;
  };
  for (const auto& variant : {Variant{"swiglu", false, false, false}, Variant{"swiglu, nf4", false, false, true},
                              Variant{"fused gate_up, nf4", true, false, true}, Variant{"geglu, sandwich norms", false, true, false}}) {
    torch::manual_seed(29);
    auto options = qtrain::testing::small_llama_options(64, 2);
    options.fused_projections = variant.fused;
    if (variant.gemma) {
      options.sandwich_norms = true;
      options.activation = Activation::kGeluTanh;
    }
    LlamaForCausalLM model(options, torch::kFloat32);
    if (variant.four_bit) qat::quantize_linear_layers(*model, qat::FourBitOptions{}, {"lm_head"});
    adapt_projections(*model, 0.0,
                      {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj"});
    auto* mlp = model->model->layers[0]->as<LlamaDecoderLayer>()->mlp->as<DenseMlpImpl>();
    ASSERT_NE(mlp, nullptr);
    EXPECT_FALSE(mlp->down_proj->reads_input_for_graph()) << variant.name;
    const auto plain = gradients_of(model, 0, 0);
    expect_bitwise_equal(plain, gradients_of(model, 1, 0), variant.name + ", checkpointed");
    expect_bitwise_equal(plain, gradients_of(model, 1, 0, ActivationMemory{false, 0, false}),
                         variant.name + ", checkpointed, weights built again in backward");
    ActivationMemory branches;
    branches.offload = branches.branch_outputs = true;
    expect_bitwise_equal(plain, gradients_of(model, 1, 0, branches), variant.name + ", branch outputs on the host");
    expect_bitwise_equal(gradients_of(model, 0, 0, ActivationMemory{false, 32}),
                         gradients_of(model, 1, 0, ActivationMemory{false, 32}), variant.name + ", MLP chunks");
  }
  // With dropout in training the adapter reads its input (the mask); in evaluation it does not.
  auto dropped = tiny_llama_with_lora(false, 0.2);
  auto* mlp = dropped->model->layers[0]->as<LlamaDecoderLayer>()->mlp->as<DenseMlpImpl>();
  EXPECT_TRUE(mlp->down_proj->reads_input_for_graph());
  dropped->eval();
  EXPECT_FALSE(mlp->down_proj->reads_input_for_graph());
}

// train.offload_branch_outputs: each layer's o_proj output (and under sandwich norms its MLP's)
// waits on the host beside the layer's input, and the recomputation takes it back instead of
// running o_proj's product (and down_proj's): one product of each a layer, as without
// checkpointing, with the plain path's gradients bit for bit, whole and with MLP chunks (whose own
// pieces keep nothing).
TEST(ActivationOffloading, BranchOutputsOnTheHostLeaveOutTheirProductsWithTheSameGradients) {
  for (const bool sandwich : {false, true}) {
    auto counting = counting_model(sandwich);
    auto& model = counting.model;
    const std::string what = sandwich ? "sandwich norms" : "pre-norm";
    using Counts = std::pair<int64_t, int64_t>;
    const auto plain = gradients_of(model, 0, 0);
    counting.products();
    ActivationMemory kept;
    kept.offload = kept.branch_outputs = true;
    expect_bitwise_equal(plain, gradients_of(model, 1, 0, kept), what + ", branch outputs on the host");
    EXPECT_EQ(counting.products(), Counts(2, 2)) << what;
    expect_bitwise_equal(plain, gradients_of(model, 2, 0, kept), what + ", every 2nd layer, branch outputs on the host");
    EXPECT_EQ(counting.products(), Counts(2, 2)) << what;  // layer 1 is not checkpointed: once
    kept.mlp_chunk_tokens = 32;
    const auto chunked = gradients_of(model, 1, 0, ActivationMemory{true, 32});
    counting.products();
    const auto chunked_kept = gradients_of(model, 1, 0, kept);
    EXPECT_EQ(counting.products(), Counts(2, sandwich ? 18 : 6)) << what;
    expect_bitwise_equal(chunked, chunked_kept, what + ", MLP chunks, branch outputs on the host");
  }
}

TEST(EmbeddingsOnHost, CudaLogitsAndGradientsEqualATableOnTheDeviceBitwise) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto recipe = default_recipe();
  recipe.train.embeddings_on_host = true;
  auto switched = switched_on_cuda(recipe);
  ASSERT_TRUE(switched.model->model->embed_tokens->weight.device().is_cpu());
  expect_bitwise_equal(switched.before, gradients_on(switched.model, torch::Device(torch::kCUDA, 0)),
                       "CUDA, embeddings on the host");
  expect_bitwise_equal(switched.before, gradients_on(switched.model, torch::Device(torch::kCUDA, 0), /*host_ids=*/true),
                       "CUDA, embeddings on the host, gathered from the host's ids");
}

TEST(LmHeadOnHost, TheRecipeRefusesTiedTrainedAdaptedOrQuantizedHeads) {
  auto recipe = default_recipe();
  recipe.train.lm_head_on_host = true;
  auto untied = refused_when_tied(recipe);
  EXPECT_EQ(refusal(*untied, recipe), "");  // on the CPU it stays where it is
  auto adapted = recipe;
  adapted.lora.target_modules = {"q_proj", "lm_head"};
  EXPECT_NE(refusal(*untied, adapted).find("include lm_head"), std::string::npos);
  auto full = recipe;
  full.lora.rank = 0;  // every weight trains, lm_head too
  full.quant = QuantMethod::kNone;
  EXPECT_NE(refusal(*untied, full).find("lm_head.weight"), std::string::npos);
  auto fake_quantized = recipe;
  fake_quantized.quant = QuantMethod::kQat;
  fake_quantized.qat.target_modules = {"lm_head"};
  EXPECT_NE(refusal(*untied, fake_quantized).find("qat.target_modules"), std::string::npos);
  qat::quantize_linear_layers(*untied, qat::FourBitOptions{}, {});  // lm_head too
  EXPECT_NE(refusal(*untied, recipe).find("quantized"), std::string::npos);
}

// train.lm_head_block_mb brings lm_head to the fused loss in tiles: without lm_head on the host, or
// without the fused loss, it is refused, naming what it needs.
TEST(ActivationOffloading, BranchOutputsNeedTheInputsOffloaded) {
  auto options = qtrain::testing::small_llama_options(32, 1);
  LlamaForCausalLM model(options, torch::kFloat32);
  auto recipe = default_recipe();
  recipe.train.gradient_checkpointing = true;
  recipe.train.offload_branch_outputs = true;
  EXPECT_NE(refusal(*model, recipe).find("set train.offload_activations: true"), std::string::npos) << refusal(*model, recipe);
  recipe.train.offload_activations = true;
  EXPECT_EQ(refusal(*model, recipe), "");
}

TEST(LmHeadOnHost, ABlockOfItNeedsItOnTheHostAndTheFusedLoss) {
  auto options = qtrain::testing::small_llama_options(32, 1);
  LlamaForCausalLM model(options, torch::kFloat32);
  auto recipe = default_recipe();
  recipe.train.lm_head_block_mb = 64;
  EXPECT_NE(refusal(*model, recipe).find("needs train.lm_head_on_host: true"), std::string::npos) << refusal(*model, recipe);
  recipe.train.lm_head_on_host = true;
  recipe.train.fused_loss = false;
  EXPECT_NE(refusal(*model, recipe).find("needs train.fused_loss: true"), std::string::npos);
  recipe.train.fused_loss = true;
  EXPECT_EQ(refusal(*model, recipe), "");
  EXPECT_EQ(model->lm_head_block_bytes(), int64_t{64} << 20);
}

// On a GPU the LoRA gradients equal those with lm_head on the device bitwise, through the logits
// path (chunks of the whole batch: each takes its own copy), and lm_head's weight stays pinned on
// the host.
TEST(LmHeadOnHost, CudaGradientsEqualAHeadOnTheDeviceBitwise) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device cuda(torch::kCUDA, 0);
  auto recipe = default_recipe();
  recipe.train.lm_head_on_host = true;
  auto [model, on_device] = switched_on_cuda(recipe);
  ASSERT_TRUE(model->lm_head_on_host());
  const auto weight = model->lm_head->parameters().front();
  ASSERT_TRUE(weight.device().is_cpu());
  EXPECT_TRUE(weight.is_pinned());
  expect_bitwise_equal(on_device, gradients_on(model, cuda), "CUDA, lm_head on the host");
  model->prefetch_lm_head();  // a prefetched copy that the next loss takes
  expect_bitwise_equal(on_device, gradients_on(model, cuda), "CUDA, lm_head on the host, prefetched");
}

TEST(ActivationOffloading, WithoutCheckpointingNothingIsOffloaded) {
  auto model = tiny_llama_with_lora(false);
  expect_bitwise_equal(gradients_of(model, 0, 0), gradients_of(model, 0, 0, ActivationMemory{true, 0}), "no checkpointing");
}

TEST(ActivationOffloading, ATicketIsTakenOnceAndComesBackAsStored) {
  ActivationOffload offload(torch::kCPU);
  const auto first = torch::randn({3, 5});
  const auto second = torch::randn({7}, torch::kBFloat16);
  const auto first_ticket = offload.store(first);
  const auto second_ticket = offload.store(second.requires_grad_(false));
  EXPECT_TRUE(torch::equal(offload.take(second_ticket), second));
  EXPECT_TRUE(torch::equal(offload.take(first_ticket), first));
  EXPECT_THROW(offload.take(first_ticket), Error);
  EXPECT_THROW(offload.take(2), Error);
  // Both buffers are back in the pool, unused: they are freed, and a second release finds none.
  EXPECT_GE(ActivationOffload::release_unused_host_buffers(), 3 * 5 * 4 + 7 * 2);
  EXPECT_EQ(ActivationOffload::release_unused_host_buffers(), 0);
}

TEST(ActivationOffloading, CudaCopiesComeBackBitwiseAndTheGradientsMatch) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device cuda(torch::kCUDA, 0);
  {
    ActivationOffload offload(cuda);
    std::vector<torch::Tensor> on_host;
    std::vector<int64_t> tickets;
    for (int layer = 0; layer < 6; ++layer) {
      auto activation = torch::randn({1, 4096, 1024}, torch::TensorOptions().dtype(torch::kBFloat16).device(cuda));
      on_host.push_back(activation.cpu());
      tickets.push_back(offload.store(activation));
    }
    for (int layer = 5; layer >= 0; --layer) {
      EXPECT_TRUE(torch::equal(offload.take(tickets[layer]).cpu(), on_host[layer])) << "layer " << layer;
    }
    EXPECT_GE(ActivationOffload::pinned_bytes(), 6 * 4096 * 1024 * 2);
  }
  auto model = tiny_llama_with_lora(false, 0.0);
  model->to(cuda);
  model->model->set_gradient_checkpointing(1);
  const auto kept = gradients_on(model, cuda);
  model->model->set_activation_offloading(true);
  expect_bitwise_equal(kept, gradients_on(model, cuda), "CUDA, offloaded");
  model->model->set_branch_output_offloading(true);
  expect_bitwise_equal(kept, gradients_on(model, cuda), "CUDA, offloaded with the attention outputs");
}

TEST(MlpChunks, GradientsEqualTheWholeMlpToFp32Rounding) {
  for (const bool four_bit : {false, true}) {
    auto model = tiny_llama_with_lora(four_bit, 0.0);  // dropout draws its masks chunk by chunk
    const auto whole = gradients_of(model, 1, 0);
    for (const auto& [checkpoint_every, chunk] : {std::pair<int64_t, int64_t>{1, 16}, {0, 33}, {1, 80}}) {
      const auto chunked = gradients_of(model, checkpoint_every, 0, ActivationMemory{checkpoint_every > 0, chunk});
      const std::string what = std::string(four_bit ? "nf4" : "dense") + ", chunks of " + std::to_string(chunk) +
                               (checkpoint_every > 0 ? ", checkpointed and offloaded" : "");
      EXPECT_NEAR(chunked.loss, whole.loss, 1e-6 * whole.loss) << what;
      ASSERT_EQ(chunked.lora.size(), whole.lora.size());
      for (size_t index = 0; index < whole.lora.size(); ++index) {
        EXPECT_TRUE(torch::allclose(chunked.lora[index], whole.lora[index], /*rtol=*/1e-4, /*atol=*/1e-6))
            << what << ", gradient " << index << " differs by "
            << (chunked.lora[index] - whole.lora[index]).abs().max().item<double>();
      }
    }
  }
}

TEST(MlpChunks, TheForwardWithoutGradEqualsTheWholeMlp) {
  auto model = tiny_llama_with_lora(false, 0.0);
  model->eval();
  torch::NoGradGuard no_grad;
  const auto input_ids = torch::randint(model->options().vocab_size, {2, 40}, torch::kInt64);
  const auto whole = model->forward({input_ids, {}, {}});
  model->model->set_mlp_chunk_tokens(24);
  const auto chunked = model->forward({input_ids, {}, {}});
  EXPECT_TRUE(torch::allclose(chunked, whole, 1e-5, 1e-5)) << (chunked - whole).abs().max().item<double>();
}

// The recipe keys through a run: QLoRA steps of the demo's tiny model on the CPU (fp32, dropout 0)
// with each memory switch log the losses of the run without it: bit for bit for offloading, the
// host table and rebuilt weights; within 1e-5 for MLP chunks (measured below that).
TEST(MemorySwitches, ARunsLossesEqualThoseWithoutTheSwitch) {
  const auto losses_with = [](const std::vector<std::string>& switches) {
    testing::TempDir run;
    std::vector<std::string> settings = {
        "model.path=" + testing::source_dir() + "/recipes/demo/tiny-llama",
        "data.train=" + testing::source_dir() + "/recipes/demo/brown-val.jsonl", "data.eval=", "quant=qlora",
        "lora.rank=4", "lora.alpha=8", "lora.dropout=0", "data.max_seq_len=64", "train.micro_batch_size=2",
        "train.steps=4", "train.dtype=fp32", "train.device=cpu", "train.gradient_checkpointing=true",
        "optim.lr=1e-3", "schedule.warmup_steps=1", "eval.every=0", "log.every=1", "train.output_dir=" + run.path()};
    settings.insert(settings.end(), switches.begin(), switches.end());
    Finetune finetune(load_recipe("", settings));
    finetune.setup();
    finetune.train();
    return testing::logged_losses(run.path());
  };
  const auto plain = losses_with({});
  ASSERT_EQ(plain.size(), 4u);
  EXPECT_EQ(losses_with({"train.offload_activations=true", "train.embeddings_on_host=true",
                         "train.keep_built_weights=false", "train.lm_head_on_host=true",
                         "train.optimizer_states_on_host=true"}),
            plain);
  const auto chunked = losses_with({"train.mlp_chunk_tokens=40", "train.offload_activations=true"});
  ASSERT_EQ(chunked.size(), 4u);
  for (size_t step = 0; step < plain.size(); ++step) {
    EXPECT_NEAR(chunked[step], plain[step], 1e-5 * plain[step]) << "step " << step + 1;
  }
}

TEST(ChunkedLoss, LossAndGradientsEqualThePlainPath) {
  auto model = tiny_llama_with_lora(false);
  const auto plain = gradients_of(model, 0, 0);
  for (const int64_t chunk : {16, 33}) {
    const auto chunked = gradients_of(model, 0, chunk);
    EXPECT_NEAR(chunked.loss, plain.loss, 1e-6 * plain.loss) << "chunks of " << chunk;
    for (size_t index = 0; index < plain.lora.size(); ++index) {
      EXPECT_TRUE(torch::allclose(chunked.lora[index], plain.lora[index], /*rtol=*/1e-5, /*atol=*/1e-7))
          << "chunks of " << chunk << ", gradient " << index;
    }
  }
  const auto both = gradients_of(model, 1, 16);
  EXPECT_NEAR(both.loss, plain.loss, 1e-6 * plain.loss);
}

TEST(ChunkedLoss, AutomaticChunksHoldAbout512MiBOfLogits) {
  EXPECT_EQ(auto_loss_chunk_tokens(128256), 1024);  // 512 MiB / (128256 x 4 bytes) = 1046 -> 1024
  EXPECT_EQ(auto_loss_chunk_tokens(32000), 4096);
  EXPECT_EQ(auto_loss_chunk_tokens(10000000), 256);
}

TEST(ActivationCheckpointing, WithoutGradModeItJustRuns) {
  torch::NoGradGuard no_grad;
  auto x = torch::ones({3});
  auto y = checkpoint([](const std::vector<torch::Tensor>& inputs) { return inputs[0] * 2; }, {x}, {});
  EXPECT_TRUE(torch::equal(y, torch::full({3}, 2.0f)));
  EXPECT_FALSE(y.requires_grad());
}

}  // namespace
}  // namespace qtrain::trainer
