// qtrain eval: held-out loss and perplexity of a Hugging Face model, optionally with a PEFT adapter.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "data/dataset.h"
#include "data/tokenizer.h"
#include "kernels/error.h"
#include "trainer/base/device.h"
#include "trainer/model/evaluate.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/peft_adapter.h"
#include "tools/commands.h"
#include "trainer/formats/hf_hub_cache.h"

namespace po = boost::program_options;

namespace qtrain::tools {

int run_eval(const Arguments& arguments) {
  std::string model_dir, data_path, adapter_dir, dtype_name, device_name, format, chat_template;
  int64_t max_seq_len = 0, batch_size = 0, max_batches = 0;
  po::options_description options("eval options");
  options.add_options()
      ("model", po::value(&model_dir)->required(), "Hugging Face model directory or ORG/NAME[@REVISION] in the HF cache (config.json, safetensors, tokenizer.json)")
      ("data", po::value(&data_path)->required(), "data file or directory of shards, in --format")
      ("format", po::value(&format)->default_value("text"), "text (cut into windows), instruct, chat (loss on the responses) or tokens")
      ("chat-template", po::value(&chat_template)->default_value(""), "chat: llama3 or chatml instead of the model's")
      ("adapter", po::value(&adapter_dir)->default_value(""), "PEFT LoRA adapter directory to apply")
      ("max-seq-len", po::value(&max_seq_len)->default_value(2048), "tokens per sequence (longer chats are truncated)")
      ("batch-size", po::value(&batch_size)->default_value(8), "sequences per forward pass")
      ("max-batches", po::value(&max_batches)->default_value(0), "stop after this many batches (0 = all)")
      ("dtype", po::value(&dtype_name)->default_value("fp32"), "compute dtype: fp32, bf16 or fp16")
      ("device", po::value(&device_name)->default_value("auto"), "cpu, cuda, cuda:N or auto")
      ("json", po::bool_switch(), "print the result as one JSON object on the last line");
  po::variables_map values;
  if (!parse_command_line("usage: qtrain eval --model DIR --data PATH [--format F] [options]", options, arguments, values)) {
    return 0;
  }
  model_dir = trainer::resolve_model_path(model_dir, "--model");  // a folder, or ORG/NAME in the HF cache

  trainer::ModelLoadOptions load;
  load.dtype = trainer::parse_dtype_name(dtype_name, "--dtype");
  load.device = trainer::resolve_device(device_name);
  if (load.dtype == torch::kFloat16 && load.device.is_cpu()) {
    throw Error(ErrorCode::kUsage, "--dtype fp16 is not supported on the CPU; use bf16 or fp32");
  }
  auto tokenizer = data::Tokenizer::from_model_dir(model_dir);
  data::DataOptions data_options;
  data_options.records.format = format;
  data_options.records.chat_template = chat_template;
  data_options.max_seq_len = max_seq_len;
  const auto dataset = data::load_dataset({data_path}, data_options, tokenizer, model_dir);
  auto loaded = trainer::load_llama(model_dir, load);
  if (!adapter_dir.empty()) trainer::apply_peft_adapter(*loaded.model, adapter_dir);

  trainer::EvalOptions eval_options;
  eval_options.batch_size = batch_size;
  eval_options.max_batches = max_batches;
  const auto result = trainer::evaluate(*loaded.model, dataset.examples, eval_options);
  std::printf("eval: loss %.6f  perplexity %.4f  tokens %lld  (%.0f tokens/s on %s, %.1f s)\n", result.loss,
              result.perplexity, static_cast<long long>(result.tokens), result.tokens_per_second,
              load.device.str().c_str(), result.seconds);
  if (values["json"].as<bool>()) {
    nlohmann::json summary = {{"loss", result.loss},
                              {"perplexity", result.perplexity},
                              {"tokens", result.tokens},
                              {"tokens_per_second", result.tokens_per_second}};
    std::cout << summary.dump() << std::endl;
  }
  return 0;
}

}  // namespace qtrain::tools
