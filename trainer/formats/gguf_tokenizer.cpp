#include "trainer/formats/gguf_tokenizer.h"

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "data/tokenizer.h"
#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

using Json = nlohmann::json;

// gguf-py's TokenType (llama.cpp's llama_token_type).
enum TokenType : int32_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

// A byte-level tokenizer.json's pre_tokenizer as the cuts it makes before ByteLevel maps the
// pieces to bytes, in order: each Split's regex (behavior Isolated), or one of these names.
constexpr const char* kGpt2Split = "ByteLevel(use_regex)";    // ByteLevel's own GPT-2 regex
constexpr const char* kDigitSplit = "Digits(individual_digits)";

// The byte-level pre-tokenizers llama.cpp knows (llama-vocab.cpp's llm_tokenizer_bpe): the
// tokenizer.ggml.pre name whose built-in regexes cut text as these splits do, and whether
// llama.cpp then keeps a pre-token that is in the vocabulary whole (tokenizer.json's
// model.ignore_merges). A file matches a row by both. Each row is checked against llama.cpp by
// tests/trainer/gguf_tokenizer_test.cpp.
struct ByteLevelPreTokenizer {
  const char* gguf_pre;
  bool ignore_merges;
  std::vector<std::string> splits;
};
const ByteLevelPreTokenizer kByteLevelPreTokenizers[] = {
    // Llama 3
    {"llama-bpe", true,
     {R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"}},
    // Llama 3's regex without ignore_merges (DBRX, Smaug)
    {"dbrx", false,
     {R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"}},
    // Qwen2, Qwen2.5, Qwen3: Llama 3's with single digits
    {"qwen2", false,
     {R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"}},
    // Qwen3.5: marks continue a word
    {"qwen35", false,
     {R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"}},
    // o200k: GPT-4o, Phi-4-mini, Llama 4
    {"gpt-4o", false,
     {R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"}},
    // Mistral's tekken (Mistral NeMo, Pixtral)
    {"tekken", true,
     {R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"}},
    // Seed-Coder (its \r\n are the characters themselves)
    {"seed-coder", false,
     {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\r\n]+|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}},
    // Ling / Bailing MoE (possessive quantifiers)
    {"bailingmoe", false,
     {R"re('(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+)re"}},
    // EXAONE MoE
    {"exaone-moe", false,
     {R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+)re"}},
    // Jais 2: Llama 3's with cascading whitespace runs
    {"jais-2", false,
     {R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1})re"}},
    // DeepSeek V3 / R1
    {"deepseek-v3", false,
     {R"re(\p{N}{1,3})re", "[一-龥぀-ゟ゠-ヿ]+",
      "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|"
      "\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}},
    // DeepSeek Coder
    {"deepseek-coder", false, {"[\r\n]", R"re(\s?\p{L}+)re", R"re(\s?\p{P}+)re", "[一-龥ࠀ-一가-퟿]+", kDigitSplit}},
    // GPT-2 (ByteLevel alone)
    {"gpt-2", false, {kGpt2Split}},
    // StarCoder, SmolLM, Command R, Refact: GPT-2's with single digits
    {"starcoder", false, {kDigitSplit, kGpt2Split}},
};

// How a sentencepiece-style tokenizer.json (BPE over "▁"-for-space text with <0xXX> byte
// fallback) turns spaces into "▁", as describe_normalizer / describe_pre_tokenizer write its
// normalizer and pre_tokenizer, and the add_space_prefix that makes llama.cpp's sentencepiece
// tokenizer ("llama") do the same: it replaces every space by "▁" and, with add_space_prefix, puts
// one " " before the text and before the text after every special token.
struct SentencepieceLayout {
  const char* normalizer;
  const char* pre_tokenizer;
  bool add_space_prefix;
};
const SentencepieceLayout kSentencepieceLayouts[] = {
    // Llama 2, Mistral v0.1, Phi-3, TinyLlama: "▁" before every stretch of text between added tokens
    {"Prepend(▁) Replace(' ',▁)", "", true},
    // Gemma 1-3: no "▁" in front; the Split finds no space left after the normalizer
    {"Replace(' ',▁)", "", false},
    {"Replace(' ',▁)", "Split(' ')", false},
    // transformers' legacy=false files (Mistral v0.3). Metaspace adds no "▁" to a text that starts
    // with one (a space), and "first" none after an added token; llama.cpp adds " " there too,
    // as sentencepiece itself does.
    {"", "Metaspace(▁,always)", true},
    {"", "Metaspace(▁,first)", true},
    {"", "Metaspace(▁,never)", false},
};

// A normalizer as the sentencepiece layouts name it: its steps, space separated.
std::string describe_normalizer(const Json& normalizer) {
  if (normalizer.is_null()) return "";
  const auto type = normalizer.value("type", "");
  if (type == "Sequence") {
    std::string steps;
    for (const auto& step : normalizer.value("normalizers", Json::array())) {
      steps += (steps.empty() ? "" : " ") + describe_normalizer(step);
    }
    return steps;
  }
  if (type == "Prepend") return "Prepend(" + normalizer.value("prepend", "") + ")";
  const auto pattern = normalizer.value("pattern", Json::object());
  if (type == "Replace" && pattern.contains("String")) {
    return "Replace('" + pattern.value("String", "") + "'," + normalizer.value("content", "") + ")";
  }
  return normalizer.dump();
}

// A pre-tokenizer as the sentencepiece layouts name it.
std::string describe_pre_tokenizer(const Json& pre_tokenizer) {
  if (pre_tokenizer.is_null()) return "";
  const auto type = pre_tokenizer.value("type", "");
  if (type == "Metaspace") {
    // Files written before prepend_scheme existed say add_prefix_space.
    std::string scheme = pre_tokenizer.value("add_prefix_space", true) ? "always" : "never";
    scheme = pre_tokenizer.value("prepend_scheme", scheme);
    const bool split = pre_tokenizer.value("split", true);
    return "Metaspace(" + pre_tokenizer.value("replacement", "") + "," + scheme + (split ? ",split" : "") + ")";
  }
  const auto pattern = pre_tokenizer.value("pattern", Json::object());
  if (type == "Split" && pattern.contains("String") && !pre_tokenizer.value("invert", false)) {
    return "Split('" + pattern.value("String", "") + "')";
  }
  return pre_tokenizer.dump();
}

// The steps of a pre_tokenizer (a Sequence's members, or the one step).
std::vector<Json> pre_tokenizer_steps(const Json& pre_tokenizer) {
  if (pre_tokenizer.is_object() && pre_tokenizer.value("type", "") == "Sequence") {
    return pre_tokenizer.value("pretokenizers", Json::array()).get<std::vector<Json>>();
  }
  if (pre_tokenizer.is_object()) return {pre_tokenizer};
  return {};
}

bool has_byte_level_step(const Json& pre_tokenizer) {
  for (const auto& step : pre_tokenizer_steps(pre_tokenizer)) {
    if (step.value("type", "") == "ByteLevel") return true;
  }
  return false;
}

// What a tokenizer.json is, for llama.cpp.
struct TokenizerLayout {
  std::string model;          // tokenizer.ggml.model: "gpt2" or "llama"
  std::string pre;            // tokenizer.ggml.pre
  bool add_space_prefix = false;
  bool user_defined_spaces = false;  // "▁" in normalized added tokens written as " "
};

class TokenizerJson {
 public:
  TokenizerJson(const std::string& path, const std::string& text) : path_(path) {
    document_ = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!document_.is_object()) throw Error(ErrorCode::kTokenizer, path + ": not a JSON object");
    model_ = document_.value("model", Json::object());
  }

  const Json& document() const { return document_; }
  const Json& model() const { return model_; }

  [[noreturn]] void refuse(const std::string& key, const std::string& why) const {
    throw Error(ErrorCode::kTokenizer, path_ + ": " + key + ": " + why + "; GGUF export cannot write it so that llama.cpp tokenizes "
                "text as the tokenizers library does");
  }

  // What the BPE model's options allow: none that llama.cpp lacks.
  void check_model() const {
    const auto type = model_.value("type", "");
    if (type != "BPE") {
      refuse("model.type", "'" + type + "' (GGUF export writes BPE tokenizers: byte-level like Llama 3's or sentencepiece-style "
             "like Llama 2's)");
    }
    if (model_.contains("dropout") && model_["dropout"].is_number() && model_["dropout"].get<double>() != 0.0) {
      refuse("model.dropout", "BPE dropout");
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (model_.contains(key) && model_[key].is_string() && !model_[key].get<std::string>().empty()) {
        refuse(std::string("model.") + key, "'" + model_[key].get<std::string>() + "'");
      }
    }
  }

  TokenizerLayout layout() const {
    const auto normalizer = document_.value("normalizer", Json());
    const auto pre_tokenizer = document_.value("pre_tokenizer", Json());
    if (has_byte_level_step(pre_tokenizer)) return byte_level_layout(normalizer, pre_tokenizer);
    const auto normalizer_name = describe_normalizer(normalizer);
    const auto pre_tokenizer_name = describe_pre_tokenizer(pre_tokenizer);
    bool known_pre_tokenizer = false;
    for (const auto& layout : kSentencepieceLayouts) {
      known_pre_tokenizer = known_pre_tokenizer || pre_tokenizer_name == layout.pre_tokenizer;
      if (normalizer_name != layout.normalizer || pre_tokenizer_name != layout.pre_tokenizer) continue;
      if (!model_.value("byte_fallback", false)) {
        refuse("model.byte_fallback", "false (llama.cpp's sentencepiece tokenizer falls back to <0xXX> byte tokens where "
               "tokenizers gives the unknown token)");
      }
      return {"llama", "default", layout.add_space_prefix, /*user_defined_spaces=*/true};
    }
    if (known_pre_tokenizer) {
      refuse("normalizer", normalizer.dump().substr(0, 300) + " (llama.cpp's sentencepiece tokenizer only replaces spaces by "
             "\"▁\", with or without one in front)");
    }
    refuse("pre_tokenizer", pre_tokenizer.dump().substr(0, 300) + " with normalizer " + normalizer.dump().substr(0, 200) +
           " is neither byte-level (a ByteLevel step) nor a sentencepiece-style layout llama.cpp has (\"▁\" for spaces by "
           "Prepend + Replace, Replace, or Metaspace without split)");
  }

 private:
  TokenizerLayout byte_level_layout(const Json& normalizer, const Json& pre_tokenizer) const {
    // llama.cpp's byte-level tokenizers normalize nothing; NFC leaves text that is NFC already
    // (nearly all text) as it is, so it stays allowed (Qwen2 has it).
    if (!normalizer.is_null() && normalizer.value("type", "") != "NFC") {
      refuse("normalizer", normalizer.dump().substr(0, 300) + " (llama.cpp's byte-level tokenizers normalize nothing)");
    }
    std::vector<std::string> splits;
    const auto steps = pre_tokenizer_steps(pre_tokenizer);
    for (size_t index = 0; index < steps.size(); ++index) {
      const auto& step = steps[index];
      const auto type = step.value("type", "");
      const auto pattern = step.value("pattern", Json::object());
      if (type == "Split" && pattern.contains("Regex") && step.value("behavior", "") == "Isolated" &&
          !step.value("invert", false)) {
        splits.push_back(pattern.value("Regex", ""));
      } else if (type == "Digits" && step.value("individual_digits", false)) {
        splits.emplace_back(kDigitSplit);
      } else if (type == "ByteLevel" && index + 1 == steps.size() && !step.value("add_prefix_space", true)) {
        if (step.value("use_regex", true)) splits.emplace_back(kGpt2Split);
      } else {
        refuse("pre_tokenizer", "the step " + step.dump().substr(0, 300) + " (llama.cpp's byte-level tokenizers cut text by "
               "regexes alone, as Split with behavior Isolated, then map bytes as a last ByteLevel without add_prefix_space)");
      }
    }
    const bool ignore_merges = model_.value("ignore_merges", false);
    for (const auto& known : kByteLevelPreTokenizers) {
      if (known.splits != splits) continue;
      if (known.ignore_merges == ignore_merges) return {"gpt2", known.gguf_pre, false, false};
    }
    for (const auto& known : kByteLevelPreTokenizers) {
      if (known.splits == splits) {
        refuse("model.ignore_merges", std::string(ignore_merges ? "true" : "false") + " (llama.cpp's '" + known.gguf_pre +
               "', which cuts text as this pre_tokenizer does, has it " + (known.ignore_merges ? "true" : "false") + ")");
      }
    }
    std::string names;
    for (const auto& known : kByteLevelPreTokenizers) names += (names.empty() ? "" : ", ") + std::string(known.gguf_pre);
    refuse("pre_tokenizer", pre_tokenizer.dump().substr(0, 300) + " cuts text as none of llama.cpp's byte-level pre-tokenizers "
           "GGUF export knows (" + names + ")");
  }

  std::string path_;
  Json document_;
  Json model_;
};

// Scores for llama.cpp's sentencepiece tokenizer, which merges the adjacent pair whose
// concatenation is the token of highest score first: a token made by merge number r scores -r,
// so that merges happen in tokenizers' order; tokens no merge makes (characters, bytes, added
// tokens) score below every merge. (convert_hf_to_gguf's tokenizer.json-only path, gguf-py's
// LlamaHfVocab, scores every token -1000, which merges left to right instead.)
std::vector<float> merge_order_scores(const data::Tokenizer& tokenizer, int64_t vocab_size) {
  const auto merges = tokenizer.merges();
  const auto lowest = -static_cast<float>(merges.size());
  std::vector<float> scores(static_cast<size_t>(vocab_size), lowest);
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto id = tokenizer.token_to_id(merges[rank].first + merges[rank].second);
    if (id && *id < vocab_size && scores[*id] == lowest) scores[*id] = -static_cast<float>(rank);
  }
  return scores;
}

// "<0x0A>": a sentencepiece byte-fallback token.
bool is_byte_token(const std::string& token) {
  auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'A' && c <= 'F'); };
  return token.size() == 6 && token.compare(0, 3, "<0x") == 0 && hex(token[3]) && hex(token[4]) && token[5] == '>';
}

std::string replace_all(std::string text, const std::string& from, const std::string& to) {
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) text.replace(at, from.size(), to);
  return text;
}

}  // namespace

std::vector<std::pair<std::string, GgufValue>> gguf_tokenizer_metadata(const BaseDirectory& base) {
  const auto& config = base.config;
  const TokenizerJson file(base.path + "/tokenizer.json", base.tokenizer_json());
  file.check_model();
  const auto layout = file.layout();
  const auto& tokenizer = base.tokenizer();
  const int64_t vocab_size = config.llama.vocab_size;
  if (tokenizer.vocab_size() > vocab_size) {
    file.refuse("model.vocab", std::to_string(tokenizer.vocab_size()) + " tokens, more than config.json's vocab_size " +
                std::to_string(vocab_size));
  }
  const bool sentencepiece = layout.model == "llama";
  std::unordered_map<int64_t, bool> normalized_added;  // added token id -> its "normalized"
  for (const auto& added : file.document().value("added_tokens", Json::array())) {
    normalized_added[added.value("id", int64_t{-1})] = added.value("normalized", false);
  }
  const auto unknown_token = file.model().value("unk_token", Json());
  const auto unknown = unknown_token.is_string() ? tokenizer.token_to_id(unknown_token.get<std::string>()) : std::nullopt;

  // As convert_hf_to_gguf's get_vocab_base: ids the tokenizer lacks become unused [PADi] tokens.
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  for (int64_t id = 0; id < vocab_size; ++id) {
    const auto token = tokenizer.id_to_token(id);
    if (!token) {
      tokens.push_back("[PAD" + std::to_string(id) + "]");
      types.push_back(kUnused);
    } else if (unknown && id == *unknown) {
      tokens.push_back(*token);
      types.push_back(kUnknown);
    } else if (tokenizer.is_special(id)) {
      tokens.push_back(*token);
      types.push_back(kControl);
    } else if (tokenizer.is_added(id)) {
      // llama.cpp finds added tokens in the raw text; tokenizers finds a normalized one in the
      // normalized text, where a space is "▁" (convert_hf_to_gguf: "pre-normalize user-defined spaces").
      tokens.push_back(layout.user_defined_spaces && normalized_added[id] ? replace_all(*token, "\u2581", " ") : *token);
      types.push_back(kUserDefined);
    } else {
      tokens.push_back(*token);
      types.push_back(sentencepiece && is_byte_token(*token) ? kByte : kNormal);
    }
  }

  std::vector<std::pair<std::string, GgufValue>> metadata = {
      {"tokenizer.ggml.model", layout.model},
      {"tokenizer.ggml.pre", layout.pre},
      {"tokenizer.ggml.tokens", GgufValue::strings(tokens)},
  };
  if (sentencepiece) {
    metadata.emplace_back("tokenizer.ggml.scores", GgufValue::float32s(merge_order_scores(tokenizer, vocab_size)));
    metadata.emplace_back("tokenizer.ggml.token_type", GgufValue::int32s(types));
    metadata.emplace_back("tokenizer.ggml.add_space_prefix", layout.add_space_prefix);
  } else {
    std::vector<std::string> merges;
    for (const auto& [left, right] : tokenizer.merges()) merges.push_back(left + " " + right);
    metadata.emplace_back("tokenizer.ggml.token_type", GgufValue::int32s(types));
    metadata.emplace_back("tokenizer.ggml.merges", GgufValue::strings(merges));
  }

  const auto bos = tokenizer.bos_id() ? tokenizer.bos_id() : config.bos_token_id;
  const auto eos = tokenizer.eos_id()                ? tokenizer.eos_id()
                   : config.eos_token_ids.empty()    ? std::nullopt
                                                     : std::optional<int64_t>(config.eos_token_ids.front());
  const auto pad = tokenizer.pad_id() ? tokenizer.pad_id() : config.pad_token_id;
  if (bos) metadata.emplace_back("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(*bos));
  if (eos) metadata.emplace_back("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(*eos));
  if (unknown) metadata.emplace_back("tokenizer.ggml.unknown_token_id", static_cast<uint32_t>(*unknown));
  if (pad) metadata.emplace_back("tokenizer.ggml.padding_token_id", static_cast<uint32_t>(*pad));

  // What the post-processor puts around a text (transformers' add_special_tokens): llama.cpp
  // can add the BOS token before and the EOS token after, nothing else.
  auto framed = tokenizer.encode("", /*add_special_tokens=*/true);
  const bool add_bos = bos && !framed.empty() && framed.front() == *bos;
  if (add_bos) framed.erase(framed.begin());
  const bool add_eos = eos && !framed.empty() && framed.back() == *eos;
  if (add_eos) framed.pop_back();
  if (!framed.empty()) {
    file.refuse("post_processor", "adds the token " + std::to_string(framed.front()) + " to every text, which is not the BOS " +
                "token before it or the EOS token after it (tokenizer_config.json's bos_token / eos_token)");
  }
  metadata.emplace_back("tokenizer.ggml.add_bos_token", add_bos);
  metadata.emplace_back("tokenizer.ggml.add_eos_token", add_eos);
  if (const auto chat_template = base.chat_template()) metadata.emplace_back("tokenizer.chat_template", *chat_template);
  return metadata;
}

}  // namespace qtrain::trainer
