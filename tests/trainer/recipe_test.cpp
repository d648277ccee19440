// Recipes: YAML in, typed structs out, errors a user can act on.
#include "trainer/recipe/recipe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <stdexcept>

#include "kernels/error.h"
#include "support.h"
#include "trainer/formats/export_formats.h"
#include "trainer/formats/model_exports.h"
#include "trainer/recipe/base_quantization.h"
#include "trainer/recipe/recipe_schema.h"

namespace qtrain::trainer {

// gtest prints a Recipe as the YAML a user would see.
void PrintTo(const Recipe& recipe, std::ostream* out) { *out << "\n" << recipe_to_yaml(recipe); }

namespace {

namespace fs = std::filesystem;

const char* const kShippedRecipes[] = {"demo_tiny.yaml",      "qlora_llama.yaml",    "lora_llama.yaml",
                                       "qat_llama.yaml",      "qat_llama_q4_0.yaml", "qat_llama_int4_weight_only.yaml",
                                       "lora_int8_llama.yaml", "lora_fp8_llama.yaml", "qlora_llama_low_memory.yaml",
                                       "qlora_qwen3_moe.yaml", "qlora_gpt_oss.yaml"};

std::string shipped(const std::string& name) {
  return qtrain::testing::source_dir() + "/recipes/" + name;
}

using qtrain::testing::TempDir;

std::string load_error(const std::string& path, const std::vector<std::string>& overrides = {}) {
  return testing::error_message([&] { load_recipe(path, overrides); });
}

// The error loading `text`, written as `name` in `dir`, gives, with the file's path (which every
// recipe error starts with) shortened to `name`: "x.yaml:4: unknown key ...".
std::string file_error(const TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir.write(name, text);
  const std::string error = load_error(path);
  return error.rfind(path, 0) == 0 ? name + error.substr(path.size()) : error;
}

const std::vector<std::string> kLlamaProjections = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                    "gate_proj", "up_proj", "down_proj"};

TEST(RecipeDefaults, AreWhatTorchtuneAndAxolotlUsersExpect) {
  const Recipe recipe = default_recipe();
  EXPECT_EQ(recipe.quant, QuantMethod::kQlora);
  EXPECT_EQ(recipe.model.dtype, "bf16");
  EXPECT_EQ(recipe.qlora.quant_type, BaseQuantization::kNf4);
  EXPECT_EQ(recipe.qlora.blocksize, 64);
  EXPECT_TRUE(recipe.qlora.double_quant);
  EXPECT_EQ(recipe.qlora.skip_modules, std::vector<std::string>{"lm_head"});
  EXPECT_EQ(recipe.lora.rank, 16);
  EXPECT_EQ(recipe.lora.alpha, 32.0);
  EXPECT_EQ(recipe.lora.dropout, 0.0);
  EXPECT_EQ(recipe.lora.target_modules, kLlamaProjections);
  EXPECT_EQ(recipe.lora.init_from, "");
  EXPECT_EQ(recipe.qat.weights.bits, 4);
  EXPECT_EQ(recipe.qat.activations.bits, 0);
  EXPECT_EQ(recipe.qat.target_modules, kLlamaProjections);
  EXPECT_EQ(recipe.data.max_seq_len, 2048);
  EXPECT_EQ(recipe.optim.name, "adamw");
  EXPECT_EQ(recipe.optim.lr, 2e-4);
  EXPECT_EQ(recipe.optim.weight_decay, 0.0);
  EXPECT_EQ(recipe.optim.betas, (std::vector<double>{0.9, 0.999}));
  EXPECT_EQ(recipe.optim.eps, 1e-8);
  EXPECT_EQ(recipe.schedule.name, "cosine");
  EXPECT_EQ(recipe.schedule.warmup_steps, 100);
  EXPECT_EQ(recipe.train.micro_batch_size, 1);
  EXPECT_EQ(recipe.train.grad_accum_steps, 1);
  EXPECT_EQ(recipe.train.dtype, "bf16");
  EXPECT_EQ(recipe.train.seed, 42);
  EXPECT_EQ(recipe.train.max_grad_norm, 1.0);
  EXPECT_EQ(recipe.train.output_dir, (fs::current_path() / "runs/qtrain").string());
  EXPECT_EQ(recipe.checkpoint.every, 500);
  EXPECT_EQ(recipe.checkpoint.keep_last, 3);
  EXPECT_EQ(recipe.log.every, 10);
  EXPECT_EQ(recipe.dist.bucket_mb, 25);
  EXPECT_EQ(recipe.export_.formats, std::vector<std::string>{"peft"});
}

TEST(RecipeDefaults, LoadingNoFileGivesTheDefaults) {
  EXPECT_EQ(load_recipe("", {}), default_recipe());
}

TEST(RecipeSchema, EveryKeyHasItsOwnField) {
  Recipe recipe;
  std::set<const void*> fields;
  std::set<std::string> names;
  for (const auto& key : recipe_keys()) {
    const void* field =
        std::visit([](auto* pointer) -> const void* { return pointer; }, key.field(recipe));
    EXPECT_TRUE(fields.insert(field).second) << key.name << " shares a field with another key";
    EXPECT_TRUE(names.insert(key.name).second) << key.name << " is listed twice";
  }
}

TEST(ShippedRecipes, EveryOneParses) {
  for (const char* name : kShippedRecipes) {
    EXPECT_NO_THROW(load_recipe(shipped(name), {})) << name << ": " << load_error(shipped(name));
  }
}

TEST(ShippedRecipes, SayWhatTheirNamesPromise) {
  const Recipe demo = load_recipe(shipped("demo_tiny.yaml"), {});
  EXPECT_EQ(demo.quant, QuantMethod::kQlora);
  EXPECT_EQ(demo.qlora.quant_type, BaseQuantization::kNf4);
  EXPECT_EQ(demo.lora.rank, 8);
  EXPECT_EQ(demo.train.device, "cpu");
  EXPECT_EQ(demo.model.path, qtrain::testing::source_dir() + "/recipes/demo/tiny-llama");
  EXPECT_EQ(demo.data.train, std::vector<std::string>{qtrain::testing::source_dir() + "/recipes/demo/brown-train.jsonl"});
  const Recipe low_memory = load_recipe(shipped("qlora_llama_low_memory.yaml"), {});
  EXPECT_EQ(low_memory.qlora.quant_type, BaseQuantization::kNf4);
  EXPECT_TRUE(low_memory.qlora.fp8_compute);
  EXPECT_TRUE(low_memory.train.gradient_checkpointing && low_memory.train.offload_activations &&
              low_memory.train.embeddings_on_host && low_memory.train.lm_head_on_host);
  EXPECT_EQ(demo.train.output_dir, qtrain::testing::source_dir() + "/runs/demo_tiny");

  EXPECT_EQ(load_recipe(shipped("qlora_llama.yaml"), {}).quant, QuantMethod::kQlora);

  const Recipe int8 = load_recipe(shipped("lora_int8_llama.yaml"), {});
  EXPECT_EQ(int8.quant, QuantMethod::kQlora);
  EXPECT_EQ(int8.qlora.quant_type, BaseQuantization::kInt8);
  EXPECT_EQ(int8.qlora.llm_int8_threshold, 6.0);
  EXPECT_EQ(int8.optim.name, "adamw8bit");

  const Recipe fp8 = load_recipe(shipped("lora_fp8_llama.yaml"), {});
  EXPECT_EQ(fp8.qlora.quant_type, BaseQuantization::kFp8);
  EXPECT_EQ(fp8.train.dtype, "bf16");
  EXPECT_EQ(base_quantization(fp8, torch::kBFloat16).kind, BaseQuantization::kFp8);

  const Recipe lora = load_recipe(shipped("lora_llama.yaml"), {});
  EXPECT_EQ(lora.quant, QuantMethod::kNone);
  EXPECT_EQ(lora.model.dtype, "bf16");

  const Recipe qat = load_recipe(shipped("qat_llama.yaml"), {});
  EXPECT_EQ(qat.quant, QuantMethod::kQat);
  EXPECT_EQ(qat.qat.weights.bits, 4);
  EXPECT_TRUE(qat.qat.weights.symmetric);
  EXPECT_EQ(qat.qat.weights.granularity, "per_group");
  EXPECT_EQ(qat.qat.weights.group_size, 32);
  EXPECT_EQ(qat.qat.activations.bits, 8);
  EXPECT_EQ(qat.qat.activations.granularity, "per_token");
  EXPECT_EQ(qat.qat.activations.observer, "dynamic");

  const Recipe q4_0 = load_recipe(shipped("qat_llama_q4_0.yaml"), {});
  EXPECT_EQ(q4_0.qat.weights.bits, 4);
  EXPECT_TRUE(q4_0.qat.weights.symmetric);
  EXPECT_EQ(q4_0.qat.weights.group_size, 32);
  EXPECT_EQ(q4_0.export_.formats, std::vector<std::string>{"gguf"});

  const Recipe weight_only = load_recipe(shipped("qat_llama_int4_weight_only.yaml"), {});
  EXPECT_EQ(weight_only.qat.weights.bits, 4);
  EXPECT_FALSE(weight_only.qat.weights.symmetric);
  EXPECT_EQ(weight_only.qat.weights.group_size, 32);
  EXPECT_EQ(weight_only.qat.weights.zero_point_domain, "float");
  EXPECT_EQ(weight_only.qat.activations.bits, 0);
}

TEST(RecipeYaml, PrintedRecipeParsesBackToTheSameRecipe) {
  TempDir dir;
  std::vector<Recipe> recipes = {default_recipe()};
  for (const char* name : kShippedRecipes) recipes.push_back(load_recipe(shipped(name), {}));
  recipes.push_back(
      load_recipe("", {"model.path='/tmp/we ird: \"dir\" #1/\xc3\xbc\\x'",
                       "lora.target_modules=['*proj', 'true', '12', 'a b', '-x']", "optim.lr=0.1",
                       "optim.betas=[0.3, 0.123456789012345]", "data.eval=", "export.formats=[]"}));
  for (const Recipe& recipe : recipes) {
    const std::string path = dir.write("printed/recipe.yaml", recipe_to_yaml(recipe));
    EXPECT_EQ(load_recipe(path, {}), recipe) << recipe_to_yaml(recipe);
  }
}

TEST(RecipeYaml, PrintedRecipeShowsEveryKeyWithItsDoc) {
  const std::string text = recipe_to_yaml(default_recipe());
  EXPECT_NE(text.find("lora:\n  rank: 16"), std::string::npos) << text;
  EXPECT_NE(text.find("qat:\n  weights:\n    format: int"), std::string::npos) << text;
  EXPECT_NE(text.find("[nf4 | fp4 | int8 | fp8]"), std::string::npos) << text;
  EXPECT_NE(text.find("\nexport:\n  formats: [peft]"), std::string::npos) << text;
}

TEST(RecipeErrors, UnknownKeyNamesFileLineAndTheKeyMeant) {
  TempDir dir;
  EXPECT_EQ(file_error(dir, "x.yaml", "model:\n  dtype: bf16\nlora:\n  rnak: 8\n"),
            "x.yaml:4: unknown key 'lora.rnak' (did you mean 'lora.rank'?)");
  EXPECT_EQ(file_error(dir, "x.yaml", "lroa:\n  rank: 8\n"), "x.yaml:1: unknown key 'lroa' (did you mean 'lora'?)");
  EXPECT_EQ(file_error(dir, "x.yaml", "train:\n  lr: 1e-4\n"),
            "x.yaml:2: unknown key 'train.lr' (did you mean 'optim.lr'?)");
  EXPECT_EQ(file_error(dir, "x.yaml", "learning_rate: 1e-4\n"),
            "x.yaml:1: unknown key 'learning_rate' (did you mean 'optim.lr'?)");
  EXPECT_EQ(file_error(dir, "x.yaml", "zzzzzzzz: 1\n"), "x.yaml:1: unknown key 'zzzzzzzz'");
}

TEST(RecipeErrors, WrongTypeNamesFileLineAndExpectedType) {
  TempDir dir;
  const auto error_for = [&](const std::string& text) { return file_error(dir, "x.yaml", text); };
  EXPECT_EQ(error_for("optim:\n  name: adamw\n  lr: fast\n"),
            "x.yaml:3: 'optim.lr' expects a number, got 'fast'");
  EXPECT_EQ(error_for("lora:\n  rank: 2.5\n"),
            "x.yaml:2: 'lora.rank' expects an integer, got '2.5'");
  EXPECT_EQ(error_for("lora:\n  rank: abc\n"),
            "x.yaml:2: 'lora.rank' expects an integer, got 'abc'");
  EXPECT_EQ(error_for("data:\n  pack: maybe\n"),
            "x.yaml:2: 'data.pack' expects true or false, got 'maybe'");
  EXPECT_EQ(error_for("optim:\n  lr: [1, 2]\n"),
            "x.yaml:2: 'optim.lr' expects a number, got a list");
  EXPECT_EQ(error_for("model:\n  path: {a: 1}\n"),
            "x.yaml:2: 'model.path' expects text, got a map");
  EXPECT_EQ(
      error_for("lora:\n  target_modules: q_proj\n"),
      "x.yaml:2: 'lora.target_modules' expects a list of names, e.g. [q_proj, k_proj], got 'q_proj'");
  EXPECT_EQ(error_for("optim:\n  betas: [0.9]\n"),
            "x.yaml:2: 'optim.betas' expects 2 numbers, e.g. [0.9, 0.999], got 1");
  EXPECT_EQ(error_for("lora: 5\n"),
            "x.yaml:1: 'lora' is a map of keys (rank, alpha, dropout, rslora, use_dora, target_modules, "
            "init_from), got '5'");
  EXPECT_EQ(error_for("lora:\n  rank:\n"),
            "x.yaml:2: 'lora.rank' expects an integer, got nothing");
}

TEST(RecipeErrors, OutOfRangeValueSaysTheRange) {
  TempDir dir;
  EXPECT_EQ(file_error(dir, "x.yaml", "lora:\n  dropout: 1.5\n"), "x.yaml:2: 'lora.dropout' must be in [0, 1), got 1.5");
  EXPECT_EQ(file_error(dir, "x.yaml", "train:\n  micro_batch_size: 0\n"),
            "x.yaml:2: 'train.micro_batch_size' must be >= 1, got 0");
}

TEST(RecipeErrors, BadChoiceListsAllowedValues) {
  TempDir dir;
  EXPECT_EQ(file_error(dir, "x.yaml", "model:\n  path: m\nquant: qlroa\n"),
            "x.yaml:3: 'quant' must be one of qlora, qat, none, got 'qlroa' (did you mean 'qlora'?)");
  EXPECT_EQ(file_error(dir, "x.yaml", "qlora:\n  blocksize: 100\n"),
            "x.yaml:2: 'qlora.blocksize' must be one of 64, 128, 256, 512, 1024, 2048, 4096, got '100'");
  EXPECT_EQ(file_error(dir, "x.yaml", "export:\n  formats:\n    - peft\n    - ggfu\n"),
            "x.yaml:4: 'export.formats' entries must be one of peft, merged, gguf, safetensors-int, compressed-tensors, got 'ggfu' "
            "(did you mean 'gguf'?)");
}

TEST(RecipeErrors, KeySetTwiceNamesBothLines) {
  TempDir dir;
  EXPECT_EQ(file_error(dir, "x.yaml", "lora:\n  rank: 8\n  alpha: 16\n  rank: 4\n"),
            "x.yaml:4: 'lora.rank' is set twice (first on line 2)");
}

TEST(RecipeErrors, KeysThatDisagreeNameWhereTheyWereSet) {
  TempDir dir;
  const std::string rank = file_error(dir, "x.yaml", "quant: qlora\nlora:\n  rank: 0\n");
  EXPECT_EQ(rank.rfind("x.yaml:3: quant: qlora trains adapters", 0), 0u) << rank;
  const std::string granularity =
      file_error(dir, "x.yaml", "qat:\n  activations:\n    bits: 8\n    observer: minmax\n");
  EXPECT_EQ(granularity.rfind("x.yaml:4: 'qat.activations.granularity: per_token' needs "
                              "'qat.activations.observer: dynamic'",
                              0),
            0u)
      << granularity;
  const std::string offload = file_error(dir, "x.yaml", "train:\n  offload_activations: true\n");
  EXPECT_EQ(offload.rfind("x.yaml:2: train.offload_activations moves the inputs that gradient checkpointing keeps", 0), 0u)
      << offload;
  const std::string branches = file_error(dir, "x.yaml", "train:\n  offload_branch_outputs: true\n");
  EXPECT_EQ(branches.rfind("x.yaml:2: train.offload_branch_outputs keeps values for the recomputation", 0), 0u)
      << branches;
}

TEST(RecipeErrors, MalformedYamlNamesFileAndLine) {
  TempDir dir;
  const std::string unclosed =
      file_error(dir, "x.yaml", "lora:\n  rank: 8\n  target_modules: [q_proj, v_proj\nquant: qat\n");
  EXPECT_EQ(unclosed.rfind("x.yaml:4: ", 0), 0u) << unclosed;
  const std::string tab = file_error(dir, "x.yaml", "lora:\n\trank: 8\n");
  EXPECT_EQ(tab.rfind("x.yaml:2: ", 0), 0u) << tab;
  EXPECT_EQ(file_error(dir, "x.yaml", "lora:\n  rank: 8\n---\nlora:\n  rank: 4\n"),
            "x.yaml:3: a recipe is one YAML document, this is a second one (after '---')");
  EXPECT_EQ(file_error(dir, "x.yaml", ",cz]9"), "x.yaml:1: not valid YAML");
}

TEST(RecipeErrors, MissingRecipeFileIsNamed) {
  EXPECT_EQ(load_error("/nonexistent/qtrain/x.yaml"),
            "recipe '/nonexistent/qtrain/x.yaml' not found");
  TempDir dir;
  EXPECT_EQ(load_error(dir.path()),
            "recipe '" + dir.path() + "' is a directory, not a YAML file");
}

TEST(RecipeErrors, NoInputCrashes) {
  TempDir dir;
  const char* const documents[] = {"",
                                   "# only a comment\n",
                                   "- 1\n- 2\n",
                                   "42\n",
                                   "~\n",
                                   "lora: [1, 2]\n",
                                   "lora:\n  - rank\n",
                                   "? [a, b]\n: 1\n",
                                   "lora:\n  ? {a: 1}\n  : 2\n",
                                   "optim:\n  betas: [[1], {a: 2}]\n",
                                   "optim:\n  betas: 0.9\n",
                                   "lora:\n  target_modules: [[q], ~]\n",
                                   "a: &x 1\nb: *x\n",
                                   "lora: &s {rank: 4}\nqat: *s\n",
                                   "optim:\n  lr: 1e999\n",
                                   "optim:\n  lr: .nan\n",
                                   "lora:\n  rank: 99999999999999999999999\n",
                                   "quant: ~\n",
                                   "model: {path: ~}\n",
                                   "\xff\xfe\x00\x01",
                                   "lora: {rank: !!int 4}\n",
                                   "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\n",
                                   "lora:\n  rank: 8\n---\nlora: 2\n",
                                   "\"unterminated\n"};
  for (const char* document : documents) {
    const std::string path = dir.write("x.yaml", document);
    testing::error_message([&] { load_recipe(path, {}); });  // an Error or a recipe; anything else fails
  }
  std::mt19937 random(7);
  const std::string alphabet = "abcdeilmnoprstuqz.:-[]{},#&*!|>'\"\n\t 0123456789";
  for (int trial = 0; trial < 300; ++trial) {
    std::string text;
    const int length = static_cast<int>(random() % 80);
    for (int i = 0; i < length; ++i) text += alphabet[random() % alphabet.size()];
    const std::string path = dir.write("fuzz.yaml", text);
    testing::error_message([&] { load_recipe(path, {}); });
    testing::error_message([&] { load_recipe("", {"lora." + text}); });
    testing::error_message([&] { load_recipe("", {"lora.target_modules=" + text}); });
  }
}

TEST(RecipeOverrides, SetReplacesValuesFromTheFile) {
  TempDir dir;
  const std::string path = dir.write("x.yaml", "lora:\n  rank: 8\noptim:\n  lr: 1e-3\n");
  const Recipe recipe = load_recipe(
      path, {"lora.rank=4", "lora.target_modules=[q_proj,v_proj]", "optim.betas=[0.8, 0.95]",
             "qat.weights={bits: 8, group_size: 64}", "data.pack=true", "quant=none"});
  EXPECT_EQ(recipe.lora.rank, 4);
  EXPECT_EQ(recipe.optim.lr, 1e-3);
  EXPECT_EQ(recipe.lora.target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(recipe.optim.betas, (std::vector<double>{0.8, 0.95}));
  EXPECT_EQ(recipe.qat.weights.bits, 8);
  EXPECT_EQ(recipe.qat.weights.group_size, 64);
  EXPECT_TRUE(recipe.data.pack);
  EXPECT_EQ(recipe.quant, QuantMethod::kNone);
  EXPECT_EQ(apply_override(default_recipe(), "train.steps=7").train.steps, 7);
}

TEST(RecipeOverrides, LaterSetWinsAndKeysMayDisagreeUntilTheLast) {
  const Recipe recipe =
      load_recipe("", {"lora.rank=0", "quant=none", "lora.rank=2", "lora.rank=0"});
  EXPECT_EQ(recipe.lora.rank, 0);
  EXPECT_EQ(recipe.quant, QuantMethod::kNone);
}

TEST(RecipeOverrides, ErrorsNameTheSetArgument) {
  EXPECT_EQ(load_error("", {"optim.lrr=1"}),
            "--set optim.lrr=1: unknown key 'optim.lrr' (did you mean 'optim.lr'?)");
  EXPECT_EQ(load_error("", {"lora.rank=abc"}),
            "--set lora.rank=abc: 'lora.rank' expects an integer, got 'abc'");
  EXPECT_EQ(load_error("", {"lora.rank"}),
            "--set lora.rank: expected key=value, e.g. --set optim.lr=1e-4");
  EXPECT_EQ(load_error("", {"=3"}), "--set =3: expected key=value, e.g. --set optim.lr=1e-4");
  EXPECT_EQ(
      load_error("", {"quant=qlora", "lora.rank=0"}).rfind("--set lora.rank=0: quant: qlora", 0),
      0u);
  EXPECT_EQ(load_error("", {"lora.target_modules=[q_proj"})
                .rfind("--set lora.target_modules=[q_proj: ", 0),
            0u);
}

TEST(RecipePaths, RecipePathsStartAtTheRecipeAndSetPathsAtTheCurrentDirectory) {
  TempDir dir;
  const std::string path = dir.write("recipes/x.yaml",
                                     "model:\n  path: ../models/./tiny\ndata:\n  train: "
                                     "data/train.jsonl\n  eval: /abs/eval.jsonl\n"
                                     "train:\n  output_dir: ../runs/x/\n");
  const Recipe recipe = load_recipe(path, {"lora.init_from=adapters/a"});
  EXPECT_EQ(recipe.model.path, dir.file("models/tiny"));
  EXPECT_EQ(recipe.data.train, std::vector<std::string>{dir.file("recipes/data/train.jsonl")});
  EXPECT_EQ(recipe.data.eval, "/abs/eval.jsonl");
  EXPECT_EQ(recipe.train.output_dir, dir.file("runs/x"));
  EXPECT_EQ(recipe.lora.init_from, (fs::current_path() / "adapters/a").string());
  EXPECT_EQ(recipe.export_.out, "");
}

TEST(RecipePaths, DataTrainTakesAListOfSourcesEachResolved) {
  TempDir dir;
  const std::string path = dir.write("recipes/x.yaml", "data:\n  train: [a.jsonl, shards/]\n  weights: [1, 3]\n");
  const Recipe recipe = load_recipe(path, {});
  EXPECT_EQ(recipe.data.train, (std::vector<std::string>{dir.file("recipes/a.jsonl"), dir.file("recipes/shards")}));
  EXPECT_EQ(recipe.data.weights, (std::vector<double>{1, 3}));
  EXPECT_TRUE(load_recipe(path, {"data.train="}).data.train.empty());
  EXPECT_EQ(load_recipe("", {"data.train=/x/b.jsonl"}).data.train, std::vector<std::string>{"/x/b.jsonl"});
}

TEST(RecipeQat, NestedWeightAndActivationKeysReachTheirFields) {
  TempDir dir;
  const std::string path = dir.write(
      "x.yaml",
      "quant: qat\nqat:\n  weights:\n    bits: 3\n    symmetric: false\n    granularity: "
      "per_channel\n"
      "    observer: moving_average\n    learned_scale: true\n  activations:\n    format: "
      "fp8_e4m3\n"
      "    bits: 8\n    granularity: per_group\n    group_size: 128\n    observer: minmax\n"
      "  start_step: 50\n  target_modules: [q_proj]\nlora:\n  dropout: 0\n");
  const Recipe recipe = load_recipe(path, {});
  EXPECT_EQ(recipe.qat.weights.bits, 3);
  EXPECT_FALSE(recipe.qat.weights.symmetric);
  EXPECT_EQ(recipe.qat.weights.granularity, "per_channel");
  EXPECT_EQ(recipe.qat.weights.observer, "moving_average");
  EXPECT_TRUE(recipe.qat.weights.learned_scale);
  EXPECT_EQ(recipe.qat.weights.group_size, 32);
  EXPECT_EQ(recipe.qat.activations.format, qat::QuantFormat::kFp8E4m3);
  EXPECT_EQ(recipe.qat.activations.bits, 8);
  EXPECT_EQ(recipe.qat.activations.granularity, "per_group");
  EXPECT_EQ(recipe.qat.activations.group_size, 128);
  EXPECT_EQ(recipe.qat.activations.observer, "minmax");
  EXPECT_EQ(recipe.qat.start_step, 50);
  EXPECT_EQ(recipe.qat.target_modules, std::vector<std::string>{"q_proj"});

  EXPECT_EQ(file_error(dir, "x.yaml", "qat:\n  weigths:\n    bits: 4\n"),
            "x.yaml:2: unknown key 'qat.weigths' (did you mean 'qat.weights'?)");
  EXPECT_EQ(file_error(dir, "x.yaml", "qat:\n  weights:\n    bitz: 4\n"),
            "x.yaml:3: unknown key 'qat.weights.bitz' (did you mean 'qat.weights.bits'?)");
  EXPECT_EQ(file_error(dir, "x.yaml", "qat:\n  weights:\n    granularity: per_token\n"),
            "x.yaml:3: 'qat.weights.granularity' must be one of per_tensor, per_channel, per_group, got 'per_token'");
}

const RecipeKey& recipe_key(const std::string& name) {
  const auto& keys = recipe_keys();
  const auto found = std::find_if(keys.begin(), keys.end(), [&](const RecipeKey& key) { return key.name == name; });
  if (found == keys.end()) throw std::runtime_error("no recipe key " + name);
  return *found;
}

// The enum keys' choices are their tables' names (quant_methods(), base_quantization_names(),
// qat::quant_formats()), as the docs list them, fp4_e2m1 included.
TEST(RecipeEnums, ChoicesAreTheTablesNames) {
  using Names = std::vector<std::string>;
  EXPECT_EQ(recipe_key("quant").choices, (Names{"qlora", "qat", "none"}));
  EXPECT_EQ(recipe_key("qlora.quant_type").choices, (Names{"nf4", "fp4", "int8", "fp8"}));
  EXPECT_EQ(recipe_key("qat.base").choices, (Names{"none", "nf4", "fp4", "int8"}));
  const Names formats = {"int", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "nf4", "fp4", "gguf"};
  EXPECT_EQ(recipe_key("qat.weights.format").choices, formats);
  EXPECT_EQ(recipe_key("qat.activations.format").choices, Names(formats.begin(), formats.end() - 1));  // gguf: weights only
  EXPECT_EQ(qat::quant_formats().size(), formats.size());
  // Every named kind has its behaviour row, in the same order.
  ASSERT_EQ(base_quantizations().size(), base_quantization_names().size());
  for (size_t index = 0; index < base_quantizations().size(); ++index) {
    EXPECT_EQ(base_quantizations()[index].kind, base_quantization_names()[index].kind);
  }
}

// Each name parses to its value, prints back as the same name, and --set takes it like a file.
TEST(RecipeEnums, NamesParseToTheirValuesAndPrintBack) {
  for (const auto& [method, name] : std::vector<std::pair<QuantMethod, std::string>>{
           {QuantMethod::kQlora, "qlora"}, {QuantMethod::kQat, "qat"}, {QuantMethod::kNone, "none"}}) {
    EXPECT_EQ(apply_override(default_recipe(), "quant=" + name).quant, method) << name;
    EXPECT_EQ(quant_method_name(method), name);
  }
  for (const auto& row : base_quantization_names()) {
    if (row.qlora_quant_type) {
      EXPECT_EQ(apply_override(default_recipe(), "qlora.quant_type=" + std::string(row.name)).qlora.quant_type, row.kind);
    }
    if (row.qat_base) EXPECT_EQ(apply_override(default_recipe(), "qat.base=" + std::string(row.name)).qat.base, row.kind);
  }
  const auto recipe = load_recipe("", {"quant=qat", "lora.dropout=0", "qat.weights.format=fp4_e2m1", "qat.base=int8",
                                       "qlora.quant_type=fp4", "qat.activations.format=nf4"});
  EXPECT_EQ(recipe.qat.weights.format, qat::QuantFormat::kFp4E2m1);
  EXPECT_EQ(recipe.qat.activations.format, qat::QuantFormat::kNf4);
  const std::string yaml = recipe_to_yaml(recipe);
  for (const char* line : {"\nquant: qat ", "  quant_type: fp4 ", "    format: fp4_e2m1 ", "    format: nf4 ", "  base: int8 "}) {
    EXPECT_NE(yaml.find(line), std::string::npos) << line << " in\n" << yaml;
  }
  EXPECT_EQ(recipe_differences(default_recipe(), recipe).front().text, "quant: qlora -> qat");
}

// qat.weights and qat.activations are one list of keys (zero_point_domain only for weights), in
// the same order, each reaching its own quantizer.
TEST(RecipeEnums, QuantizerSectionsHaveTheSameKeys) {
  std::vector<std::string> weights, activations;
  for (const auto& key : recipe_keys()) {
    if (key.name.rfind("qat.weights.", 0) == 0) weights.push_back(key.name.substr(std::string("qat.weights.").size()));
    if (key.name.rfind("qat.activations.", 0) == 0) {
      activations.push_back(key.name.substr(std::string("qat.activations.").size()));
    }
  }
  EXPECT_EQ(weights, (std::vector<std::string>{"format", "bits", "symmetric", "granularity", "group_size", "scale_dtype",
                                                "zero_point_domain", "scheme", "gguf_type", "observer", "momentum",
                                                "learned_scale", "learned_scale_init"}));
  weights.erase(std::find(weights.begin(), weights.end(), "zero_point_domain"));  // weight grids only
  weights.erase(std::find(weights.begin(), weights.end(), "scheme"));
  weights.erase(std::find(weights.begin(), weights.end(), "gguf_type"));
  EXPECT_EQ(weights, activations);
  const auto recipe = load_recipe("", {"qat.weights.format=fp8_e5m2", "qat.activations.momentum=0.5"});
  EXPECT_EQ(recipe.qat.weights.format, qat::QuantFormat::kFp8E5m2);
  EXPECT_EQ(recipe.qat.activations.format, qat::QuantFormat::kInt);
  EXPECT_EQ(recipe.qat.activations.momentum, 0.5);
  EXPECT_EQ(recipe.qat.weights.momentum, 0.01);
}

// One table of export formats: the recipe's export.formats accepts exactly its names, and an
// unknown name is an error listing them.
TEST(ExportFormats, TheRecipeAndTheCommandsReadOneTable) {
  const auto& keys = recipe_keys();
  const auto formats = std::find_if(keys.begin(), keys.end(), [](const RecipeKey& key) { return key.name == "export.formats"; });
  ASSERT_NE(formats, keys.end());
  EXPECT_EQ(formats->choices, export_format_names());
  EXPECT_TRUE(find_export_format("gguf", "--format").single_file);
  EXPECT_FALSE(find_export_format("safetensors-int", "--format").accepts(ExportedWeights::kFloat));
  EXPECT_TRUE(find_export_format("merged", "--format").accepts(ExportedWeights::kFloat));
  try {
    find_export_format("onnx", "--format");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("--format: unknown format 'onnx'"), std::string::npos) << message;
    for (const auto& name : export_format_names()) EXPECT_NE(message.find(name), std::string::npos) << message;
  }
}

// Each format is a row and a writer: the formats a float model cannot fill are named from the
// rows, peft alone has no writer here (the adapter is its own), and gguf alone checks a run
// before it trains.
TEST(ExportFormats, EachFormatIsARowWithItsWriter) {
  ASSERT_EQ(export_formats().size(), 5u);
  EXPECT_EQ(export_formats_refusing(ExportedWeights::kFloat), "safetensors-int");
  EXPECT_EQ(export_formats_refusing(ExportedWeights::kQatCodes), "");
  for (const auto& row : export_formats()) {
    SCOPED_TRACE(row.name);
    const auto& writer = export_writer(row.format);
    EXPECT_EQ(writer.write == nullptr, row.format == ExportFormat::kPeft);
    EXPECT_EQ(writer.preflight != nullptr, row.format == ExportFormat::kGguf);
  }
}

}  // namespace
}  // namespace qtrain::trainer

