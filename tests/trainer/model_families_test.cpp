// The Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 and Phi-3 families against transformers: the fixtures' fp32 CPU logits with
// and without their peft adapters and their greedy tokens (../shared/fixtures/families), held-out
// checkpoints with the switches the fixtures leave out (tests/interop/family_variants.py: windows
// shorter than the input, sliding and full layers mixed, tied embeddings, head_dim != hidden /
// heads), decoding through a sliding window, and config.json switches qtrain refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <sstream>

#include "data/chat_template.h"
#include "kernels/error.h"
#include "model_outputs.h"
#include "small_llama.h"
#include "support.h"
#include "tensor_support.h"
#include "trainer/model/generation.h"
#include "trainer/formats/gguf_export.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/hf_config.h"
#include "trainer/formats/llama_shapes.h"
#include "trainer/model/model_families.h"
#include "trainer/recipe/model_memory.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {
namespace {

using testing::fixture;

using testing::max_relative_error;
using testing_outputs::logits_of;

class FamilyFixture : public ::testing::TestWithParam<std::string> {};

// The fixtures' logits were computed on another machine: transformers 5.17 itself, run here on
// the same weights and inputs, lands 6e-6 to 1.5e-5 (base) and 1.9e-5 to 2.2e-5 (with the adapter)
// from them, whatever the attention kernel. So the bound is that machine-to-machine spread; the
// held-out variants below, whose references are computed here, hold qtrain to 1e-5.
constexpr double kOtherMachineTolerance = 3e-5;

// The Gemma fixtures are further from transformers 5.17 as it runs here: its own fp32 logits for
// them land 7.3e-4 (Gemma 2; 1.4e-3 with the adapter) and 2.3e-3 (Gemma 3) from the stored ones, and ours within 1e-5 of
// transformers here (GemmaAndPhi3FixturesEqualTransformersAndPeftRunHere). The fixture bound is that spread.
double fixture_tolerance(const std::string& family) {
  if (family == "gemma2") return 2e-3;  // 1.4e-3 with the adapter
  if (family == "gemma3") return 3e-3;
  return kOtherMachineTolerance;
}

TEST_P(FamilyFixture, LogitsEqualTransformersInFp32WithAndWithoutTheAdapter) {
  const std::string name = GetParam();
  auto loaded = load_llama(fixture("families/" + name));
  const auto reference = SafetensorsFile::open(fixture("families/" + name + "-reference.safetensors"));
  const auto input_ids = reference.tensor("input_ids");
  const double base_error = max_relative_error(logits_of(*loaded.model, input_ids), reference.tensor("logits"));
  std::printf("[ measured ] %s fp32 logits vs transformers: %.3g relative\n", name.c_str(), base_error);
  EXPECT_LE(base_error, fixture_tolerance(name));

  apply_peft_adapter(*loaded.model, fixture("families/" + name + "-lora"));
  const double adapter_error = max_relative_error(logits_of(*loaded.model, input_ids), reference.tensor("lora.logits"));
  std::printf("[ measured ] %s + peft adapter: %.3g relative\n", name.c_str(), adapter_error);
  EXPECT_LE(adapter_error, fixture_tolerance(name));
}

TEST_P(FamilyFixture, GreedyTokensEqualTransformersGenerate) {
  const std::string name = GetParam();
  auto loaded = load_llama(fixture("families/" + name));
  const auto reference = SafetensorsFile::open(fixture("families/" + name + "-reference.safetensors"));
  const auto first = reference.tensor("input_ids")[0].narrow(0, 0, 8).contiguous();
  const std::vector<int64_t> prompt(first.data_ptr<int64_t>(), first.data_ptr<int64_t>() + 8);
  const auto greedy = reference.tensor("greedy").contiguous();
  const std::vector<int64_t> expected(greedy.data_ptr<int64_t>(), greedy.data_ptr<int64_t>() + greedy.numel());
  GenerationOptions options;
  options.max_new_tokens = static_cast<int64_t>(expected.size());
  EXPECT_EQ(generate(*loaded.model, prompt, options).tokens, expected);
}

// On the GPU the fused RMSNorm also normalises Qwen3's [batch, seq, heads, head_dim] q and k,
// and the biases ride in cuBLAS's matmuls.
TEST_P(FamilyFixture, CudaLogitsEqualTransformersInFp32) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  const std::string name = GetParam();
  ModelLoadOptions options;
  options.device = torch::Device(torch::kCUDA, 0);
  auto loaded = load_llama(fixture("families/" + name), options);
  const auto reference = SafetensorsFile::open(fixture("families/" + name + "-reference.safetensors"));
  const auto logits = logits_of(*loaded.model, reference.tensor("input_ids").to(options.device)).cpu();
  const double error = max_relative_error(logits, reference.tensor("logits"));
  std::printf("[ measured ] %s fp32 logits on CUDA vs transformers: %.3g relative\n", name.c_str(), error);
  EXPECT_LE(error, fixture_tolerance(name));
}

// What inspect and the memory estimate count is what transformers saved, q/k norms and biases
// included.
TEST_P(FamilyFixture, ParameterCountOfTheConfigIsTheCheckpoints) {
  const std::string name = GetParam();
  const auto loaded = load_llama(fixture("families/" + name));
  int64_t stored = 0;
  const auto weights = SafetensorsCheckpoint::open(fixture("families/" + name));
  for (const auto& tensor : weights.names()) stored += weights.tensor(tensor).numel();
  EXPECT_EQ(llama_parameter_counts(loaded.config.llama).total, stored);
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyFixture,
                         ::testing::Values("mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"));

// The Gemma and Phi-3 fixtures through transformers and peft on this machine
// (tests/interop/peft_logits.py: the base in fp32, eager attention where scores are soft-capped,
// with the fixture's adapter): ours equal theirs to fp32's rounding.
TEST(ModelFamilies, GemmaAndPhi3FixturesEqualTransformersAndPeftRunHere) {
  const auto lacks = testing::python_lacks("torch transformers peft safetensors");
  if (!lacks.empty()) GTEST_SKIP() << lacks;
  testing::TempDir directory;
  for (const std::string name : {"gemma2", "gemma3", "phi3"}) {
    SCOPED_TRACE(name);
    const std::string reference = fixture("families/" + name + "-reference.safetensors");
    const auto run = testing::run_interop_script(
        "peft_logits.py", fixture("families/" + name) + " " + fixture("families/" + name + "-lora") + " " + reference +
                              " input_ids " + directory.file(name + ".safetensors"));
    ASSERT_EQ(run.status, 0) << run.output;
    auto loaded = load_llama(fixture("families/" + name));
    apply_peft_adapter(*loaded.model, fixture("families/" + name + "-lora"));
    const auto ours = logits_of(*loaded.model, SafetensorsFile::open(reference).tensor("input_ids"));
    const double error = max_relative_error(ours, SafetensorsFile::open(directory.file(name + ".safetensors")).tensor("logits"));
    std::printf("[ measured ] %s + adapter vs peft here: %.3g relative\n", name.c_str(), error);
    EXPECT_LE(error, 1e-5);
  }
}

const char* const kVariants[] = {"mistral_window8_head_dim24", "qwen2_layers_from_1_slide_tied_bf16_v4",
                                 "qwen3_head_dim32_bias_layer_types", "gemma2_window8_softcap2_scalar20",
                                 "gemma3_pattern2_linear_rope_bf16_v4", "phi3_head_dim24_partial_rotary_window8_tied",
                                 "phi3_longrope_partial_half_window8_bf16_v4"};

// One test for all the variants: building them costs one Python start.
TEST(ModelFamilies, HeldOutVariantsEqualTransformersInFp32AndTheirWindowsMatter) {
  const auto lacks = testing::python_lacks("torch transformers safetensors");
  if (!lacks.empty()) GTEST_SKIP() << lacks;
  testing::TempDir directory;
  const auto built = testing::run_interop_script("family_variants.py", directory.path());
  ASSERT_EQ(built.status, 0) << built.output;
  for (const char* variant : kVariants) {
    SCOPED_TRACE(variant);
    auto loaded = load_llama(directory.file(variant));
    EXPECT_GT(loaded.config.llama.sliding_window, 0);
    const auto reference = SafetensorsFile::open(directory.file(variant) + "/reference.safetensors");
    const auto ours = logits_of(*loaded.model, reference.tensor("input_ids"));
    const double error = max_relative_error(ours, reference.tensor("logits"));
    std::printf("[ measured ] %s: %.3g relative\n", variant, error);
    EXPECT_LE(error, 1e-5);
    // 12 positions alone: within longrope's original context, its short factors.
    const auto prefix = logits_of(*loaded.model, reference.tensor("input_ids").narrow(1, 0, 12));
    EXPECT_LE(max_relative_error(prefix, reference.tensor("prefix_logits")), 1e-5);
    // Greedy decoding through the key/value cache, past the window (and longrope's switch).
    const auto first = reference.tensor("input_ids")[0].narrow(0, 0, 8).contiguous();
    const auto greedy = reference.tensor("greedy").contiguous();
    GenerationOptions options;
    options.max_new_tokens = greedy.numel();
    EXPECT_EQ(generate(*loaded.model, std::vector<int64_t>(first.data_ptr<int64_t>(), first.data_ptr<int64_t>() + 8), options).tokens,
              std::vector<int64_t>(greedy.data_ptr<int64_t>(), greedy.data_ptr<int64_t>() + greedy.numel()));
    // The windows are shorter than the input: without them the logits would differ.
    EXPECT_GT(max_relative_error(reference.tensor("full_attention_logits"), reference.tensor("logits")), 1e-2);
  }
}

// Decoding one token at a time past the window gives the full forward's logits: the cache keeps
// every key and the mask hides those that left the window.
TEST(ModelFamilies, DecodingPastTheSlidingWindowGivesTheFullForwardLogits) {
  torch::manual_seed(7);
  auto options = testing::small_llama_options(/*hidden_size=*/32, /*layers=*/2);
  options.query_key_norm = true;
  options.sliding_window = 5;
  options.sliding_layers = {true, false};
  LlamaForCausalLM model(options, torch::kFloat32);
  torch::NoGradGuard no_grad;
  for (auto& parameter : model->parameters()) parameter.normal_(0.0, 0.3);
  const auto ids = torch::randint(0, 97, {1, 19}, torch::kInt64);
  const auto full = logits_of(*model, ids);
  KeyValueCache cache(2);
  std::vector<torch::Tensor> pieces;
  LlamaInputs prefill;
  prefill.input_ids = ids.narrow(1, 0, 7);  // longer than the window already
  prefill.cache = &cache;
  pieces.push_back(model->forward(prefill));
  for (int64_t position = 7; position < 15; ++position) {
    LlamaInputs step;
    step.input_ids = ids.narrow(1, position, 1);
    step.cache = &cache;
    pieces.push_back(model->forward(step));
  }
  LlamaInputs chunk;
  chunk.input_ids = ids.narrow(1, 15, 4);
  chunk.cache = &cache;
  pieces.push_back(model->forward(chunk));
  EXPECT_LE(max_relative_error(torch::cat(pieces, 1), full), 1e-5);
}

// The bench shapes are the real models: their parameter counts are the totals of the published
// checkpoints (the safetensors index's total_size / 2 bytes, bf16).
TEST(ModelFamilies, BenchShapesHaveThePublishedModelsParameterCounts) {
  EXPECT_EQ(llama_parameter_counts(llama_shape("qwen3-8b")).total, 8190735360);     // Qwen/Qwen3-8B
  EXPECT_EQ(llama_parameter_counts(llama_shape("qwen2.5-7b")).total, 7615616512);   // Qwen/Qwen2.5-7B
  EXPECT_EQ(llama_parameter_counts(llama_shape("mistral-7b")).total, 7248023552);   // mistralai/Mistral-7B-v0.3
  EXPECT_EQ(llama_parameter_counts(llama_shape("llama3-8b")).total, 8030261248);    // meta-llama/Meta-Llama-3-8B
  EXPECT_EQ(llama_parameter_counts(llama_shape("llama3-70b")).total, 70553706496);  // meta-llama/Meta-Llama-3-70B
  EXPECT_EQ(llama_parameter_counts(llama_shape("gemma2-9b")).total, 9241705984);    // google/gemma-2-9b
}

// The bench shapes as qtrain's own table held them before each family read its shapes from an
// embedded config.json (the numbers are the models' published config.json values): `qtrain bench`
// figures stay only while every shape builds exactly these options.
struct TableShape {
  const char* name;
  int64_t vocab, hidden, intermediate, layers, heads, kv_heads, head_dim;
  bool tied;
  double rope_theta, rms_norm_eps;
  bool query_key_value_bias, query_key_norm;
};
const TableShape kTableShapes[] = {
    {"llama3-8b", 128256, 4096, 14336, 32, 32, 8, 128, false, 500000.0, 1e-5, false, false},
    {"llama3-1b", 128256, 2048, 8192, 16, 32, 8, 64, true, 500000.0, 1e-5, false, false},
    {"llama3-70b", 128256, 8192, 28672, 80, 64, 8, 128, false, 500000.0, 1e-5, false, false},  // added later
    {"qwen3-8b", 151936, 4096, 12288, 36, 32, 8, 128, false, 1000000.0, 1e-6, false, true},
    {"qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, 128, false, 1000000.0, 1e-6, true, false},
    {"mistral-7b", 32768, 4096, 14336, 32, 32, 8, 128, false, 1000000.0, 1e-5, false, false},
    {"tiny", 8192, 256, 688, 4, 8, 2, 32, false, 500000.0, 1e-5, false, false},
    {"gemma2-9b", 256000, 3584, 14336, 42, 16, 8, 256, true, 10000.0, 1e-6, false, false},
    {"gemma3-12b", 262208, 3840, 15360, 48, 16, 8, 256, true, 1000000.0, 1e-6, false, true},
    {"phi4-mini", 200064, 3072, 8192, 32, 24, 8, 128, true, 10000.0, 1e-5, false, false},
};

LlamaOptions table_options(const TableShape& shape) {
  LlamaOptions options;
  options.vocab_size = shape.vocab;
  options.hidden_size = shape.hidden;
  options.intermediate_size = shape.intermediate;
  options.num_hidden_layers = shape.layers;
  options.num_attention_heads = shape.heads;
  options.num_key_value_heads = shape.kv_heads;
  options.head_dim = shape.head_dim;
  options.tie_word_embeddings = shape.tied;
  options.max_position_embeddings = 8192;
  options.rms_norm_eps = shape.rms_norm_eps;
  options.rope.theta = shape.rope_theta;
  options.attention_bias = shape.query_key_value_bias;
  options.query_key_norm = shape.query_key_norm;
  const std::string name = shape.name;
  if (name == "gemma2-9b" || name == "gemma3-12b") {
    const bool gemma3 = name == "gemma3-12b";
    options.norm_style = NormStyle::kUnitOffset;
    options.sandwich_norms = true;
    options.scale_embeddings = true;
    options.activation = Activation::kGeluTanh;
    options.query_pre_attn_scalar = 256.0;
    options.attention_softcap = gemma3 ? 0.0 : 50.0;
    options.final_logit_softcap = gemma3 ? 0.0 : 30.0;
    options.sliding_window = gemma3 ? 1024 : 4096;
    const int64_t full_every = gemma3 ? 6 : 2;
    for (int64_t layer = 0; layer < options.num_hidden_layers; ++layer) {
      options.sliding_layers.push_back((layer + 1) % full_every != 0);
    }
    if (gemma3) {
      RopeOptions sliding;
      sliding.theta = 10000.0;
      options.sliding_rope = sliding;
      options.rope.type = RopeType::kLinear;
      options.rope.factor = 8.0;
    }
  }
  if (name == "phi4-mini") {
    options.fused_projections = true;
    options.partial_rotary_factor = 0.75;
  }
  return options;
}

void describe_rope(std::ostream& out, const RopeOptions& rope) {
  out << "type " << static_cast<int>(rope.type) << " theta " << rope.theta << " factor " << rope.factor << " low "
      << rope.low_freq_factor << " high " << rope.high_freq_factor << " original " << rope.original_max_position_embeddings
      << " short " << rope.short_factor.size() << " long " << rope.long_factor.size() << " attention "
      << rope.attention_factor;
}

// Every field of `options`, for a comparison that names what differs.
std::string describe(const LlamaOptions& options) {
  std::ostringstream out;
  out.precision(17);
  out << "vocab " << options.vocab_size << "\nhidden " << options.hidden_size << "\nintermediate "
      << options.intermediate_size << "\nlayers " << options.num_hidden_layers << "\nheads " << options.num_attention_heads
      << "\nkv_heads " << options.num_key_value_heads << "\nhead_dim " << options.head_dim << "\npositions "
      << options.max_position_embeddings << "\nrms_norm_eps " << options.rms_norm_eps << "\nattention_bias "
      << options.attention_bias << "\noutput_bias " << options.output_bias << "\nmlp_bias " << options.mlp_bias
      << "\ntied " << options.tie_word_embeddings << "\npartial_rotary " << options.partial_rotary_factor << "\nfused "
      << options.fused_projections << "\nquery_key_norm " << options.query_key_norm << "\nsliding_window "
      << options.sliding_window << "\nsliding_layers ";
  for (const bool slides : options.sliding_layers) out << slides;
  out << "\nrope ";
  describe_rope(out, options.rope);
  out << "\nsliding_rope ";
  if (options.sliding_rope) describe_rope(out, *options.sliding_rope);
  out << "\nnorm_style " << static_cast<int>(options.norm_style) << "\nsandwich " << options.sandwich_norms
      << "\nscale_embeddings " << options.scale_embeddings << "\nactivation " << static_cast<int>(options.activation)
      << "\nquery_pre_attn_scalar " << options.query_pre_attn_scalar << "\nattention_softcap " << options.attention_softcap
      << "\nfinal_logit_softcap " << options.final_logit_softcap;
  return out.str();
}

TEST(ModelFamilies, BenchShapesBuildTheOptionsOfQtrainsFormerTable) {
  size_t shapes = 0;
  std::vector<std::string> expert_shapes;  // the mixtures of experts came after that table
  for (const auto& family : model_families()) {
    for (const auto& shape : family.bench_shapes) {
      if (llama_shape(shape.name).feed_forward == FeedForwardKind::kExperts) {
        expert_shapes.push_back(shape.name);
      } else {
        ++shapes;
      }
    }
  }
  EXPECT_EQ(shapes, std::size(kTableShapes));
  EXPECT_EQ(expert_shapes, (std::vector<std::string>{"qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b"}));
  // Their published configs, as read: Qwen3-30B-A3B 48 layers of 128 experts (top 8, 768 wide,
  // renormalised); gpt-oss-20b 32 experts (top 4) with sinks, YaRN and alternating windows.
  const auto qwen3 = llama_shape("qwen3-30b-a3b");
  EXPECT_EQ(qwen3.num_hidden_layers, 48);
  EXPECT_EQ(qwen3.experts.num_experts, 128);
  EXPECT_EQ(qwen3.experts.experts_per_token, 8);
  EXPECT_EQ(qwen3.experts.intermediate_size, 768);
  EXPECT_TRUE(qwen3.experts.normalize_top_k);
  const auto gpt_oss = llama_shape("gpt-oss-20b");
  EXPECT_EQ(gpt_oss.experts.num_experts, 32);
  EXPECT_EQ(gpt_oss.experts.experts_per_token, 4);
  EXPECT_TRUE(gpt_oss.attention_sinks && gpt_oss.experts.top_k_then_softmax && gpt_oss.experts.interleaved_gate_up);
  EXPECT_EQ(gpt_oss.rope.type, RopeType::kYarn);
  EXPECT_TRUE(gpt_oss.layer_slides(0) && !gpt_oss.layer_slides(1));
  for (const auto& shape : kTableShapes) {
    SCOPED_TRACE(shape.name);
    EXPECT_EQ(describe(llama_shape(shape.name)), describe(table_options(shape)));
  }
  try {
    llama_shape("llama4-400b");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& error) {
    for (const auto& shape : kTableShapes) EXPECT_NE(std::string(error.what()).find(shape.name), std::string::npos) << error.what();
  }
}

// A shape's config.json is read by the family that holds it, through its own read_config.
TEST(ModelFamilies, EachBenchShapeIsReadByItsOwnFamily) {
  for (const auto& family : model_families()) {
    for (const auto& shape : family.bench_shapes) {
      EXPECT_EQ(parse_hf_config(shape.config_json, shape.name).family, &family) << shape.name;
    }
  }
}

// Adding a family is one file in trainer/model/families/ and its line in the list there
// (families.h): each other .cpp file there is one row, and no two rows take the same config.json.
TEST(ModelFamilies, EachFileOfTheFamiliesFolderIsOneRow) {
  size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(QTRAIN_SOURCE_DIR) + "/trainer/model/families")) {
    if (entry.path().extension() == ".cpp" && entry.path().filename() != "family_list.cpp") ++files;
  }
  EXPECT_EQ(files, model_families().size());
  std::set<std::string> architectures, model_types;
  for (const auto& family : model_families()) {
    EXPECT_TRUE(architectures.insert(family.architecture).second) << family.architecture;
    EXPECT_TRUE(model_types.insert(family.model_type).second) << family.model_type;
    EXPECT_FALSE(family.gguf.name.empty()) << family.architecture;
  }
}

// The chat templates the rows name are data/chat_template.h's, and every one it renders belongs to
// a family.
TEST(ModelFamilies, ChatTemplatesAreTheOnesTheDataLibraryRenders) {
  const auto supported = data::ChatTemplate::supported_families();
  std::set<std::string> named;
  for (const auto& family : model_families()) {
    for (const auto& chat_template : family.chat_templates) {
      EXPECT_NE(std::find(supported.begin(), supported.end(), chat_template), supported.end()) << chat_template;
      named.insert(chat_template);
    }
  }
  EXPECT_EQ(named, std::set<std::string>(supported.begin(), supported.end()));
}

std::string config_error(const std::string& json) {
  try {
    parse_hf_config(json, "config.json");
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

const char* const kQwen2Shape =
    R"("vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, )"
    R"("num_attention_heads": 2)";

TEST(ModelFamilies, FamilySwitchesComeFromTheirRowOfTheTable) {
  const auto qwen2 = parse_hf_config(std::string(R"({"architectures": ["Qwen2ForCausalLM"], )") + kQwen2Shape + "}", "c");
  EXPECT_TRUE(qwen2.llama.attention_bias);
  EXPECT_FALSE(qwen2.llama.output_bias);
  EXPECT_EQ(qwen2.llama.sliding_window, 0);
  const auto mistral = parse_hf_config(
      std::string(R"({"architectures": ["MistralForCausalLM"], "sliding_window": 4096, "attention_bias": true, )") +
          kQwen2Shape + "}",
      "c");
  EXPECT_FALSE(mistral.llama.attention_bias);  // transformers' Mistral has no biases, whatever the key says
  EXPECT_EQ(mistral.llama.sliding_window, 4096);
  EXPECT_EQ(mistral.llama.sliding_layers, (std::vector<bool>{true, true}));
  const auto qwen3 = parse_hf_config(
      std::string(R"({"model_type": "qwen3", "use_sliding_window": true, "max_window_layers": 1, "sliding_window": 9, )") +
          kQwen2Shape + "}",
      "c");
  EXPECT_TRUE(qwen3.llama.query_key_norm);
  EXPECT_EQ(qwen3.llama.sliding_layers, (std::vector<bool>{false, true}));
}

TEST(ModelFamilies, SwitchesQtrainDoesNotImplementAreErrorsNamingTheKey) {
  const auto unknown = config_error(std::string(R"({"architectures": ["FalconForCausalLM"], )") + kQwen2Shape + "}");
  EXPECT_NE(unknown.find("FalconForCausalLM"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("Qwen3ForCausalLM"), std::string::npos) << unknown;
  const auto layer_type = config_error(std::string(R"({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4, )") +
                                       R"("layer_types": ["full_attention", "chunked_attention"], )" + kQwen2Shape + "}");
  EXPECT_NE(layer_type.find("layer_types"), std::string::npos) << layer_type;
  EXPECT_NE(layer_type.find("chunked_attention"), std::string::npos) << layer_type;
  const auto no_window = config_error(std::string(R"({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": true, )") +
                                      kQwen2Shape + "}");
  EXPECT_NE(no_window.find("sliding_window"), std::string::npos) << no_window;
}

// llama.cpp's qwen3 reads no attention biases: a Qwen3 with attention_bias would lose them.
TEST(ModelFamilies, GgufExportRefusesWhatTheArchitectureCannotHold) {
  testing::TempDir temp;
  auto loaded = load_llama(fixture("families/qwen3"));
  loaded.config.llama.attention_bias = true;
  try {
    write_gguf_model(*loaded.model, BaseDirectory::read(fixture("families/qwen3"), loaded.config), temp.file("qwen3.gguf"), {});
    ADD_FAILURE() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("attention_bias"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("Qwen3ForCausalLM"), std::string::npos) << error.what();
  }
  EXPECT_FALSE(std::filesystem::exists(temp.file("qwen3.gguf")));
}

}  // namespace
}  // namespace qtrain::trainer
