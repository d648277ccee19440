// qtrain inspect: what a Hugging Face Llama directory holds and what training it would need;
// with a recipe, the peak memory of that recipe's run on its device.
#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>

#include "kernels/error.h"
#include "tools/commands.h"
#include "trainer/formats/hf_hub_cache.h"
#include "trainer/recipe/memory_plan.h"
#include "trainer/formats/hf_config.h"
#include "trainer/base/memory_stats.h"
#include "trainer/formats/compressed_tensors.h"
#include "trainer/formats/compressed_tensors_config.h"
#include "trainer/recipe/model_memory.h"
#include "trainer/recipe/recipe.h"
#include "trainer/formats/safetensors.h"

namespace po = boost::program_options;

namespace qtrain::tools {

namespace {

void print_model(const std::string& model_dir, const trainer::HfModelConfig& config) {
  const auto& llama = config.llama;
  const auto weights = trainer::SafetensorsCheckpoint::open(model_dir);
  std::map<std::string, int64_t> elements_by_dtype;
  int64_t stored_elements = 0;
  for (const auto& name : weights.names()) {
    const auto& info = weights.info(name);
    int64_t elements = 1;
    for (auto dim : info.shape) elements *= dim;
    elements_by_dtype[info.dtype] += elements;
    stored_elements += elements;
  }
  const auto sizes = trainer::llama_parameter_counts(llama);

  std::printf("model        %s (%s)\n", model_dir.c_str(), config.architecture.c_str());
  std::printf("layers       %lld, hidden %lld, intermediate %lld, vocab %lld\n",
              static_cast<long long>(llama.num_hidden_layers), static_cast<long long>(llama.hidden_size),
              static_cast<long long>(llama.intermediate_size), static_cast<long long>(llama.vocab_size));
  std::printf("attention    %lld heads, %lld KV heads (%s), head_dim %lld, bias %s\n",
              static_cast<long long>(llama.num_attention_heads), static_cast<long long>(llama.num_key_value_heads),
              llama.num_key_value_heads == 1 ? "MQA"
              : llama.num_key_value_heads < llama.num_attention_heads ? "GQA" : "MHA",
              static_cast<long long>(llama.head_dim),
              llama.attention_bias ? (llama.output_bias ? "yes" : "q/k/v only") : "no");
  if (llama.query_key_norm) std::printf("             RMSNorm on each head's query and key\n");
  if (llama.fused_projections) std::printf("             q, k and v from one qkv_proj; gate and up from one gate_up_proj\n");
  if (llama.sliding_window > 0) {
    const auto sliding = std::count(llama.sliding_layers.begin(), llama.sliding_layers.end(), true);
    std::printf("             sliding window of %lld keys in %lld of %lld layers\n",
                static_cast<long long>(llama.sliding_window), static_cast<long long>(sliding),
                static_cast<long long>(llama.num_hidden_layers));
  }
  if (llama.query_pre_attn_scalar > 0) std::printf("             scores scaled by %g^-1/2\n", llama.query_pre_attn_scalar);
  if (llama.attention_softcap > 0) std::printf("             scores soft-capped at %g\n", llama.attention_softcap);
  std::printf("rope         %s, theta %g, factor %g; max positions %lld\n", config.rope_type_name.c_str(),
              llama.rope.theta, llama.rope.factor, static_cast<long long>(llama.max_position_embeddings));
  if (llama.rotary_dim() < llama.head_dim) {
    std::printf("             rotary on %lld of each head's %lld dimensions (partial_rotary_factor %g)\n",
                static_cast<long long>(llama.rotary_dim()), static_cast<long long>(llama.head_dim), llama.partial_rotary_factor);
  }
  if (llama.rope.type == trainer::RopeType::kLongRope) {
    std::printf("             longrope: short factors to position %lld, long ones past it; cos and sin x %g\n",
                static_cast<long long>(llama.rope.original_max_position_embeddings), llama.rope.attention_factor);
  }
  if (llama.sliding_rope) {
    std::printf("             sliding layers: theta %g, factor %g\n", llama.sliding_rope->theta, llama.sliding_rope->factor);
  }
  if (llama.norm_style == trainer::NormStyle::kUnitOffset) {
    std::printf("block        Gemma: RMSNorm x (1 + w), %s, %s, embeddings x sqrt(hidden)",
                llama.sandwich_norms ? "4 norms per layer" : "2 norms per layer",
                llama.activation == trainer::Activation::kGeluTanh ? "GeGLU" : "SwiGLU");
    if (llama.final_logit_softcap > 0) std::printf(", logits soft-capped at %g", llama.final_logit_softcap);
    std::printf("\n");
  }
  if (llama.feed_forward == trainer::FeedForwardKind::kExperts) {
    const auto& experts = llama.experts;
    int64_t expert_layers = 0;
    for (int64_t layer = 0; layer < llama.num_hidden_layers; ++layer) {
      expert_layers += llama.layer_feed_forward(layer) == trainer::FeedForwardKind::kExperts;
    }
    const double bank_elements = 3.0 * static_cast<double>(experts.num_experts * llama.hidden_size * experts.intermediate_size);
    std::printf("experts      %lld experts, top %lld per token, each %lld wide, in %lld of %lld layers; router '%s' (%s)\n",
                static_cast<long long>(experts.num_experts), static_cast<long long>(experts.experts_per_token),
                static_cast<long long>(experts.intermediate_size), static_cast<long long>(expert_layers),
                static_cast<long long>(llama.num_hidden_layers), experts.router.c_str(),
                experts.top_k_then_softmax ? "softmax of the top-k logits, biased"
                : experts.normalize_top_k  ? "softmax, top-k renormalised"
                                           : "softmax, top-k as they are");
    std::printf("             the experts hold %.3fM parameters (%s in bf16, %s in NF4); a token runs %lld of them per layer;"
                " load-balancing loss x %g %s\n",
                bank_elements * static_cast<double>(expert_layers) / 1e6,
                trainer::format_bytes(bank_elements * static_cast<double>(expert_layers) * 2).c_str(),
                trainer::format_bytes(bank_elements * static_cast<double>(expert_layers) * 0.5).c_str(),
                static_cast<long long>(experts.experts_per_token), experts.router_aux_loss_coef,
                experts.output_router_logits ? "(on: output_router_logits)" : "(off: output_router_logits false)");
  }
  if (llama.attention_sinks) std::printf("             a learned sink logit per head (gpt-oss)\n");
  std::printf("embeddings   %s, rms_norm_eps %g, mlp bias %s\n", llama.tie_word_embeddings ? "tied" : "untied",
              llama.rms_norm_eps, llama.mlp_bias ? "yes" : "no");
  std::printf("parameters   %.3fM (config), %.3fM stored in %zu tensors\n", sizes.total / 1e6, stored_elements / 1e6,
              weights.names().size());
  std::printf("dtypes       config %s;", trainer::dtype_short_name(config.stored_dtype).c_str());
  for (const auto& [dtype, elements] : elements_by_dtype) std::printf(" %s %.3fM", dtype.c_str(), elements / 1e6);
  std::printf("\n");
}

// A compressed-tensors checkpoint: its groups, as qtrain keeps them (quant: none: stored form).
void print_compressed_tensors(const trainer::HfModelConfig& config) {
  if (!trainer::is_compressed_tensors_checkpoint(config)) return;
  const auto parsed = trainer::parse_compressed_tensors_config(config.json, config.path);
  for (const auto& group : parsed.groups) {
    if (!group.weights) continue;
    const auto& weights = *group.weights;
    std::printf("quantized    compressed-tensors %s: %lld-bit %s %s%s weights%s on %zu target(s), %zu ignored; "
                "quant: none keeps them stored\n",
                group.format.c_str(), static_cast<long long>(weights.num_bits), weights.type.c_str(), weights.strategy.c_str(),
                weights.group_size > 0 ? ("(" + std::to_string(weights.group_size) + ")").c_str() : "",
                group.input_activations ? (", " + group.input_activations->type + std::to_string(group.input_activations->num_bits) +
                                           " inputs per " + group.input_activations->strategy).c_str()
                                        : "",
                group.targets.size(), parsed.ignore.size());
  }
}

void print_training_modes(const trainer::LlamaOptions& llama, int64_t lora_rank) {
  std::printf("\nmemory for weights and trainable state (activations not included; --recipe estimates a run):\n");
  for (const auto& [mode, estimate] : trainer::training_memory_estimates(llama, lora_rank)) {
    std::printf("  %-6s frozen %-11s trainable %8.3fM params, with grads + AdamW %-11s total %s\n", mode.c_str(),
                trainer::format_bytes(estimate.frozen_weight_bytes).c_str(), estimate.trainable_parameters / 1e6,
                trainer::format_bytes(estimate.trainable_state_bytes).c_str(),
                trainer::format_bytes(estimate.frozen_weight_bytes + estimate.trainable_state_bytes).c_str());
  }
}

// " *" after the figure the recipe's settings use.
const char* used(bool in_use) { return in_use ? " *" : "  "; }

void print_peak_estimate(const std::string& recipe_path, const trainer::TrainingMemorySetup& setup,
                         const trainer::LlamaOptions& llama) {
  const auto estimate = trainer::estimate_peak_memory(llama, setup);
  const auto bytes = [](double value) { return trainer::format_bytes(value); };

  const auto& base = trainer::base_quantization_row(setup.base.kind);
  std::string training = setup.full_finetune                              ? "full finetune"
                         : base.kind == trainer::BaseQuantization::kNone
                             ? (setup.base.multiply_on_float8 ? "quant none on FP8 tensor cores (16-bit weights on the host)" : "quant none")
                                                                         : "qlora " + std::string(trainer::base_quantization_name(base.kind));
  if (setup.fake_quantized) training = "qat-lora on a " + std::string(base.kind == trainer::BaseQuantization::kNone ? "16-bit" : trainer::base_quantization_name(base.kind)) + " base";
  std::string switches;  // the train section's memory switches that are on
  if (setup.gradient_checkpointing && setup.offload_activations) switches += ", checkpointed inputs on the host";
  if (setup.gradient_checkpointing && setup.offload_branch_outputs) switches += ", branch outputs on the host";
  if (setup.embeddings_on_host) switches += ", embedding table on the host";
  if (setup.lm_head_on_host) switches += ", lm_head on the host";
  if (setup.optimizer_states_on_host) switches += ", optimizer state on the host";
  if (setup.gradient_checkpointing && !setup.keep_built_weights) switches += ", weights rebuilt in backward";
  std::printf("\npeak memory estimate for %s on %s (%s, compute %s, micro-batch %lld x %lld tokens%s%s%s):\n",
              recipe_path.c_str(), setup.device == torch::kCUDA ? "cuda" : "cpu", training.c_str(),
              trainer::dtype_short_name(setup.compute_dtype).c_str(), static_cast<long long>(setup.micro_batch_size),
              static_cast<long long>(setup.sequence_length), setup.packed ? ", packed" : "", switches.c_str(),
              estimate.attention_keeps_probabilities ? ", attention keeps [heads, seq, seq] scores" : "");
  std::printf("  %-22s %11s\n", "frozen weights", bytes(estimate.frozen_weight_bytes).c_str());
  if (estimate.visiting_weight_bytes > 0) {
    std::printf("  %-22s %11s     (%s)\n", "lm_head from the host", bytes(estimate.visiting_weight_bytes).c_str(),
                estimate.visits_in_tiles ? "its tiles on the device at once, during the loss: train.lm_head_block_mb"
                                         : "on the device from the forward to the loss's backward");
  }
  if (setup.full_finetune) {
    std::printf("  %-22s %11s     (%.3fM parameters)\n", "weights + grads + AdamW",
                bytes(estimate.trainable_state_bytes).c_str(), estimate.trainable_parameters / 1e6);
  } else {
    std::printf("  %-22s %11s     (%.3fM parameters in %lld adapters of rank %lld)\n", "LoRA + grads + AdamW",
                bytes(estimate.trainable_state_bytes).c_str(), estimate.trainable_parameters / 1e6,
                static_cast<long long>(estimate.adapted_layers), static_cast<long long>(setup.adapter.lora.rank));
  }
  if (estimate.host_state_bytes > 0) {
    std::printf("  %-22s %11s     (of the above: on the device %s at a time, two layers' shares, for their "
                "updates in the next forward)\n",
                "optimizer state, host", bytes(estimate.host_state_bytes).c_str(),
                bytes(estimate.state_in_flight_bytes).c_str());
  }
  if (estimate.offloaded_host_bytes > 0) {
    std::printf("  %-22s %11s     (pinned: each checkpointed layer's input%s until its backward)\n", "activations, host",
                bytes(estimate.offloaded_host_bytes).c_str(),
                !setup.offload_branch_outputs ? ""
                : llama.sandwich_norms        ? " and its attention and MLP outputs"
                                              : " and its attention output");
  }
  const std::string every = setup.checkpoint_every <= 1 ? "every layer"
                                                        : "every " + std::to_string(setup.checkpoint_every) + " layers";
  std::printf("  %-22s %11s%s   (with gradient checkpointing, %s: %s%s)\n", "activations",
              bytes(estimate.activation_bytes).c_str(), used(!estimate.uses_checkpointing), every.c_str(),
              bytes(estimate.checkpointed_activation_bytes).c_str(), used(estimate.uses_checkpointing));
  if (estimate.uses_fused_loss) {
    std::printf("  %-22s %11s%s   (fused over vocabulary tiles of %lld columns, %lld tokens at a time: %s%s)\n",
                "loss logits", bytes(estimate.logits_bytes).c_str(), used(false),
                static_cast<long long>(estimate.loss_tile_columns), static_cast<long long>(estimate.loss_chunk_tokens),
                bytes(estimate.fused_loss_bytes).c_str(), used(true));
  } else if (estimate.uses_chunking) {
    std::printf("  %-22s %11s%s   (chunked by %lld tokens: %s%s)\n", "loss logits", bytes(estimate.logits_bytes).c_str(),
                used(false), static_cast<long long>(estimate.loss_chunk_tokens),
                bytes(estimate.chunked_logits_bytes).c_str(), used(true));
  } else {
    std::printf("  %-22s %11s%s   (all %lld predicted tokens fit one chunk of %lld: not chunked)\n", "loss logits",
                bytes(estimate.logits_bytes).c_str(), used(true), static_cast<long long>(estimate.predicted_tokens),
                static_cast<long long>(setup.loss_chunk_tokens));
  }
  std::printf("  %-22s %11s%s   (with checkpointing and the fused or chunked loss: %s)\n", "total",
              bytes(estimate.total()).c_str(), used(true), bytes(estimate.lowest_total()).c_str());
  std::printf("  * this recipe's settings. The total is the peak of the loss's backward or, with checkpointing,\n"
              "    of the layers' after it, which can be less than the sum. Not counted: the CUDA context (about\n"
              "    500 MiB), allocator fragmentation, backward's transient gradients; see trainer/recipe/model_memory.h\n");
}

}  // namespace

int run_inspect(const Arguments& arguments) {
  std::string model_dir;
  std::string recipe_path;
  std::vector<std::string> overrides;
  int64_t lora_rank = 0;
  po::options_description options("inspect options");
  options.add_options()
      ("model", po::value(&model_dir), "Hugging Face model directory or ORG/NAME[@REVISION] in the HF cache")
      ("recipe", po::value(&recipe_path), "YAML recipe: also estimate its run's peak memory (the model is its model.path)")
      ("set", po::value(&overrides)->composing(), "override a recipe key: --set train.micro_batch_size=8 (repeatable)")
      ("lora-rank", po::value(&lora_rank)->default_value(16), "LoRA rank for the memory table of --model");
  po::variables_map values;
  if (!parse_command_line("usage: qtrain inspect --model DIR [--lora-rank R]\n"
                          "       qtrain inspect --recipe FILE [--set key=value ...]",
                          options, arguments, values)) {
    return 0;
  }
  model_dir = trainer::resolve_model_path(model_dir, "--model");  // a folder, or ORG/NAME in the HF cache
  if (model_dir.empty() == recipe_path.empty()) {
    throw Error(ErrorCode::kUsage, "inspect needs --model DIR or --recipe FILE, one of them (a recipe's model is its model.path; "
                "--set model.path=DIR changes it)");
  }
  if (!overrides.empty() && recipe_path.empty()) throw Error(ErrorCode::kUsage, "--set changes a recipe key: give --recipe FILE too");

  std::optional<trainer::Recipe> recipe;
  if (!recipe_path.empty()) {
    recipe = trainer::load_recipe(recipe_path, overrides);
    model_dir = trainer::resolve_model_path(recipe->model.path, "model.path");
    if (model_dir.empty()) {
      throw Error(ErrorCode::kRecipe, recipe_path + ": model.path is not set; point it at a Hugging Face model directory "
                  "(--set model.path=DIR)");
    }
  }
  const auto config = trainer::read_hf_config(model_dir);
  std::optional<trainer::TrainingMemorySetup> setup;
  std::vector<std::string> memory_plan;  // what train.memory chose (auto: on a GPU, unless train.device is cpu)
  if (recipe) {
    const bool on_gpu = recipe->train.device != "cpu";
    // Fitted to this machine's first GPU where it has one (a run on another GPU may choose otherwise).
    const double device_bytes = on_gpu && torch::cuda::is_available() ? trainer::device_free_bytes(torch::Device(torch::kCUDA, 0)) : 0;
    memory_plan = trainer::describe_memory_plan(
        *recipe, trainer::plan_memory(*recipe, config.llama, on_gpu, device_bytes), on_gpu);
    setup = trainer::training_memory_setup(*recipe, config.llama);
  }
  if (setup && recipe->quant == trainer::QuantMethod::kNone && trainer::is_compressed_tensors_checkpoint(config)) {
    // The checkpoint's projections stay in their stored form (scales in the compute dtype's bytes).
    const auto parsed = trainer::parse_compressed_tensors_config(config.json, config.path);
    const int64_t scale_bytes = static_cast<int64_t>(c10::elementSize(setup->compute_dtype));
    setup->stored_projection_bytes = [parsed, scale_bytes](const std::string& name, int64_t out, int64_t in) {
      return trainer::compressed_tensors_stored_bytes(parsed, name, out, in, scale_bytes);
    };
  }
  print_model(model_dir, config);
  print_compressed_tensors(config);
  if (setup) {
    print_peak_estimate(recipe_path, *setup, config.llama);
    for (const auto& line : memory_plan) std::printf("%s\n", line.c_str());
  } else {
    print_training_modes(config.llama, lora_rank);
  }
  return 0;
}

}  // namespace qtrain::tools
