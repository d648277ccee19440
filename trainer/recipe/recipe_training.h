#pragma once
// Recipe sections that Finetune and the memory estimate (trainer/recipe/model_memory.h) must read the
// same way, in one place.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "optim/optimizer.h"
#include "qat/qat_linear.h"
#include "qat/quant_presets.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/peft_adapter.h"
#include "trainer/recipe/recipe.h"

namespace qtrain::trainer {

// The adapters a run trains: lora.init_from's own configuration when it is set, else the
// recipe's lora section.
PeftAdapterConfig lora_adapter_config(const Recipe& recipe);

// A recipe's target list (`key`: lora.target_modules or qat.target_modules) must not name a
// projection the model fused (Phi-3's q/k/v_proj in qkv_proj, gate/up_proj in gate_up_proj):
// those would match nothing and leave the model partly unadapted. Error naming the fused names.
void require_model_projections(const LlamaOptions& model, const std::vector<std::string>& target_modules,
                               const std::string& key);

// The frozen base of a run as training builds it: model.path loaded on the CPU in `dtype`, and
// for quant: qlora its linear layers quantized with the qlora section's format on `device`
// (where the packed weights stay; the rest of the model is still on the CPU). quantize_base
// false skips that, for callers that only need the model's shapes and names.
// A recipe whose LoRA reaches a mixture of experts' banks with dropout or DoRA: an Error naming the
// key (peft cannot load such an adapter).
void require_lora_on_experts_supported(const LlamaOptions& model, const Recipe& recipe);

LoadedModel load_base_model(const Recipe& recipe, torch::ScalarType dtype, const torch::Device& device = torch::kCPU,
                            bool quantize_base = true);

// quant: qat: the fake quantizers of the qat section (a float format takes its own width; an
// activations width of 0 quantizes no inputs). Error naming the key (`qat.weights.bits`) when a
// spec cannot work (Finetune and qtrain quantize call it before loading the model, to fail fast).
qat::QatLinearOptions qat_linear_options(const Recipe& recipe);

// For quant: qat, wraps the qat.target_modules of `model` in fake quantizers (LoRA layers as a
// whole, so the merged weight is what is quantized: apply LoRA first) and returns their names;
// for other quant modes, nothing. qat.weights.format gguf gives each layer the block type of its
// tensor in a llama.cpp file of qat.weights.gguf_type, which needs the model's `config`.
std::vector<std::string> apply_recipe_qat(torch::nn::Module& model, const Recipe& recipe,
                                          const HfModelConfig* config = nullptr);

// The llama.cpp file type a GGUF export of a run of `recipe` writes: export.gguf_type, whose auto
// means qat.weights.gguf_type for a run that trained on a GGUF file type's blocks.
std::string gguf_export_type(const Recipe& recipe);

// The compressed-tensors preset an export of a run of `recipe` writes: export.scheme, whose auto
// means qat.weights.scheme for a run that trained on one, W4A16 otherwise.
const qat::QuantPreset& compressed_tensors_export_scheme(const Recipe& recipe);

// Whether the parameter `name` trains in a run of `recipe`: every parameter when the run trains
// the full weights, else the LoRA adapters'; and the learned QAT scales either way.
bool is_trained_parameter(const Recipe& recipe, const std::string& name);

// Sets requires_grad on every parameter of `model` by is_trained_parameter and returns the
// trained ones, by name, in module order (what the optimizer steps and a checkpoint saves).
struct TrainedParameters {
  std::vector<std::string> names;
  std::vector<torch::Tensor> tensors;
  int64_t count = 0;  // elements
};
TrainedParameters mark_trained_parameters(torch::nn::Module& model, const Recipe& recipe);

// The optim section's optimizer over `parameters` (the key table has checked optim.betas' length).
std::unique_ptr<optim::Optimizer> recipe_optimizer(const Recipe& recipe, std::vector<torch::Tensor> parameters);

// What a checkpoint must carry besides the trained parameters for a QAT run to continue (or be
// exported) as it was: the quantizers' buffers (observer ranges, zero points, whether a learned
// scale was initialised), by name, in module order.
std::vector<std::pair<std::string, torch::Tensor>> qat_state_buffers(const torch::nn::Module& model);

// What the train section says about memory, applied to a model already on its device: gradient
// checkpointing (every k-th layer), activation offloading, the MLP's chunks, the built weights
// of a recomputed layer, train.lm_head_on_host (LlamaForCausalLMImpl::keep_lm_head_on_host) and
// train.embeddings_on_host (the input embedding table moves back to the host; an Error naming the
// key when the table is tied to lm_head or trains).
void apply_recipe_memory_settings(LlamaForCausalLMImpl& model, const Recipe& recipe);

// Why the frozen lm_head / input embedding table of this run cannot wait on the host (tied to
// each other, trained, adapted, fake-quantized), or "" when it can: the errors of
// train.lm_head_on_host / train.embeddings_on_host, and what train.memory: auto asks.
std::string lm_head_on_host_refusal(const Recipe& recipe, bool tied_embeddings);
std::string embeddings_on_host_refusal(const Recipe& recipe, bool tied_embeddings);

// train.loss_chunk_tokens, or the automatic chunk for the model's vocabulary when it is 0.
int64_t loss_chunk_tokens(const Recipe& recipe, int64_t vocab_size);

}  // namespace qtrain::trainer
