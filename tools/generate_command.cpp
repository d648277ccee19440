// qtrain generate: text from a Hugging Face model (optionally with a PEFT adapter), streamed to
// stdout as it is generated; speed on stderr. The decoding itself is trainer/model/generation.h.
#include <cstdio>
#include <iostream>
#include <optional>
#include <nlohmann/json.hpp>

#include "data/chat_template.h"
#include "data/jsonl.h"
#include "data/sample_formats.h"
#include "data/streaming_decoder.h"
#include "data/tokenizer.h"
#include "kernels/error.h"
#include "tools/commands.h"
#include "trainer/formats/hf_hub_cache.h"
#include "tools/kernel_profile.h"
#include "trainer/base/device.h"
#include "trainer/model/generation.h"
#include "trainer/formats/generation_config.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/peft_adapter.h"

namespace po = boost::program_options;

namespace qtrain::tools {

namespace {

// The prompts to continue, as token ids: --prompt with the tokenizer's special tokens (BOS), as
// transformers' tokenizer(text) gives them; each --chat record rendered by the chat template
// with the assistant header to answer after (add_generation_prompt), as apply_chat_template does.
std::vector<std::vector<int64_t>> prompt_ids(const std::string& prompt, const std::string& chat_file,
                                             const std::string& chat_template, const std::string& model_dir,
                                             const data::Tokenizer& tokenizer) {
  if (!prompt.empty()) return {tokenizer.encode(prompt, /*add_special_tokens=*/true)};
  const auto chat = data::ChatTemplate::from_model_dir(model_dir, chat_template);
  std::vector<std::vector<int64_t>> prompts;
  data::for_each_jsonl_record(chat_file, [&](const data::JsonlRecord& record) {
    const auto text = chat.render(data::read_chat_messages(record), /*add_generation_prompt=*/true);
    prompts.push_back(tokenizer.encode(text, /*add_special_tokens=*/false));
  });
  if (prompts.empty()) throw Error(ErrorCode::kData, chat_file + ": no chats in the file (one {\"messages\": [...]} per line)");
  return prompts;
}

// Command-line settings over the model's generation_config.json.
void apply_overrides(const po::variables_map& values, trainer::GenerationOptions& generation) {
  auto& sampling = generation.sampling;
  if (values.count("max-new-tokens")) generation.max_new_tokens = values["max-new-tokens"].as<int64_t>();
  if (generation.max_new_tokens < 1) throw Error(ErrorCode::kUsage, "--max-new-tokens must be at least 1");
  if (values.count("temperature")) {
    const double temperature = values["temperature"].as<double>();
    if (temperature < 0) throw Error(ErrorCode::kUsage, "--temperature must be 0 (greedy) or positive (sampling)");
    sampling.do_sample = temperature > 0;
    if (temperature > 0) sampling.temperature = temperature;
  }
  if (values.count("top-k")) sampling.top_k = values["top-k"].as<int64_t>();
  if (sampling.top_k < 0) throw Error(ErrorCode::kUsage, "--top-k must be 0 (off) or positive");
  if (values.count("top-p")) sampling.top_p = values["top-p"].as<double>();
  if (!(sampling.top_p > 0 && sampling.top_p <= 1)) throw Error(ErrorCode::kUsage, "--top-p must be in (0, 1]");
  if (values.count("repetition-penalty")) sampling.repetition_penalty = values["repetition-penalty"].as<double>();
  if (!(sampling.repetition_penalty > 0)) throw Error(ErrorCode::kUsage, "--repetition-penalty must be positive (1 = none)");
  if (!sampling.do_sample && (values.count("top-k") || values.count("top-p"))) {
    std::cerr << "generate: note: decoding is greedy, so --top-k / --top-p do nothing; give --temperature T > 0 "
                 "to sample\n";
  }
  generation.seed = values["seed"].as<uint64_t>();
}

}  // namespace

int run_generate(const Arguments& arguments) {
  std::string model_dir, adapter_dir, prompt, chat_file, chat_template, dtype_name, device_name, trace_path;
  po::options_description options("generate options");
  options.add_options()
      ("model", po::value(&model_dir)->required(), "Hugging Face model directory or ORG/NAME[@REVISION] in the HF cache (bf16/fp32, or bnb 4-bit)")
      ("adapter", po::value(&adapter_dir)->default_value(""), "PEFT LoRA adapter directory to apply")
      ("prompt", po::value(&prompt)->default_value(""), "text to continue (BOS added as the tokenizer does)")
      ("chat", po::value(&chat_file)->default_value(""),
       "JSONL file of chats ({\"messages\": [...]} per line): answers each, after the model's chat template")
      ("chat-template", po::value(&chat_template)->default_value(""), "chat: llama3 or chatml instead of the model's")
      ("max-new-tokens", po::value<int64_t>(), "most tokens to generate (default: generation_config.json's, else 256)")
      ("temperature", po::value<double>(),
       "0 = greedy; > 0 samples with this temperature (default: generation_config.json's do_sample / "
       "temperature; greedy without one)")
      ("top-k", po::value<int64_t>(), "sampling: keep the K most likely tokens, 0 = all (default: generation_config.json's, else 50)")
      ("top-p", po::value<double>(), "sampling: nucleus probability, 1 = off (default: generation_config.json's, else 1)")
      ("repetition-penalty", po::value<double>(),
       "divide positive / multiply negative logits of tokens already present; 1 = off, applies to greedy too "
       "(default: generation_config.json's, else 1)")
      ("seed", po::value<uint64_t>()->default_value(0), "seed of the sampling")
      ("dtype", po::value(&dtype_name)->default_value("auto"),
       "compute dtype: fp32, bf16, fp16; auto = fp32 on the CPU, the model's dtype on a GPU")
      ("device", po::value(&device_name)->default_value("auto"), "cpu, cuda, cuda:N or auto")
      ("profile", po::bool_switch(),
       "profile the first prompt's generation: GPU time per kernel and host time per operator, per new token, on "
       "stderr")
      ("trace", po::value(&trace_path), "with --profile: also write a Chrome trace to this file, with each operator's input shapes")
      ("json", po::bool_switch(),
       "instead of streaming text, one JSON object per prompt: prompt_tokens, tokens, text, stopped_at_eos, "
       "tokens_per_second");
  po::variables_map values;
  if (!parse_command_line("usage: qtrain generate --model DIR [--adapter DIR] (--prompt TEXT | --chat FILE.jsonl) [options]",
                          options, arguments, values)) {
    return 0;
  }
  model_dir = trainer::resolve_model_path(model_dir, "--model");  // a folder, or ORG/NAME in the HF cache
  if (prompt.empty() == chat_file.empty()) throw Error(ErrorCode::kUsage, "give either --prompt TEXT or --chat FILE.jsonl");

  const auto config = trainer::read_hf_config(model_dir);
  trainer::ModelLoadOptions load;
  load.device = trainer::resolve_device(device_name);
  load.dtype = dtype_name != "auto"    ? trainer::parse_dtype_name(dtype_name, "--dtype")
               : load.device.is_cpu() ? torch::kFloat32
                                      : config.stored_dtype;
  if (load.dtype == torch::kFloat16 && load.device.is_cpu()) {
    throw Error(ErrorCode::kUsage, "--dtype fp16 is not supported on the CPU; use bf16 or fp32");
  }
  auto generation = trainer::read_generation_config(model_dir, config);
  apply_overrides(values, generation);
  const auto tokenizer = data::Tokenizer::from_model_dir(model_dir);
  const auto prompts = prompt_ids(prompt, chat_file, chat_template, model_dir, tokenizer);
  auto loaded = trainer::load_llama(model_dir, load);
  if (!adapter_dir.empty()) trainer::apply_peft_adapter(*loaded.model, adapter_dir);

  const bool json = values["json"].as<bool>();
  bool profiling = values["profile"].as<bool>();
  for (const auto& ids : prompts) {
    std::optional<KernelProfile> profile;
    if (profiling) profile.emplace(load.device.is_cuda(), /*record_shapes=*/!trace_path.empty());
    data::StreamingDecoder stream(tokenizer);
    auto print = [](const std::string& piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    };
    const auto result = trainer::generate(*loaded.model, ids, generation, [&](int64_t token) {
      const auto piece = stream.push(token);
      if (!json) print(piece);
    });
    if (json) {
      nlohmann::json line = {{"prompt_tokens", ids},
                             {"tokens", result.tokens},
                             {"text", tokenizer.decode(result.tokens, /*skip_special_tokens=*/true)},
                             {"stopped_at_eos", result.stopped_at_eos},
                             {"tokens_per_second", result.decode_tokens_per_second()}};
      std::cout << line.dump() << std::endl;
    } else {
      print(stream.finish() + "\n");
    }
    std::fprintf(stderr, "generate: %zu prompt tokens, %zu new tokens (%s); prefill %.3f s, decoding %.1f tokens/s on %s\n",
                 ids.size(), result.tokens.size(), result.stopped_at_eos ? "end of sequence" : "max-new-tokens",
                 result.prefill_seconds, result.decode_tokens_per_second(), load.device.str().c_str());
    if (profile) {
      profile->finish(trace_path, static_cast<int64_t>(result.tokens.size()), 15, std::cerr);
      profile.reset();
      profiling = false;
    }
  }
  return 0;
}

}  // namespace qtrain::tools
