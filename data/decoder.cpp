#include "data/decoder.h"

#include "data/byte_level.h"
#include "data/pre_tokenizer.h"
#include "data/text_pattern.h"
#include "data/utf8.h"

namespace qtrain::data {

namespace {

// Each token's characters back to bytes (a token with a character outside the alphabet, e.g.
// an added token, keeps its own bytes), then all bytes read as one UTF-8 string with invalid
// sequences replaced: one token out.
class ByteLevelStep : public DecoderStep {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const std::string& token : tokens) {
      if (!byte_level::decode(token, bytes)) bytes += token;
    }
    tokens.assign(1, utf8::replace_invalid(bytes));
  }
};

class ReplaceStep : public DecoderStep {
 public:
  explicit ReplaceStep(const JsonNode& config)
      : pattern_(config.at("pattern")), content_(config.at("content").as_string()) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) token = replace_all(token, pattern_, content_);
  }

 private:
  TextPattern pattern_;
  std::string content_;
};

// The byte a "<0xXX>" token stands for, or -1. Rust's u8::from_str_radix, which tokenizers
// uses here, takes either case and a leading '+'.
int byte_of_token(const std::string& token) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return -1;
  auto digit = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (token[3] == '+') return digit(token[4]);
  const int high = digit(token[3]);
  const int low = digit(token[4]);
  return high < 0 || low < 0 ? -1 : high * 16 + low;
}

// Each run of "<0xXX>" tokens becomes the string its bytes spell, or, when they are not valid
// UTF-8, one U+FFFD per byte token.
class ByteFallbackStep : public DecoderStep {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    std::vector<std::string> result;
    result.reserve(tokens.size());
    std::string bytes;
    size_t byte_tokens = 0;
    auto flush = [&] {
      if (byte_tokens == 0) return;
      if (utf8::is_valid(bytes)) {
        result.push_back(bytes);
      } else {
        result.insert(result.end(), byte_tokens, "\xEF\xBF\xBD");
      }
      bytes.clear();
      byte_tokens = 0;
    };
    for (std::string& token : tokens) {
      const int byte = byte_of_token(token);
      if (byte >= 0) {
        bytes += static_cast<char>(byte);
        ++byte_tokens;
      } else {
        flush();
        result.push_back(std::move(token));
      }
    }
    flush();
    tokens = std::move(result);
  }
};

class FuseStep : public DecoderStep {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    std::string fused;
    for (const std::string& token : tokens) fused += token;
    tokens.assign(1, std::move(fused));
  }
};

// Up to `start` leading and `stop` trailing copies of one character cut from every token
// (Llama 2 cuts the space its normalizer put in front of the text).
class StripStep : public DecoderStep {
 public:
  explicit StripStep(const JsonNode& config)
      : content_(config.at("content").as_string()),
        start_(static_cast<size_t>(config.at("start").as_integer())),
        stop_(static_cast<size_t>(config.at("stop").as_integer())) {
    if (content_.empty() || utf8::character_at(content_, 0).length != content_.size()) {
      config.at("content").fail("must be one character, got '" + content_ + "'");
    }
  }

  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) {
      size_t begin = 0;
      for (size_t i = 0; i < start_ && token.compare(begin, content_.size(), content_) == 0; ++i) {
        begin += content_.size();
      }
      size_t end = token.size();
      for (size_t i = 0; i < stop_ && end >= begin + content_.size() &&
                         token.compare(end - content_.size(), content_.size(), content_) == 0;
           ++i) {
        end -= content_.size();
      }
      token = token.substr(begin, end - begin);
    }
  }

 private:
  std::string content_;
  size_t start_;
  size_t stop_;
};

// Every replacement character back to a space, except in the first token, where (unless the
// scheme is never) each one is dropped: the "▁" the pre-tokenizer put in front.
class MetaspaceStep : public DecoderStep {
 public:
  explicit MetaspaceStep(const JsonNode& config)
      : options_(MetaspaceOptions::from_json(config)), replacement_(TextPattern::literal(options_.replacement)) {}

  void apply(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      const bool drop = i == 0 && options_.prepend_scheme != PrependScheme::kNever;
      tokens[i] = replace_all(tokens[i], replacement_, drop ? "" : " ");
    }
  }

 private:
  MetaspaceOptions options_;
  TextPattern replacement_;
};

// Models whose merges end words with a suffix ("</w>": CLIP, the original GPT): the suffix is
// a space between words, and nothing at the very end.
class BpeSuffixStep : public DecoderStep {
 public:
  explicit BpeSuffixStep(const JsonNode& config) : suffix_(TextPattern::literal(config.string_or("suffix", "</w>"))) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = replace_all(tokens[i], suffix_, i + 1 == tokens.size() ? "" : " ");
  }

 private:
  TextPattern suffix_;
};

using DecoderRow = std::pair<const char*, std::shared_ptr<const DecoderStep> (*)(const JsonNode& config)>;

// The decoders qtrain implements, by tokenizer.json's type name.
const std::vector<DecoderRow>& decoder_rows() {
  static const std::vector<DecoderRow> rows = {
      {"ByteLevel", [](const JsonNode&) -> std::shared_ptr<const DecoderStep> { return std::make_shared<ByteLevelStep>(); }},
      {"Replace", [](const JsonNode& config) -> std::shared_ptr<const DecoderStep> { return std::make_shared<ReplaceStep>(config); }},
      {"ByteFallback", [](const JsonNode&) -> std::shared_ptr<const DecoderStep> { return std::make_shared<ByteFallbackStep>(); }},
      {"Fuse", [](const JsonNode&) -> std::shared_ptr<const DecoderStep> { return std::make_shared<FuseStep>(); }},
      {"Strip", [](const JsonNode& config) -> std::shared_ptr<const DecoderStep> { return std::make_shared<StripStep>(config); }},
      {"Metaspace", [](const JsonNode& config) -> std::shared_ptr<const DecoderStep> {
         return std::make_shared<MetaspaceStep>(config);
       }},
      {"BPEDecoder", [](const JsonNode& config) -> std::shared_ptr<const DecoderStep> {
         return std::make_shared<BpeSuffixStep>(config);
       }},
  };
  return rows;
}

void add_steps(const JsonNode& config, std::vector<std::shared_ptr<const DecoderStep>>& steps) {
  const JsonNode type_node = config.at("type");
  const std::string type = type_node.as_string();
  if (type == "Sequence") {
    const JsonNode members = config.at("decoders");
    for (size_t i = 0; i < members.size(); ++i) add_steps(members.at(i), steps);
    return;
  }
  for (const auto& [name, make] : decoder_rows()) {
    if (type == name) {
      steps.push_back(make(config));
      return;
    }
  }
  if (type == "WordPiece" || type == "CTC") {
    type_node.fail("'" + type + "' is not supported (it comes with " +
                   (type == "WordPiece" ? "BERT's WordPiece models" : "CTC speech models (wav2vec2)") +
                   ", and qtrain reads BPE models only)");
  }
  type_node.fail("'" + type + "' is not supported (supported decoders: ByteLevel, Replace, ByteFallback, Fuse, "
                 "Strip, Metaspace, BPEDecoder, a Sequence of these, or null)");
}

}  // namespace

Decoder Decoder::from_json(const std::optional<JsonNode>& config) {
  Decoder decoder;
  if (config) {
    add_steps(*config, decoder.steps_);
  } else {
    decoder.join_with_spaces_ = true;
  }
  return decoder;
}

std::string Decoder::decode(std::vector<std::string> tokens) const {
  for (const auto& step : steps_) step->apply(tokens);
  std::string text;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (join_with_spaces_ && i > 0) text += ' ';
    text += tokens[i];
  }
  return text;
}

}  // namespace qtrain::data
