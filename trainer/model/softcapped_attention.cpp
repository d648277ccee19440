#include "trainer/model/softcapped_attention.h"

#include <limits>
#include <optional>
#include <string>

#include "kernels/error.h"
#include "kernels/softcapped_flash_attention.h"
#include "kernels/softcapped_softmax.h"
#include "trainer/model/llama_layers.h"

namespace qtrain::trainer {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Keys and values repeated to every query head (transformers' repeat_kv).
std::pair<torch::Tensor, torch::Tensor> per_query_head(const torch::Tensor& query, const torch::Tensor& key,
                                                       const torch::Tensor& value) {
  const int64_t groups = query.size(1) / key.size(1);
  if (groups == 1) return {key, value};
  return {key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)};
}

kernels::SoftcappedScores options_of(AutogradContext* context) {
  kernels::SoftcappedScores options;
  options.queries = context->saved_data["queries"].toInt();
  options.past = context->saved_data["past"].toInt();
  options.window = context->saved_data["window"].toInt();
  options.scale = context->saved_data["scale"].toDouble();
  options.cap = context->saved_data["cap"].toDouble();
  return options;
}

// scores [batch, heads, T, keys] -> probabilities, through kernels/softcapped_softmax.h.
class SoftcappedSoftmaxFunction : public torch::autograd::Function<SoftcappedSoftmaxFunction> {
 public:
  static torch::Tensor forward(AutogradContext* context, const torch::Tensor& scores, int64_t past, int64_t window,
                               double scale, double cap) {
    kernels::SoftcappedScores options;
    options.queries = scores.size(2);
    options.past = past;
    options.window = window;
    options.scale = scale;
    options.cap = cap;
    const auto rows = scores.reshape({-1, scores.size(3)}).contiguous();
    auto [probabilities, probabilities32, tanh_output] = kernels::softcapped_softmax_forward_cuda(rows, options);
    context->save_for_backward({probabilities32, tanh_output});
    context->saved_data["queries"] = options.queries;
    context->saved_data["past"] = past;
    context->saved_data["window"] = window;
    context->saved_data["scale"] = scale;
    context->saved_data["cap"] = cap;
    return probabilities.view(scores.sizes());
  }

  static variable_list backward(AutogradContext* context, variable_list grads) {
    const auto saved = context->get_saved_variables();
    const auto grad_rows = grads[0].reshape(saved[0].sizes()).contiguous();
    auto grad_scores = kernels::softcapped_softmax_backward_cuda(grad_rows, saved[0], saved[1], options_of(context));
    return {grad_scores.view(grads[0].sizes()), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// The whole attention as flash-style kernels (kernels/softcapped_flash_attention.h): saves q, k, v,
// the output and its rows' log-sum-exp, nothing of [T, T]. run_bounds: packed samples' runs, or
// none (an optional: autograd's Function takes no undefined tensor).
class SoftcappedFlashFunction : public torch::autograd::Function<SoftcappedFlashFunction> {
 public:
  static torch::Tensor forward(AutogradContext* context, const torch::Tensor& query, const torch::Tensor& key,
                               const torch::Tensor& value, const std::optional<torch::Tensor>& run_bounds, int64_t window,
                               double scale, double cap) {
    const kernels::SoftcappedFlash options{window, scale, cap, run_bounds.value_or(torch::Tensor())};
    auto [out, log_sum_exp2] = kernels::softcapped_flash_forward_cuda(query, key, value, options);
    context->save_for_backward({query, key, value, out, log_sum_exp2});
    context->saved_data["run_bounds"] = run_bounds;
    context->saved_data["window"] = window;
    context->saved_data["scale"] = scale;
    context->saved_data["cap"] = cap;
    return out;
  }

  static variable_list backward(AutogradContext* context, variable_list grads) {
    const auto saved = context->get_saved_variables();
    const auto runs = context->saved_data["run_bounds"];
    const kernels::SoftcappedFlash options{context->saved_data["window"].toInt(), context->saved_data["scale"].toDouble(),
                                           context->saved_data["cap"].toDouble(),
                                           runs.isNone() ? torch::Tensor() : runs.toTensor()};
    auto [grad_query, grad_key, grad_value] =
        kernels::softcapped_flash_backward_cuda(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4], options);
    return {grad_query, grad_key, grad_value, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// [batch, heads, seq, head_dim] as [1, heads, batch * seq, head_dim]: the rows end to end (a view
// where the projections' [batch, seq, heads, head_dim] layout is kept), and back.
torch::Tensor rows_end_to_end(const torch::Tensor& x) {
  return x.transpose(1, 2).reshape({1, x.size(0) * x.size(2), x.size(1), x.size(3)}).transpose(1, 2);
}
torch::Tensor rows_apart(const torch::Tensor& x, int64_t batch) {
  return x.transpose(1, 2).reshape({batch, x.size(2) / batch, x.size(1), x.size(3)}).transpose(1, 2);
}

}  // namespace

torch::Tensor softcapped_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                   const torch::Tensor& visible, double scale, double softcap) {
  const auto [keys, values] = per_query_head(query, key, value);
  auto scores = torch::matmul(query, keys.transpose(2, 3)) * scale;
  scores = torch::tanh(scores / softcap) * softcap;
  scores = scores.masked_fill(visible.logical_not(), -std::numeric_limits<double>::infinity());
  const auto probabilities = torch::softmax(scores, -1, torch::kFloat32).to(query.scalar_type());
  return torch::matmul(probabilities, values);
}

bool softcapped_kernel_applies(const torch::Tensor& query) { return on_fused_kernels(query); }

torch::Tensor softcapped_causal_attention(const torch::Tensor& query, const torch::Tensor& key,
                                          const torch::Tensor& value, int64_t past, int64_t window, double scale,
                                          double softcap) {
  if (past == 0 && kernels::softcapped_flash_takes(query, key)) {
    return SoftcappedFlashFunction::apply(query, key, value, std::nullopt, window, scale, softcap);
  }
  return softcapped_scores_attention(query, key, value, past, window, scale, softcap);
}

torch::Tensor softcapped_scores_attention(const torch::Tensor& query, const torch::Tensor& key,
                                          const torch::Tensor& value, int64_t past, int64_t window, double scale,
                                          double softcap) {
  const auto [keys, values] = per_query_head(query, key, value);
  const auto scores = torch::matmul(query, keys.transpose(2, 3));
  const auto probabilities = SoftcappedSoftmaxFunction::apply(scores, past, window, scale, softcap);
  return torch::matmul(probabilities, values);
}

bool softcapped_packed_applies(const torch::Tensor& query, const torch::Tensor& key) {
  return on_fused_kernels(query) && kernels::softcapped_flash_takes(query, key);
}

torch::Tensor softcapped_packed_attention(const torch::Tensor& query, const torch::Tensor& key,
                                          const torch::Tensor& value, const SampleSpans& spans, int64_t window,
                                          double scale, double softcap) {
  const int64_t batch = query.size(0);
  if (!spans.run_bounds.defined() || spans.run_bounds.size(1) != batch * query.size(2) ||
      spans.run_bounds.device() != query.device()) {
    throw Error(ErrorCode::kInternal, "softcapped_packed_attention: the spans' run bounds must cover the batch's " +
                                          std::to_string(batch * query.size(2)) + " tokens on the query's device");
  }
  const auto out = SoftcappedFlashFunction::apply(rows_end_to_end(query), rows_end_to_end(key), rows_end_to_end(value),
                                                  std::optional<torch::Tensor>(spans.run_bounds), window, scale, softcap);
  return rows_apart(out, batch);
}

}  // namespace qtrain::trainer
