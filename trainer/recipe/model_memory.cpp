#include "trainer/recipe/model_memory.h"

#include <algorithm>
#include <map>

#include "kernels/error.h"
#include "qat/expert_linear.h"
#include "kernels/softcapped_flash_attention.h"
#include "trainer/formats/hf_config.h"
#include "trainer/model/flash_attention.h"
#include "trainer/model/fused_linear_cross_entropy.h"
#include "trainer/objectives/objectives.h"
#include "trainer/recipe/recipe_training.h"

namespace qtrain::trainer {

namespace {

// The tensor a projection reads; projections reading the same one share what is saved of it.
// kMlpProduct: the feed-forward block's inner activation (the dense MLP's gated product).
enum class LayerInput { kNormedForAttention, kAttentionOutput, kNormedForMlp, kMlpProduct };

struct Projection {
  std::string name;  // the module's dotted path, e.g. "model.layers.3.self_attn.q_proj"
  int64_t in = 0;
  int64_t out = 0;
  bool bias = false;
  LayerInput input = LayerInput::kNormedForAttention;
  int64_t experts = 0;  // > 0: an expert bank (out = experts × each one's rows)
};

// Layer `layer`'s projections, as its attention and its feed-forward block make them.
std::vector<Projection> decoder_projections(const LlamaOptions& model, int64_t layer) {
  const std::string prefix = "model.layers." + std::to_string(layer) + ".";
  std::vector<Projection> projections;
  for (const auto& shape : attention_projections(model)) {
    projections.push_back({prefix + "self_attn." + shape.name, shape.in, shape.out, shape.bias,
                           shape.input == ProjectionInput::kBlockInput ? LayerInput::kNormedForAttention
                                                                       : LayerInput::kAttentionOutput});
  }
  const auto& block = feed_forward_row(model.layer_feed_forward(layer));
  for (const auto& shape : block.projections(model)) {
    projections.push_back({prefix + block.module_name + "." + shape.name, shape.in, shape.out, shape.bias,
                           shape.input == ProjectionInput::kBlockInput ? LayerInput::kNormedForMlp
                                                                       : LayerInput::kMlpProduct,
                           shape.experts});
  }
  return projections;
}

// Every linear layer of the model: the decoder projections, then lm_head unless it is tied.
std::vector<Projection> all_projections(const LlamaOptions& model) {
  std::vector<Projection> projections;
  for (int64_t layer = 0; layer < model.num_hidden_layers; ++layer) {
    for (auto& projection : decoder_projections(model, layer)) projections.push_back(std::move(projection));
  }
  if (!model.tie_word_embeddings) projections.push_back({"lm_head", model.hidden_size, model.vocab_size, false, {}});
  return projections;
}

// Every RMSNorm's weight: two per block (four with Gemma's sandwich norms), the final one, and
// the per-head q/k norms.
int64_t norm_parameters(const LlamaOptions& options) {
  const int64_t per_block = options.sandwich_norms ? 4 : 2;
  return options.hidden_size * (per_block * options.num_hidden_layers + 1) +
         (options.query_key_norm ? 2 * options.head_dim * options.num_hidden_layers : 0);
}

bool is_quantized(const Projection& projection, const TrainingMemorySetup& setup) {
  const bool quantizes = setup.base.kind != BaseQuantization::kNone || setup.base.multiply_on_float8;
  return quantizes && !qat::module_name_matches(projection.name, setup.base.skip_modules);
}

// The bytes of a projection a pre-quantized checkpoint keeps in its stored form; negative: none.
double stored_bytes(const Projection& projection, const TrainingMemorySetup& setup) {
  if (!setup.stored_projection_bytes || is_quantized(projection, setup)) return -1.0;
  return setup.stored_projection_bytes(projection.name, projection.out, projection.in);
}

// The LoRA rank of the adapter on `projection`; 0: none.
int64_t adapter_rank(const Projection& projection, const TrainingMemorySetup& setup) {
  if (setup.full_finetune || !setup.adapter.targets.matches(projection.name)) return 0;
  return setup.adapter.options_for(projection.name).rank;
}

// QAT-LoRA's projections: adapted and named by qat.target_modules.
bool is_fake_quantized(const Projection& projection, const TrainingMemorySetup& setup) {
  return setup.fake_quantized && adapter_rank(projection, setup) > 0 && setup.fake_quantized_targets.matches(projection.name);
}

double element_bytes(torch::ScalarType dtype) { return static_cast<double>(c10::elementSize(dtype)); }

// One RMSNorm: its input in fp32 and 1 / rms per token; its normed output when its weight trains.
double rms_norm_bytes(double tokens, int64_t hidden, double compute_bytes, bool weight_trains, bool fused) {
  // The fused CUDA kernel (trainer/model/llama_layers.h) keeps its input and one fp32 rstd per row.
  if (fused) return tokens * (static_cast<double>(hidden) * compute_bytes + 4.0);
  return tokens * (4.0 * static_cast<double>(hidden) + 4.0) +
         (weight_trains ? tokens * static_cast<double>(hidden) * compute_bytes : 0.0);
}

// The [batch, heads, seq, seq] tensors attention keeps for its backward, in bytes per query and key;
// 0 where a fused kernel keeps only its rows' logsumexp.
// - PyTorch 2.11's scaled_dot_product_attention runs fp32 grouped-query attention on CUDA through
//   its math path (neither cuDNN, flash nor memory-efficient attention take it): the probabilities.
// - Gemma 2's soft cap where its flash kernels (kernels/softcapped_flash_attention.h) do not take
//   the model (the CPU, fp32, head sizes other than 128 / 256): tanh's output and the fp32 softmax,
//   and the probabilities cast back to the compute dtype (on the CPU that cast is the softmax
//   itself in fp32; CUDA's score kernel writes both).
// Whether Gemma 2's soft-capped layers run on their flash-style kernels (kernels/softcapped_flash_attention.h).
bool softcapped_flash(const LlamaOptions& model, const TrainingMemorySetup& setup) {
  return setup.device == torch::kCUDA && kernels::softcapped_flash_takes(setup.compute_dtype, model.head_dim);
}

double attention_score_bytes(const LlamaOptions& model, const TrainingMemorySetup& setup) {
  const double s = element_bytes(setup.compute_dtype);
  const bool cuda = setup.device == torch::kCUDA;
  if (model.attention_softcap > 0) {
    if (softcapped_flash(model, setup)) return 0.0;
    return s + 4.0 + (cuda || s != 4.0 ? s : 0.0);
  }
  const bool math = cuda && setup.compute_dtype == torch::kFloat32 && model.num_key_value_heads != model.num_attention_heads;
  return math ? s : 0.0;
}

// A packed batch writes its [batch, 1, seq, seq] mask out only where no kernel takes its spans:
// flash attention's (trainer/model/flash_attention.h), or under Gemma 2's soft cap its own
// (kernels/softcapped_flash_attention.h). That leaves the CPU, fp32 and other head sizes.
bool writes_packed_mask(const LlamaOptions& model, const TrainingMemorySetup& setup) {
  const bool spans = model.attention_softcap > 0 ? softcapped_flash(model, setup)
                                                 : flash_attention_takes(setup.device, setup.compute_dtype, model.head_dim);
  return setup.packed && !spans;
}

// What decoder layer `layer` saves for its backward, for one micro-batch (the model in the header).
double decoder_layer_activation_bytes(const LlamaOptions& model, const TrainingMemorySetup& setup, int64_t layer) {
  const double s = element_bytes(setup.compute_dtype);
  const double sequence = static_cast<double>(setup.sequence_length);
  const double tokens = static_cast<double>(setup.micro_batch_size) * sequence;
  const double hidden = static_cast<double>(model.hidden_size);
  const double heads = static_cast<double>(model.num_attention_heads);
  const double query = heads * static_cast<double>(model.head_dim);
  const double key_value = static_cast<double>(model.num_key_value_heads * model.head_dim);
  const double mask_bytes = setup.device == torch::kCUDA ? 1.0 : s;  // CUDA's fused dropout keeps a bool mask
  const bool fused_layers = setup.device == torch::kCUDA;  // RMSNorm and SwiGLU kernels (trainer/model/llama_layers.h)
  // The first layer's input comes from the frozen embeddings and does not require grad.
  const bool input_requires_grad = layer > 0 || setup.full_finetune;

  double bytes = rms_norm_bytes(tokens, model.hidden_size, s, setup.full_finetune, fused_layers);  // post_attention_layernorm
  if (input_requires_grad) bytes += rms_norm_bytes(tokens, model.hidden_size, s, setup.full_finetune, fused_layers);
  // Gemma's sandwich norms: two more, one on the attention's output and one on the MLP's.
  if (model.sandwich_norms) bytes += 2.0 * rms_norm_bytes(tokens, model.hidden_size, s, setup.full_finetune, fused_layers);
  std::map<LayerInput, bool> input_saved, input_rebuilt;
  std::map<LayerInput, double> input_width;  // values per token
  for (const auto& projection : decoder_projections(model, layer)) {
    const double in = static_cast<double>(projection.in);
    input_width[projection.input] = in;
    const double out = static_cast<double>(projection.out);
    const bool input_needs_grad = input_requires_grad || projection.input != LayerInput::kNormedForAttention;
    // A 4-bit base keeps nothing: qat/four_bit_matmul.h dequantizes again in backward.
    if (setup.full_finetune) {
      input_saved[projection.input] = true;  // for the weight's gradient
      continue;
    }
    const auto rank = static_cast<double>(adapter_rank(projection, setup));
    if (rank == 0) continue;
    bytes += tokens * rank * s;  // A's output, for B's gradient
    const bool dropout = setup.adapter.options_for(projection.name).dropout > 0.0;
    if (is_fake_quantized(projection, setup)) {
      // One node (qat/qat_lora_matmul.h): its input, x A^T above, B cast.
      if (setup.compute_dtype != torch::kFloat32) bytes += rank * out * s;
      if (setup.activations_quantized) {
        bytes += tokens * in * (s + 1.0);  // the quantized input, and its quantizer's bool mask
      } else {
        input_saved[projection.input] = true;
      }
      continue;
    }
    if (base_quantization_row(setup.base.kind).fused_lora) {
      // One fused node (qat/lora_matmul.h): the input, A and B cast, and dropout's mask as bytes.
      // The inputs it makes again instead of keeping them: the norms' outputs from the norms'
      // inputs (RMSNormImpl::forward_rebuildable), down_proj's, the MLP's product, from gate and up.
      if (setup.compute_dtype != torch::kFloat32) bytes += rank * (in + out) * s;
      if (dropout) bytes += tokens * in;
      if (projection.input == LayerInput::kAttentionOutput) input_saved[projection.input] = true;
      if (projection.input == LayerInput::kNormedForAttention || projection.input == LayerInput::kNormedForMlp) {
        input_rebuilt[projection.input] = true;
      }
      continue;
    }
    if (setup.compute_dtype != torch::kFloat32) bytes += rank * ((input_needs_grad ? in : 0.0) + out) * s;  // A, B cast
    if (dropout) {
      bytes += tokens * in * (s + mask_bytes);  // its own dropped input and mask
    } else {
      input_saved[projection.input] = true;  // for A's gradient
    }
  }
  const double score_bytes = attention_score_bytes(model, setup);
  if (input_saved[LayerInput::kNormedForAttention]) bytes += tokens * hidden * s;
  // A fused kernel's output is o_proj's input as it is (a view); the written-out paths' is a copy.
  if (input_saved[LayerInput::kAttentionOutput] && score_bytes > 0) bytes += tokens * query * s;
  if (input_saved[LayerInput::kNormedForMlp]) bytes += tokens * hidden * s;
  // A rebuilt norm output keeps the norm's input, which the norm keeps as it is only with a backward
  // of its own and where it keeps it unconverted (the fused kernel; the torch operations in fp32).
  const bool norm_keeps_its_input = fused_layers || s == 4.0;
  if (input_rebuilt[LayerInput::kNormedForAttention] && !(input_requires_grad && norm_keeps_its_input)) {
    bytes += tokens * hidden * s;
  }
  if (input_rebuilt[LayerInput::kNormedForMlp] && !norm_keeps_its_input) bytes += tokens * hidden * s;
  if (input_saved[LayerInput::kMlpProduct]) bytes += tokens * input_width[LayerInput::kMlpProduct] * s;

  if (score_bytes > 0) {
    // the [batch, heads, seq, seq] scores; q, and k and v repeated to every head; under the soft cap
    // a written-out mask as the bool [batch, 1, seq, seq] that masked_fill keeps.
    bytes += tokens * (heads * sequence * score_bytes + 3.0 * query * s) +
             (model.attention_softcap > 0 && writes_packed_mask(model, setup) ? tokens * sequence : 0.0);
  } else {
    // q and k after rotary, v, the output; the fp32 logsumexp [batch, heads, seq]; a written-out
    // mask becomes a [batch, 1, seq, seq] tensor of the compute dtype in every call.
    bytes += tokens * ((2.0 * query + 2.0 * key_value) * s + 4.0 * heads) +
             (writes_packed_mask(model, setup) ? tokens * sequence * s : 0.0);
  }
  // The feed-forward block's activation (SwiGLU: the gate and up outputs, and the torch operations'
  // silu(gate) too).
  bytes += tokens * feed_forward_row(model).activation_values_per_token(model, fused_layers) * s;
  return bytes;
}

}  // namespace

LlamaParameterCounts llama_parameter_counts(const LlamaOptions& options) {
  LlamaParameterCounts counts;
  for (int64_t layer = 0; layer < options.num_hidden_layers; ++layer) {
    for (const auto& projection : decoder_projections(options, layer)) {
      counts.projections += projection.in * projection.out + (projection.bias ? projection.out : 0);
    }
  }
  counts.embeddings = options.vocab_size * options.hidden_size * (options.tie_word_embeddings ? 1 : 2);
  counts.norms = norm_parameters(options);
  counts.total = counts.projections + counts.embeddings + counts.norms;
  return counts;
}

double active_matmul_weights(const LlamaOptions& model) {
  double active = 0;
  for (const auto& projection : all_projections(model)) {
    const double weights = static_cast<double>(projection.in) * static_cast<double>(projection.out);
    active += projection.experts > 0 ? weights * static_cast<double>(model.experts.experts_per_token) / projection.experts : weights;
  }
  // The head's product, through the table.
  if (model.tie_word_embeddings) active += static_cast<double>(model.vocab_size) * static_cast<double>(model.hidden_size);
  return active;
}

namespace {

// An adapter of `rank` on `projection`: A [rank, in] and B [out, rank]; an expert bank's has rank
// rows of A per expert, A [experts · rank, in], B [out / experts, experts · rank].
int64_t adapter_weights(const Projection& projection, int64_t rank) {
  return rank * (std::max<int64_t>(projection.experts, 1) * projection.in + projection.out);
}

}  // namespace

HostCopyWork host_copy_work(const LlamaOptions& model, const Recipe& recipe) {
  TrainingMemorySetup setup;  // what the adapters' ranks need
  setup.adapter = lora_adapter_config(recipe);
  setup.full_finetune = trains_full_weights(recipe);
  double trained = 0;
  for (const auto& projection : all_projections(model)) {
    const double weights = static_cast<double>(projection.in) * static_cast<double>(projection.out);
    const int64_t rank = adapter_rank(projection, setup);
    trained += setup.full_finetune ? weights : static_cast<double>(adapter_weights(projection, rank));
  }
  const double table = static_cast<double>(model.vocab_size) * static_cast<double>(model.hidden_size);
  const double active = active_matmul_weights(model);
  HostCopyWork work;
  work.lm_head_bytes = table * element_bytes(parse_dtype_name(recipe.train.dtype, "train.dtype"));
  constexpr double kMomentBytes = 8.0;
  work.state_bytes = 2.0 * kMomentBytes * trained;
  work.flops_per_token = 6.0 * active;
  return work;
}

TrainingMemorySetup training_memory_setup(const Recipe& recipe, const LlamaOptions& model) {
  TrainingMemorySetup setup;
  if (recipe.quant == QuantMethod::kQat) {
    const auto options = qat_linear_options(recipe);
    if (trains_full_weights(recipe) || !qat::quantizer_fuses_merge(options.weights)) {
      throw Error(ErrorCode::kRecipe, "quant: qat is estimated for QAT-LoRA (lora.rank > 0) with qat.weights on an int grid, "
                  "per_group or per_channel, observer dynamic, no learned_scale; this recipe's (" +
                  std::string(trains_full_weights(recipe) ? "full weights" : options.weights.spec.describe()) +
                  ") is not modelled yet");
    }
    setup.fake_quantized = true;
    setup.fake_quantized_targets.include.names = recipe.qat.target_modules;
    setup.activations_quantized = options.activations.has_value();
  }
  if (recipe.lora.use_dora) {
    throw Error(ErrorCode::kRecipe, "lora.use_dora is not estimated yet (DoRA's per-layer weight norms are not modelled); "
                "estimate without it and measure with qtrain bench --dora");
  }
  setup.compute_dtype = parse_dtype_name(recipe.train.dtype, "train.dtype");
  setup.base = base_quantization(recipe, setup.compute_dtype);
  for (auto& name : dense_base_projections(model)) setup.base.skip_modules.push_back(std::move(name));
  setup.adapter = lora_adapter_config(recipe);
  setup.full_finetune = trains_full_weights(recipe);
  if (recipe.lora.init_from.empty() && !setup.full_finetune) {
    require_model_projections(model, recipe.lora.target_modules, "lora.target_modules");
    require_lora_on_experts_supported(model, recipe);
  }
  setup.device = recipe.train.device == "cpu" ? torch::kCPU : torch::kCUDA;  // auto: a GPU, where runs go
  setup.micro_batch_size = recipe.train.micro_batch_size;
  setup.sequence_length = longest_row_tokens(recipe.train.objective, recipe.data.max_seq_len);
  setup.packed = recipe.data.pack;
  setup.gradient_checkpointing = recipe.train.gradient_checkpointing;
  setup.checkpoint_every = recipe.train.gradient_checkpointing_every;
  setup.loss_chunk_tokens = loss_chunk_tokens(recipe, model.vocab_size);
  setup.fused_loss = recipe.train.fused_loss;
  setup.offload_activations = recipe.train.offload_activations;
  setup.offload_branch_outputs = recipe.train.offload_branch_outputs;
  setup.keep_built_weights = recipe.train.keep_built_weights;
  setup.expert_bank_block_bytes = recipe.train.expert_bank_block_mb << 20;
  setup.embeddings_on_host = recipe.train.embeddings_on_host;
  setup.lm_head_on_host = recipe.train.lm_head_on_host;
  setup.lm_head_block_bytes = recipe.train.lm_head_block_mb << 20;
  setup.optimizer_states_on_host = recipe.train.optimizer_states_on_host;
  if (recipe.train.mlp_chunk_tokens > 0) {
    throw Error(ErrorCode::kRecipe, "train.mlp_chunk_tokens is not estimated yet (the MLP's chunks and their "
                "recomputation are not modelled); estimate without it and measure with qtrain bench --mlp-chunk");
  }
  return setup;
}

namespace {

// The loss's backward runs first, over everything the forward kept; the layers' backward (and
// their recomputation) after it, once the loss has let go of its logits.
double peak_of(const PeakMemoryEstimate& estimate, bool checkpointing, bool chunking, bool fused) {
  const double logits = fused      ? estimate.fused_loss_bytes
                        : chunking ? estimate.chunked_logits_bytes
                                   : estimate.logits_bytes;
  const double loss = logits + estimate.visiting_weight_bytes;
  const double activations = checkpointing
                                 ? std::max(estimate.checkpointed_saved_bytes + loss,
                                            estimate.checkpointed_activation_bytes)
                                 : estimate.activation_bytes + loss;
  // A state kept on the host visits a layer's share at a time; counted beside the peak's
  // activations, though the forward that applies it holds fewer.
  return estimate.frozen_weight_bytes + estimate.trainable_state_bytes - estimate.host_state_bytes +
         estimate.state_in_flight_bytes + activations + estimate.fake_quant_build_bytes;
}

}  // namespace

double PeakMemoryEstimate::total() const {
  return peak_of(*this, uses_checkpointing, uses_chunking, uses_fused_loss);
}

double PeakMemoryEstimate::lowest_total() const { return peak_of(*this, true, true, fused_loss_applies); }

namespace {

// The frozen weights and the trainable state (with what the setup keeps on the host). Returns
// whether lm_head trains (fully or through an adapter).
bool estimate_weights_and_state(const LlamaOptions& model, const TrainingMemorySetup& setup,
                                PeakMemoryEstimate& estimate) {
  const double s = element_bytes(setup.compute_dtype);
  bool lm_head_trains = setup.full_finetune;
  for (const auto& projection : all_projections(model)) {
    const int64_t weights = projection.in * projection.out;
    const int64_t biases = projection.bias ? projection.out : 0;
    if (setup.full_finetune) {
      estimate.trainable_parameters += weights + biases;
      continue;
    }
    const double quantized_bytes = base_quantization_row(setup.base.kind).weight_bytes(projection.out, projection.in, setup.base);
    const double stored = stored_bytes(projection, setup);
    estimate.frozen_weight_bytes += is_quantized(projection, setup) ? quantized_bytes + biases * s
                                    : stored >= 0                   ? stored + static_cast<double>(biases) * s
                                                                    : static_cast<double>(weights + biases) * s;
    const int64_t rank = adapter_rank(projection, setup);
    if (rank > 0) {
      estimate.trainable_parameters += adapter_weights(projection, rank);
      ++estimate.adapted_layers;
      lm_head_trains |= projection.name == "lm_head";
    }
  }
  const int64_t embeddings_and_norms =
      model.vocab_size * model.hidden_size + norm_parameters(model);
  if (setup.full_finetune) {
    estimate.trainable_parameters += embeddings_and_norms;
  } else {
    // train.embeddings_on_host: the input table is not on the device (a tied one only with
    // train.lm_head_on_host: it visits the device for the loss, below). On a CPU the host is the
    // device: nothing moves.
    const bool moved = setup.embeddings_on_host && (!model.tie_word_embeddings || setup.lm_head_on_host) &&
                       setup.device == torch::kCUDA;
    const int64_t on_host = moved ? model.vocab_size * model.hidden_size : 0;
    estimate.frozen_weight_bytes += static_cast<double>(embeddings_and_norms - on_host) * s;
  }
  if (setup.lm_head_on_host) {
    // A plain frozen lm_head waits on the host (LlamaForCausalLMImpl::keep_lm_head_on_host refuses
    // the others); on a CPU the host is the device.
    const Projection lm_head{"lm_head", model.hidden_size, model.vocab_size, false, {}};
    const bool tied = model.tie_word_embeddings;
    if ((tied && !setup.embeddings_on_host) || lm_head_trains || is_quantized(lm_head, setup) ||
        is_fake_quantized(lm_head, setup)) {
      throw Error(ErrorCode::kRecipe, "train.lm_head_on_host keeps a plain frozen lm_head on the host, but this run's "
                  "lm_head is trained, adapted or quantized, or tied without train.embeddings_on_host: set "
                  "train.lm_head_on_host: false");
    }
    if (setup.device == torch::kCUDA) {
      estimate.visiting_weight_bytes = static_cast<double>(model.vocab_size * model.hidden_size) * s;
      // A tied table left the frozen weights with the input table, above.
      if (!tied) estimate.frozen_weight_bytes -= estimate.visiting_weight_bytes;
    }
  }
  // fp32 LoRA weight, grad, exp_avg, exp_avg_sq; or, training every weight, a compute-dtype weight
  // and grad, an fp32 master copy when those are 16-bit, and the two moments: 16 bytes either way.
  constexpr double kTrainableStateBytes = 16.0;
  estimate.trainable_state_bytes = static_cast<double>(estimate.trainable_parameters) * kTrainableStateBytes;
  // The two moments, and a training weight's master: all but the weight and its gradient.
  constexpr double kHostStateBytes = 8.0;
  constexpr double kHostStateBytesWithMaster = 12.0;
  if (setup.optimizer_states_on_host && setup.device == torch::kCUDA) {
    const bool masters = setup.full_finetune && setup.compute_dtype != torch::kFloat32;
    estimate.host_state_bytes = static_cast<double>(estimate.trainable_parameters) *
                                (masters ? kHostStateBytesWithMaster : kHostStateBytes);
    const double layers = static_cast<double>(std::max<int64_t>(model.num_hidden_layers, 1));
    estimate.state_in_flight_bytes = estimate.host_state_bytes * std::min(1.0, 2.0 / layers);
  }
  return lm_head_trains;
}

// What the forward of one micro-batch keeps, with and without checkpointing, and QAT-LoRA's
// weight build.
void estimate_activations(const LlamaOptions& model, const TrainingMemorySetup& setup, PeakMemoryEstimate& estimate) {
  const double s = element_bytes(setup.compute_dtype);
  const double tokens = static_cast<double>(setup.micro_batch_size * setup.sequence_length);
  const double hidden = static_cast<double>(model.hidden_size);
  const double per_micro_batch = tokens * 2.0 * static_cast<double>(model.head_dim) * s +  // rotary cos, sin
                                 rms_norm_bytes(tokens, model.hidden_size, s, setup.full_finetune,
                                                setup.device == torch::kCUDA) +  // final norm
                                 (writes_packed_mask(model, setup) ? tokens * static_cast<double>(setup.sequence_length)
                                                                   : 0.0);  // bool mask
  // With checkpointing, backward walks the layers from the last: when it reaches layer j, the
  // layers above have let go of theirs, those below still keep theirs, and a checkpointed j holds
  // its recomputed activations on top of its input.
  const int64_t every = std::max<int64_t>(setup.checkpoint_every, 1);
  double kept_below = per_micro_batch;
  estimate.activation_bytes = per_micro_batch;
  estimate.checkpointed_activation_bytes = per_micro_batch;
  for (int64_t layer = 0; layer < model.num_hidden_layers; ++layer) {
    const double layer_bytes = decoder_layer_activation_bytes(model, setup, layer);
    const bool checkpointed = layer % every == 0;
    // A checkpointed layer keeps its input: on the device, or offloaded until its backward, when
    // it and the input below it (fetched ahead) are back.
    const double input = tokens * hidden * s;
    const bool offloading = setup.gradient_checkpointing && setup.offload_activations && setup.device == torch::kCUDA;
    const double kept = checkpointed ? (offloading ? 0.0 : input) : layer_bytes;
    if (checkpointed && offloading) {
      const double branch_outputs = setup.offload_branch_outputs ? (model.sandwich_norms ? 2.0 : 1.0) : 0.0;
      estimate.offloaded_host_bytes += (1.0 + branch_outputs) * input;
    }
    // The input of the checkpointed layer being differentiated, or of the one below it fetched
    // ahead, through the uncheckpointed layers between them: two at most; with the branch outputs
    // kept too (train.offload_branch_outputs), the one fetched ahead of the layer's own recomputation.
    const double fetched = offloading ? (setup.offload_branch_outputs ? 3.0 : 2.0) * input : 0.0;
    // A recomputed layer keeps its dequantized 4-bit weights for its backward (qat::KeepBuiltWeights).
    // So does QAT-LoRA's fake-quantized weight (in place of the 4-bit base's: its dequantization
    // is let go once the weight is built).
    // Not kept, backward builds them again one at a time: the largest is there with the layer (an
    // expert bank a block of experts at a time, where its base builds rows).
    double built_weights = 0.0;
    if (checkpointed && !setup.full_finetune) {
      const auto& base = base_quantization_row(setup.base.kind);
      for (const auto& projection : decoder_projections(model, layer)) {
        if (is_fake_quantized(projection, setup) || (base.keeps_built_weights && is_quantized(projection, setup)) ||
            (adapter_rank(projection, setup) > 0 && stored_bytes(projection, setup) >= 0)) {
          const double bytes = static_cast<double>(projection.in * projection.out) * s;
          if (setup.keep_built_weights) {
            built_weights += bytes;
            continue;
          }
          double one_build = bytes;
          if (projection.experts > 0 && base.builds_weight_rows && is_quantized(projection, setup)) {
            const int64_t expert = projection.out / projection.experts * projection.in * static_cast<int64_t>(s);
            one_build = static_cast<double>(
                qat::experts_per_block(projection.experts, expert, setup.expert_bank_block_bytes) * expert);
          }
          built_weights = std::max(built_weights, one_build);
        }
      }
    }
    estimate.activation_bytes += layer_bytes;
    if (checkpointed && setup.gradient_checkpointing) {
      estimate.recomputed_layer_bytes = std::max(estimate.recomputed_layer_bytes, layer_bytes);
    }
    estimate.checkpointed_activation_bytes =
        std::max(estimate.checkpointed_activation_bytes,
                 kept_below + kept + fetched + (checkpointed ? layer_bytes + built_weights : 0.0));
    kept_below += kept;
  }
  estimate.checkpointed_saved_bytes = kept_below;
  double largest_fake_quantized = 0.0;
  for (const auto& projection : decoder_projections(model, 0)) {
    if (is_fake_quantized(projection, setup)) {
      largest_fake_quantized = std::max(largest_fake_quantized, static_cast<double>(projection.in * projection.out));
    }
  }
  // The CPU's builder holds the running sum, one product, the merge and the values in fp32.
  estimate.fake_quant_build_bytes = largest_fake_quantized * (setup.device == torch::kCPU ? 4.0 * 4.0 + s : s);
  estimate.attention_keeps_probabilities = attention_score_bytes(model, setup) > 0;
  estimate.uses_checkpointing = setup.gradient_checkpointing;
}

// The loss's peak: whole, chunked and fused.
void estimate_loss(const LlamaOptions& model, const TrainingMemorySetup& setup, bool lm_head_trains,
                   PeakMemoryEstimate& estimate) {
  const double s = element_bytes(setup.compute_dtype);
  const double hidden = static_cast<double>(model.hidden_size);
  // The loss: three fp32 [tokens, vocab] tensors at the start of its backward.
  estimate.predicted_tokens = setup.micro_batch_size * std::max<int64_t>(setup.sequence_length - 1, 0);
  const double predicted = static_cast<double>(estimate.predicted_tokens);
  const double logit_bytes_per_token = 3.0 * 4.0 * static_cast<double>(model.vocab_size);
  const double final_states = predicted * hidden * s;  // [tokens, hidden], kept by chunks or a trained lm_head
  estimate.logits_bytes = predicted * logit_bytes_per_token + (lm_head_trains ? final_states : 0.0);
  estimate.loss_chunk_tokens = setup.loss_chunk_tokens > 0
                                   ? std::min(setup.loss_chunk_tokens, estimate.predicted_tokens)
                                   : estimate.predicted_tokens;
  estimate.uses_chunking = estimate.loss_chunk_tokens < estimate.predicted_tokens;
  estimate.chunked_logits_bytes =
      estimate.uses_chunking
          ? static_cast<double>(estimate.loss_chunk_tokens) * logit_bytes_per_token + final_states
          : estimate.logits_bytes;

  // The fused loss: a frozen lm_head that multiplies by a plain weight, or frozen tied
  // embeddings. A quantized lm_head has one where its kind's LoRA fuses over it (a 4-bit one
  // builds it); LLM.int8's has none, nor does a fake-quantized one (QAT).
  const Projection lm_head{"lm_head", model.hidden_size, model.vocab_size, false, {}};
  const bool lm_head_multiplies =
      model.tie_word_embeddings ||
      (!is_fake_quantized(lm_head, setup) &&
       (!is_quantized(lm_head, setup) || base_quantization_row(setup.base.kind).fused_lora));
  estimate.fused_loss_applies = !lm_head_trains && lm_head_multiplies;
  estimate.uses_fused_loss = setup.fused_loss && estimate.fused_loss_applies;
  // train.lm_head_block_mb: lm_head visits in tiles, the loss walking it once over every token
  // (fused_linear_cross_entropy's host_tiles).
  estimate.visits_in_tiles = estimate.visiting_weight_bytes > 0 && setup.lm_head_block_bytes > 0 && estimate.uses_fused_loss;
  if (estimate.visits_in_tiles) estimate.loss_chunk_tokens = estimate.predicted_tokens;
  estimate.loss_tile_columns = fused_loss_tile_columns(estimate.loss_chunk_tokens, model.vocab_size);
  if (estimate.visits_in_tiles) {
    const auto tiles = streamed_tiles(estimate.loss_chunk_tokens, model.vocab_size,
                                      static_cast<int64_t>(static_cast<double>(model.hidden_size) * s),
                                      setup.lm_head_block_bytes, estimate.loss_tile_columns);
    estimate.visiting_weight_bytes =
        std::min(estimate.visiting_weight_bytes, static_cast<double>(tiles.on_device * tiles.rows * model.hidden_size) * s);
  }
  const double chunk = static_cast<double>(estimate.loss_chunk_tokens);
  const double tile = chunk * static_cast<double>(estimate.loss_tile_columns);
  // Per tile element: the fp32 logits (exponentials in place), their compute-dtype matmul output
  // when that is not fp32, and on the CPU under a cap its fp32 derivative (the CUDA kernel keeps it
  // in registers); per chunk row, the fp32 sum of the tiles' products and one product; the
  // states, their gradient, the statistics and the targets.
  const bool cap_block = model.final_logit_softcap > 0 && setup.device != torch::kCUDA;
  const double tile_element_bytes = 4.0 + (s < 4.0 ? s : 0.0) + (cap_block ? 4.0 : 0.0);
  estimate.fused_loss_bytes = tile * tile_element_bytes + chunk * hidden * (4.0 + s) + 2.0 * final_states +
                              predicted * (4.0 + 8.0);
}

}  // namespace

PeakMemoryEstimate estimate_peak_memory(const LlamaOptions& model, const TrainingMemorySetup& setup) {
  PeakMemoryEstimate estimate;
  const bool lm_head_trains = estimate_weights_and_state(model, setup, estimate);
  estimate_activations(model, setup, estimate);
  estimate_loss(model, setup, lm_head_trains, estimate);
  return estimate;
}

std::vector<MemoryEstimate> training_memory_estimates(const LlamaOptions& model, int64_t lora_rank) {
  TrainingMemorySetup qlora;
  qlora.adapter.lora.rank = lora_rank;
  qlora.adapter.targets.include.names = model.projection_names();  // every projection, fused ones by their names
  TrainingMemorySetup int8 = qlora;
  int8.base.kind = BaseQuantization::kInt8;
  TrainingMemorySetup lora = qlora;
  lora.base.kind = BaseQuantization::kNone;
  TrainingMemorySetup full = lora;
  full.full_finetune = true;
  return {{"qlora", estimate_peak_memory(model, qlora)},
          {"int8", estimate_peak_memory(model, int8)},
          {"lora", estimate_peak_memory(model, lora)},
          {"full", estimate_peak_memory(model, full)}};
}

}  // namespace qtrain::trainer
