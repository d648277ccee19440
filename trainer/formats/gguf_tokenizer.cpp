#include "trainer/formats/gguf_tokenizer.h"

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

// The pre-tokenizer regexes llama.cpp knows, by the name its tokenizer.ggml.pre gives them
// (llama-vocab.cpp): Llama 3's, Qwen2's and GPT-2's (ByteLevel's own regex).
struct PreTokenizerName {
  const char* regex;
  const char* gguf_pre;
};
const PreTokenizerName kPreTokenizers[] = {
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
     "\\s+(?!\\S)|\\s+",
     "llama-bpe"},
    // Qwen2 / Qwen2.5 / Qwen3: Llama 3's with single digits.
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
     "\\s+(?!\\S)|\\s+",
     "qwen2"},
};
constexpr const char* kGpt2ByteLevelPre = "gpt-2";

// gguf-py's TokenType.
enum TokenType : int32_t { kNormal = 1, kControl = 3, kUserDefined = 4, kUnused = 5 };

// tokenizer.ggml.pre for the pre_tokenizer of `base`'s tokenizer.json.
std::string pre_tokenizer_name(const BaseDirectory& base) {
  const std::string tokenizer_path = base.path + "/tokenizer.json";
  const auto document = nlohmann::json::parse(base.tokenizer_json(), nullptr, /*allow_exceptions=*/false);
  if (document.is_discarded()) throw Error(ErrorCode::kTokenizer, tokenizer_path + ": not JSON");
  const auto model = document.value("model", nlohmann::json::object());
  if (model.value("byte_fallback", false)) {
    throw Error(ErrorCode::kTokenizer, tokenizer_path + ": a sentencepiece-style tokenizer (byte_fallback, Llama 2 / Mistral); GGUF export "
                "supports byte-level BPE tokenizers (Llama 3 style) only, for now");
  }
  nlohmann::json steps = nlohmann::json::array();
  const auto pre = document.value("pre_tokenizer", nlohmann::json());
  if (pre.is_object() && pre.value("type", "") == "Sequence") {
    steps = pre.value("pretokenizers", nlohmann::json::array());
  } else if (pre.is_object()) {
    steps.push_back(pre);
  }
  std::string regex;
  bool byte_level_regex = false;
  for (const auto& step : steps) {
    const auto type = step.value("type", "");
    if (type == "Split" && step.contains("pattern") && step["pattern"].contains("Regex")) {
      regex = step["pattern"]["Regex"].get<std::string>();
    } else if (type == "ByteLevel") {
      byte_level_regex = step.value("use_regex", true);
    }
  }
  for (const auto& known : kPreTokenizers) {
    if (regex == known.regex) return known.gguf_pre;
  }
  if (regex.empty() && byte_level_regex) return kGpt2ByteLevelPre;
  throw Error(ErrorCode::kTokenizer, tokenizer_path + ": pre_tokenizer " + pre.dump().substr(0, 200) +
              " is not one GGUF export knows (Llama 3's or Qwen2's regex, or GPT-2's byte-level); llama.cpp would tokenize "
              "differently");
}

}  // namespace

std::vector<std::pair<std::string, GgufValue>> gguf_tokenizer_metadata(const BaseDirectory& base) {
  const auto& config = base.config;
  const std::string tokenizer_path = base.path + "/tokenizer.json";
  const auto pre = pre_tokenizer_name(base);
  const auto& tokenizer = base.tokenizer();
  const int64_t vocab_size = config.llama.vocab_size;
  if (tokenizer.vocab_size() > vocab_size) {
    throw Error(ErrorCode::kTokenizer, tokenizer_path + ": " + std::to_string(tokenizer.vocab_size()) + " tokens, more than config.json's "
                "vocab_size " + std::to_string(vocab_size));
  }
  // As convert_hf_to_gguf's get_vocab_base: ids the tokenizer lacks become unused [PADi] tokens.
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  for (int64_t id = 0; id < vocab_size; ++id) {
    const auto token = tokenizer.id_to_token(id);
    if (!token) {
      tokens.push_back("[PAD" + std::to_string(id) + "]");
      types.push_back(kUnused);
    } else {
      tokens.push_back(*token);
      types.push_back(tokenizer.is_special(id) ? kControl : tokenizer.is_added(id) ? kUserDefined : kNormal);
    }
  }
  std::vector<std::string> merges;
  for (const auto& [left, right] : tokenizer.merges()) merges.push_back(left + " " + right);

  std::vector<std::pair<std::string, GgufValue>> metadata = {
      {"tokenizer.ggml.model", std::string("gpt2")},
      {"tokenizer.ggml.pre", pre},
      {"tokenizer.ggml.tokens", GgufValue::strings(tokens)},
      {"tokenizer.ggml.token_type", GgufValue::int32s(types)},
      {"tokenizer.ggml.merges", GgufValue::strings(merges)},
  };
  const auto bos = tokenizer.bos_id() ? tokenizer.bos_id() : config.bos_token_id;
  const auto eos = tokenizer.eos_id()                ? tokenizer.eos_id()
                   : config.eos_token_ids.empty()    ? std::nullopt
                                                     : std::optional<int64_t>(config.eos_token_ids.front());
  const auto pad = tokenizer.pad_id() ? tokenizer.pad_id() : config.pad_token_id;
  if (bos) metadata.emplace_back("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(*bos));
  if (eos) metadata.emplace_back("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(*eos));
  if (pad) metadata.emplace_back("tokenizer.ggml.padding_token_id", static_cast<uint32_t>(*pad));
  // What the post-processor adds around a text, as transformers' add_special_tokens does.
  const auto framed = tokenizer.encode("", /*add_special_tokens=*/true);
  const bool add_bos = bos && !framed.empty() && framed.front() == *bos;
  const bool add_eos = eos && !framed.empty() && framed.back() == *eos && (framed.size() > 1 || !add_bos);
  metadata.emplace_back("tokenizer.ggml.add_bos_token", add_bos);
  metadata.emplace_back("tokenizer.ggml.add_eos_token", add_eos);
  if (const auto chat_template = base.chat_template()) metadata.emplace_back("tokenizer.chat_template", *chat_template);
  return metadata;
}

}  // namespace qtrain::trainer
