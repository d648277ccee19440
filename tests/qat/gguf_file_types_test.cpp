// llama.cpp's file types: the table's names and llama.h's numbers, and the type llama.cpp's
// quantizer (llama_model_quantize, default parameters) gives each tensor of small all-F32 models of
// every architecture qtrain writes, for every file type: rows that are and are not multiples of
// 256 (the K-quants' fallbacks), tied and untied embeddings, 1 to 8 query heads per kv head, 2 to
// 80 layers (the mixes' layer rules, llama's 70B rule) and experts.
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "qat/gguf_file_types.h"
#include "support.h"

namespace qtrain::qat {
namespace {

using T = GgufBlockType;

// How an architecture names and shapes a decoder's tensors (gguf-py's MODEL_TENSORS).
struct ArchitectureTensors {
  const char* architecture;
  bool fused_projections;  // phi3: attn_qkv, and ffn_up holding gate's rows then up's
  bool attention_bias;     // qwen2: attn_q / attn_k / attn_v biases
  bool query_key_norm;     // qwen3, gemma3: attn_q_norm / attn_k_norm
  bool sandwich_norms;     // gemma2, gemma3: post_attention_norm, post_ffw_norm
};

const ArchitectureTensors kArchitectures[] = {
    {"llama", false, false, false, false}, {"qwen2", false, true, false, false},  {"qwen3", false, false, true, false},
    {"phi3", true, false, false, false},   {"gemma2", false, false, false, true}, {"gemma3", false, false, true, true},
};

const ArchitectureTensors& architecture_tensors(const std::string& name) {
  for (const auto& row : kArchitectures) {
    if (name == row.architecture) return row;
  }
  throw Error(ErrorCode::kInternal, "no test tensors for architecture " + name);
}

struct TestModel {
  std::string name;
  GgufModelShape shape;
  int64_t hidden = 256;
  int64_t ffn = 256;
  int64_t head_dim = 32;
  bool tied = false;
  std::vector<std::string> file_types;  // empty: every row of the table
};

TestModel model(const std::string& architecture, int64_t hidden, int64_t layers, int64_t heads, int64_t kv_heads, bool tied) {
  TestModel test;
  test.shape = {architecture, layers, heads, kv_heads, 0};
  test.hidden = hidden;
  test.ffn = hidden;
  test.head_dim = hidden / heads;
  test.tied = tied;
  test.name = architecture + "-h" + std::to_string(hidden) + "-l" + std::to_string(layers) + "-gqa" +
              std::to_string(heads / kv_heads) + (tied ? "-tied" : "-untied");
  return test;
}

std::vector<GgufTensorShape> decoder_tensors(const TestModel& test) {
  constexpr int64_t kVocab = 32;
  const auto& architecture = architecture_tensors(test.shape.architecture);
  const int64_t hidden = test.hidden;
  const int64_t ffn = test.ffn;
  const int64_t queries = test.shape.heads * test.head_dim;
  const int64_t keys = test.shape.kv_heads * test.head_dim;
  const int64_t experts = test.shape.experts;
  std::vector<GgufTensorShape> tensors = {{"token_embd.weight", {kVocab, hidden}}, {"output_norm.weight", {hidden}}};
  if (!test.tied) tensors.push_back({"output.weight", {kVocab, hidden}});
  for (int64_t layer = 0; layer < test.shape.layers; ++layer) {
    const std::string block = "blk." + std::to_string(layer) + ".";
    auto add = [&](const std::string& name, std::vector<int64_t> shape) { tensors.push_back({block + name, std::move(shape)}); };
    add("attn_norm.weight", {hidden});
    if (architecture.fused_projections) {
      add("attn_qkv.weight", {queries + 2 * keys, hidden});
    } else {
      add("attn_q.weight", {queries, hidden});
      add("attn_k.weight", {keys, hidden});
      add("attn_v.weight", {keys, hidden});
    }
    if (architecture.attention_bias) {
      add("attn_q.bias", {queries});
      add("attn_k.bias", {keys});
      add("attn_v.bias", {keys});
    }
    if (architecture.query_key_norm) {
      add("attn_q_norm.weight", {test.head_dim});
      add("attn_k_norm.weight", {test.head_dim});
    }
    add("attn_output.weight", {hidden, queries});
    if (architecture.sandwich_norms) add("post_attention_norm.weight", {hidden});
    add("ffn_norm.weight", {hidden});
    if (experts > 0) {
      add("ffn_gate_inp.weight", {experts, hidden});
      add("ffn_gate_exps.weight", {experts, ffn, hidden});
      add("ffn_up_exps.weight", {experts, ffn, hidden});
      add("ffn_down_exps.weight", {experts, hidden, ffn});
    } else if (architecture.fused_projections) {
      add("ffn_up.weight", {2 * ffn, hidden});
      add("ffn_down.weight", {hidden, ffn});
    } else {
      add("ffn_gate.weight", {ffn, hidden});
      add("ffn_up.weight", {ffn, hidden});
      add("ffn_down.weight", {hidden, ffn});
    }
    if (architecture.sandwich_norms) add("post_ffw_norm.weight", {hidden});
  }
  return tensors;
}

// The K-quant mixes, whose rules count layers, heads and experts (the other file types give every
// tensor of a kind one type).
const std::vector<std::string> kMixes = {"Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K"};

// The mixes whose rules count layers.
const std::vector<std::string> kLayerMixes = {"Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M"};

TestModel with_file_types(TestModel test, std::vector<std::string> file_types) {
  test.file_types = std::move(file_types);
  return test;
}

// Every architecture with rows of 256 (the K-quants' own blocks); 64 and 96 (their fallbacks), 48
// and an ffn of 176 (not even 32's: F16); 2, 4, 8, 32 and 80 layers; 1, 2, 4 and 8 query heads
// per kv head; tied and untied; 4 and 8 experts. Every file type on each architecture and shape,
// the mixes alone where only the counts differ.
std::vector<TestModel> test_models() {
  std::vector<TestModel> models = {
      model("llama", 256, 4, 8, 4, false),  model("qwen2", 256, 2, 8, 8, false), model("qwen3", 256, 2, 8, 1, true),
      model("phi3", 256, 2, 8, 8, false),   model("gemma2", 256, 2, 8, 4, true), model("gemma3", 256, 2, 8, 2, true),
      model("llama", 64, 32, 4, 1, false),  model("phi3", 64, 8, 4, 2, true),    model("gemma3", 96, 2, 4, 4, false),
      model("llama", 96, 2, 4, 2, true),    model("llama", 48, 2, 2, 1, false),
      with_file_types(model("llama", 256, 8, 8, 2, true), kLayerMixes),
      with_file_types(model("qwen3", 64, 32, 8, 1, true), kMixes),
      with_file_types(model("qwen2", 96, 8, 2, 1, true), kMixes),
  };
  auto odd_ffn = model("llama", 256, 2, 8, 2, false);
  odd_ffn.ffn = 176;
  odd_ffn.name += "-ffn176";
  models.push_back(odd_ffn);
  // The 70B rule: llama's 80 layers with grouped queries and qwen2's; not llama's without, nor qwen3's.
  models.push_back(with_file_types(model("llama", 64, 80, 4, 2, false), {"Q3_K_S", "Q3_K_M"}));
  for (const auto& eighty : {model("llama", 64, 80, 2, 2, false), model("qwen2", 64, 80, 2, 2, true),
                             model("qwen3", 64, 80, 4, 2, true)}) {
    models.push_back(with_file_types(eighty, {"Q3_K_S"}));
  }
  // Experts: layers from the tensors' names, and the 8-expert rules.
  auto eight_experts = model("llama", 256, 2, 8, 2, false);
  eight_experts.shape.experts = 8;
  eight_experts.ffn = 64;
  eight_experts.name += "-experts8";
  models.push_back(eight_experts);
  auto four_experts = with_file_types(model("llama", 256, 2, 8, 2, false), {"Q2_K", "Q3_K_M", "Q4_K_M"});
  four_experts.shape.experts = 4;
  four_experts.name += "-experts4";
  models.push_back(four_experts);
  return models;
}

std::vector<std::string> file_types_of(const TestModel& test) {
  if (!test.file_types.empty()) return test.file_types;
  std::vector<std::string> names;
  for (const auto& file_type : gguf_file_types()) names.emplace_back(file_type.name);
  return names;
}

// tests/interop/llama_quantize_types.py's report on test_models(), run once for the tests that
// read it: {"llama_ftypes": {...}, "models": {name: {file type: {"file_type": n, "tensors":
// {name: type}} or {"error": ...}}}}.
struct LlamaCppReport {
  nlohmann::json json;
  std::string skip_reason;  // no Python with llama_cpp
  std::string failure;      // the script's command, status and output when it failed
};

const LlamaCppReport& llama_cpp_report() {
  static const LlamaCppReport report = [] {
    LlamaCppReport result;
    const auto python = testing::find_python_with("llama_cpp gguf numpy");
    if (python.empty()) {
      result.skip_reason = "no Python with llama_cpp and gguf: tools/setup.sh installs them";
      return result;
    }
    nlohmann::json models = nlohmann::json::array();
    for (const auto& test : test_models()) {
      nlohmann::json tensors = nlohmann::json::array();
      for (const auto& tensor : decoder_tensors(test)) tensors.push_back({{"name", tensor.name}, {"shape", tensor.shape}});
      nlohmann::json hparams = {{"block_count", test.shape.layers},       {"embedding_length", test.hidden},
                                {"feed_forward_length", test.ffn},        {"attention.head_count", test.shape.heads},
                                {"attention.head_count_kv", test.shape.kv_heads}, {"attention.key_length", test.head_dim},
                                {"attention.value_length", test.head_dim}, {"rope.dimension_count", test.head_dim}};
      if (test.shape.experts > 0) {
        hparams["expert_count"] = test.shape.experts;
        hparams["expert_used_count"] = 2;
      }
      models.push_back({{"name", test.name}, {"architecture", test.shape.architecture}, {"hparams", hparams},
                        {"tensors", tensors}, {"file_types", file_types_of(test)}});
    }
    testing::TempDir temp;
    const auto models_path = temp.write("models.json", nlohmann::json{{"models", models}}.dump());
    const std::string command = "'" + python + "' '" + testing::source_dir() + "/tests/interop/llama_quantize_types.py' types '" +
                                models_path + "' '" + temp.path() + "' 2>'" + temp.file("stderr.txt") + "'";
    const auto run = testing::run_command(command);
    const auto parsed = nlohmann::json::parse(run.output, nullptr, /*allow_exceptions=*/false);
    if (run.status != 0 || parsed.is_discarded()) {
      result.failure = command + " failed (status " + std::to_string(run.status) + "):\n" + run.output +
                       testing::read_text(temp.file("stderr.txt"));
    } else {
      result.json = parsed;
    }
    return result;
  }();
  return report;
}

TEST(GgufFileTypes, TableHoldsLlamaHsNumbersAndDefaultTypes) {
  struct Expected {
    const char* name;
    uint32_t llama_ftype;
    T base_type;
  };
  const Expected expected[] = {
      {"F32", 0, T::kF32},     {"F16", 1, T::kF16},      {"BF16", 32, T::kBF16},   {"Q8_0", 7, T::kQ8_0},
      {"Q4_0", 2, T::kQ4_0},   {"Q4_1", 3, T::kQ4_1},    {"Q5_0", 8, T::kQ5_0},    {"Q5_1", 9, T::kQ5_1},
      {"Q2_K", 10, T::kQ2_K},  {"Q3_K_S", 11, T::kQ3_K}, {"Q3_K_M", 12, T::kQ3_K}, {"Q3_K_L", 13, T::kQ3_K},
      {"Q4_K_S", 14, T::kQ4_K}, {"Q4_K_M", 15, T::kQ4_K}, {"Q5_K_S", 16, T::kQ5_K}, {"Q5_K_M", 17, T::kQ5_K},
      {"Q6_K", 18, T::kQ6_K},  {"MXFP4_MOE", 38, T::kMXFP4},
  };
  ASSERT_EQ(gguf_file_types().size(), std::size(expected));
  for (size_t index = 0; index < std::size(expected); ++index) {
    const auto& row = gguf_file_types()[index];
    SCOPED_TRACE(expected[index].name);
    EXPECT_STREQ(row.name, expected[index].name);
    EXPECT_EQ(row.llama_ftype, expected[index].llama_ftype);
    EXPECT_EQ(row.base_type, expected[index].base_type);
    EXPECT_EQ(&find_gguf_file_type(row.name, "--gguf-type"), &row);
  }
  EXPECT_EQ(gguf_file_type_names().rfind("F32, F16, BF16, Q8_0, Q4_0, ", 0), 0u) << gguf_file_type_names();
}

TEST(GgufFileTypes, UnknownNameIsRefusedNamingTheKeyAndTheNames) {
  const auto message = testing::error_message([] { find_gguf_file_type("Q4_K_X", "export.gguf_type"); });
  EXPECT_EQ(message, "export.gguf_type: unknown GGUF file type 'Q4_K_X' (expected one of " + gguf_file_type_names() + ")");
  EXPECT_NE(message.find("Q4_K_M"), std::string::npos);
  EXPECT_NE(testing::error_message([] { find_gguf_file_type("q4_k_m", "--gguf-type"); }).find("--gguf-type: "),
            std::string::npos);
}

// Known answers from llama.cpp's quantizer (no Python needed): a 4-layer llama with rows of 256,
// untied, as Q4_K_M: use_more_bits gives the last two layers' attn_v and ffn_down Q6_K, the
// output Q6_K, norms stay F32.
TEST(GgufFileTypes, Q4_K_MGivesTheLastLayersAndTheOutputQ6_K) {
  const auto test = model("llama", 256, 4, 4, 2, false);
  const auto tensors = decoder_tensors(test);
  const auto types = gguf_tensor_types(find_gguf_file_type("Q4_K_M", "--gguf-type"), test.shape, tensors);
  std::map<std::string, T> by_name;
  for (size_t index = 0; index < tensors.size(); ++index) by_name[tensors[index].name] = types[index];
  EXPECT_EQ(by_name["output.weight"], T::kQ6_K);
  EXPECT_EQ(by_name["token_embd.weight"], T::kQ4_K);
  EXPECT_EQ(by_name["output_norm.weight"], T::kF32);
  for (const char* layer : {"0", "1"}) {
    EXPECT_EQ(by_name[std::string("blk.") + layer + ".attn_v.weight"], T::kQ4_K) << layer;
    EXPECT_EQ(by_name[std::string("blk.") + layer + ".ffn_down.weight"], T::kQ4_K) << layer;
  }
  for (const char* layer : {"2", "3"}) {
    EXPECT_EQ(by_name[std::string("blk.") + layer + ".attn_v.weight"], T::kQ6_K) << layer;
    EXPECT_EQ(by_name[std::string("blk.") + layer + ".ffn_down.weight"], T::kQ6_K) << layer;
  }
  EXPECT_EQ(by_name["blk.0.attn_q.weight"], T::kQ4_K);
  EXPECT_EQ(by_name["blk.0.attn_norm.weight"], T::kF32);
}

// Tied embeddings (no output.weight): token_embd takes the output's rule, Q8_0 where the base
// type's block does not divide its rows of 96; the K-quants' other rows of 96 fall back to blocks
// of 32, and rows of 48 (not 32's) to F16 in every quantized file type.
TEST(GgufFileTypes, TiedEmbeddingsAndRowsNot256TakeLlamaCppsFallbacks) {
  const auto tied = model("llama", 96, 2, 4, 2, true);
  const auto tied_tensors = decoder_tensors(tied);
  ASSERT_EQ(tied_tensors[0].name, "token_embd.weight");
  const auto q4_k_m = gguf_tensor_types(find_gguf_file_type("Q4_K_M", "--gguf-type"), tied.shape, tied_tensors);
  EXPECT_EQ(q4_k_m[0], T::kQ8_0);
  const auto q4_0 = gguf_tensor_types(find_gguf_file_type("Q4_0", "--gguf-type"), tied.shape, tied_tensors);
  EXPECT_EQ(q4_0[0], T::kQ8_0);  // Q6_K's 256 does not divide 96
  const auto q3_k_s = gguf_tensor_types(find_gguf_file_type("Q3_K_S", "--gguf-type"), tied.shape, tied_tensors);
  EXPECT_EQ(q3_k_s[3], T::kQ4_0) << tied_tensors[3].name;  // blk.0.attn_q: Q3_K -> Q4_0
  const auto narrow = model("llama", 48, 2, 2, 1, false);
  const auto narrow_tensors = decoder_tensors(narrow);
  for (const char* name : {"Q8_0", "Q4_0", "Q6_K"}) {
    const auto types = gguf_tensor_types(find_gguf_file_type(name, "--gguf-type"), narrow.shape, narrow_tensors);
    EXPECT_EQ(types[0], T::kF16) << name << " " << narrow_tensors[0].name;
    EXPECT_EQ(types[2], T::kF16) << name << " " << narrow_tensors[2].name;
  }
}

// Every test model, every file type: each tensor's type is the one llama.cpp's quantizer wrote.
TEST(GgufFileTypes, TensorTypesAreLlamaQuantizes) {
  const auto& report = llama_cpp_report();
  if (!report.skip_reason.empty()) GTEST_SKIP() << report.skip_reason;
  ASSERT_TRUE(report.failure.empty()) << report.failure;
  int64_t compared = 0;
  for (const auto& test : test_models()) {
    const auto tensors = decoder_tensors(test);
    for (const auto& name : file_types_of(test)) {
      const auto& theirs = report.json.at("models").at(test.name).at(name);
      const std::string what = test.name + " as " + name;
      ASSERT_FALSE(theirs.contains("error")) << what << ": llama.cpp refused it: " << theirs.at("error");
      const auto ours = gguf_tensor_types(find_gguf_file_type(name, "--gguf-type"), test.shape, tensors);
      std::string differences;
      for (size_t index = 0; index < tensors.size(); ++index) {
        const std::string llama_cpp = theirs.at("tensors").value(tensors[index].name, "(missing)");
        const std::string our_type = gguf_block_format(ours[index]).name;
        if (llama_cpp != our_type) differences += "\n  " + tensors[index].name + ": llama.cpp " + llama_cpp + ", ours " + our_type;
        ++compared;
      }
      EXPECT_TRUE(differences.empty()) << what << ":" << differences;
      EXPECT_EQ(theirs.at("file_type").get<int64_t>(), find_gguf_file_type(name, "--gguf-type").llama_ftype) << what;
    }
  }
  std::printf("[ measured ] %lld tensor types compared with llama_model_quantize's\n", static_cast<long long>(compared));
}

// The table's numbers are llama.h's, as llama-cpp-python names them (LLAMA_FTYPE_MOSTLY_Q4_K_M...).
TEST(GgufFileTypes, NumbersAreLlamaCppsOwn) {
  const auto& report = llama_cpp_report();
  if (!report.skip_reason.empty()) GTEST_SKIP() << report.skip_reason;
  ASSERT_TRUE(report.failure.empty()) << report.failure;
  for (const auto& file_type : gguf_file_types()) {
    EXPECT_EQ(report.json.at("llama_ftypes").value(file_type.name, int64_t{-1}), static_cast<int64_t>(file_type.llama_ftype))
        << file_type.name;
  }
}

}  // namespace
}  // namespace qtrain::qat
