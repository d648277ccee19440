// The qtrain executable as a user runs it: subcommands, --help, results and error messages.
#include <gtest/gtest.h>

#include <filesystem>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include "support.h"
#include "trainer/formats/safetensors.h"
#include "trainer/formats/training_checkpoint.h"

namespace qtrain {
namespace {

using testing::CommandResult;
using testing::fixture;
using testing::run_command;

using testing::qtrain;

std::string last_line(const std::string& output) {
  auto end = output.find_last_not_of('\n');
  if (end == std::string::npos) return "";
  auto begin = output.rfind('\n', end);
  return output.substr(begin == std::string::npos ? 0 : begin + 1, end - (begin == std::string::npos ? 0 : begin + 1) + 1);
}

// `qtrain generate --json` prints its JSON object first (stdout), its speed after (stderr).
nlohmann::json first_line_json(const CommandResult& result) {
  return nlohmann::json::parse(result.output.substr(0, result.output.find('\n')));
}

// Two training steps of a shipped recipe, written to run_dir.
CommandResult train_two_steps(const std::string& recipe, const std::string& run_dir, const std::string& extra = "") {
  return qtrain("--recipe " + testing::source_dir() + "/recipes/" + recipe +
                " --set train.steps=2 --set eval.max_batches=1 --set log.every=1 --set train.output_dir=" + run_dir +
                extra);
}

// A user-facing error: exit status 2, a single line that says qtrain and error, never an abort.
void expect_user_error(const CommandResult& result, const std::string& mentions) {
  EXPECT_EQ(result.status, 2) << result.output;
  EXPECT_NE(result.output.find(mentions), std::string::npos) << result.output;
  EXPECT_EQ(result.output.find("terminate called"), std::string::npos) << result.output;
  EXPECT_EQ(std::count(result.output.begin(), result.output.end(), '\n'), 1) << result.output;
}

TEST(Cli, HelpListsTheCommands) {
  auto result = qtrain("--help");
  EXPECT_EQ(result.status, 0);
  for (const char* command : {"train", "eval", "generate", "tokenize", "inspect", "export"}) {
    EXPECT_NE(result.output.find(command), std::string::npos) << command;
  }
}

TEST(Cli, SubcommandHelpListsEveryOptionWithItsDefault) {
  auto result = qtrain("eval --help");
  EXPECT_EQ(result.status, 0);
  for (const char* option : {"--model", "--data", "--adapter", "--max-seq-len arg (=2048)", "--batch-size arg (=8)",
                             "--dtype arg (=fp32)", "--device arg (=auto)", "--json"}) {
    EXPECT_NE(result.output.find(option), std::string::npos) << option << "\n" << result.output;
  }
  for (const char* command : {"train --help", "tokenize --help", "inspect --help", "export --help"}) {
    EXPECT_EQ(qtrain(command).status, 0) << command;
  }
}

TEST(Cli, EvalLossOnTokenIdsEqualsTransformers) {
  auto reference = trainer::SafetensorsFile::open(fixture("tiny-llama-reference.safetensors"));
  auto input_ids = reference.tensor("base.input_ids");
  testing::TempDir directory;
  {
    std::ofstream data(directory.file("ids.jsonl"));
    for (int64_t row = 0; row < input_ids.size(0); ++row) {
      auto ids = input_ids[row];
      std::vector<int64_t> values(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
      data << nlohmann::json{{"input_ids", values}}.dump() << "\n";
    }
  }
  auto result = qtrain("eval --model " + fixture("tiny-llama") + " --data " + directory.file("ids.jsonl") +
                       " --device cpu --batch-size 1 --json");
  ASSERT_EQ(result.status, 0) << result.output;
  auto summary = nlohmann::json::parse(last_line(result.output));
  const double expected = reference.tensor("base.loss").item<double>();
  EXPECT_NEAR(summary["loss"].get<double>(), expected, 1e-6 * expected);
  EXPECT_EQ(summary["tokens"].get<int64_t>(), 2 * 47);
  EXPECT_NEAR(summary["perplexity"].get<double>(), std::exp(expected), 1e-4);
}

TEST(Cli, TokenizeGivesTheTokenizersLibrarysIds) {
  std::ifstream file(fixture("tokenizer-reference.json"));
  const auto cases = nlohmann::json::parse(file);
  testing::TempDir directory;
  {
    std::ofstream input(directory.file("texts.jsonl"));
    for (const auto& item : cases) input << nlohmann::json{{"text", item["text"]}}.dump() << "\n";
  }
  for (const bool special : {true, false}) {
    auto result = run_command(testing::qtrain_binary() + " tokenize --model " + fixture("tiny-llama") +
                              (special ? "" : " --no-special") + " < " + directory.file("texts.jsonl"));
    ASSERT_EQ(result.status, 0) << result.output;
    std::istringstream lines(result.output);
    std::string line;
    for (const auto& item : cases) {
      ASSERT_TRUE(std::getline(lines, line));
      EXPECT_EQ(nlohmann::json::parse(line)["ids"], item[special ? "ids" : "ids_no_special"]) << item["text"];
    }
  }
}

TEST(Cli, DecodeInvertsTokenize) {
  testing::TempDir directory;
  std::ofstream(directory.file("in.jsonl")) << "{\"text\": \"The jury said, in 1961: \\\"fine\\\".\"}\n";
  const auto model = " --model " + fixture("tiny-llama");
  auto result = run_command(testing::qtrain_binary() + " tokenize --no-special" + model + " < " +
                            directory.file("in.jsonl") + " | " + testing::qtrain_binary() + " tokenize --decode" + model);
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_EQ(nlohmann::json::parse(result.output)["text"], "The jury said, in 1961: \"fine\".");
}

TEST(Cli, InspectDescribesTheModel) {
  auto result = qtrain("inspect --model " + fixture("tiny-llama"));
  ASSERT_EQ(result.status, 0) << result.output;
  for (const char* fact : {"LlamaForCausalLM", "layers       4", "8 heads, 2 KV heads (GQA)", "head_dim 32",
                           "theta 500000", "qlora", "lora", "full", "BF16"}) {
    EXPECT_NE(result.output.find(fact), std::string::npos) << fact << "\n" << result.output;
  }
}

// Gemma's switches, each from the fixture's config.json.
TEST(Cli, InspectDescribesGemmasBlock) {
  auto result = qtrain("inspect --model " + fixture("families/gemma2"));
  ASSERT_EQ(result.status, 0) << result.output;
  for (const char* fact : {"Gemma2ForCausalLM", "sliding window of 32 keys in 1 of 2 layers", "scores scaled by 16^-1/2",
                           "scores soft-capped at 50", "RMSNorm x (1 + w), 4 norms per layer, GeGLU",
                           "logits soft-capped at 30"}) {
    EXPECT_NE(result.output.find(fact), std::string::npos) << fact << "\n" << result.output;
  }
  result = qtrain("inspect --model " + fixture("families/gemma3"));
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("sliding layers: theta 10000"), std::string::npos) << result.output;
  EXPECT_EQ(result.output.find("soft-capped"), std::string::npos) << result.output;
}

// Phi-3's fused projections, and Phi-4-mini's partial rotary with a 128k model's longrope, from a
// copy of the fixture whose config.json says so; the recipe's estimate runs with the fused targets.
TEST(Cli, InspectDescribesPhi3sBlock) {
  testing::TempDir directory;
  std::filesystem::copy(fixture("families/phi3"), directory.file("phi3"));
  auto config = nlohmann::json::parse(std::ifstream(directory.file("phi3/config.json")));
  config["rope_parameters"] = {{"rope_type", "longrope"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5},
                               {"short_factor", {1.0, 1.0, 1.0, 1.0}}, {"long_factor", {1.0, 2.0, 4.0, 8.0}},
                               {"original_max_position_embeddings", 256}};
  std::ofstream(directory.file("phi3/config.json")) << config.dump();
  auto result = qtrain("inspect --recipe " + testing::source_dir() + "/recipes/qlora_phi3.yaml --set model.path=" +
                       directory.file("phi3"));
  ASSERT_EQ(result.status, 0) << result.output;
  // attention factor sqrt(1 + ln(512 / 256) / ln(256))
  for (const char* fact : {"Phi3ForCausalLM", "q, k and v from one qkv_proj; gate and up from one gate_up_proj",
                           "rotary on 8 of each head's 16 dimensions (partial_rotary_factor 0.5)",
                           "longrope: short factors to position 256, long ones past it; cos and sin x 1.06066"}) {
    EXPECT_NE(result.output.find(fact), std::string::npos) << fact << "\n" << result.output;
  }
}

TEST(Cli, PrintRecipeParsesBackToTheSameRecipe) {
  auto first = qtrain("--recipe " + testing::source_dir() + "/recipes/demo_tiny.yaml --set optim.lr=0.001 --print-recipe");
  ASSERT_EQ(first.status, 0) << first.output;
  testing::TempDir directory;
  std::ofstream(directory.file("resolved.yaml")) << first.output;
  auto second = qtrain("train --recipe " + directory.file("resolved.yaml") + " --print-recipe");
  ASSERT_EQ(second.status, 0) << second.output;
  EXPECT_EQ(first.output, second.output);
}

TEST(Cli, TrainWritesTheRunDirectoryAndAnAdapterThatEvalApplies) {
  testing::TempDir run;
  auto trained = train_two_steps("demo_tiny.yaml", run.path(), " --set data.max_seq_len=64");
  ASSERT_EQ(trained.status, 0) << trained.output;
  EXPECT_NE(trained.output.find("step 2/2 | loss "), std::string::npos) << trained.output;
  auto evaluated = qtrain("eval --model " + testing::source_dir() + "/recipes/demo/tiny-llama --data " +
                          testing::source_dir() + "/recipes/demo/brown-val.jsonl --max-seq-len 64 --max-batches 1 --device cpu --adapter " +
                          run.file("adapter"));
  EXPECT_EQ(evaluated.status, 0) << evaluated.output;

  auto exported = qtrain("export --run " + run.path() + " --format peft --out " + run.file("exported"));
  ASSERT_EQ(exported.status, 0) << exported.output;
  EXPECT_TRUE(std::ifstream(run.file("exported/adapter_model.safetensors")).good());
  expect_user_error(qtrain("export --run " + run.path() + " --format peft --out " + run.file("exported")),
                    "already exists");
  EXPECT_EQ(qtrain("export --run " + run.path() + " --out " + run.file("exported") + " --force").status, 0);
  // The final step's training-state checkpoint exports the same adapter, byte for byte.
  auto from_checkpoint =
      qtrain("export --run " + run.path() + " --checkpoint step-000002 --out " + run.file("from-checkpoint"));
  ASSERT_EQ(from_checkpoint.status, 0) << from_checkpoint.output;
  const auto bytes_of = [](const std::string& path) {
    std::ifstream input(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(input), std::istreambuf_iterator<char>());
  };
  EXPECT_EQ(bytes_of(run.file("from-checkpoint/adapter_model.safetensors")),
            bytes_of(run.file("exported/adapter_model.safetensors")));
  expect_user_error(qtrain("export --run " + run.path() + " --format safetensors-int --out " + run.file("int")),
                    "was not trained with quant: qat");
  expect_user_error(qtrain("export --run " + run.path() + " --format merged --gguf-type Q4_K_M --out " + run.file("m")),
                    "--gguf-type goes with --format gguf");
  expect_user_error(qtrain("export --run " + run.path() + " --format gguf --gguf-type Q4_K_X --out " + run.file("g")),
                    "Q4_K_M");
}

// `qtrain quantize --run` starts from the run's float model. For a 16-bit base that trained on FP8
// tensor cores (qlora.fp8_compute with quant: none) that is the 16-bit base with the adapter, as
// the run's merged export holds it, not the e4m3 rows it multiplied by (0.002 off in loss here).
TEST(Cli, QuantizingARunThatTrainedOnFloat8StartsFromItsSixteenBitBase) {
  testing::TempDir run;
  auto trained = train_two_steps("demo_tiny.yaml", run.path(),
                                 " --set data.max_seq_len=64 --set quant=none --set qlora.fp8_compute=true --set lora.dropout=0");
  ASSERT_EQ(trained.status, 0) << trained.output;
  auto exported = qtrain("export --run " + run.path() + " --format merged --dtype fp32 --out " + run.file("merged"));
  ASSERT_EQ(exported.status, 0) << exported.output;
  const std::string recipe = "quantize --recipe " + testing::source_dir() + "/recipes/demo_qat_tiny.yaml --set eval.max_batches=2";
  auto from_run = qtrain(recipe + " --run " + run.path() + " --out " + run.file("from-run"));
  auto from_merged = qtrain(recipe + " --model " + run.file("merged") + " --out " + run.file("from-merged"));
  ASSERT_EQ(from_run.status, 0) << from_run.output;
  ASSERT_EQ(from_merged.status, 0) << from_merged.output;
  const auto float_loss = [](const std::string& output) {
    const auto at = output.find("eval float:");
    if (at == std::string::npos) return -1.0;
    return std::stod(output.substr(output.find("loss", at) + 4));
  };
  const double merged = float_loss(from_merged.output);
  ASSERT_GT(merged, 0) << from_merged.output;
  // The adapter beside the base against it merged in: fp32 rounding apart.
  EXPECT_NEAR(float_loss(from_run.output), merged, 1e-5 * merged) << from_run.output;
}

TEST(Cli, MergedExportOfARunGeneratesLikeTheRunsModel) {
  testing::TempDir run;
  auto trained = train_two_steps("demo_tiny.yaml", run.path(), " --set data.max_seq_len=64");
  ASSERT_EQ(trained.status, 0) << trained.output;
  auto exported = qtrain("export --run " + run.path() + " --format merged --dtype fp32 --out " + run.file("merged"));
  ASSERT_EQ(exported.status, 0) << exported.output;
  for (const char* file : {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"}) {
    EXPECT_TRUE(std::ifstream(run.file(std::string("merged/") + file)).good()) << file;
  }
  expect_user_error(qtrain("export --run " + run.path() + " --format merged --out " + run.file("merged")),
                    "already exists");

  // Greedy text of the merged model equals that of the base with the adapter beside it, when
  // both merge the same (unquantized) base: --model + --adapter is that export.
  const std::string base = testing::source_dir() + "/recipes/demo/tiny-llama";
  auto merged_plain = qtrain("export --model " + base + " --adapter " + run.file("adapter") +
                             " --format merged --dtype fp32 --out " + run.file("merged-plain"));
  ASSERT_EQ(merged_plain.status, 0) << merged_plain.output;
  const std::string prompt = " --prompt 'The jury said' --max-new-tokens 12 --device cpu --json";
  auto from_merged = qtrain("generate --model " + run.file("merged-plain") + prompt);
  auto from_adapter = qtrain("generate --model " + base + " --adapter " + run.file("adapter") + prompt);
  ASSERT_EQ(from_merged.status, 0) << from_merged.output;
  ASSERT_EQ(from_adapter.status, 0) << from_adapter.output;
  const auto merged_tokens = first_line_json(from_merged).at("tokens");
  EXPECT_EQ(merged_tokens, first_line_json(from_adapter).at("tokens"));
  EXPECT_EQ(merged_tokens.size(), 12u);
}

TEST(Cli, GenerateStreamsTextAndReportsItsSpeed) {
  const std::string model = testing::source_dir() + "/recipes/demo/tiny-llama";
  testing::TempDir temp;
  auto streamed = run_command(testing::qtrain_binary() + " generate --model " + model +
                              " --prompt 'The jury said' --max-new-tokens 8 --device cpu 2>" + temp.file("stderr"));
  ASSERT_EQ(streamed.status, 0) << streamed.output;
  auto as_json = qtrain("generate --model " + model + " --prompt 'The jury said' --max-new-tokens 8 --device cpu --json");
  ASSERT_EQ(as_json.status, 0) << as_json.output;
  const auto result = first_line_json(as_json);
  EXPECT_EQ(streamed.output, result.at("text").get<std::string>() + "\n");
  std::ifstream stderr_file(temp.file("stderr"));
  const std::string speed((std::istreambuf_iterator<char>(stderr_file)), std::istreambuf_iterator<char>());
  EXPECT_NE(speed.find("tokens/s on cpu"), std::string::npos) << speed;

  const std::string chat = temp.write("chat.jsonl", R"({"messages": [{"role": "user", "content": "Hello"}]})" "\n");
  auto chatted = qtrain("generate --model " + model + " --chat " + chat + " --max-new-tokens 4 --device cpu --json");
  ASSERT_EQ(chatted.status, 0) << chatted.output;
  const auto chat_result = first_line_json(chatted);
  EXPECT_EQ(chat_result.at("prompt_tokens").at(0), 0) << "the template's BOS";
  auto sampled = qtrain("generate --model " + model + " --prompt 'The' --temperature 0.8 --top-p 0.9 --seed 3 "
                        "--max-new-tokens 8 --device cpu --json");
  auto sampled_again = qtrain("generate --model " + model + " --prompt 'The' --temperature 0.8 --top-p 0.9 --seed 3 "
                              "--max-new-tokens 8 --device cpu --json");
  EXPECT_EQ(first_line_json(sampled).at("tokens"), first_line_json(sampled_again).at("tokens")) << "the same seed";
  expect_user_error(qtrain("generate --model " + model + " --device cpu"), "--prompt");
  expect_user_error(qtrain("generate --model " + model + " --prompt x --temperature -1 --device cpu"), "--temperature");
}

TEST(Cli, DataShowsWhatTheLossSeesAsTextAndAsJson) {
  const std::string recipe = " --recipe " + testing::source_dir() + "/recipes/demo_chat.yaml";
  auto text = qtrain("data" + recipe + " -n 1");
  ASSERT_EQ(text.status, 0) << text.output;
  EXPECT_NE(text.output.find("[[<|begin_of_text|><|start_header_id|>system"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("packed into"), std::string::npos) << text.output;

  auto json = run_command(testing::qtrain_binary() + " data" + recipe + " -n 2 --json 2>/dev/null");
  ASSERT_EQ(json.status, 0) << json.output;
  std::istringstream lines(json.output);
  std::string line;
  int examples = 0;
  for (; std::getline(lines, line); ++examples) {
    const auto example = nlohmann::json::parse(line);
    const auto labels = example["labels"].get<std::vector<int64_t>>();
    ASSERT_EQ(labels.size(), example["input_ids"].size());
    EXPECT_GT(std::count(labels.begin(), labels.end(), -100), 0);
    EXPECT_LT(std::count(labels.begin(), labels.end(), -100), static_cast<long>(labels.size()));
    EXPECT_TRUE(example.contains("sample_lengths"));
  }
  EXPECT_EQ(examples, 2);
}

// Two alpaca records and the demo recipe's micro-batch of 4: showing them does not depend on the
// batch size, and training takes the two as one batch.
TEST(Cli, TwoExamplesShowAndTrainWithAMicroBatchOfFour) {
  testing::TempDir directory;
  {
    std::ofstream data(directory.file("two.jsonl"));
    data << R"({"instruction": "Name a colour.", "input": "", "output": "Blue."})" << "\n"
         << R"({"instruction": "Add the numbers.", "input": "2 and 3", "output": "5."})" << "\n";
  }
  const std::string recipe = " --recipe " + testing::source_dir() + "/recipes/demo_tiny.yaml --set data.format=instruct" +
                             " --set data.train=" + directory.file("two.jsonl") + " --set data.eval=";
  auto shown = qtrain("data" + recipe + " -n 1");
  ASSERT_EQ(shown.status, 0) << shown.output;
  EXPECT_TRUE(shown.output.find("Name a colour.") != std::string::npos ||
              shown.output.find("Add the numbers.") != std::string::npos)
      << shown.output;
  auto trained = qtrain("train" + recipe + " --set train.steps=2 --set checkpoint.every=0 --set train.output_dir=" +
                        directory.file("run"));
  ASSERT_EQ(trained.status, 0) << trained.output;
  EXPECT_NE(trained.output.find("1 batches of 2 per epoch"), std::string::npos) << trained.output;
  EXPECT_NE(trained.output.find("fewer examples than one micro-batch of 4"), std::string::npos) << trained.output;
  EXPECT_NE(trained.output.find("done: 2 steps"), std::string::npos) << trained.output;
}

TEST(Cli, TokenizeWritesATokenFileThatTrainingReads) {
  testing::TempDir directory;
  const std::string model = testing::source_dir() + "/recipes/demo/tiny-llama";
  auto tokenized = qtrain("tokenize --model " + model + " --data " + testing::source_dir() +
                          "/recipes/demo/brown-val.jsonl --out " + directory.file("val.bin"));
  ASSERT_EQ(tokenized.status, 0) << tokenized.output;
  EXPECT_NE(tokenized.output.find("12 samples from 12 records"), std::string::npos) << tokenized.output;
  auto shown = qtrain("data --recipe " + testing::source_dir() + "/recipes/demo_tiny.yaml --set data.format=tokens" +
                      " --set data.train=" + directory.file("val.bin") + " -n 1");
  ASSERT_EQ(shown.status, 0) << shown.output;
  EXPECT_NE(shown.output.find("from 12 records in 1 file"), std::string::npos) << shown.output;
  auto trained = qtrain("--recipe " + testing::source_dir() + "/recipes/demo_tiny.yaml --set data.format=tokens" +
                        " --set data.train=" + directory.file("val.bin") + " --set data.eval= --set train.steps=1" +
                        " --set train.output_dir=" + directory.file("run"));
  EXPECT_EQ(trained.status, 0) << trained.output;
  std::ofstream(directory.file("bad.bin")) << "not a token file";
  expect_user_error(qtrain("data --recipe " + testing::source_dir() + "/recipes/demo_tiny.yaml --set data.format=tokens" +
                           " --set data.train=" + directory.file("bad.bin")),
                    "bad.bin");
}

TEST(Cli, ChatDataTrainsPacked) {
  testing::TempDir run;
  auto trained = train_two_steps("demo_chat.yaml", run.path());
  ASSERT_EQ(trained.status, 0) << trained.output;
  EXPECT_NE(trained.output.find("step 2/2 | loss "), std::string::npos) << trained.output;
}

// The command of a long CPU run that writes a checkpoint after every step.
std::string checkpointing_run(const std::string& run_dir) {
  return testing::qtrain_binary() + " --recipe " + testing::source_dir() + "/recipes/demo_tiny.yaml" +
         " --set data.train=" + testing::source_dir() + "/recipes/demo/brown-val.jsonl --set data.eval=" +
         " --set data.max_seq_len=32 --set train.steps=150 --set checkpoint.every=1 --set checkpoint.keep_last=2" +
         " --set log.every=50 --set train.output_dir=" + run_dir;
}

TEST(Cli, KilledAtRandomMomentsTheRunStaysResumable) {
  testing::TempDir run;
  std::mt19937 generator(1234);
  // Moments after start-up, in the steps and the checkpoint writes (one after every step).
  std::uniform_real_distribution<double> moment(1.0, 3.0);
  for (int kill = 0; kill < 12; ++kill) {
    run_command("timeout -s KILL " + std::to_string(moment(generator)) + " " + checkpointing_run(run.path()) +
                " --resume auto >/dev/null 2>&1");
    // Whatever the moment, every checkpoint that looks complete is complete.
    for (const auto& checkpoint : trainer::list_training_checkpoints(run.path())) {
      EXPECT_NO_THROW(trainer::verify_training_checkpoint(checkpoint)) << "after kill " << kill << ": " << checkpoint;
    }
  }
  ASSERT_TRUE(trainer::newest_valid_checkpoint(run.path()).has_value());
  auto finished = run_command(checkpointing_run(run.path()) + " --resume auto 2>&1");
  EXPECT_EQ(finished.status, 0) << finished.output;
  EXPECT_NE(finished.output.find("resume: continuing from"), std::string::npos) << finished.output;
  EXPECT_NE(finished.output.find("done: 150 steps"), std::string::npos) << finished.output;
}

TEST(Cli, SigtermSavesACheckpointAndSaysHowToResume) {
  testing::TempDir run;
  // The signal goes once training has started (the "data:" line), however slow the machine.
  const std::string out = run.file("out.txt");
  auto stopped = run_command("bash -c '" + checkpointing_run(run.path()) + " --set checkpoint.every=0 > " + out +
                             " 2>&1 & pid=$!; for i in $(seq 600); do grep -q ^data: " + out +
                             " && break; sleep 0.1; done; sleep 0.5; kill -TERM $pid; wait $pid; echo status=$?; cat " +
                             out + "'");
  EXPECT_NE(stopped.output.find("status=0"), std::string::npos) << stopped.output;
  EXPECT_NE(stopped.output.find("stopped after step"), std::string::npos) << stopped.output;
  EXPECT_NE(stopped.output.find("--resume auto"), std::string::npos) << stopped.output;
  const auto newest = trainer::newest_valid_checkpoint(run.path());
  ASSERT_TRUE(newest.has_value()) << stopped.output;
}

TEST(Cli, BadInputIsOneLineAndExitStatus2) {
  testing::TempDir directory;
  expect_user_error(qtrain("eval --model " + directory.path() + " --data x.jsonl --device cpu"), directory.path());
  expect_user_error(qtrain("inspect --model /nonexistent/model"), "/nonexistent/model");
  std::ofstream(directory.file("bad.jsonl")) << "{\"text\": \"fine\"}\n[1, 2]\n";
  expect_user_error(qtrain("eval --model " + fixture("tiny-llama") + " --data " + directory.file("bad.jsonl")),
                    "bad.jsonl:2:");
  std::ofstream(directory.file("typo.yaml")) << "lora:\n  rnak: 8\n";
  expect_user_error(qtrain("--recipe " + directory.file("typo.yaml") + " --print-recipe"), "did you mean 'lora.rank'");
  expect_user_error(qtrain("eval --modle x"), "--help");
  expect_user_error(qtrain("evaluate --model x"), "unknown command 'evaluate'");
  expect_user_error(qtrain("eval --model " + fixture("tiny-llama") + " --data x.jsonl --dtype fp8"), "fp8");
  expect_user_error(qtrain("bench --shape tiny --device cpu --micro-batch 2 --packed-whole-rows 1"), "--packed-samples");
  expect_user_error(qtrain("bench --shape tiny --device cpu --micro-batch 2 --packed-samples 2 --packed-whole-rows 3"),
                    "--packed-whole-rows");
  expect_user_error(qtrain("bench --shape tiny --device cpu --token-ids-below 8193"), "8192 ids");
  expect_user_error(qtrain("bench --shape tiny --device cpu --objective orpo --precompute-reference"), "--objective dpo");
  expect_user_error(qtrain("bench --shape tiny --device cpu --memory-phases"), "GPU's allocator");
}

// One step of `qtrain bench` on the tiny shape (CPU, fp32, sequences of 32) with `flags`: its
// output and its --json object (empty, and a test failure, where it does not run).
std::pair<std::string, nlohmann::json> tiny_bench(const std::string& flags) {
  const auto result = qtrain("bench --shape tiny --device cpu --dtype fp32 --seq 32 " + flags +
                             " --steps 1 --warmup 0 --json 2>&1");
  EXPECT_EQ(result.status, 0) << result.output;
  if (result.status != 0) return {result.output, nlohmann::json::object()};
  return {result.output, nlohmann::json::parse(last_line(result.output))};
}

// bench's DPO with the reference's log-probabilities computed before the steps, as
// dpo.precompute_reference does: the steps read them, and that pass's time is reported beside.
TEST(Cli, BenchPrecomputesTheReferenceOfDpoWhenAsked) {
  const auto [output, measured] = tiny_bench("--micro-batch 2 --objective dpo --precompute-reference");
  EXPECT_NE(output.find("the reference's log-probabilities computed before the steps"), std::string::npos) << output;
  EXPECT_NE(output.find("the reference's pass before training"), std::string::npos) << output;
  EXPECT_TRUE(measured.at("precompute_reference").get<bool>());
  EXPECT_GT(measured.at("reference_seconds").get<double>(), 0);
  EXPECT_GT(measured.at("tokens_per_second").get<double>(), 0);
}

// bench's packed rows as a packed document's data has them: some rows one sample each, first.
TEST(Cli, BenchPacksWholeRowsBesideRowsOfSeveralSamples) {
  const auto [output, measured] = tiny_bench("--micro-batch 2 --packed-samples 2 --packed-whole-rows 1");
  EXPECT_NE(output.find("packed: 2 samples a sequence (the first 1 rows one sample each)"), std::string::npos) << output;
  EXPECT_EQ(measured.at("packed_whole_rows").get<int64_t>(), 1);
  EXPECT_EQ(measured.at("packed_samples").get<int64_t>(), 2);
  EXPECT_GT(measured.at("tokens_per_second").get<double>(), 0);
}

// bench's token ids from part of the vocabulary, as the real command's data on a random checkpoint
// with a small tokenizer.
TEST(Cli, BenchDrawsTokenIdsBelowABound) {
  const auto [output, measured] = tiny_bench("--micro-batch 1 --token-ids-below 100");
  EXPECT_NE(output.find("token ids drawn from [0, 100) of the 8192"), std::string::npos) << output;
  EXPECT_EQ(measured.at("token_ids_below").get<int64_t>(), 100);
}

// bench on a GPU from a fresh process: its memory plan reads the device's free and reserved memory
// before the caching allocator has made anything.
TEST(Cli, BenchRunsOnAGpuFromAFreshProcess) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  const auto result =
      qtrain("bench --shape tiny --device cuda --seq 64 --micro-batch 1 --steps 1 --warmup 0 --memory-phases --json 2>&1");
  ASSERT_EQ(result.status, 0) << result.output;
  const auto measured = nlohmann::json::parse(last_line(result.output));
  EXPECT_GT(measured.at("tokens_per_second").get<double>(), 0);
  // --memory-phases: one more step's peak by phase, in a step's order.
  EXPECT_NE(result.output.find("memory by phase"), std::string::npos) << result.output;
  std::vector<std::string> phases;
  for (const auto& phase : measured.at("memory_phases")) {
    phases.push_back(phase.at("phase").get<std::string>());
    EXPECT_GE(phase.at("peak_bytes").get<double>(), phase.at("at_start_bytes").get<double>()) << phase.dump();
  }
  EXPECT_EQ(phases, (std::vector<std::string>{"forward", "loss", "backward", "update"}));
}

}  // namespace
}  // namespace qtrain
