#include "trainer/model/logits_processors.h"

#include <algorithm>
#include <limits>

namespace qtrain::trainer {

namespace {
const double kRemoved = -std::numeric_limits<double>::infinity();
}

torch::Tensor apply_repetition_penalty(const torch::Tensor& logits, const torch::Tensor& previous_ids, double penalty) {
  auto seen = logits.gather(1, previous_ids);
  // Dividing a positive logit and multiplying a negative one both make the token less likely.
  seen = torch::where(seen < 0, seen * penalty, seen / penalty);
  return logits.scatter(1, previous_ids, seen);
}

torch::Tensor apply_temperature(const torch::Tensor& logits, double temperature) { return logits / temperature; }

torch::Tensor apply_top_k(const torch::Tensor& logits, int64_t top_k) {
  const int64_t kept = std::min<int64_t>(std::max<int64_t>(top_k, 1), logits.size(-1));
  auto kth_largest = std::get<0>(logits.topk(kept, -1)).narrow(-1, kept - 1, 1);
  return logits.masked_fill(logits < kth_largest, kRemoved);
}

torch::Tensor apply_top_p(const torch::Tensor& logits, double top_p) {
  auto [sorted_logits, sorted_indices] = logits.sort(-1, /*descending=*/false);
  auto cumulative = sorted_logits.softmax(-1).cumsum(-1);
  auto remove_sorted = cumulative <= (1.0 - top_p);
  remove_sorted.narrow(-1, remove_sorted.size(-1) - 1, 1).fill_(false);
  auto remove = remove_sorted.scatter(-1, sorted_indices, remove_sorted);
  return logits.masked_fill(remove, kRemoved);
}

torch::Tensor process_logits(const torch::Tensor& logits, const torch::Tensor& previous_ids,
                             const SamplingOptions& options) {
  auto processed = logits;
  if (options.repetition_penalty != 1.0) {
    processed = apply_repetition_penalty(processed, previous_ids, options.repetition_penalty);
  }
  if (!options.do_sample) return processed;
  if (options.temperature != 1.0) processed = apply_temperature(processed, options.temperature);
  if (options.top_k > 0) processed = apply_top_k(processed, options.top_k);
  if (options.top_p < 1.0) processed = apply_top_p(processed, options.top_p);
  return processed;
}

torch::Tensor choose_next_tokens(const torch::Tensor& logits, const torch::Tensor& previous_ids,
                                 const SamplingOptions& options, torch::Generator& generator) {
  auto scores = process_logits(logits.to(torch::kCPU, torch::kFloat32), previous_ids.to(torch::kCPU), options);
  if (!options.do_sample) return scores.argmax(-1);
  return torch::multinomial(scores.softmax(-1), /*num_samples=*/1, /*replacement=*/false, generator).squeeze(-1);
}

}  // namespace qtrain::trainer
