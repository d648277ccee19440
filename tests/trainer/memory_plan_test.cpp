// train.memory: auto (trainer/recipe/memory_plan.h): on a GPU the host switches that cost no
// speed come on where the run allows them, each said with its reason; nothing changes on the CPU
// or under manual, and a switch the recipe set stays set.
#include <gtest/gtest.h>

#include <map>

#include "trainer/formats/llama_shapes.h"
#include "trainer/model/feed_forward.h"
#include "trainer/recipe/memory_plan.h"
#include "trainer/recipe/model_memory.h"

namespace qtrain::trainer {
namespace {

// The QLoRA recipe a user starts from, with checkpointing, micro-batch 4 x 2048.
Recipe qlora_recipe() {
  Recipe recipe = default_recipe();
  recipe.train.gradient_checkpointing = true;
  recipe.train.micro_batch_size = 4;
  recipe.data.max_seq_len = 2048;
  return recipe;
}

// A bench shape, `layers` of it (0: all), with LoRA on every projection but a router, as bench trains it.
LlamaOptions shape(const std::string& name, int64_t layers = 0) {
  auto model = llama_shape(name);
  if (layers > 0) model.num_hidden_layers = layers;
  return model;
}

void target_every_projection(Recipe& recipe, const LlamaOptions& model) {
  recipe.lora.target_modules = projections_but_dense_base(model);
}

LlamaOptions untied() { return shape("llama3-8b"); }

LlamaOptions tied() {
  auto model = untied();
  model.tie_word_embeddings = true;
  return model;
}

std::map<std::string, MemoryChoice> by_key(const std::vector<MemoryChoice>& choices) {
  std::map<std::string, MemoryChoice> keyed;
  for (const auto& choice : choices) keyed[choice.key] = choice;
  return keyed;
}

TEST(MemoryPlan, AutoOnAGpuTurnsOnEveryHostSwitchTheRunAllows) {
  auto recipe = qlora_recipe();
  EXPECT_EQ(recipe.train.memory, "auto");  // the default
  auto choices = by_key(plan_memory(recipe, untied(), /*on_gpu=*/true));
  ASSERT_EQ(choices.size(), 6u);
  for (const auto& [key, choice] : choices) {
    // Llama's lm_head visits whole at micro-batch 4 (LmHeadVisitsInTilesWhereItsWholeVisitSetsThePeak)
    if (key != "train.lm_head_block_mb") EXPECT_TRUE(choice.on) << key << ": " << choice.why;
  }
  EXPECT_TRUE(recipe.train.offload_activations);
  EXPECT_TRUE(recipe.train.embeddings_on_host);
  EXPECT_TRUE(recipe.train.lm_head_on_host);
  EXPECT_TRUE(recipe.train.optimizer_states_on_host);
  EXPECT_TRUE(recipe.train.offload_branch_outputs);
  EXPECT_TRUE(recipe.train.keep_built_weights);  // rebuilding costs speed: left as set
  const auto lines = describe_memory_plan(recipe, plan_memory(recipe, untied(), true), true);
  EXPECT_NE(lines.front().find("memory: auto: train.offload_activations on (set in the recipe)"), std::string::npos)
      << lines.front();
}

// lm_head's copy (each micro-batch) and the optimizer state's (each step) go to the host where
// their bytes are a small share of the work, as measured (memory_plan.cpp): at the 8B shapes'
// micro-batch 1 x 2048 both; at the 12-layer Qwen3-30B-A3B's, lm_head but not the experts'
// adapters' state (1.28 GB each way); below 2,048 tokens neither.
TEST(MemoryPlan, CopiesGoToTheHostWhereTheyAreASmallShareOfTheWork) {
  for (const std::string name : {"llama3-8b", "qwen3-8b"}) {
    auto recipe = qlora_recipe();
    recipe.train.micro_batch_size = 1;
    const auto model = shape(name);
    target_every_projection(recipe, model);
    auto choices = by_key(plan_memory(recipe, model, true));
    EXPECT_TRUE(choices["train.lm_head_on_host"].on) << name << ": " << choices["train.lm_head_on_host"].why;
    EXPECT_TRUE(choices["train.optimizer_states_on_host"].on) << name << ": " << choices["train.optimizer_states_on_host"].why;
  }
  auto moe_recipe = qlora_recipe();
  moe_recipe.train.micro_batch_size = 1;
  const auto moe = shape("qwen3-30b-a3b", 12);
  target_every_projection(moe_recipe, moe);
  const auto work = host_copy_work(moe, moe_recipe);
  EXPECT_NEAR(work.state_bytes, 2 * 8 * 160.6e6, 0.01 * 2 * 8 * 160.6e6);  // 160.6M adapter weights (bench's count)
  EXPECT_NEAR(work.lm_head_bytes, 151936.0 * 2048 * 2, 1);
  auto choices = by_key(plan_memory(moe_recipe, moe, true));
  EXPECT_TRUE(choices["train.lm_head_on_host"].on) << choices["train.lm_head_on_host"].why;
  EXPECT_FALSE(choices["train.optimizer_states_on_host"].on);
  EXPECT_NE(choices["train.optimizer_states_on_host"].why.find("bytes per FLOP of the step's work"), std::string::npos)
      << choices["train.optimizer_states_on_host"].why;

  auto recipe = qlora_recipe();
  recipe.train.micro_batch_size = 1;
  recipe.data.max_seq_len = 512;
  choices = by_key(plan_memory(recipe, untied(), true));
  EXPECT_TRUE(choices["train.offload_activations"].on);
  EXPECT_TRUE(choices["train.embeddings_on_host"].on);
  EXPECT_FALSE(choices["train.lm_head_on_host"].on);
  EXPECT_NE(choices["train.lm_head_on_host"].why.find("a micro-batch of 512 tokens may be too short"), std::string::npos)
      << choices["train.lm_head_on_host"].why;
  EXPECT_FALSE(choices["train.optimizer_states_on_host"].on);
  // Accumulating 4 micro-batches makes the step long enough for the optimizer's copies.
  auto accumulated = qlora_recipe();
  accumulated.train.micro_batch_size = 1;
  accumulated.data.max_seq_len = 512;
  accumulated.train.grad_accum_steps = 4;
  choices = by_key(plan_memory(accumulated, untied(), true));
  EXPECT_FALSE(choices["train.lm_head_on_host"].on);
  EXPECT_TRUE(choices["train.optimizer_states_on_host"].on);
}

// Where the estimated peak would not fit the GPU's free memory, the switches that cost speed go on,
// cheapest first and each only while the estimate is above 90% of it, each saying what it costs;
// a run that fits even so not is told to shorten its micro-batch; with room, none of them.
TEST(MemoryPlan, SwitchesThatCostSpeedGoOnOnlyToFitTheGpu) {
  const auto moe = shape("qwen3-30b-a3b", 12);
  const auto moe_recipe = [&] {
    auto recipe = qlora_recipe();
    recipe.train.micro_batch_size = 1;
    target_every_projection(recipe, moe);
    return recipe;
  };
  const auto peak = [&](const Recipe& recipe) {
    return estimate_peak_memory(moe, training_memory_setup(recipe, moe)).total();
  };
  auto roomy = moe_recipe();
  auto choices = by_key(plan_memory(roomy, moe, true, 80.0 * (1 << 30)));
  EXPECT_FALSE(roomy.train.optimizer_states_on_host);
  EXPECT_TRUE(roomy.train.keep_built_weights);
  EXPECT_EQ(roomy.train.expert_bank_block_mb, 0);
  const double free_choices_peak = peak(roomy);
  auto with_state = roomy;
  with_state.train.optimizer_states_on_host = true;
  const double state_peak = peak(with_state);
  ASSERT_LT(state_peak, free_choices_peak);

  // Just too little for the free switches: the state goes to the host, and that is enough.
  auto tight = moe_recipe();
  choices = by_key(plan_memory(tight, moe, true, (free_choices_peak - 1.0) / 0.9));
  EXPECT_TRUE(tight.train.optimizer_states_on_host);
  EXPECT_NE(choices["train.optimizer_states_on_host"].why.find("to fit the GPU's"), std::string::npos)
      << choices["train.optimizer_states_on_host"].why;
  EXPECT_NE(choices["train.optimizer_states_on_host"].why.find("it costs"), std::string::npos);
  EXPECT_TRUE(tight.train.keep_built_weights);
  EXPECT_LE(peak(tight), 0.9 * (free_choices_peak - 1.0) / 0.9);

  // Less: the weights are built again in backward too.
  auto tighter = moe_recipe();
  plan_memory(tighter, moe, true, (state_peak - 1.0) / 0.9);
  EXPECT_TRUE(tighter.train.optimizer_states_on_host);
  EXPECT_FALSE(tighter.train.keep_built_weights);

  // Far too little: every switch that lowers the estimate, and the advice.
  auto hopeless = moe_recipe();
  const auto lines = describe_memory_plan(hopeless, plan_memory(hopeless, moe, true, 1.0 * (1 << 30)), true);
  EXPECT_TRUE(hopeless.train.optimizer_states_on_host);
  EXPECT_FALSE(hopeless.train.keep_built_weights);
  EXPECT_EQ(hopeless.train.expert_bank_block_mb, 256);
  bool advised = false;
  for (const auto& line : lines) advised = advised || line.find("lower train.micro_batch_size") != std::string::npos;
  EXPECT_TRUE(advised);

  // Unknown memory (0): nothing is fitted.
  auto unknown = moe_recipe();
  plan_memory(unknown, moe, true, 0);
  EXPECT_FALSE(unknown.train.optimizer_states_on_host);
  EXPECT_TRUE(unknown.train.keep_built_weights);
}

TEST(MemoryPlan, WhatTheRunCannotTakeStaysOffWithItsReason) {
  auto recipe = qlora_recipe();
  recipe.train.gradient_checkpointing = false;
  recipe.lora.target_modules.push_back("lm_head");
  auto choices = by_key(plan_memory(recipe, untied(), true));
  EXPECT_FALSE(choices["train.offload_activations"].on);
  EXPECT_NE(choices["train.offload_activations"].why.find("train.gradient_checkpointing is off"), std::string::npos);
  EXPECT_FALSE(choices["train.offload_branch_outputs"].on);  // refused without the offload
  EXPECT_NE(choices["train.offload_branch_outputs"].why.find("train.offload_activations is off"), std::string::npos);
  EXPECT_FALSE(choices["train.lm_head_on_host"].on);
  EXPECT_NE(choices["train.lm_head_on_host"].why.find("include lm_head"), std::string::npos);
  EXPECT_TRUE(choices["train.embeddings_on_host"].on);
  EXPECT_FALSE(recipe.train.offload_activations);
  EXPECT_FALSE(recipe.train.offload_branch_outputs);
  EXPECT_FALSE(recipe.train.lm_head_on_host);

  auto short_tied = qlora_recipe();
  short_tied.train.micro_batch_size = 1;
  short_tied.data.max_seq_len = 512;
  choices = by_key(plan_memory(short_tied, tied(), true));
  EXPECT_FALSE(choices["train.embeddings_on_host"].on);
  EXPECT_FALSE(choices["train.lm_head_on_host"].on);
  EXPECT_NE(choices["train.lm_head_on_host"].why.find("tie_word_embeddings"), std::string::npos);
  EXPECT_NE(choices["train.lm_head_on_host"].why.find("512 tokens may be too short"), std::string::npos);

  auto full = qlora_recipe();
  full.lora.rank = 0;  // every weight trains, the table and lm_head too
  full.quant = QuantMethod::kNone;
  choices = by_key(plan_memory(full, untied(), true));
  EXPECT_FALSE(choices["train.optimizer_states_on_host"].on);
  EXPECT_FALSE(choices["train.embeddings_on_host"].on);
  EXPECT_NE(choices["train.embeddings_on_host"].why.find("model.embed_tokens.weight"), std::string::npos);
}

// A tied table goes to the host only as a pair (train.embeddings_on_host and lm_head_on_host):
// auto chooses it where lm_head's copy is a small share of the work, as for an untied head (the
// tied bench shapes, measured in memory_plan.cpp), completes a pair the recipe began, and leaves
// it off where the table trains.
TEST(MemoryPlan, ATiedTableGoesToTheHostAsAPairWhereItsCopyIsASmallShare) {
  for (const std::string name : {"phi4-mini", "gemma2-9b"}) {
    for (const int64_t micro_batch : {1, 4}) {
      auto recipe = qlora_recipe();
      recipe.train.micro_batch_size = micro_batch;
      const auto model = shape(name);
      ASSERT_TRUE(model.tie_word_embeddings) << name;
      target_every_projection(recipe, model);
      auto choices = by_key(plan_memory(recipe, model, true));
      EXPECT_TRUE(recipe.train.embeddings_on_host && recipe.train.lm_head_on_host)
          << name << " mb" << micro_batch << ": " << choices["train.lm_head_on_host"].why;
      EXPECT_NE(choices["train.embeddings_on_host"].why.find("tied table"), std::string::npos);
    }
  }
  // A tied head far larger than the work behind it stays on the GPU, with its share said.
  auto small = shape("phi4-mini", 1);
  auto recipe = qlora_recipe();
  recipe.train.micro_batch_size = 1;
  auto choices = by_key(plan_memory(recipe, small, true));
  EXPECT_FALSE(recipe.train.embeddings_on_host || recipe.train.lm_head_on_host);
  EXPECT_NE(choices["train.lm_head_on_host"].why.find("bytes per FLOP of the micro-batch's work"), std::string::npos)
      << choices["train.lm_head_on_host"].why;

  auto began = qlora_recipe();
  began.data.max_seq_len = 512;  // too short to choose the pair, but the recipe began it
  began.train.micro_batch_size = 1;
  began.train.embeddings_on_host = true;
  choices = by_key(plan_memory(began, tied(), true));
  EXPECT_TRUE(began.train.lm_head_on_host) << choices["train.lm_head_on_host"].why;
  EXPECT_EQ(choices["train.embeddings_on_host"].why, "set in the recipe");
  auto trained = qlora_recipe();
  trained.train.lm_head_on_host = true;
  trained.lora.rank = 0;  // every weight trains, the table too
  trained.quant = QuantMethod::kNone;
  choices = by_key(plan_memory(trained, tied(), true));
  EXPECT_FALSE(trained.train.embeddings_on_host);
  EXPECT_NE(choices["train.embeddings_on_host"].why.find("model.embed_tokens.weight"), std::string::npos)
      << choices["train.embeddings_on_host"].why;
}

// lm_head visits the loss in tiles (train.lm_head_block_mb 256) where the estimate says that takes
// a fifth or more off the peak: a large vocabulary beside a short micro-batch (phi4-mini's
// 200,064-token table at micro-batch 1, measured 3.07 -> 2.37 GiB), not where the cut is smaller
// than the step's 6% is worth (phi4-mini at 4, gemma2-9b at 1: 13%) or the layers' backward sets
// the peak (the 8B shapes). A block the recipe set stays set; with lm_head on the device there is none.
TEST(MemoryPlan, LmHeadVisitsInTilesWhereItsWholeVisitSetsThePeak) {
  for (const std::string name : {"phi4-mini", "gemma2-9b", "llama3-8b", "qwen3-8b", "mistral-7b"}) {
    for (const int64_t micro_batch : {1, 4}) {
      auto recipe = qlora_recipe();
      recipe.train.micro_batch_size = micro_batch;
      const auto model = shape(name);
      target_every_projection(recipe, model);
      auto choices = by_key(plan_memory(recipe, model, true));
      const auto& tiles = choices["train.lm_head_block_mb"];
      std::printf("%s mb%lld: %s (%s)\n", name.c_str(), static_cast<long long>(micro_batch), tiles.on ? "on" : "off",
                  tiles.why.c_str());
      const bool expected = name == "phi4-mini" && micro_batch == 1;
      EXPECT_EQ(tiles.on, expected) << name << " mb" << micro_batch << ": " << tiles.why;
      EXPECT_EQ(recipe.train.lm_head_block_mb, expected ? 256 : 0) << name << " mb" << micro_batch;
    }
  }
  auto set = qlora_recipe();
  set.train.lm_head_block_mb = 64;
  auto choices = by_key(plan_memory(set, untied(), true));
  EXPECT_EQ(set.train.lm_head_block_mb, 64);
  EXPECT_EQ(choices["train.lm_head_block_mb"].why, "set in the recipe");
  auto on_device = qlora_recipe();
  on_device.train.micro_batch_size = 1;
  on_device.data.max_seq_len = 512;  // too short to choose lm_head on the host
  choices = by_key(plan_memory(on_device, untied(), true));
  EXPECT_FALSE(on_device.train.lm_head_on_host);
  EXPECT_EQ(on_device.train.lm_head_block_mb, 0);
  EXPECT_EQ(choices["train.lm_head_block_mb"].why, "lm_head stays on the device");
}

TEST(MemoryPlan, ManualAndTheCpuChangeNothing) {
  auto manual = qlora_recipe();
  manual.train.memory = "manual";
  EXPECT_TRUE(plan_memory(manual, untied(), true).empty());
  EXPECT_FALSE(manual.train.offload_activations || manual.train.embeddings_on_host || manual.train.lm_head_on_host ||
               manual.train.optimizer_states_on_host);
  EXPECT_EQ(describe_memory_plan(manual, {}, true), std::vector<std::string>{"memory: manual: the train.* switches as set"});
  auto cpu = qlora_recipe();
  EXPECT_TRUE(plan_memory(cpu, untied(), /*on_gpu=*/false).empty());
  EXPECT_FALSE(cpu.train.offload_activations || cpu.train.embeddings_on_host);
  EXPECT_NE(describe_memory_plan(cpu, {}, false).front().find("on the CPU"), std::string::npos);
}

}  // namespace
}  // namespace qtrain::trainer
