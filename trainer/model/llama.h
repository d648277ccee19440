#pragma once
// A Llama-style decoder as LibTorch modules: LlamaForCausalLM, and with the switches of
// LlamaOptions the Mistral, Qwen, Gemma and Phi-3 families (trainer/model/model_families.h). Parameter
// names are Hugging Face's (`model.layers.3.self_attn.q_proj.weight`), so checkpoints and peft
// adapters map by name.
// The numerics follow transformers: RMSNorm and rotary tables in fp32, the residual stream in
// the compute dtype, attention through scaled_dot_product_attention.
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qat/linear.h"
#include "trainer/model/attention_mask.h"
#include "trainer/model/feed_forward.h"
#include "trainer/model/host_resident_weight.h"
#include "trainer/model/llama_options.h"
#include "trainer/model/projections.h"

namespace qtrain::trainer {

class RMSNormImpl : public torch::nn::Module {
 public:
  // The weight starts at the identity: ones (Llama) or zeros (Gemma's 1 + w).
  RMSNormImpl(int64_t hidden_size, double eps, torch::ScalarType dtype, NormStyle style = NormStyle::kLlama);
  // x [..., hidden] in any dtype; normalised in fp32, scaled as `style` says (llama_options.h).
  torch::Tensor forward(const torch::Tensor& x);
  // forward(x), for projections whose adapters would keep the output for A's gradient: with grad
  // on, `rebuild` makes it again bit for bit from x, which this norm's backward keeps anyway, so
  // they keep that instead ([tokens, hidden] less per norm and layer). The first backward to call
  // it makes the output; the others read that tensor, which goes when the last one lets go.
  struct Rebuildable {
    torch::Tensor value;
    qat::LinearLayer::InputRebuild rebuild;  // empty without grad
  };
  Rebuildable forward_rebuildable(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
  NormStyle style_;
};
TORCH_MODULE(RMSNorm);

// cos and sin tables for rotary embeddings, computed in fp32 as transformers does.
class RotaryEmbedding {
 public:
  // `rope`: the settings of the layers it serves (options.rope, or options.sliding_rope).
  RotaryEmbedding(const LlamaOptions& options, const RopeOptions& rope);
  // position_ids [batch, seq] -> (cos, sin) [batch, seq, rotary_dim] in `dtype`.
  std::pair<torch::Tensor, torch::Tensor> tables(const torch::Tensor& position_ids, torch::ScalarType dtype) const;

 private:
  torch::Tensor inverse_frequencies(int64_t sequence_length, const torch::Device& device) const;
  LlamaOptions options_;
  torch::Tensor inverse_frequencies_;       // [rotary_dim / 2], fp32
  torch::Tensor long_inverse_frequencies_;  // longrope's beyond the original context
};

// One decoder layer's keys and values of the positions processed so far, so that generation
// runs each new token through the model alone (its query against every cached key).
// Keys are stored after the rotary embedding, as transformers' cache holds them.
class LayerKeyValues {
 public:
  // key, value [batch, kv_heads, new, head_dim] -> every position's keys and values
  // [batch, kv_heads, length(), head_dim] (views into a buffer that grows by doubling).
  std::pair<torch::Tensor, torch::Tensor> append(const torch::Tensor& key, const torch::Tensor& value);
  int64_t length() const { return length_; }

 private:
  torch::Tensor keys_, values_;  // [batch, kv_heads, capacity, head_dim], the model's dtype
  int64_t length_ = 0;
};

// The key/value cache of a whole model: one LayerKeyValues per decoder layer. A forward pass
// given a cache (LlamaInputs::cache) continues the sequence it holds: positions start at
// length() and the new tokens attend to the cached ones and causally among themselves.
class KeyValueCache {
 public:
  explicit KeyValueCache(int64_t num_layers) : layers_(static_cast<size_t>(num_layers)) {}
  LayerKeyValues& layer(int64_t index) { return layers_.at(static_cast<size_t>(index)); }
  int64_t length() const { return layers_.empty() ? 0 : layers_.front().length(); }

 private:
  std::vector<LayerKeyValues> layers_;
};

// The attention's projections, named relative to it (`q_proj`: model.layers.N.self_attn.q_proj),
// in the order it registers them.
std::vector<ProjectionShape> attention_projections(const LlamaOptions& options);

// The blocks holding projections implement qat::LinearLayerOwner, so that swapping one (LoRA,
// QAT) updates the pointer forward() calls as well as the registered child.
class LlamaAttentionImpl : public torch::nn::Module, public qat::LinearLayerOwner {
 public:
  // sliding_window > 0: each query sees only the keys of the last sliding_window positions.
  LlamaAttentionImpl(const LlamaOptions& options, const std::string& prefix, const LinearFactory& make_linear,
                     torch::ScalarType dtype, int64_t sliding_window = 0);
  // hidden [batch, seq, hidden]; attention_mask: undefined (causal), a packed batch's samples or
  // a written-out mask (trainer/model/attention_mask.h). With `cache`, the sequence continues the
  // cached one (causal over cached + new positions; no attention_mask then). `rebuild_hidden`:
  // LinearLayer::forward_rebuilding_input's, for q, k and v.
  torch::Tensor forward(const torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                        const AttentionMask& attention_mask, LayerKeyValues* cache = nullptr,
                        const qat::LinearLayer::InputRebuild& rebuild_hidden = {});
  void replace_linear(const std::string& child_name, std::shared_ptr<qat::LinearLayer> layer) override;
  std::shared_ptr<qat::LinearLayer> q_proj, k_proj, v_proj, o_proj;
  std::shared_ptr<qat::LinearLayer> qkv_proj;  // instead of q, k and v: LlamaOptions::fused_projections
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  // LlamaOptions::query_key_norm only
  torch::Tensor sinks;                        // LlamaOptions::attention_sinks only: [heads]

 private:
  std::shared_ptr<qat::LinearLayer>* slot(const std::string& child_name);
  // attended [batch, heads, seq, head_dim] -> o_proj's output, a value a checkpointed layer may
  // keep for its recomputation (kept_in_recomputation), which then leaves out o_proj's product.
  torch::Tensor project_output(const torch::Tensor& attended);
  int64_t num_heads_, num_key_value_heads_, head_dim_;
  int64_t sliding_window_;
  double scale_;    // of the scores
  double softcap_;  // 0: none
};
TORCH_MODULE(LlamaAttention);

class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  // Decoder layer `layer` (model.layers.LAYER), its window and feed-forward block as `options` say.
  LlamaDecoderLayerImpl(const LlamaOptions& options, int64_t layer, const LinearFactory& make_linear,
                        torch::ScalarType dtype);
  torch::Tensor forward(const torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                        const AttentionMask& attention_mask, LayerKeyValues* cache = nullptr);
  // Run the feed-forward block (with its norms and residual add) over slices of this many tokens,
  // each its own checkpoint (recomputed in backward), so no [tokens, intermediate] tensor exists
  // whole: long sequences. 0: the whole input at once.
  void set_mlp_chunk_tokens(int64_t tokens) { mlp_chunk_tokens_ = tokens; }
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  // LlamaOptions::sandwich_norms only (Gemma): around the feed-forward block.
  RMSNorm pre_feedforward_layernorm{nullptr}, post_feedforward_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  // The block LlamaOptions::feed_forward names (trainer/model/feed_forward.h), registered under
  // its row's module_name.
  FeedForward mlp{nullptr};

 private:
  // residual + the feed-forward sublayer: the layer's (or an MLP chunk's) output, which a
  // recomputation does not read (FeedForwardImpl::forward_for_graph)
  torch::Tensor feed_forward(const torch::Tensor& residual);
  torch::Tensor feed_forward_in_chunks(const torch::Tensor& residual);
  int64_t mlp_chunk_tokens_ = 0;
};
TORCH_MODULE(LlamaDecoderLayer);

// The `model.` part of LlamaForCausalLM: embeddings, decoder layers, final norm.
class LlamaBackboneImpl : public torch::nn::Module {
 public:
  LlamaBackboneImpl(const LlamaOptions& options, const LinearFactory& make_linear, torch::ScalarType dtype);
  // input_ids [batch, seq] int64 -> hidden [batch, seq, hidden] in the model dtype in two parts
  // (LlamaForCausalLMImpl::hidden_states starts lm_head's copy between them): the input rows of
  // input_ids on input_ids' device (Gemma's scale applied). host_input_ids: the
  // same ids on the host where the caller has them (LlamaInputs').
  torch::Tensor embed(const torch::Tensor& input_ids, const torch::Tensor& host_input_ids = {});
  // The decoder layers and the final norm over embed's rows; `at_layer`, where given, is called
  // with each layer's index as it starts, after set_before_layer's hook.
  torch::Tensor forward_embedded(torch::Tensor hidden, const torch::Tensor& position_ids,
                                 const AttentionMask& attention_mask, KeyValueCache* cache = nullptr,
                                 const std::function<void(size_t)>& at_layer = nullptr);
  // Recompute every k-th decoder layer in backward instead of keeping its activations
  // (trainer/model/activation_checkpoint.h); 0 turns it off. Only while training with grad enabled.
  void set_gradient_checkpointing(int64_t every_k_layers) { checkpoint_every_ = every_k_layers; }
  // With checkpointing: the checkpointed layers' inputs wait in pinned host memory until their
  // backward (trainer/model/activation_offload.h).
  void set_activation_offloading(bool offload) { offload_activations_ = offload; }
  // train.offload_branch_outputs: with checkpointing and offloading, each layer's attention output
  // (and, under Gemma's sandwich norms, its MLP's) waits on the host too, so that the layer's
  // recomputation leaves out the products that made them (kept_in_recomputation).
  void set_branch_output_offloading(bool offload) { offload_branch_outputs_ = offload; }
  // Every decoder layer's feed-forward block in slices of this many tokens
  // (LlamaDecoderLayerImpl); 0: whole.
  void set_mlp_chunk_tokens(int64_t tokens);
  // With checkpointing: whether a recomputed layer keeps the weights it built (dequantized,
  // fake-quantized) for its backward (qat::KeepBuiltWeights), or builds them again there.
  void set_keep_built_weights(bool keep) { keep_built_weights_ = keep; }
  // train.expert_bank_block_mb: a frozen expert bank built again in backward is built at most
  // this many bytes at a time (qat::BuildBanksInBlocks); 0: whole. The checkpointed forward
  // builds a bank whole where it is at most `bytes`, plus the trained weights' gradients, plus
  // `recomputed_layer_bytes` (what one recomputed layer saves: the memory estimate's figure),
  // which backward holds beside its blocks and the forward does not (qat::WholeBanksWithoutGrad).
  void set_expert_bank_block_bytes(int64_t bytes, int64_t recomputed_layer_bytes = 0) {
    expert_bank_block_bytes_ = bytes;
    recomputed_layer_bytes_ = recomputed_layer_bytes;
  }
  // The bytes of the weights that train here: their gradients, which backward holds.
  int64_t trained_weight_bytes();
  // Called with each decoder layer's index just before the layer runs forward (never in its
  // recomputation): trainer/deferred_update.h applies the layer's share of the last update there.
  void set_before_layer(std::function<void(size_t)> hook) { before_layer_ = std::move(hook); }
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};

 private:
  LlamaOptions options_;
  std::function<void(size_t)> before_layer_;
  RotaryEmbedding rotary_;
  std::optional<RotaryEmbedding> sliding_rotary_;  // LlamaOptions::sliding_rope
  int64_t checkpoint_every_ = 0;
  bool offload_activations_ = false;
  bool offload_branch_outputs_ = false;
  bool keep_built_weights_ = true;
  int64_t expert_bank_block_bytes_ = 0;
  int64_t recomputed_layer_bytes_ = 0;
};
TORCH_MODULE(LlamaBackbone);

struct LlamaInputs {
  torch::Tensor input_ids;       // [batch, seq] int64
  torch::Tensor position_ids;    // [batch, seq] int64; undefined = 0..seq-1 for every row
  AttentionMask attention_mask;  // undefined = causal
  // Generation: the keys and values of the tokens before input_ids, extended by the forward
  // pass; default position_ids then start at cache->length(). Inference only.
  KeyValueCache* cache = nullptr;
  // The same ids on the host, where the caller has them (a training batch): train.embeddings_on_host
  // gathers the rows there without copying the ids back, a copy that waits for the device.
  torch::Tensor host_input_ids;
};

class LlamaForCausalLMImpl : public torch::nn::Module, public qat::LinearLayerOwner {
 public:
  LlamaForCausalLMImpl(const LlamaOptions& options, torch::ScalarType dtype,
                       const LinearFactory& make_linear = dense_linear_factory());
  // [batch, seq, hidden]: the final normed hidden states (the loss projects them in chunks).
  torch::Tensor hidden_states(const LlamaInputs& inputs);
  // [batch, seq, vocab] in the model dtype.
  torch::Tensor forward(const LlamaInputs& inputs);
  // Where the model computes: its final norm's device (the input embedding table may stay on the
  // host, train.embeddings_on_host).
  torch::Device device() const { return model->norm->weight.device(); }
  // hidden [..., hidden] -> [..., vocab], soft-capped where the family caps them (Gemma 2).
  torch::Tensor logits(const torch::Tensor& hidden);
  void replace_linear(const std::string& child_name, std::shared_ptr<qat::LinearLayer> layer) override;
  const LlamaOptions& options() const { return options_; }
  torch::ScalarType dtype() const { return dtype_; }
  // The load-balancing loss the training loss adds (trainer/model/router_loss.h): for a mixture of
  // experts whose config.json sets output_router_logits, else null.
  RouterLoss* router_loss() const { return router_loss_.get(); }

  // train.lm_head_on_host: lm_head's frozen weight waits in pinned host memory and visits the
  // device for each use (trainer/model/host_resident_weight.h). Needs a plain (qat::DenseLinear)
  // lm_head, an Error naming the key otherwise, or a tied one: the input table, which then waits
  // pinned on the host for the rows' gather too (train.embeddings_on_host with it). It must not
  // train (apply_recipe_memory_settings refuses such recipes; logits() such a model). On a CPU
  // nothing moves.
  void keep_lm_head_on_host();
  bool lm_head_on_host() const { return host_lm_head_ != nullptr; }
  // The host-kept weight starts for the device with the next hidden_states(), once that batch's
  // embedding rows are queued (a copy engine runs one copy at a time: a gigabyte of head ahead of
  // them held up the first layer), and arrives while the layers run forward (the training step
  // calls it first); nothing unless lm_head_on_host().
  void prefetch_lm_head();
  // With lm_head_on_host(): its weight on the device, the prefetched copy or one made now, for
  // the caller to let go of after its use; and its bias there (undefined when it has none).
  torch::Tensor take_lm_head_weight();
  torch::Tensor lm_head_bias_on_device() const;
  // train.lm_head_block_mb: with lm_head_on_host(), the fused loss takes lm_head from the host a
  // vocabulary tile at a time, at most this many bytes of it on the device at once, and the
  // prefetch queues that many bytes of its first tiles; 0: the weight visits whole.
  void set_lm_head_block_bytes(int64_t bytes) { lm_head_block_bytes_ = bytes; }
  int64_t lm_head_block_bytes() const { return lm_head_block_bytes_; }
  // The host-kept weight (lm_head_on_host()), for the fused loss's tiles; null otherwise.
  HostResidentWeight* host_lm_head() const { return host_lm_head_.get(); }

  LlamaBackbone model{nullptr};
  std::shared_ptr<qat::LinearLayer> lm_head;  // null when tied to model.embed_tokens

 private:
  LlamaOptions options_;
  torch::ScalarType dtype_;
  std::unique_ptr<HostResidentWeight> host_lm_head_;
  bool lm_head_prefetch_pending_ = false;  // prefetch_lm_head() asked; hidden_states() starts it
  int64_t lm_head_block_bytes_ = 0;
  void prefetch_host_lm_head(const torch::Tensor& input_ids);  // whole, or its first tiles
  std::shared_ptr<RouterLoss> router_loss_;
};
TORCH_MODULE(LlamaForCausalLM);

}  // namespace qtrain::trainer
