#include "trainer/recipe/recipe_training.h"

#include <algorithm>

#include "kernels/error.h"
#include "qat/compressed_linear.h"
#include "qat/expert_linear.h"
#include "qat/gguf_file_types.h"
#include "qat/quant_format.h"
#include "trainer/model/causal_lm_loss.h"
#include "trainer/formats/gguf_export.h"
#include "trainer/formats/hf_config.h"
#include "trainer/recipe/base_quantization.h"
#include "trainer/recipe/model_memory.h"

namespace qtrain::trainer {

PeftAdapterConfig lora_adapter_config(const Recipe& recipe) {
  if (!recipe.lora.init_from.empty()) return read_peft_adapter_config(recipe.lora.init_from);
  PeftAdapterConfig config;
  config.lora.rank = recipe.lora.rank;
  config.lora.alpha = recipe.lora.alpha;
  config.lora.dropout = recipe.lora.dropout;
  config.lora.rslora = recipe.lora.rslora;
  config.lora.dora = recipe.lora.use_dora;
  config.targets.include.names = recipe.lora.target_modules;
  return config;
}

void require_model_projections(const LlamaOptions& model, const std::vector<std::string>& target_modules,
                               const std::string& key) {
  // The names a Llama layer has and this model's do not: what its blocks fused or name otherwise.
  const auto names = model.projection_names();
  std::string listed;
  for (const auto& name : names) listed += (listed.empty() ? "[" : ", ") + name;
  for (const auto& entry : target_modules) {
    for (const auto& name : decoder_projection_names()) {
      // The model has it as a block's child too ("experts.down_proj": a mixture of experts' bank).
      const bool has = std::any_of(names.begin(), names.end(), [&](const std::string& own) {
        return own == name || (own.size() > name.size() && own.compare(own.size() - name.size() - 1, std::string::npos, "." + name) == 0);
      });
      if (has) continue;
      const bool names_it = entry == name || (entry.size() > name.size() && entry.compare(entry.size() - name.size() - 1,
                                                                                          std::string::npos, "." + name) == 0);
      if (!names_it) continue;
      throw Error(ErrorCode::kRecipe,
                  key + " names '" + entry + "', which this model does not have: its decoder layers' projections are " +
                  listed + "] (peft's names; a fused one joins the projections it replaces). Target those or all-linear");
    }
  }
}

void require_lora_on_experts_supported(const LlamaOptions& model, const Recipe& recipe) {
  if (model.feed_forward != FeedForwardKind::kExperts || (recipe.lora.dropout == 0 && !recipe.lora.use_dora)) return;
  const auto targets = lora_adapter_config(recipe).targets;
  for (const auto& shape : feed_forward_row(model).projections(model)) {
    if (shape.experts == 0 || !targets.matches(std::string(feed_forward_row(model).module_name) + "." + shape.name)) continue;
    const std::string key = recipe.lora.use_dora ? "lora.use_dora" : "lora.dropout";
    throw Error(ErrorCode::kRecipe, key + " is set, and lora.target_modules selects the experts' '" + shape.name +
                "': peft trains expert parameters without dropout or DoRA (its ParamWrapper refuses them, so it could not "
                "load the adapter); set " + (recipe.lora.use_dora ? "lora.use_dora: false" : "lora.dropout: 0") +
                ", or leave gate_up_proj / down_proj out of lora.target_modules");
  }
}

LoadedModel load_base_model(const Recipe& recipe, torch::ScalarType dtype, const torch::Device& device,
                            bool quantize_base) {
  ModelLoadOptions options;
  options.dtype = dtype;
  auto loaded = load_llama(recipe.model.path, options);
  // A compressed-tensors base stays in its stored form under quant: none; QLoRA quantizes it
  // again (NF4, ...) and QAT trains on its weights, from the decompressed values.
  if (recipe.quant != QuantMethod::kNone) qat::decompress_stored_linear_layers(*loaded.model, dtype);
  if (quantize_base) {
    auto base = base_quantization(recipe, dtype, device);
    for (auto& name : dense_base_projections(loaded.config.llama)) base.skip_modules.push_back(std::move(name));
    base_quantization_row(base.kind).quantize(*loaded.model, base);
  }
  return loaded;
}

namespace {

qat::FakeQuantizerOptions fake_quantizer_options(const QuantizerRecipe& quantizer, const std::string& what) {
  qat::FakeQuantizerOptions options;
  auto& spec = options.spec;
  if (quantizer.format == qat::QuantFormat::kGguf) {
    // The file type's main block type; apply_recipe_qat gives each layer its own.
    spec = qat::QuantSpec::gguf_block_type(qat::find_gguf_file_type(quantizer.gguf_type, what + ".gguf_type").base_type);
  }
  spec.format = quantizer.format;
  if (!spec.is_gguf_block()) {
    spec.bits = spec.is_integer() ? quantizer.bits : spec.format_info().bits;
    spec.symmetric = quantizer.symmetric;
    spec.granularity = qat::parse_granularity(quantizer.granularity, what + ".granularity");
    spec.group_size = quantizer.group_size;
    spec.scale_dtype = parse_dtype_name(quantizer.scale_dtype, what + ".scale_dtype");
    spec.zero_point_domain = qat::parse_zero_point_domain(quantizer.zero_point_domain, what + ".zero_point_domain");
  }
  spec.validate(what);
  options.observer = qat::parse_observer_kind(quantizer.observer, what + ".observer");
  options.momentum = quantizer.momentum;
  options.learned_scale = quantizer.learned_scale;
  options.learned_scale_init =
      quantizer.learned_scale_init == "paper" ? qat::LearnedScaleInit::kPaper : qat::LearnedScaleInit::kObserver;
  return options;
}

}  // namespace

qat::QatLinearOptions qat_linear_options(const Recipe& recipe) {
  qat::QatLinearOptions options;
  if (!recipe.qat.weights.scheme.empty()) {
    // A compressed-tensors preset: its grids, scales from the current values at every step.
    const auto& preset = qat::find_quant_preset(recipe.qat.weights.scheme, "qat.weights.scheme");
    options.weights.spec = qat::QuantSpec::compressed_tensors_weights(preset);
    options.weights.observer = qat::ObserverKind::kDynamic;
    if (preset.quantizes_activations) {
      qat::FakeQuantizerOptions activations;
      activations.spec = qat::QuantSpec::compressed_tensors_activations(preset);
      activations.observer = qat::ObserverKind::kDynamic;
      options.activations = activations;
    }
  } else {
    options.weights = fake_quantizer_options(recipe.qat.weights, "qat.weights");
    if (recipe.qat.activations.bits != 0) {
      options.activations = fake_quantizer_options(recipe.qat.activations, "qat.activations");
    }
  }
  options.lora_gradient = qat::parse_lora_gradient(recipe.qat.lora_gradient, "qat.lora_gradient");
  return options;
}

std::vector<std::string> apply_recipe_qat(torch::nn::Module& model, const Recipe& recipe, const HfModelConfig* config) {
  if (recipe.quant != QuantMethod::kQat) return {};
  qat::LoraTargets targets;
  targets.include.names = recipe.qat.target_modules;
  // A mixture of experts' banks multiply grouped by expert, which QAT's layers do not.
  for (const auto& [name, experts] : qat::expert_banks(model)) {
    if (!targets.matches(name)) continue;
    throw Error(ErrorCode::kRecipe, "qat.target_modules selects the expert bank '" + name +
                "': QAT on experts is not implemented; leave gate_up_proj / down_proj out of qat.target_modules "
                "(the experts keep the frozen base, and LoRA may train them)");
  }
  auto options = qat_linear_options(recipe);
  if (options.weights.spec.is_gguf_block()) {
    const std::string key = "qat.weights.gguf_type";
    if (config == nullptr) throw Error(ErrorCode::kUsage, key + ": training on a GGUF file type's blocks needs the model's config.json");
    const auto& file_type = qat::find_gguf_file_type(recipe.qat.weights.gguf_type, key);
    options.weight_spec_of = [types = gguf_layer_types(model, *config, file_type), &file_type, key](const std::string& name) {
      const auto type = types.find(name);
      if (type == types.end()) throw Error(ErrorCode::kInternal, key + ": no GGUF type for layer " + name);
      if (!qat::gguf_block_format(type->second).integer_codes) {
        throw Error(ErrorCode::kRecipe, key + ": " + file_type.name + " writes " + name + " as " + qat::gguf_block_format(type->second).name +
                    " (its rows are not a multiple of 32), which has no grid to train on: leave it out of qat.target_modules");
      }
      return qat::QuantSpec::gguf_block_type(type->second);
    };
  }
  return qat::apply_qat(model, targets, options, "qat");
}

std::string gguf_export_type(const Recipe& recipe) {
  const bool trained_on_gguf = recipe.quant == QuantMethod::kQat && recipe.qat.weights.format == qat::QuantFormat::kGguf;
  if (recipe.export_.gguf_type == qat::kGgufFileTypeAuto && trained_on_gguf) return recipe.qat.weights.gguf_type;
  return recipe.export_.gguf_type;
}

const qat::QuantPreset& compressed_tensors_export_scheme(const Recipe& recipe) {
  if (recipe.export_.scheme != "auto") return qat::find_quant_preset(recipe.export_.scheme, "export.scheme");
  const bool trained_on_preset = recipe.quant == QuantMethod::kQat && !recipe.qat.weights.scheme.empty();
  return qat::find_quant_preset(trained_on_preset ? recipe.qat.weights.scheme : "W4A16", "qat.weights.scheme");
}

namespace {

bool is_fake_quant_state(const std::string& name) {
  return name.find("weight_fake_quant.") != std::string::npos ||
         name.find("activation_fake_quant.") != std::string::npos;
}

}  // namespace

bool is_trained_parameter(const Recipe& recipe, const std::string& name) {
  if (trains_full_weights(recipe)) return true;
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos ||
         name.find(".lora_magnitude_vector") != std::string::npos ||
         is_fake_quant_state(name);
}

TrainedParameters mark_trained_parameters(torch::nn::Module& model, const Recipe& recipe) {
  TrainedParameters trained;
  for (auto& item : model.named_parameters()) {
    const bool trains = is_trained_parameter(recipe, item.key());
    item.value().set_requires_grad(trains);
    if (!trains) continue;
    trained.names.push_back(item.key());
    trained.tensors.push_back(item.value());
    trained.count += item.value().numel();
  }
  return trained;
}

std::unique_ptr<optim::Optimizer> recipe_optimizer(const Recipe& recipe, std::vector<torch::Tensor> parameters) {
  const auto& optim = recipe.optim;
  return optim::make_optimizer(optim.name, std::move(parameters), optim.lr, optim.weight_decay,
                               {optim.betas.at(0), optim.betas.at(1)}, optim.eps);
}

std::vector<std::pair<std::string, torch::Tensor>> qat_state_buffers(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, torch::Tensor>> buffers;
  for (const auto& item : model.named_buffers()) {
    if (is_fake_quant_state(item.key())) buffers.emplace_back(item.key(), item.value());
  }
  return buffers;
}

namespace {

// train.lm_head_on_host, refused where the recipe will train, adapt or fake-quantize lm_head
// (LoRA and QAT wrap it after this, so the recipe says it, not the model yet).
void keep_lm_head_on_host(LlamaForCausalLMImpl& model, const Recipe& recipe) {
  const std::string why = lm_head_on_host_refusal(recipe, model.options().tie_word_embeddings);
  if (!why.empty()) {
    throw Error(ErrorCode::kRecipe, "train.lm_head_on_host keeps a frozen plain lm_head on the host, but " + why +
                                        ": set train.lm_head_on_host: false");
  }
  model.keep_lm_head_on_host();
}

// What one recomputed layer saves for its backward (the memory estimate's figure), where expert
// banks build in blocks under checkpointing; 0 where the estimate does not model the run (some
// QAT setups): the forward then weighs a whole bank against the block and the gradients alone.
int64_t recomputed_layer_bytes(const Recipe& recipe, const LlamaOptions& model) {
  if (recipe.train.expert_bank_block_mb <= 0 || !recipe.train.gradient_checkpointing) return 0;
  try {
    return static_cast<int64_t>(estimate_peak_memory(model, training_memory_setup(recipe, model)).recomputed_layer_bytes);
  } catch (const Error&) {
    return 0;
  }
}

}  // namespace

void apply_recipe_memory_settings(LlamaForCausalLMImpl& model, const Recipe& recipe) {
  auto& backbone = *model.model;
  backbone.set_gradient_checkpointing(recipe.train.gradient_checkpointing ? recipe.train.gradient_checkpointing_every : 0);
  backbone.set_activation_offloading(recipe.train.offload_activations);
  if (recipe.train.offload_branch_outputs && !recipe.train.offload_activations) {
    throw Error(ErrorCode::kRecipe, "train.offload_branch_outputs keeps the layers' branch outputs where "
                                    "train.offload_activations keeps their inputs, on the host: set "
                                    "train.offload_activations: true (or train.memory: auto, which does on a GPU), or "
                                    "train.offload_branch_outputs: false");
  }
  backbone.set_branch_output_offloading(recipe.train.offload_branch_outputs);
  if (recipe.train.mlp_chunk_tokens > 0 && recipe.quant == QuantMethod::kQat && recipe.qat.activations.bits > 0) {
    // Dynamic per-tensor scales and observers would see one chunk's inputs, not the batch's.
    throw Error(ErrorCode::kRecipe,
                "train.mlp_chunk_tokens runs the MLP a chunk of tokens at a time, which would change what "
                "qat.activations measures its ranges over: set train.mlp_chunk_tokens: 0 or qat.activations.bits: 0");
  }
  backbone.set_mlp_chunk_tokens(recipe.train.mlp_chunk_tokens);
  backbone.set_expert_bank_block_bytes(recipe.train.expert_bank_block_mb << 20,
                                       recomputed_layer_bytes(recipe, model.options()));
  backbone.set_keep_built_weights(recipe.train.keep_built_weights);
  if (recipe.train.embeddings_on_host) {
    const std::string why = embeddings_on_host_refusal(recipe, model.options().tie_word_embeddings);
    if (!why.empty()) {
      throw Error(ErrorCode::kRecipe, "train.embeddings_on_host keeps the frozen input embedding table on the host, but " +
                                          why + ": set train.embeddings_on_host: false");
    }
  }
  // A tied table goes with lm_head: pinned, for the copies to the loss.
  if (recipe.train.lm_head_on_host) keep_lm_head_on_host(model, recipe);
  if (recipe.train.lm_head_block_mb > 0) {
    const char* missing = !recipe.train.lm_head_on_host ? "train.lm_head_on_host: true"
                          : !recipe.train.fused_loss    ? "train.fused_loss: true"
                                                        : nullptr;
    if (missing) {
      throw Error(ErrorCode::kRecipe, "train.lm_head_block_mb brings lm_head from the host to the fused loss a tile at "
                                      "a time, which needs " + std::string(missing) +
                                      ": set it, or train.lm_head_block_mb: 0");
    }
    model.set_lm_head_block_bytes(recipe.train.lm_head_block_mb << 20);
  }
  if (recipe.train.embeddings_on_host) backbone.embed_tokens->to(torch::kCPU);
}

std::string lm_head_on_host_refusal(const Recipe& recipe, bool tied_embeddings) {
  if (tied_embeddings && is_trained_parameter(recipe, "model.embed_tokens.weight")) {
    return "this run trains model.embed_tokens.weight, which is also lm_head's (tie_word_embeddings)";
  }
  if (is_trained_parameter(recipe, "lm_head.weight")) return "this run trains lm_head.weight";
  if (!trains_full_weights(recipe) && lora_adapter_config(recipe).targets.matches("lm_head")) {
    return "the adapters' target modules include lm_head";
  }
  qat::LoraTargets fake_quantized;
  fake_quantized.include.names = recipe.qat.target_modules;
  if (recipe.quant == QuantMethod::kQat && fake_quantized.matches("lm_head")) return "qat.target_modules includes lm_head";
  if (tied_embeddings && !recipe.train.embeddings_on_host) {
    return "this model ties lm_head to its input embeddings (tie_word_embeddings): the one table goes to the host "
           "with train.embeddings_on_host: true as well";
  }
  return "";
}

std::string embeddings_on_host_refusal(const Recipe& recipe, bool tied_embeddings) {
  if (is_trained_parameter(recipe, "model.embed_tokens.weight")) return "this run trains model.embed_tokens.weight";
  if (tied_embeddings && !recipe.train.lm_head_on_host) {
    return "this model ties lm_head to its input embeddings (tie_word_embeddings), which the loss needs on the "
           "device: the one table goes to the host with train.lm_head_on_host: true as well, and visits the GPU "
           "for the loss";
  }
  return "";
}

int64_t loss_chunk_tokens(const Recipe& recipe, int64_t vocab_size) {
  return recipe.train.loss_chunk_tokens > 0 ? recipe.train.loss_chunk_tokens : auto_loss_chunk_tokens(vocab_size);
}

}  // namespace qtrain::trainer
