#include "trainer/model/llama.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "kernels/error.h"
#include "trainer/model/activation_checkpoint.h"
#include "trainer/model/attention_sinks.h"
#include "trainer/model/llama_layers.h"
#include "trainer/model/flash_attention.h"
#include "trainer/model/fused_linear_cross_entropy.h"
#include "trainer/model/softcapped_attention.h"

namespace qtrain::trainer {

namespace F = torch::nn::functional;

RMSNormImpl::RMSNormImpl(int64_t hidden_size, double eps, torch::ScalarType dtype, NormStyle style)
    : eps_(eps), style_(style) {
  const auto options = torch::TensorOptions().dtype(dtype);
  weight = register_parameter("weight", style == NormStyle::kUnitOffset ? torch::zeros({hidden_size}, options)
                                                                   : torch::ones({hidden_size}, options));
}

namespace {

torch::Tensor normalized(const torch::Tensor& x, const torch::Tensor& weight, double eps, NormStyle style) {
  return style == NormStyle::kUnitOffset ? unit_offset_rms_norm(x, weight, eps) : rms_norm(x, weight, eps);
}

}  // namespace

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) { return normalized(x, weight, eps_, style_); }

RMSNormImpl::Rebuildable RMSNormImpl::forward_rebuildable(const torch::Tensor& x) {
  auto value = forward(x);
  if (!torch::GradMode::is_enabled()) return {value, {}};
  struct Source {
    torch::Tensor input, weight, made;
    double eps;
    NormStyle style;
  };
  auto source = std::make_shared<Source>(Source{x.detach(), weight.detach(), {}, eps_, style_});
  auto rebuild = [source] {
    if (!source->made.defined()) source->made = normalized(source->input, source->weight, source->eps, source->style);
    return source->made;
  };
  return {value, rebuild};
}

namespace {

// 1 / theta^(2i / dim) for i < dim / 2, in fp32 exactly as transformers computes it.
torch::Tensor default_inverse_frequencies(double theta, int64_t dim, const torch::Device& device) {
  auto exponent = torch::arange(0, dim, 2, torch::TensorOptions().dtype(torch::kInt64).device(device))
                      .to(torch::kFloat32) / static_cast<double>(dim);
  return torch::reciprocal(torch::pow(theta, exponent));
}

// Llama 3.1's frequency-dependent scaling: long wavelengths divided by `factor`, short ones
// kept, the band between interpolated smoothly.
torch::Tensor llama3_inverse_frequencies(torch::Tensor inverse_frequencies, const RopeOptions& rope) {
  const double old_context = static_cast<double>(rope.original_max_position_embeddings);
  const double low_frequency_wavelength = old_context / rope.low_freq_factor;
  const double high_frequency_wavelength = old_context / rope.high_freq_factor;
  auto wavelength = 2.0 * M_PI / inverse_frequencies;
  auto scaled = torch::where(wavelength > low_frequency_wavelength, inverse_frequencies / rope.factor,
                             inverse_frequencies);
  auto smooth = (old_context / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor);
  auto smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled;
  auto is_medium = (wavelength >= high_frequency_wavelength).logical_and(wavelength <= low_frequency_wavelength);
  return torch::where(is_medium, smoothed, scaled);
}

// longrope: 1 / (factor_i * theta^(2i / dim)), one factor per frequency, in fp32 as transformers.
torch::Tensor longrope_inverse_frequencies(const std::vector<double>& factors, double theta, int64_t dim) {
  const auto factor_tensor = torch::tensor(factors, torch::kFloat64).to(torch::kFloat32);
  auto exponent = torch::arange(0, dim, 2, torch::kInt64).to(torch::kFloat32) / static_cast<double>(dim);
  return torch::reciprocal(factor_tensor * torch::pow(theta, exponent));
}

// YaRN, as transformers' _compute_yarn_parameters: fp32 frequencies, the ramp's ends in double.
torch::Tensor yarn_inverse_frequencies(const RopeOptions& rope, int64_t dim) {
  const double original = static_cast<double>(rope.original_max_position_embeddings);
  const auto correction_dim = [&](double rotations) {
    return (static_cast<double>(dim) * std::log(original / (rotations * 2 * M_PI))) / (2 * std::log(rope.theta));
  };
  double low = correction_dim(rope.beta_fast), high = correction_dim(rope.beta_slow);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  const auto ramp = ((torch::arange(dim / 2, torch::kFloat32) - low) / (high - low)).clamp(0, 1);
  const auto position_frequencies =
      torch::pow(rope.theta, torch::arange(0, dim, 2, torch::kInt64).to(torch::kFloat32) / static_cast<double>(dim));
  const auto extrapolation = 1.0 / position_frequencies;
  const auto interpolation = 1.0 / (rope.factor * position_frequencies);
  const auto kept = 1 - ramp;  // inv_freq_extrapolation_factor
  return interpolation * (1 - kept) + extrapolation * kept;
}

}  // namespace

RotaryEmbedding::RotaryEmbedding(const LlamaOptions& options, const RopeOptions& rope) : options_(options) {
  options_.rope = rope;
  if (options_.rope.original_max_position_embeddings <= 0) {
    options_.rope.original_max_position_embeddings = options_.max_position_embeddings;
  }
  auto frequencies = default_inverse_frequencies(options_.rope.theta, options_.rotary_dim(), torch::kCPU);
  switch (options_.rope.type) {
    case RopeType::kLinear: frequencies = frequencies / options_.rope.factor; break;
    case RopeType::kLlama3: frequencies = llama3_inverse_frequencies(frequencies, options_.rope); break;
    case RopeType::kLongRope:
      frequencies = longrope_inverse_frequencies(options_.rope.short_factor, options_.rope.theta, options_.rotary_dim());
      long_inverse_frequencies_ =
          longrope_inverse_frequencies(options_.rope.long_factor, options_.rope.theta, options_.rotary_dim());
      break;
    case RopeType::kYarn: frequencies = yarn_inverse_frequencies(options_.rope, options_.rotary_dim()); break;
    case RopeType::kDefault:
    case RopeType::kDynamic: break;
  }
  inverse_frequencies_ = frequencies;
}

torch::Tensor RotaryEmbedding::inverse_frequencies(int64_t sequence_length, const torch::Device& device) const {
  const auto& rope = options_.rope;
  if (rope.type == RopeType::kDynamic && sequence_length > rope.original_max_position_embeddings) {
    // Dynamic NTK: grow the base with the sequence, as transformers' dynamic_rope_update does.
    const double dim = static_cast<double>(options_.rotary_dim());
    const double ratio = rope.factor * static_cast<double>(sequence_length) /
                             static_cast<double>(rope.original_max_position_embeddings) - (rope.factor - 1);
    return default_inverse_frequencies(rope.theta * std::pow(ratio, dim / (dim - 2)), options_.rotary_dim(), device);
  }
  if (rope.type == RopeType::kLongRope && sequence_length > rope.original_max_position_embeddings) {
    return long_inverse_frequencies_.to(device);
  }
  return inverse_frequencies_.to(device);
}

std::pair<torch::Tensor, torch::Tensor> RotaryEmbedding::tables(const torch::Tensor& position_ids,
                                                                torch::ScalarType dtype) const {
  int64_t sequence_length = position_ids.size(1);
  if (options_.rope.type == RopeType::kDynamic || options_.rope.type == RopeType::kLongRope) {
    sequence_length = position_ids.max().item<int64_t>() + 1;  // as transformers' dynamic_rope_update
  }
  auto frequencies = inverse_frequencies(sequence_length, position_ids.device());
  // [batch, seq, 1] * [dim/2] -> [batch, seq, dim/2]: the outer product in fp32. transformers
  // writes it as a matmul over an inner dimension of 1, whose every output is one rounded
  // product: the same bits as this multiply, without a batched matmul's launch cost per token.
  auto angles = position_ids.to(torch::kFloat32).unsqueeze(-1) * frequencies;
  auto embedding = torch::cat({angles, angles}, -1);
  const bool scaled = options_.rope.type == RopeType::kLongRope || options_.rope.type == RopeType::kYarn;
  const double scale = scaled ? options_.rope.attention_factor : 1.0;
  if (scale != 1.0) return {(embedding.cos() * scale).to(dtype), (embedding.sin() * scale).to(dtype)};
  return {embedding.cos().to(dtype), embedding.sin().to(dtype)};
}

std::vector<ProjectionShape> attention_projections(const LlamaOptions& options) {
  const int64_t hidden = options.hidden_size;
  const int64_t query_width = options.num_attention_heads * options.head_dim;
  const int64_t key_value_width = options.num_key_value_heads * options.head_dim;
  const bool bias = options.attention_bias;
  const ProjectionShape output{"o_proj", query_width, hidden, options.output_bias, ProjectionInput::kBlockActivation};
  if (options.fused_projections) return {{"qkv_proj", hidden, query_width + 2 * key_value_width, bias}, output};
  return {{"q_proj", hidden, query_width, bias},
          {"k_proj", hidden, key_value_width, bias},
          {"v_proj", hidden, key_value_width, bias},
          output};
}

std::vector<std::string> LlamaOptions::projection_names() const {
  std::vector<std::string> names;
  for (const auto& shape : attention_projections(*this)) names.push_back(shape.name);
  for (const auto& shape : feed_forward_row(*this).projections(*this)) names.push_back(shape.name);
  // A mixture of experts with dense layers (Qwen3-MoE's mlp_only_layers) has their names too.
  if (std::find(dense_layers.begin(), dense_layers.end(), true) != dense_layers.end() && feed_forward != FeedForwardKind::kDense) {
    for (const auto& shape : feed_forward_row(FeedForwardKind::kDense).projections(*this)) names.push_back(shape.name);
  }
  return names;
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaOptions& options, const std::string& prefix,
                                       const LinearFactory& make_linear, torch::ScalarType dtype,
                                       int64_t sliding_window)
    : num_heads_(options.num_attention_heads),
      num_key_value_heads_(options.num_key_value_heads),
      head_dim_(options.head_dim),
      sliding_window_(sliding_window),
      scale_(options.attention_scale()),
      softcap_(options.attention_softcap) {
  register_projections(*this, attention_projections(options), prefix, make_linear, dtype,
                       [this](const std::string& name) { return slot(name); });
  if (options.query_key_norm) {
    if (options.fused_projections) {
      throw Error(ErrorCode::kModelConfig, prefix + ": an RMSNorm on each head's query and key (q_norm / k_norm) "
                  "after a fused qkv_proj is not implemented; no model family qtrain reads has both");
    }
    q_norm = register_module("q_norm", RMSNorm(head_dim_, options.rms_norm_eps, dtype, options.norm_style));
    k_norm = register_module("k_norm", RMSNorm(head_dim_, options.rms_norm_eps, dtype, options.norm_style));
  }
  if (options.attention_sinks) sinks = register_parameter("sinks", torch::zeros({num_heads_}, torch::TensorOptions().dtype(dtype)));
}

std::pair<torch::Tensor, torch::Tensor> LayerKeyValues::append(const torch::Tensor& key, const torch::Tensor& value) {
  const int64_t added = key.size(2);
  const int64_t needed = length_ + added;
  if (!keys_.defined() || needed > keys_.size(2)) {
    // Doubling keeps the copies amortised O(1) per token; the views handed out before stay valid
    // (they hold the old buffer).
    const int64_t capacity = std::max<int64_t>(needed, keys_.defined() ? 2 * keys_.size(2) : 2 * added);
    auto grow = [&](const torch::Tensor& old, const torch::Tensor& like) {
      auto buffer = torch::empty({like.size(0), like.size(1), capacity, like.size(3)}, like.options());
      if (length_ > 0) buffer.narrow(2, 0, length_).copy_(old.narrow(2, 0, length_));
      return buffer;
    };
    keys_ = grow(keys_, key);
    values_ = grow(values_, value);
  }
  keys_.narrow(2, length_, added).copy_(key);
  values_.narrow(2, length_, added).copy_(value);
  length_ = needed;
  return {keys_.narrow(2, 0, length_), values_.narrow(2, 0, length_)};
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& hidden, const torch::Tensor& cos,
                                          const torch::Tensor& sin, const AttentionMask& attention_mask,
                                          LayerKeyValues* cache, const qat::LinearLayer::InputRebuild& rebuild_hidden) {
  const int64_t batch = hidden.size(0);
  const int64_t sequence = hidden.size(1);
  // [batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim]
  // The rotary embedding runs on the projections' [batch, seq, heads, head_dim] layout.
  torch::Tensor query, key, value;
  if (qkv_proj) {
    // Phi-3: one function splits the fused output and turns query and key; its gradient comes
    // back as one [batch, seq, qkv width] tensor (no query_key_norm: the constructor refuses it).
    const auto split = split_rotary_qkv(qkv_proj->forward_rebuilding_input(hidden, rebuild_hidden), cos, sin, num_heads_,
                                        num_key_value_heads_, head_dim_);
    query = split.query;
    key = split.key;
    value = split.value;
  } else {
    query = q_proj->forward_rebuilding_input(hidden, rebuild_hidden).view({batch, sequence, num_heads_, head_dim_});
    key = k_proj->forward_rebuilding_input(hidden, rebuild_hidden).view({batch, sequence, num_key_value_heads_, head_dim_});
    if (q_norm) {
      // Qwen3: each head's query and key normalised over head_dim before the rotation.
      query = q_norm->forward(query);
      key = k_norm->forward(key);
    }
    query = rotary_embedding(query, cos, sin);
    key = rotary_embedding(key, cos, sin);
    value = v_proj->forward_rebuilding_input(hidden, rebuild_hidden).view({batch, sequence, num_key_value_heads_, head_dim_});
  }
  query = query.transpose(1, 2);
  key = key.transpose(1, 2);
  value = value.transpose(1, 2);
  const int64_t past = cache != nullptr ? cache->length() : 0;
  if (cache != nullptr) {
    if (attention_mask.defined()) throw Error(ErrorCode::kInternal, "an attention mask cannot be combined with a key/value cache");
    std::tie(key, value) = cache->append(key, value);
  }
  const bool window_cuts = sliding_window_ > 0 && past + sequence > sliding_window_;
  if (softcap_ > 0 && !attention_mask.defined() && softcapped_kernel_applies(query)) {
    // Gemma 2 on CUDA: the cap, the causal / window mask and the softmax as one kernel.
    const auto attended = softcapped_causal_attention(query, key, value, past, window_cuts ? sliding_window_ : 0,
                                                      scale_, softcap_);
    return project_output(attended);
  }
  const SampleSpans* spans = attention_mask.spans();
  if (softcap_ > 0 && spans != nullptr && past == 0 && softcapped_packed_applies(query, key)) {
    // Gemma 2's packed batches: the same kernels over the samples' runs.
    const auto attended =
        softcapped_packed_attention(query, key, value, *spans, window_cuts ? sliding_window_ : 0, scale_, softcap_);
    return project_output(attended);
  }
  if (sinks.defined() && past == 0 && (spans != nullptr || !attention_mask.defined()) && flash_attention_applies(query, key)) {
    // gpt-oss on CUDA: flash attention, its output weighed by what the sink leaves the keys
    // (trainer/model/flash_attention.h), no [T, T] scores.
    const int64_t window = window_cuts ? sliding_window_ : 0;
    const auto attended = spans != nullptr ? flash_packed_attention(query, key, value, *spans, window, scale_, sinks)
                                           : flash_window_attention(query, key, value, window, scale_, sinks);
    return project_output(attended);
  }
  if (sinks.defined() || softcap_ > 0) {
    // gpt-oss's sinks, Gemma 2's soft-capped scores: no SDPA kernel takes them; the visible keys
    // are written out.
    auto visible = visible_keys(past, sequence, window_cuts ? sliding_window_ : 0, hidden.device());
    if (attention_mask.defined()) {
      const auto& mask = attention_mask.dense();
      visible = visible & (mask.scalar_type() == torch::kBool ? mask : mask.eq(0));
    }
    const auto attended = sinks.defined() ? sink_attention(query, key, value, visible, scale_, sinks)
                                          : softcapped_attention(query, key, value, visible, scale_, softcap_);
    return project_output(attended);
  }
  // SDPA's is_causal aligns its mask to the top left, right only without cached keys before the
  // new queries and without a window that cuts keys off; otherwise the mask is written out.
  // (One new token after the cache, within the window, sees every key: no mask at all.)
  if (spans != nullptr && past == 0 && flash_attention_applies(query, key)) {
    // Packed samples as flash attention's cumulative lengths: no [T, T] mask, and no work on the
    // blocks across samples (trainer/model/flash_attention.h).
    const auto attended =
        flash_packed_attention(query, key, value, *spans, window_cuts ? sliding_window_ : 0, scale_);
    return project_output(attended);
  }
  if (window_cuts && past == 0 && !attention_mask.defined() && flash_attention_applies(query, key)) {
    // Flash attention's own window: no [T, T] mask (trainer/model/flash_attention.h).
    const auto attended = flash_window_attention(query, key, value, sliding_window_, scale_);
    return project_output(attended);
  }
  const bool causal = !attention_mask.defined() && sequence > 1 && past == 0 && !window_cuts;
  std::optional<at::Tensor> mask =
      attention_mask.defined() ? std::optional<at::Tensor>(attention_mask.dense()) : std::nullopt;
  if ((past > 0 && sequence > 1) || window_cuts) {
    const auto visible = visible_keys(past, sequence, window_cuts ? sliding_window_ : 0, hidden.device());
    mask = mask.has_value() ? (*mask & visible) : visible;  // within a packed row, its own sample's too
  }
  auto attended = at::scaled_dot_product_attention(query, key, value, mask, /*dropout_p=*/0.0, causal, scale_,
                                                   /*enable_gqa=*/num_key_value_heads_ != num_heads_);
  return project_output(attended);
}

torch::Tensor LlamaAttentionImpl::project_output(const torch::Tensor& attended) {
  const auto rows = attended.transpose(1, 2).reshape({attended.size(0), attended.size(2), num_heads_ * head_dim_});
  return kept_in_recomputation([&] { return o_proj->forward(rows); }, [&] { return o_proj->forward_for_graph(rows, {}); });
}

std::shared_ptr<qat::LinearLayer>* LlamaAttentionImpl::slot(const std::string& child_name) {
  return child_name == "q_proj"     ? &q_proj
         : child_name == "qkv_proj" ? &qkv_proj
         : child_name == "k_proj"   ? &k_proj
         : child_name == "v_proj"   ? &v_proj
         : child_name == "o_proj"   ? &o_proj
                                    : nullptr;
}

void LlamaAttentionImpl::replace_linear(const std::string& child_name, std::shared_ptr<qat::LinearLayer> layer) {
  replace_projection(*this, [this](const std::string& name) { return slot(name); }, child_name, std::move(layer));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaOptions& options, int64_t layer, const LinearFactory& make_linear,
                                             torch::ScalarType dtype) {
  const std::string prefix = "model.layers." + std::to_string(layer);
  const int64_t sliding_window = options.layer_slides(layer) ? options.sliding_window : 0;
  const auto norm = [&] { return RMSNorm(options.hidden_size, options.rms_norm_eps, dtype, options.norm_style); };
  input_layernorm = register_module("input_layernorm", norm());
  self_attn = register_module("self_attn",
                              LlamaAttention(options, prefix + ".self_attn", make_linear, dtype, sliding_window));
  post_attention_layernorm = register_module("post_attention_layernorm", norm());
  if (options.sandwich_norms) {
    pre_feedforward_layernorm = register_module("pre_feedforward_layernorm", norm());
    post_feedforward_layernorm = register_module("post_feedforward_layernorm", norm());
  }
  const auto& block = feed_forward_row(options.layer_feed_forward(layer));
  mlp = register_module(block.module_name, block.make(options, prefix + "." + block.module_name, make_linear, dtype));
}

torch::Tensor LlamaDecoderLayerImpl::forward(const torch::Tensor& hidden, const torch::Tensor& cos,
                                             const torch::Tensor& sin, const AttentionMask& attention_mask,
                                             LayerKeyValues* cache) {
  const auto normed = input_layernorm->forward_rebuildable(hidden);
  auto attended = self_attn->forward(normed.value, cos, sin, attention_mask, cache, normed.rebuild);
  // Gemma: each sublayer's output is normed before it joins the residual stream.
  const auto residual = pre_feedforward_layernorm ? hidden + post_attention_layernorm->forward(attended)
                                                  : hidden + attended;
  return mlp_chunk_tokens_ > 0 ? feed_forward_in_chunks(residual) : feed_forward(residual);
}

torch::Tensor LlamaDecoderLayerImpl::feed_forward(const torch::Tensor& residual) {
  const auto normed = (pre_feedforward_layernorm ? pre_feedforward_layernorm : post_attention_layernorm)
                          ->forward_rebuildable(residual);
  if (pre_feedforward_layernorm) {
    // Gemma: the norm after the block reads its output; where the layer keeps its branch outputs
    // (train.offload_branch_outputs), its recomputation takes them from the host instead.
    const auto output = kept_in_recomputation([&] { return mlp->forward(normed.value, normed.rebuild); },
                                              [&] { return mlp->forward_for_graph(normed.value, normed.rebuild); });
    return residual + post_feedforward_layernorm->forward(output);
  }
  if (recomputing()) {
    // A checkpointed piece's recomputation: its output (this sum) is only the root of its backward,
    // and the sum's backward reads no values, so the block's last product is left out.
    return residual + mlp->forward_for_graph(normed.value, normed.rebuild);
  }
  return residual + mlp->forward(normed.value, normed.rebuild);
}

torch::Tensor LlamaDecoderLayerImpl::feed_forward_in_chunks(const torch::Tensor& residual) {
  const auto shape = residual.sizes().vec();
  const auto rows = residual.reshape({-1, shape.back()});  // every token of every sequence
  const int64_t tokens = rows.size(0);
  if (tokens <= mlp_chunk_tokens_) return feed_forward(residual);
  std::vector<torch::Tensor> parameters = mlp->parameters();
  for (const auto& norm : {post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm}) {
    if (norm) {
      const auto norm_parameters = norm->parameters();
      parameters.insert(parameters.end(), norm_parameters.begin(), norm_parameters.end());
    }
  }
  // A recomputed layer's chunks keep its built weights as the layer would; their own backward
  // runs after the layer's guard has ended, so each chunk sets it again.
  const bool keep_built = qat::KeepBuiltWeights::active();
  std::vector<torch::Tensor> outputs;
  // split, not narrow: one backward node gathers the chunks' gradients, instead of a zero-filled
  // [tokens, hidden] gradient per chunk.
  for (const auto& chunk : rows.split(mlp_chunk_tokens_, 0)) {
    outputs.push_back(checkpoint(
                          [this, keep_built](const std::vector<torch::Tensor>& inputs) {
                            const qat::KeepBuiltWeights keep(keep_built && torch::GradMode::is_enabled());
                            return feed_forward(inputs[0]);  // the piece's output, as the layer's is
                          },
                          {chunk.unsqueeze(0)}, parameters)
                          .squeeze(0));
  }
  return torch::cat(outputs).view(shape);
}

LlamaBackboneImpl::LlamaBackboneImpl(const LlamaOptions& options, const LinearFactory& make_linear,
                                     torch::ScalarType dtype)
    : options_(options), rotary_(options, options.rope) {
  if (options.sliding_rope) sliding_rotary_.emplace(options, *options.sliding_rope);
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(options.vocab_size, options.hidden_size));
  embed_tokens->weight.set_data(embed_tokens->weight.data().normal_(0.0, 0.02).to(dtype));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t index = 0; index < options.num_hidden_layers; ++index) {
    layers->push_back(LlamaDecoderLayer(options, index, make_linear, dtype));
  }
  norm = register_module("norm", RMSNorm(options.hidden_size, options.rms_norm_eps, dtype, options.norm_style));
}

torch::Tensor LlamaBackboneImpl::embed(const torch::Tensor& input_ids, const torch::Tensor& host_input_ids) {
  // train.embeddings_on_host leaves the frozen table on the host: the lookup runs there and only
  // the rows of this batch travel to the device. They are gathered straight into pinned memory
  // and sent without blocking: the copy queues behind the device's work at the link's speed,
  // where pageable rows took the host with them (7.8 ms of copy a step at 8B, micro-batch 4). A
  // training batch's ids are on the host already (LlamaInputs::host_input_ids): copying them back
  // from the device would wait for the device's queue, and for whatever copy the engine runs.
  const auto& table = embed_tokens->weight;
  torch::Tensor hidden;
  if (table.device() == input_ids.device()) {
    hidden = embed_tokens->forward(input_ids);
  } else {
    auto shape = input_ids.sizes().vec();
    shape.push_back(table.size(1));
    auto rows = torch::empty(shape, table.options().pinned_memory(input_ids.is_cuda()));
    // The embedding's forward is this gather: the same values.
    auto flat_rows = rows.view({-1, table.size(1)});
    const auto ids = host_input_ids.defined() && host_input_ids.device() == table.device() ? host_input_ids : input_ids;
    torch::index_select_out(flat_rows, table.detach(), 0, ids.reshape(-1).to(table.device()));
    hidden = rows.to(input_ids.device(), /*non_blocking=*/true);
  }
  if (options_.scale_embeddings) {
    // Gemma: sqrt(hidden) as an fp32 scalar rounded to the model dtype, as transformers' buffer is;
    // rounded on the host and multiplied as a scalar (no copy to the device per forward).
    const double scale = torch::scalar_tensor(std::sqrt(static_cast<double>(options_.hidden_size)), torch::kFloat32)
                             .to(hidden.scalar_type())
                             .item<double>();
    hidden = hidden * scale;
  }
  return hidden;
}

torch::Tensor LlamaBackboneImpl::forward_embedded(torch::Tensor hidden, const torch::Tensor& position_ids,
                                                  const AttentionMask& attention_mask, KeyValueCache* cache,
                                                  const std::function<void(size_t)>& at_layer) {
  const auto [full_cos, full_sin] = rotary_.tables(position_ids, hidden.scalar_type());
  torch::Tensor sliding_cos, sliding_sin;
  if (sliding_rotary_) std::tie(sliding_cos, sliding_sin) = sliding_rotary_->tables(position_ids, hidden.scalar_type());
  const bool checkpointing = checkpoint_every_ > 0 && is_training() && torch::GradMode::is_enabled();
  const auto offload =
      checkpointing && offload_activations_ ? std::make_shared<ActivationOffload>(hidden.device()) : nullptr;
  const qat::BuildBanksInBlocks bank_blocks(expert_bank_block_bytes_);
  const qat::WholeBanksWithoutGrad whole_banks(
      expert_bank_block_bytes_ > 0 ? expert_bank_block_bytes_ + trained_weight_bytes() + recomputed_layer_bytes_ : 0);
  for (size_t index = 0; index < layers->size(); ++index) {
    if (before_layer_) before_layer_(index);
    if (at_layer) at_layer(index);
    auto* layer = layers[index]->as<LlamaDecoderLayer>();
    const bool own_rope = sliding_rotary_ && options_.layer_slides(static_cast<int64_t>(index));
    const auto& cos = own_rope ? sliding_cos : full_cos;
    const auto& sin = own_rope ? sliding_sin : full_sin;
    if (checkpointing && static_cast<int64_t>(index) % checkpoint_every_ == 0) {
      hidden = checkpoint(
          [layer, cos = cos, sin = sin, attention_mask, keep = keep_built_weights_,
           block_bytes = expert_bank_block_bytes_](const std::vector<torch::Tensor>& inputs) {
            // Grad mode is on only in the recomputation, whose backward follows at once.
            const qat::KeepBuiltWeights keep_dequantized(keep && torch::GradMode::is_enabled());
            const qat::BuildBanksInBlocks bank_blocks(block_bytes);  // the recomputation runs on autograd's thread
            // One layer a piece: its output is the piece's, which a recomputation does not read
            // (feed_forward leaves the MLP's last product out there).
            return layer->forward(inputs[0], cos, sin, attention_mask);
          },
          {hidden}, layer->parameters(), offload, offload_branch_outputs_);
    } else {
      hidden = layer->forward(hidden, cos, sin, attention_mask,
                              cache ? &cache->layer(static_cast<int64_t>(index)) : nullptr);
    }
  }
  return norm->forward(hidden);
}

int64_t LlamaBackboneImpl::trained_weight_bytes() {
  int64_t bytes = 0;
  for (const auto& parameter : parameters()) {
    if (parameter.requires_grad()) bytes += parameter.numel() * static_cast<int64_t>(parameter.element_size());
  }
  return bytes;
}

void LlamaBackboneImpl::set_mlp_chunk_tokens(int64_t tokens) {
  for (const auto& layer : *layers) layer->as<LlamaDecoderLayer>()->set_mlp_chunk_tokens(tokens);
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaOptions& options, torch::ScalarType dtype,
                                           const LinearFactory& make_linear)
    : options_(options), dtype_(dtype) {
  model = register_module("model", LlamaBackbone(options, make_linear, dtype));
  if (!options.tie_word_embeddings) {
    lm_head = register_module("lm_head", make_linear("lm_head", projection_options({"lm_head", options.hidden_size,
                                                                                   options.vocab_size, false}, dtype)));
  }
  if (options.feed_forward == FeedForwardKind::kExperts && options.experts.output_router_logits) {
    router_loss_ = std::make_shared<RouterLoss>(options.experts.num_experts);
    for (const auto& layer : *model->layers) layer->as<LlamaDecoderLayer>()->mlp->share_router_loss(router_loss_);
  }
}

torch::Tensor LlamaForCausalLMImpl::hidden_states(const LlamaInputs& inputs) {
  auto position_ids = inputs.position_ids;
  if (!position_ids.defined()) {
    const int64_t past = inputs.cache ? inputs.cache->length() : 0;
    position_ids = torch::arange(past, past + inputs.input_ids.size(1),
                                 inputs.input_ids.options().dtype(torch::kInt64))
                       .unsqueeze(0)
                       .expand({inputs.input_ids.size(0), -1});
  }
  auto hidden = model->embed(inputs.input_ids, inputs.host_input_ids);
  const bool prefetching = lm_head_prefetch_pending_ && host_lm_head_;
  if (prefetching) prefetch_host_lm_head(inputs.input_ids);
  lm_head_prefetch_pending_ = false;
  // A whole lm_head travels a piece as each layer starts (HostResidentWeight::prefetch's pieces).
  const auto next_piece = [this](size_t index) {
    if (index > 0) host_lm_head_->continue_prefetch();
  };
  return model->forward_embedded(std::move(hidden), position_ids, inputs.attention_mask, inputs.cache,
                                 prefetching && lm_head_block_bytes_ <= 0 ? next_piece : std::function<void(size_t)>());
}

torch::Tensor LlamaForCausalLMImpl::logits(const torch::Tensor& hidden) {
  if (lm_head_on_host() && torch::GradMode::is_enabled()) {
    for (const auto& parameter : lm_head ? lm_head->parameters() : std::vector<torch::Tensor>{model->embed_tokens->weight}) {
      // Its copy from the host carries no gradient back to it.
      if (parameter.requires_grad()) {
        throw Error(ErrorCode::kRecipe, "train.lm_head_on_host keeps a frozen lm_head on the host, but lm_head trains "
                                        "here: set train.lm_head_on_host: false");
      }
    }
  }
  auto logits = lm_head_on_host()  ? F::linear(hidden, take_lm_head_weight(), lm_head_bias_on_device())
                : lm_head          ? lm_head->forward(hidden)
                                   : F::linear(hidden, model->embed_tokens->weight);
  const double cap = options_.final_logit_softcap;
  if (cap > 0) logits = torch::tanh(logits / cap) * cap;  // Gemma 2, in the model dtype as transformers
  return logits;
}

void LlamaForCausalLMImpl::replace_linear(const std::string& child_name, std::shared_ptr<qat::LinearLayer> layer) {
  if (child_name == "lm_head") host_lm_head_.reset();  // the new layer's weights are where it put them
  replace_projection(*this, [this](const std::string& name) { return name == "lm_head" ? &lm_head : nullptr; },
                     child_name, std::move(layer));
}

void LlamaForCausalLMImpl::keep_lm_head_on_host() {
  const auto* dense = dynamic_cast<const qat::DenseLinear*>(lm_head.get());
  if (lm_head && !dense) {
    throw Error(ErrorCode::kRecipe, "train.lm_head_on_host keeps a plain 16-bit lm_head weight on the host, but lm_head "
                                    "here is quantized or wrapped (an adapter, QAT): set train.lm_head_on_host: false");
  }
  // Tied: the input table, which then waits on the host for the rows' gather too.
  auto weight = dense ? dense->weight() : model->embed_tokens->weight;
  const torch::Device compute = device();
  if (compute.is_cpu() || host_lm_head_) return;  // the host is the device, or it is there already
  host_lm_head_ = std::make_unique<HostResidentWeight>(weight, compute, "train.lm_head_on_host");
  torch::NoGradGuard no_grad;
  weight.set_data(host_lm_head_->host());  // a bias, [vocab], stays on the device
}

void LlamaForCausalLMImpl::prefetch_lm_head() { lm_head_prefetch_pending_ = host_lm_head_ != nullptr; }

void LlamaForCausalLMImpl::prefetch_host_lm_head(const torch::Tensor& input_ids) {
  if (lm_head_block_bytes_ <= 0) {
    host_lm_head_->prefetch(device(), std::max<int64_t>(static_cast<int64_t>(model->layers->size()), 1));
    return;
  }
  // The tiles the loss will ask for first: its columns for the batch's predicting tokens (each
  // row's but the last), as fused_linear_cross_entropy chooses them for one chunk of them all.
  const auto& host = host_lm_head_->host();
  const int64_t predicting = input_ids.numel() - (input_ids.dim() > 1 ? input_ids.size(0) : 1);
  const auto tiles = streamed_tiles(std::max<int64_t>(predicting, 1), host.size(0), host.size(1) * host.element_size(),
                                    lm_head_block_bytes_);
  host_lm_head_->prefetch_tiles(device(), tiles.rows, tiles.on_device);
}

torch::Tensor LlamaForCausalLMImpl::take_lm_head_weight() {
  if (!host_lm_head_) throw Error(ErrorCode::kInternal, "lm_head's weight was taken from the host, where it is not kept");
  lm_head_prefetch_pending_ = false;
  return host_lm_head_->take(device());
}

torch::Tensor LlamaForCausalLMImpl::lm_head_bias_on_device() const { return lm_head ? lm_head->bias() : torch::Tensor(); }

torch::Tensor LlamaForCausalLMImpl::forward(const LlamaInputs& inputs) { return logits(hidden_states(inputs)); }

}  // namespace qtrain::trainer
