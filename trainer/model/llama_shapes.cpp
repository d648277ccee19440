#include "trainer/model/llama_shapes.h"

#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

struct NamedShape {
  const char* name;
  int64_t vocab, hidden, intermediate, layers, heads, kv_heads, head_dim;
  bool tied;
  double rope_theta, rms_norm_eps;
  bool query_key_value_bias;  // Qwen2: q/k/v only
  bool query_key_norm;        // Qwen3
};

// Each row is its model's config.json (head_dim = hidden / heads where the config omits it).
const NamedShape kShapes[] = {
    {"llama3-8b", 128256, 4096, 14336, 32, 32, 8, 128, false, 500000.0, 1e-5, false, false},
    {"llama3-1b", 128256, 2048, 8192, 16, 32, 8, 64, true, 500000.0, 1e-5, false, false},  // Llama-3.2-1B
    {"qwen3-8b", 151936, 4096, 12288, 36, 32, 8, 128, false, 1000000.0, 1e-6, false, true},
    {"qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, 128, false, 1000000.0, 1e-6, true, false},
    {"mistral-7b", 32768, 4096, 14336, 32, 32, 8, 128, false, 1000000.0, 1e-5, false, false},  // v0.3, no window
    {"tiny", 8192, 256, 688, 4, 8, 2, 32, false, 500000.0, 1e-5, false, false},  // the shape of tests' tiny-llama
    {"gemma2-9b", 256000, 3584, 14336, 42, 16, 8, 256, true, 10000.0, 1e-6, false, false},
    {"gemma3-12b", 262208, 3840, 15360, 48, 16, 8, 256, true, 1000000.0, 1e-6, false, true},
    {"phi4-mini", 200064, 3072, 8192, 32, 24, 8, 128, true, 10000.0, 1e-5, false, false},  // Phi-4-mini-instruct
};

// Phi-3's rows: fused projections and the rotated fraction of each head. (Their longrope factors
// change the rotary tables' values, not the work: the rows keep the default rope.)
struct Phi3Shape {
  const char* name;
  double partial_rotary_factor;
};
const Phi3Shape kPhi3Shapes[] = {
    {"phi4-mini", 0.75},
};

// What Gemma's rows add (llama_options.h): the block, the score scale, the caps and the windows.
struct GemmaShape {
  const char* name;
  double query_pre_attn_scalar, attention_softcap, final_logit_softcap;
  int64_t sliding_window, full_every;  // every full_every-th layer attends fully
  double sliding_theta;                // 0: the rows' theta; Gemma 3's full layers scale linearly x8
};

const GemmaShape kGemmaShapes[] = {
    {"gemma2-9b", 256.0, 50.0, 30.0, 4096, 2, 0.0},
    {"gemma3-12b", 256.0, 0.0, 0.0, 1024, 6, 10000.0},
};

void apply_gemma_shape(const GemmaShape& gemma, LlamaOptions& options) {
  options.norm_style = NormStyle::kGemma;
  options.sandwich_norms = true;
  options.scale_embeddings = true;
  options.activation = Activation::kGeluTanh;
  options.query_pre_attn_scalar = gemma.query_pre_attn_scalar;
  options.attention_softcap = gemma.attention_softcap;
  options.final_logit_softcap = gemma.final_logit_softcap;
  options.sliding_window = gemma.sliding_window;
  options.sliding_layers.clear();
  for (int64_t layer = 0; layer < options.num_hidden_layers; ++layer) {
    options.sliding_layers.push_back((layer + 1) % gemma.full_every != 0);
  }
  if (gemma.sliding_theta > 0) {
    RopeOptions sliding;
    sliding.theta = gemma.sliding_theta;
    options.sliding_rope = sliding;
    options.rope.type = RopeType::kLinear;
    options.rope.factor = 8.0;
  }
}

}  // namespace

LlamaOptions llama_shape(const std::string& name) {
  for (const auto& shape : kShapes) {
    if (name != shape.name) continue;
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
    for (const auto& gemma : kGemmaShapes) {
      if (name == gemma.name) apply_gemma_shape(gemma, options);
    }
    for (const auto& phi3 : kPhi3Shapes) {
      if (name != phi3.name) continue;
      options.fused_projections = true;
      options.partial_rotary_factor = phi3.partial_rotary_factor;
    }
    return options;
  }
  std::string known;
  for (const auto& shape : kShapes) known += (known.empty() ? "" : ", ") + std::string(shape.name);
  throw Error(ErrorCode::kUsage, "unknown model shape '" + name + "' (known: " + known + ")");
}

}  // namespace qtrain::trainer
