#include "trainer/model_memory.h"

namespace qtrain::trainer {

LlamaParameterCounts llama_parameter_counts(const LlamaOptions& options, int64_t lora_rank) {
  const int64_t hidden = options.hidden_size;
  const int64_t query = options.num_attention_heads * options.head_dim;
  const int64_t key_value = options.num_key_value_heads * options.head_dim;
  const int64_t intermediate = options.intermediate_size;
  // {in, out} of q, k, v, o, gate, up, down
  const int64_t shapes[7][2] = {{hidden, query},        {hidden, key_value}, {hidden, key_value},
                                {query, hidden},        {hidden, intermediate},
                                {hidden, intermediate}, {intermediate, hidden}};
  LlamaParameterCounts counts;
  for (const auto& shape : shapes) {
    counts.projections += shape[0] * shape[1];
    counts.lora += lora_rank * (shape[0] + shape[1]);
  }
  int64_t biases = 0;
  if (options.attention_bias) biases += query + 2 * key_value + hidden;
  if (options.mlp_bias) biases += 2 * intermediate + hidden;
  counts.projections = (counts.projections + biases) * options.num_hidden_layers;
  counts.lora *= options.num_hidden_layers;
  counts.embeddings = options.vocab_size * hidden * (options.tie_word_embeddings ? 1 : 2);
  counts.norms = hidden * (2 * options.num_hidden_layers + 1);
  counts.total = counts.projections + counts.embeddings + counts.norms;
  return counts;
}

std::vector<MemoryEstimate> training_memory_estimates(const LlamaParameterCounts& counts) {
  constexpr double kBf16 = 2.0;
  constexpr double kTrainableState = 16.0;  // fp32 weight, grad, AdamW exp_avg and exp_avg_sq
  // NF4 with double quantization: 4 bits + an 8-bit absmax per 64 + an fp32 absmax per 256 blocks.
  constexpr double kNf4 = (4.0 + 8.0 / 64.0 + 32.0 / (64.0 * 256.0)) / 8.0;
  const double rest = static_cast<double>(counts.embeddings + counts.norms) * kBf16;
  return {
      {"qlora", counts.projections * kNf4 + rest, counts.lora, counts.lora * kTrainableState},
      {"lora", counts.projections * kBf16 + rest, counts.lora, counts.lora * kTrainableState},
      {"full", 0.0, counts.total, counts.total * kTrainableState},
  };
}

}  // namespace qtrain::trainer
