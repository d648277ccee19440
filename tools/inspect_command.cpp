// qtrain inspect: what a Hugging Face Llama directory holds and what training it would need.
#include <cstdio>
#include <map>

#include "tools/commands.h"
#include "trainer/hf_config.h"
#include "trainer/memory_stats.h"
#include "trainer/model_memory.h"
#include "trainer/safetensors.h"

namespace po = boost::program_options;

namespace qtrain::tools {


int run_inspect(const Arguments& arguments) {
  std::string model_dir;
  int64_t lora_rank = 0;
  po::options_description options("inspect options");
  options.add_options()
      ("model", po::value(&model_dir)->required(), "Hugging Face model directory")
      ("lora-rank", po::value(&lora_rank)->default_value(16), "LoRA rank for the memory estimate");
  po::variables_map values;
  if (!parse_command_line("usage: qtrain inspect --model DIR", options, arguments, values)) return 0;

  const auto config = trainer::read_hf_config(model_dir);
  const auto& llama = config.llama;
  const auto weights = trainer::SafetensorsCheckpoint::open(model_dir);
  std::map<std::string, int64_t> elements_by_dtype;
  int64_t stored_elements = 0;
  for (const auto& name : weights.names()) {
    const auto& info = weights.info(name);
    int64_t elements = 1;
    for (auto dim : info.shape) elements *= dim;
    elements_by_dtype[info.dtype] += elements;
    stored_elements += elements;
  }
  const auto sizes = trainer::llama_parameter_counts(llama, lora_rank);

  std::printf("model        %s (%s)\n", model_dir.c_str(), config.architecture.c_str());
  std::printf("layers       %lld, hidden %lld, intermediate %lld, vocab %lld\n",
              static_cast<long long>(llama.num_hidden_layers), static_cast<long long>(llama.hidden_size),
              static_cast<long long>(llama.intermediate_size), static_cast<long long>(llama.vocab_size));
  std::printf("attention    %lld heads, %lld KV heads (%s), head_dim %lld, bias %s\n",
              static_cast<long long>(llama.num_attention_heads), static_cast<long long>(llama.num_key_value_heads),
              llama.num_key_value_heads == 1 ? "MQA"
              : llama.num_key_value_heads < llama.num_attention_heads ? "GQA" : "MHA",
              static_cast<long long>(llama.head_dim), llama.attention_bias ? "yes" : "no");
  std::printf("rope         %s, theta %g, factor %g; max positions %lld\n", config.rope_type_name.c_str(),
              llama.rope.theta, llama.rope.factor, static_cast<long long>(llama.max_position_embeddings));
  std::printf("embeddings   %s, rms_norm_eps %g, mlp bias %s\n", llama.tie_word_embeddings ? "tied" : "untied",
              llama.rms_norm_eps, llama.mlp_bias ? "yes" : "no");
  std::printf("parameters   %.3fM (config), %.3fM stored in %zu tensors\n", sizes.total / 1e6, stored_elements / 1e6,
              weights.names().size());
  std::printf("dtypes       config %s;", trainer::dtype_short_name(config.stored_dtype).c_str());
  for (const auto& [dtype, elements] : elements_by_dtype) std::printf(" %s %.3fM", dtype.c_str(), elements / 1e6);
  std::printf("\n\nmemory for weights and trainable state (activations not included):\n");
  for (const auto& estimate : trainer::training_memory_estimates(sizes)) {
    std::printf("  %-6s frozen %-11s trainable %8.3fM params, with grads + AdamW %-11s total %s\n",
                estimate.mode.c_str(), trainer::format_bytes(estimate.frozen_bytes).c_str(), estimate.trainable_parameters / 1e6,
                trainer::format_bytes(estimate.trainable_bytes).c_str(), trainer::format_bytes(estimate.frozen_bytes + estimate.trainable_bytes).c_str());
  }
  return 0;
}

}  // namespace qtrain::tools
