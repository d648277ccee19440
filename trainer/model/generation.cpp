#include "trainer/model/generation.h"

#include <algorithm>
#include <ATen/CPUGeneratorImpl.h>
#include <chrono>

#include "kernels/error.h"
#include "trainer/base/cpu_threads.h"

namespace qtrain::trainer {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_from(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Logits of the last position only: the vocabulary projection of the other prompt positions
// is never needed. [1, vocab]
torch::Tensor next_token_logits(LlamaForCausalLMImpl& model, const torch::Tensor& input_ids, KeyValueCache& cache) {
  LlamaInputs inputs;
  inputs.input_ids = input_ids;
  inputs.cache = &cache;
  auto hidden = model.hidden_states(inputs);
  return model.logits(hidden.select(1, hidden.size(1) - 1));
}

}  // namespace

double GenerationResult::decode_tokens_per_second() const {
  if (tokens.size() < 2 || decode_seconds <= 0) return 0;
  return static_cast<double>(tokens.size() - 1) / decode_seconds;
}

GenerationResult generate(LlamaForCausalLMImpl& model, const std::vector<int64_t>& prompt_ids,
                          const GenerationOptions& options, const TokenCallback& on_token) {
  if (prompt_ids.empty()) throw Error(ErrorCode::kUsage, "generation needs a prompt of at least one token");
  const int64_t vocab_size = model.options().vocab_size;
  for (const int64_t id : prompt_ids) {
    if (id < 0 || id >= vocab_size) {
      throw Error(ErrorCode::kUsage, "prompt token id " + std::to_string(id) + " is outside the model's vocabulary (size " +
                  std::to_string(vocab_size) + ")");
    }
  }
  torch::NoGradGuard no_grad;
  const WithoutCudnnAttention attention_for_growing_lengths;
  model.eval();
  const auto device = model.device();
  auto generator = at::make_generator<at::CPUGeneratorImpl>(options.seed);
  KeyValueCache cache(model.options().num_hidden_layers);
  // The whole sequence on the CPU, for the repetition penalty. [1, n] int64
  auto sequence = torch::tensor(prompt_ids, torch::kInt64).unsqueeze(0);

  CpuThreadGovernor cpu_threads(device.is_cpu());
  GenerationResult result;
  auto start = Clock::now();
  auto logits = next_token_logits(model, sequence.to(device), cache);
  while (static_cast<int64_t>(result.tokens.size()) < options.max_new_tokens) {
    const auto next = choose_next_tokens(logits, sequence, options.sampling, generator);  // [1]
    const int64_t token = next.item<int64_t>();
    if (result.tokens.empty()) {
      result.prefill_seconds = seconds_from(start);
      start = Clock::now();
    }
    result.tokens.push_back(token);
    if (on_token) on_token(token);
    if (std::find(options.eos_token_ids.begin(), options.eos_token_ids.end(), token) != options.eos_token_ids.end()) {
      result.stopped_at_eos = true;
      break;
    }
    if (static_cast<int64_t>(result.tokens.size()) == options.max_new_tokens) break;
    cpu_threads.between_work();
    sequence = torch::cat({sequence, next.unsqueeze(0)}, 1);
    const auto& rope = model.options().rope;
    if (rope.type == RopeType::kLongRope && sequence.size(1) > rope.original_max_position_embeddings &&
        cache.length() <= rope.original_max_position_embeddings) {
      // longrope switches to its long factors here: the cached keys were turned by the short ones,
      // so the whole sequence runs again, as transformers' Phi-3 drops its cache at this point.
      cache = KeyValueCache(model.options().num_hidden_layers);
      logits = next_token_logits(model, sequence.to(device), cache);
      continue;
    }
    logits = next_token_logits(model, next.unsqueeze(0).to(device), cache);
  }
  if (!result.tokens.empty()) result.decode_seconds = seconds_from(start);
  return result;
}

}  // namespace qtrain::trainer
