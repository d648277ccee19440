#include "trainer/model/flash_attention.h"

#include <optional>

#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

// Flash attention works on [batch, T, heads, head_dim], or over packed samples on the
// [batch * T, heads, head_dim] tokens; the transposes are views of the projections' own layout.
torch::Tensor to_flash_layout(const torch::Tensor& tensor, bool packed) {
  const auto tokens_first = tensor.transpose(1, 2);
  if (!packed) return tokens_first.contiguous();
  return tokens_first.reshape({tensor.size(0) * tensor.size(2), tensor.size(1), tensor.size(3)}).contiguous();
}

// Back to [batch, heads, T, head_dim] (a view).
torch::Tensor from_flash_layout(const torch::Tensor& tensor, int64_t batch) {
  if (tensor.dim() == 4) return tensor.transpose(1, 2);
  return tensor.view({batch, tensor.size(0) / batch, tensor.size(1), tensor.size(2)}).transpose(1, 2);
}

// window_size_left counts the keys before the query's own: window - 1; none without a window.
std::optional<int64_t> keys_left(int64_t window) { return window > 0 ? std::optional<int64_t>(window - 1) : std::nullopt; }
std::optional<int64_t> keys_right(int64_t window) { return window > 0 ? std::optional<int64_t>(0) : std::nullopt; }

// Without cumulative_lengths each row is one sequence of `longest` tokens.
class FlashAttention : public torch::autograd::Function<FlashAttention> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* context, const torch::Tensor& query,
                               const torch::Tensor& key, const torch::Tensor& value,
                               const std::optional<torch::Tensor>& cumulative_lengths, int64_t longest, int64_t window,
                               double scale) {
    const bool packed = cumulative_lengths.has_value();
    const auto q = to_flash_layout(query, packed), k = to_flash_layout(key, packed), v = to_flash_layout(value, packed);
    auto [out, logsumexp, rng_state, unused, debug] =
        at::_flash_attention_forward(q, k, v, cumulative_lengths, cumulative_lengths, longest, longest, /*dropout_p=*/0.0,
                                     /*is_causal=*/true, /*return_debug_mask=*/false, scale, keys_left(window),
                                     keys_right(window));
    context->save_for_backward({q, k, v, out, logsumexp, rng_state, unused});
    // Not an input autograd tracks (an optional, so that the unpacked call has no undefined tensor).
    context->saved_data["cumulative_lengths"] = cumulative_lengths;
    context->saved_data["longest"] = longest;
    context->saved_data["window"] = window;
    context->saved_data["scale"] = scale;
    context->saved_data["batch"] = query.size(0);
    return from_flash_layout(out, query.size(0));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = context->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &logsumexp = saved[4];
    const auto lengths = context->saved_data["cumulative_lengths"];
    const auto cumulative_lengths = lengths.isNone() ? torch::Tensor() : lengths.toTensor();
    const int64_t longest = context->saved_data["longest"].toInt();
    const int64_t window = context->saved_data["window"].toInt();
    const double scale = context->saved_data["scale"].toDouble();
    const int64_t batch = context->saved_data["batch"].toInt();
    auto [grad_q, grad_k, grad_v] = at::_flash_attention_backward(
        to_flash_layout(grad_outputs[0], cumulative_lengths.defined()), q, k, v, out, logsumexp, cumulative_lengths,
        cumulative_lengths, longest, longest, /*dropout_p=*/0.0, /*is_causal=*/true, saved[5], saved[6], scale,
        keys_left(window), keys_right(window));
    return {from_flash_layout(grad_q, batch), from_flash_layout(grad_k, batch), from_flash_layout(grad_v, batch),
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

void require_flash(const torch::Tensor& query, const torch::Tensor& key, const char* what) {
  if (!flash_attention_applies(query, key)) {
    throw Error(ErrorCode::kInternal, std::string(what) + ": needs CUDA bf16 / fp16 tensors, head_dim a multiple of 8 up "
                                                          "to 256 and as many queries as keys");
  }
}

}  // namespace

bool flash_attention_applies(const torch::Tensor& query, const torch::Tensor& key) {
  const int64_t head_dim = query.size(3);
  return query.is_cuda() && (query.scalar_type() == torch::kBFloat16 || query.scalar_type() == torch::kFloat16) &&
         head_dim % 8 == 0 && head_dim <= 256 && query.size(2) == key.size(2) && query.size(1) % key.size(1) == 0;
}

torch::Tensor flash_window_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                     int64_t window, double scale) {
  require_flash(query, key, "flash_window_attention");
  return FlashAttention::apply(query, key, value, std::optional<torch::Tensor>(), query.size(2), window, scale);
}

torch::Tensor flash_packed_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                     const SampleSpans& spans, int64_t window, double scale) {
  require_flash(query, key, "flash_packed_attention");
  const int64_t tokens = query.size(0) * query.size(2);
  if (!spans.cumulative_lengths.defined() || spans.cumulative_lengths.scalar_type() != torch::kInt32 ||
      spans.cumulative_lengths.device() != query.device() || spans.tokens != tokens) {
    throw Error(ErrorCode::kInternal, "flash_packed_attention: the spans must be int32 cumulative lengths on the "
                                      "query's device ending at the batch's " + std::to_string(tokens) + " tokens");
  }
  return FlashAttention::apply(query, key, value, std::optional<torch::Tensor>(spans.cumulative_lengths), spans.longest,
                               window, scale);
}

torch::Tensor visible_keys(int64_t past, int64_t sequence, int64_t window, const torch::Device& device) {
  const auto options = torch::TensorOptions().dtype(torch::kInt64).device(device);
  const auto key_positions = torch::arange(past + sequence, options).unsqueeze(0);
  const auto query_positions = (torch::arange(sequence, options) + past).unsqueeze(1);
  auto visible = key_positions <= query_positions;
  if (window > 0) visible = visible & (key_positions > query_positions - window);
  return visible;
}

}  // namespace qtrain::trainer
