#include "trainer/model/evaluate.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <thread>

#include "kernels/error.h"
#include "qat/qat_linear.h"
#include "trainer/model/attention_backends.h"
#include "trainer/model/batch_inputs.h"
#include "trainer/model/causal_lm_loss.h"
#include "trainer/base/cpu_threads.h"

namespace qtrain::trainer {

namespace {

struct BatchLoss {
  double loss_sum = 0;
  int64_t predicted_tokens = 0;
  int64_t input_tokens = 0;
};

BatchLoss evaluate_batch(LlamaForCausalLMImpl& model, const std::vector<data::Example>& examples, size_t first,
                         size_t last, const torch::Device& device, const LossOptions& loss_options) {
  std::vector<const data::Example*> rows;
  for (size_t index = first; index < last; ++index) rows.push_back(&examples[index]);
  const auto batch = data::collate(rows);
  auto labels = batch.labels.to(device);
  model.prefetch_lm_head();  // train.lm_head_on_host: it travels while the layers run
  // Right padding after a causal mask never reaches the real tokens before it.
  auto hidden = model.hidden_states(model_inputs(batch, device));
  auto loss = causal_lm_loss(model, hidden, labels, loss_options, batch.labels);
  return {loss.loss_sum.item<double>(), loss.tokens.item<int64_t>(), batch.input_tokens};
}

// On a CPU with several cores, whole batches run side by side, one thread each, instead of one
// batch at a time on every core: no thread then waits for another at each operation, so a core
// that another process shares slows only its own batch (beside one busy loop on 2 cores this
// keeps 0.7x of the idle speed where splitting every operation kept 0.5x). The batches' sums
// are added in batch order, so the result does not depend on which thread took which batch.
void evaluate_side_by_side(LlamaForCausalLMImpl& model, const std::vector<data::Example>& examples,
                           const std::vector<std::pair<size_t, size_t>>& batches, const torch::Device& device,
                           const LossOptions& loss_options, int workers, std::vector<BatchLoss>& losses) {
  // Each worker sets its own count to 1 (OpenMP's count is per thread), which also sets
  // LibTorch's global default: put the caller's back afterwards.
  const int previous_threads = at::get_num_threads();
  std::atomic<size_t> next{0};
  std::vector<std::exception_ptr> errors(static_cast<size_t>(workers));
  std::vector<std::thread> threads;
  for (int worker = 0; worker < workers; ++worker) {
    threads.emplace_back([&, worker] {
      try {
        at::set_num_threads(1);
        torch::NoGradGuard no_grad;  // grad mode is per thread
        for (size_t index = next++; index < batches.size(); index = next++) {
          losses[index] = evaluate_batch(model, examples, batches[index].first, batches[index].second, device,
                                         loss_options);
        }
      } catch (...) {
        errors[static_cast<size_t>(worker)] = std::current_exception();
        next = batches.size();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  at::set_num_threads(previous_threads);
  for (const auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

}  // namespace

EvalResult evaluate(LlamaForCausalLMImpl& model, const std::vector<data::Example>& examples,
                    const EvalOptions& options) {
  if (examples.empty()) throw Error(ErrorCode::kData, "evaluation data holds no example with a token to predict");
  if (options.batch_size < 1) throw Error(ErrorCode::kRecipe, "batch size must be at least 1");
  torch::NoGradGuard no_grad;
  const WithoutCudnnAttention attention_for_varied_lengths;
  const bool was_training = model.is_training();
  model.eval();
  const auto device = model.device();
  const auto start = std::chrono::steady_clock::now();

  std::vector<std::pair<size_t, size_t>> batches;
  for (size_t first = 0; first < examples.size(); first += static_cast<size_t>(options.batch_size)) {
    if (options.max_batches > 0 && static_cast<int64_t>(batches.size()) == options.max_batches) break;
    batches.emplace_back(first, std::min(examples.size(), first + static_cast<size_t>(options.batch_size)));
  }
  std::vector<BatchLoss> losses(batches.size());
  LossOptions loss_options;
  loss_options.chunk_tokens = options.loss_chunk_tokens;
  loss_options.fused = options.fused_loss;
  const CpuThreadGovernor cpu_threads(device.is_cpu());
  const int workers = std::min<int>(available_cpus(), static_cast<int>(batches.size()));
  // QAT layers' observers and learned scales change state in their forward: one batch at a time.
  const bool stateless_forward = qat::find_qat_layers(model).empty();
  if (cpu_threads.active() && workers > 1 && stateless_forward) {
    evaluate_side_by_side(model, examples, batches, device, loss_options, workers, losses);
  } else {
    for (size_t index = 0; index < batches.size(); ++index) {
      losses[index] = evaluate_batch(model, examples, batches[index].first, batches[index].second, device,
                                     loss_options);
    }
  }
  if (was_training) model.train();

  double loss_sum = 0;
  int64_t predicted_tokens = 0;
  int64_t input_tokens = 0;
  for (const auto& batch : losses) {
    loss_sum += batch.loss_sum;
    predicted_tokens += batch.predicted_tokens;
    input_tokens += batch.input_tokens;
  }
  EvalResult result;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.tokens = predicted_tokens;
  result.loss = loss_sum / static_cast<double>(std::max<int64_t>(predicted_tokens, 1));
  result.perplexity = std::exp(result.loss);
  result.tokens_per_second = static_cast<double>(input_tokens) / std::max(result.seconds, 1e-9);
  return result;
}

}  // namespace qtrain::trainer
