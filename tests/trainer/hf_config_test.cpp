// config.json in both transformers generations, and the errors a user sees for bad ones.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "support.h"
#include "trainer/formats/hf_config.h"

namespace qtrain::trainer {
namespace {

using nlohmann::json;

json fixture_config() {
  std::ifstream file(testing::fixture("tiny-llama/config.json"));
  return json::parse(file);
}

void write_config(const testing::TempDir& directory, const std::string& text) {
  std::ofstream(directory.file("config.json")) << text;
}

std::string error_of(const std::string& text) {
  testing::TempDir directory;
  write_config(directory, text);
  return testing::error_message([&] { read_hf_config(directory.path()); });
}

TEST(HfConfig, ReadsTheFixtureModel) {
  const auto config = read_hf_config(testing::fixture("tiny-llama"));
  EXPECT_EQ(config.architecture, "LlamaForCausalLM");
  EXPECT_EQ(config.llama.num_hidden_layers, 4);
  EXPECT_EQ(config.llama.hidden_size, 256);
  EXPECT_EQ(config.llama.num_attention_heads, 8);
  EXPECT_EQ(config.llama.num_key_value_heads, 2);
  EXPECT_EQ(config.llama.head_dim, 32);
  EXPECT_EQ(config.llama.vocab_size, 8192);
  EXPECT_DOUBLE_EQ(config.llama.rope.theta, 500000.0);
  EXPECT_EQ(config.llama.rope.type, RopeType::kDefault);
  EXPECT_EQ(config.stored_dtype, torch::kBFloat16);
  EXPECT_EQ(config.bos_token_id, 0);
  EXPECT_EQ(config.eos_token_ids, std::vector<int64_t>{4});
}

TEST(HfConfig, Transformers4KeysGiveTheSameModel) {
  auto config = fixture_config();
  config.erase("rope_parameters");
  config.erase("dtype");
  config["rope_theta"] = 500000.0;
  config["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                            {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  config["torch_dtype"] = "float16";
  config["eos_token_id"] = {4, 1};
  testing::TempDir directory;
  write_config(directory, config.dump());
  const auto parsed = read_hf_config(directory.path());
  EXPECT_DOUBLE_EQ(parsed.llama.rope.theta, 500000.0);
  EXPECT_EQ(parsed.llama.rope.type, RopeType::kLlama3);
  EXPECT_DOUBLE_EQ(parsed.llama.rope.factor, 8.0);
  EXPECT_EQ(parsed.llama.rope.original_max_position_embeddings, 8192);
  EXPECT_EQ(parsed.stored_dtype, torch::kFloat16);
  EXPECT_EQ(parsed.eos_token_ids, (std::vector<int64_t>{4, 1}));
}

TEST(HfConfig, HeadDimDefaultsToHiddenOverHeads) {
  auto config = fixture_config();
  config.erase("head_dim");
  config.erase("num_key_value_heads");
  testing::TempDir directory;
  write_config(directory, config.dump());
  const auto parsed = read_hf_config(directory.path());
  EXPECT_EQ(parsed.llama.head_dim, 32);
  EXPECT_EQ(parsed.llama.num_key_value_heads, 8);
}

TEST(HfConfig, UnsupportedArchitectureIsNamed) {
  auto config = fixture_config();
  config["architectures"] = {"DeepseekV3ForCausalLM"};
  const auto message = error_of(config.dump());
  EXPECT_NE(message.find("unsupported architecture 'DeepseekV3ForCausalLM'"), std::string::npos) << message;
  EXPECT_NE(message.find("Qwen3MoeForCausalLM, MixtralForCausalLM, GptOssForCausalLM"), std::string::npos) << message;
}

TEST(HfConfig, ErrorsNameTheFileAndTheKey) {
  auto missing = fixture_config();
  missing.erase("hidden_size");
  auto message = error_of(missing.dump());
  EXPECT_NE(message.find("config.json"), std::string::npos) << message;
  EXPECT_NE(message.find("'hidden_size'"), std::string::npos) << message;

  auto wrong_type = fixture_config();
  wrong_type["num_hidden_layers"] = "four";
  EXPECT_NE(error_of(wrong_type.dump()).find("'num_hidden_layers' must be a positive integer"), std::string::npos);

  auto bad_heads = fixture_config();
  bad_heads["num_key_value_heads"] = 3;
  EXPECT_NE(error_of(bad_heads.dump()).find("multiple of num_key_value_heads"), std::string::npos);

  auto bad_rope = fixture_config();
  bad_rope["rope_parameters"] = {{"rope_type", "ntk-by-parts"}, {"rope_theta", 1e4}, {"factor", 2.0}};
  EXPECT_NE(error_of(bad_rope.dump()).find("rope type 'ntk-by-parts' is not supported"), std::string::npos);
  auto yarn = fixture_config();  // YaRN (gpt-oss) needs its pre-training context
  yarn["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e4}, {"factor", 2.0}};
  EXPECT_NE(error_of(yarn.dump()).find("rope type 'yarn' needs 'original_max_position_embeddings'"), std::string::npos);
}

TEST(HfConfig, MalformedJsonIsAnErrorNotACrash) {
  for (const std::string text : {"", "{", "[1, 2]", "{\"architectures\": 7}", "null", "\"text\""}) {
    EXPECT_NE(error_of(text).find("config.json"), std::string::npos) << text;
  }
  testing::TempDir empty;
  EXPECT_THROW(read_hf_config(empty.path()), Error);
}

}  // namespace
}  // namespace qtrain::trainer
