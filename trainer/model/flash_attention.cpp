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

// The logsumexp (fp32: [batch, heads, T], or over packed tokens [heads, tokens]) laid out as the
// output's rows with a trailing 1: [batch, T, heads, 1] or [tokens, heads, 1].
torch::Tensor per_output_row(const torch::Tensor& logsumexp) {
  return (logsumexp.dim() == 3 ? logsumexp.transpose(1, 2) : logsumexp.t()).unsqueeze(-1);
}

// Without cumulative_lengths each row is one sequence of `longest` tokens. With `sinks` [heads]
// (gpt-oss: one more key per head with score sink and no value), a row's output is flash's times
// the weight its real keys keep, exp(L) / (exp(L) + exp(sink)) = sigmoid(L - sink) with L the
// row's logsumexp; backward takes L's gradient g into the scores' (dS = P (dP - D + g)) by handing
// flash's backward an output whose rowsum(dO * O) is D - g.
class FlashAttention : public torch::autograd::Function<FlashAttention> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* context, const torch::Tensor& query,
                               const torch::Tensor& key, const torch::Tensor& value, const torch::Tensor& sinks,
                               const std::optional<torch::Tensor>& cumulative_lengths, int64_t longest, int64_t window,
                               double scale) {
    const bool packed = cumulative_lengths.has_value();
    const auto q = to_flash_layout(query, packed), k = to_flash_layout(key, packed), v = to_flash_layout(value, packed);
    auto [out, logsumexp, rng_state, unused, debug] =
        at::_flash_attention_forward(q, k, v, cumulative_lengths, cumulative_lengths, longest, longest, /*dropout_p=*/0.0,
                                     /*is_causal=*/true, /*return_debug_mask=*/false, scale, keys_left(window),
                                     keys_right(window));
    context->save_for_backward({q, k, v, out, logsumexp, rng_state, unused, sinks});
    if (sinks.numel() > 0) {
      const auto kept = torch::sigmoid(per_output_row(logsumexp) - sinks.to(torch::kFloat32).unsqueeze(-1));
      out = (out.to(torch::kFloat32) * kept).to(out.scalar_type());
    }
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
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &logsumexp = saved[4], &sinks = saved[7];
    auto out = saved[3];
    const auto lengths = context->saved_data["cumulative_lengths"];
    const auto cumulative_lengths = lengths.isNone() ? torch::Tensor() : lengths.toTensor();
    const int64_t longest = context->saved_data["longest"].toInt();
    const int64_t window = context->saved_data["window"].toInt();
    const double scale = context->saved_data["scale"].toDouble();
    const int64_t batch = context->saved_data["batch"].toInt();
    auto grad_out = to_flash_layout(grad_outputs[0], cumulative_lengths.defined());
    torch::Tensor grad_sinks;
    if (sinks.numel() > 0) {
      // y = O s, s = sigmoid(L - sink): dO = dy s; g = dL = s (1 - s) rowsum(dy * O); dsink = -sum g.
      const auto kept = torch::sigmoid(per_output_row(logsumexp) - sinks.to(torch::kFloat32).unsqueeze(-1));
      const auto dy = grad_out.to(torch::kFloat32), o = out.to(torch::kFloat32);
      const auto d_out = dy * kept;
      const auto g = kept * (1 - kept) * (dy * o).sum(-1, /*keepdim=*/true);
      grad_sinks = -g.squeeze(-1).reshape({-1, g.size(-2)}).sum(0).to(sinks.scalar_type());
      // O' = O - g dO / |dO|^2 keeps rowsum(dO * O') = D - g (|g dO / |dO|^2| <= |O|: g carries rowsum(dO * O));
      // a row without gradient (dO = 0) has g = 0 too.
      const auto norm = (d_out * d_out).sum(-1, /*keepdim=*/true);
      out = (o - torch::where(norm > 0, g / norm, torch::zeros_like(norm)) * d_out).to(out.scalar_type());
      grad_out = d_out.to(grad_out.scalar_type());
    }
    auto [grad_q, grad_k, grad_v] = at::_flash_attention_backward(
        grad_out, q, k, v, out, logsumexp, cumulative_lengths, cumulative_lengths, longest, longest, /*dropout_p=*/0.0,
        /*is_causal=*/true, saved[5], saved[6], scale, keys_left(window), keys_right(window));
    return {from_flash_layout(grad_q, batch), from_flash_layout(grad_k, batch), from_flash_layout(grad_v, batch),
            grad_sinks, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// Autograd's functions take no undefined tensor: no sinks travel as an empty one.
torch::Tensor sink_input(const torch::Tensor& sinks, const torch::Tensor& query) {
  return sinks.defined() ? sinks : torch::empty({0}, query.options());
}

void require_flash(const torch::Tensor& query, const torch::Tensor& key, const char* what) {
  if (!flash_attention_applies(query, key)) {
    throw Error(ErrorCode::kInternal, std::string(what) + ": needs CUDA bf16 / fp16 tensors, head_dim a multiple of 8 up "
                                                          "to 256 and as many queries as keys");
  }
}

}  // namespace

bool flash_attention_takes(torch::DeviceType device, torch::ScalarType dtype, int64_t head_dim) {
  return device == torch::kCUDA && (dtype == torch::kBFloat16 || dtype == torch::kFloat16) && head_dim % 8 == 0 &&
         head_dim <= 256;
}

bool flash_attention_applies(const torch::Tensor& query, const torch::Tensor& key) {
  return flash_attention_takes(query.device().type(), query.scalar_type(), query.size(3)) &&
         query.size(2) == key.size(2) && query.size(1) % key.size(1) == 0;
}

torch::Tensor flash_window_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                     int64_t window, double scale, const torch::Tensor& sinks) {
  require_flash(query, key, "flash_window_attention");
  return FlashAttention::apply(query, key, value, sink_input(sinks, query), std::optional<torch::Tensor>(), query.size(2),
                               window, scale);
}

torch::Tensor flash_packed_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                     const SampleSpans& spans, int64_t window, double scale, const torch::Tensor& sinks) {
  require_flash(query, key, "flash_packed_attention");
  const int64_t batch = query.size(0), whole = spans.whole_rows;
  const auto on_device = [&](const torch::Tensor& lengths) {
    return lengths.defined() && lengths.scalar_type() == torch::kInt32 && lengths.device() == query.device();
  };
  if (!on_device(spans.cumulative_lengths) || spans.tokens != batch * query.size(2) || whole < 0 || whole > batch ||
      (whole > 0 && whole < batch && !on_device(spans.rest_cumulative_lengths))) {
    throw Error(ErrorCode::kInternal, "flash_packed_attention: the spans must be int32 cumulative lengths on the "
                                      "query's device ending at the batch's " + std::to_string(batch * query.size(2)) +
                                      " tokens, with those of the rows after the whole ones");
  }
  if (whole == 0 || window > 0 || sinks.defined()) {
    return FlashAttention::apply(query, key, value, sink_input(sinks, query),
                                 std::optional<torch::Tensor>(spans.cumulative_lengths), spans.longest, window, scale);
  }
  // The leading rows that are one sample each are plain causal attention: SDPA's, which on Hopper
  // runs cuDNN's kernels, ~1.8x flash's over cumulative lengths (docs/PERFORMANCE.md).
  const auto leading = [&](const torch::Tensor& tensor) { return tensor.narrow(0, 0, whole); };
  const auto causal = at::scaled_dot_product_attention(leading(query), leading(key), leading(value), std::nullopt,
                                                       /*dropout_p=*/0.0, /*is_causal=*/true, scale,
                                                       /*enable_gqa=*/key.size(1) != query.size(1));
  if (whole == batch) return causal;
  const auto rest = [&](const torch::Tensor& tensor) { return tensor.narrow(0, whole, batch - whole); };
  const auto spanned =
      FlashAttention::apply(rest(query), rest(key), rest(value), sink_input(sinks, query),
                            std::optional<torch::Tensor>(spans.rest_cumulative_lengths), spans.rest_longest, 0, scale);
  // Joined as [batch, T, heads, head_dim], the layout the output projection reads.
  return torch::cat({causal.transpose(1, 2), spanned.transpose(1, 2)}, 0).transpose(1, 2);
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
