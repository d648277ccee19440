#include "trainer/model/sliding_window_attention.h"

#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

// Flash attention works on [batch, T, heads, head_dim]; the transposes are views of the
// projections' own layout.
torch::Tensor to_flash_layout(const torch::Tensor& tensor) { return tensor.transpose(1, 2).contiguous(); }

class FlashWindowAttention : public torch::autograd::Function<FlashWindowAttention> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* context, const torch::Tensor& query,
                               const torch::Tensor& key, const torch::Tensor& value, int64_t window, double scale) {
    const auto q = to_flash_layout(query), k = to_flash_layout(key), v = to_flash_layout(value);
    const int64_t length = q.size(1);
    // window_size_left counts the keys before the query's own: window - 1.
    auto [out, logsumexp, rng_state, unused, debug] =
        at::_flash_attention_forward(q, k, v, std::nullopt, std::nullopt, length, length, /*dropout_p=*/0.0,
                                     /*is_causal=*/true, /*return_debug_mask=*/false, scale, window - 1, 0);
    context->save_for_backward({q, k, v, out, logsumexp, rng_state, unused});
    context->saved_data["window"] = window;
    context->saved_data["scale"] = scale;
    return out.transpose(1, 2);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = context->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &logsumexp = saved[4];
    const int64_t window = context->saved_data["window"].toInt();
    const double scale = context->saved_data["scale"].toDouble();
    const int64_t length = q.size(1);
    const torch::Tensor no_lengths;
    auto [grad_q, grad_k, grad_v] = at::_flash_attention_backward(
        to_flash_layout(grad_outputs[0]), q, k, v, out, logsumexp, no_lengths, no_lengths, length, length,
        /*dropout_p=*/0.0, /*is_causal=*/true, saved[5], saved[6], scale, window - 1, 0);
    return {grad_q.transpose(1, 2), grad_k.transpose(1, 2), grad_v.transpose(1, 2), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

bool flash_window_attention_applies(const torch::Tensor& query, const torch::Tensor& key) {
  const int64_t head_dim = query.size(3);
  return query.is_cuda() && (query.scalar_type() == torch::kBFloat16 || query.scalar_type() == torch::kFloat16) &&
         head_dim % 8 == 0 && head_dim <= 256 && query.size(2) == key.size(2) && query.size(1) % key.size(1) == 0;
}

torch::Tensor flash_window_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                     int64_t window, double scale) {
  if (window <= 0 || !flash_window_attention_applies(query, key)) {
    throw Error(ErrorCode::kInternal, "flash_window_attention: needs CUDA bf16 / fp16 tensors, head_dim a multiple of 8 "
                "up to 256, as many queries as keys and a positive window");
  }
  return FlashWindowAttention::apply(query, key, value, window, scale);
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
