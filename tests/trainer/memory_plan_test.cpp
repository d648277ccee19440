// train.memory: auto (trainer/recipe/memory_plan.h): on a GPU the host switches that cost no
// speed come on where the run allows them, each said with its reason; nothing changes on the CPU
// or under manual, and a switch the recipe set stays set.
#include <gtest/gtest.h>

#include <map>

#include "trainer/recipe/memory_plan.h"

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

std::map<std::string, MemoryChoice> by_key(const std::vector<MemoryChoice>& choices) {
  std::map<std::string, MemoryChoice> keyed;
  for (const auto& choice : choices) keyed[choice.key] = choice;
  return keyed;
}

TEST(MemoryPlan, AutoOnAGpuTurnsOnEveryHostSwitchTheRunAllows) {
  auto recipe = qlora_recipe();
  EXPECT_EQ(recipe.train.memory, "auto");  // the default
  auto choices = by_key(plan_memory(recipe, /*tied_embeddings=*/false, /*on_gpu=*/true));
  ASSERT_EQ(choices.size(), 4u);
  for (const auto& [key, choice] : choices) EXPECT_TRUE(choice.on) << key << ": " << choice.why;
  EXPECT_TRUE(recipe.train.offload_activations);
  EXPECT_TRUE(recipe.train.embeddings_on_host);
  EXPECT_TRUE(recipe.train.lm_head_on_host);
  EXPECT_TRUE(recipe.train.optimizer_states_on_host);
  EXPECT_TRUE(recipe.train.keep_built_weights);  // rebuilding costs speed: left as set
  const auto lines = describe_memory_plan(recipe, plan_memory(recipe, false, true), true);
  EXPECT_NE(lines.front().find("memory: auto: train.offload_activations on (set in the recipe)"), std::string::npos)
      << lines.front();
}

// lm_head's copy (each micro-batch) and the optimizer state's (each step) hide behind 2,048
// tokens of work; below that they stay on the GPU.
TEST(MemoryPlan, ShortStepsKeepLmHeadAndOptimizerStateOnTheGpu) {
  auto recipe = qlora_recipe();
  recipe.train.micro_batch_size = 1;
  auto choices = by_key(plan_memory(recipe, false, true));
  EXPECT_TRUE(choices["train.lm_head_on_host"].on) << choices["train.lm_head_on_host"].why;
  EXPECT_TRUE(choices["train.optimizer_states_on_host"].on) << choices["train.optimizer_states_on_host"].why;
  recipe = qlora_recipe();
  recipe.train.micro_batch_size = 1;
  recipe.data.max_seq_len = 512;
  choices = by_key(plan_memory(recipe, false, true));
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
  choices = by_key(plan_memory(accumulated, false, true));
  EXPECT_FALSE(choices["train.lm_head_on_host"].on);
  EXPECT_TRUE(choices["train.optimizer_states_on_host"].on);
}

TEST(MemoryPlan, WhatTheRunCannotTakeStaysOffWithItsReason) {
  auto recipe = qlora_recipe();
  recipe.train.gradient_checkpointing = false;
  recipe.lora.target_modules.push_back("lm_head");
  auto choices = by_key(plan_memory(recipe, /*tied_embeddings=*/false, true));
  EXPECT_FALSE(choices["train.offload_activations"].on);
  EXPECT_NE(choices["train.offload_activations"].why.find("train.gradient_checkpointing is off"), std::string::npos);
  EXPECT_FALSE(choices["train.lm_head_on_host"].on);
  EXPECT_NE(choices["train.lm_head_on_host"].why.find("include lm_head"), std::string::npos);
  EXPECT_TRUE(choices["train.embeddings_on_host"].on);
  EXPECT_FALSE(recipe.train.offload_activations);
  EXPECT_FALSE(recipe.train.lm_head_on_host);

  auto tied = qlora_recipe();
  choices = by_key(plan_memory(tied, /*tied_embeddings=*/true, true));
  EXPECT_FALSE(choices["train.embeddings_on_host"].on);
  EXPECT_FALSE(choices["train.lm_head_on_host"].on);
  EXPECT_NE(choices["train.lm_head_on_host"].why.find("tie_word_embeddings"), std::string::npos);
  EXPECT_TRUE(choices["train.optimizer_states_on_host"].on);

  auto full = qlora_recipe();
  full.lora.rank = 0;  // every weight trains, the table and lm_head too
  full.quant = QuantMethod::kNone;
  choices = by_key(plan_memory(full, false, true));
  EXPECT_FALSE(choices["train.optimizer_states_on_host"].on);
  EXPECT_FALSE(choices["train.embeddings_on_host"].on);
  EXPECT_NE(choices["train.embeddings_on_host"].why.find("model.embed_tokens.weight"), std::string::npos);
}

TEST(MemoryPlan, ManualAndTheCpuChangeNothing) {
  auto manual = qlora_recipe();
  manual.train.memory = "manual";
  EXPECT_TRUE(plan_memory(manual, false, true).empty());
  EXPECT_FALSE(manual.train.offload_activations || manual.train.embeddings_on_host || manual.train.lm_head_on_host ||
               manual.train.optimizer_states_on_host);
  EXPECT_EQ(describe_memory_plan(manual, {}, true), std::vector<std::string>{"memory: manual: the train.* switches as set"});
  auto cpu = qlora_recipe();
  EXPECT_TRUE(plan_memory(cpu, false, /*on_gpu=*/false).empty());
  EXPECT_FALSE(cpu.train.offload_activations || cpu.train.embeddings_on_host);
  EXPECT_NE(describe_memory_plan(cpu, {}, false).front().find("on the CPU"), std::string::npos);
}

}  // namespace
}  // namespace qtrain::trainer
