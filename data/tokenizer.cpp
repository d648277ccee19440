#include "data/tokenizer.h"

#include <algorithm>
#include <filesystem>

#include "data/added_vocabulary.h"
#include "data/bpe_model.h"
#include "data/decoder.h"
#include "data/json_node.h"
#include "data/normalizer.h"
#include "data/pre_tokenizer.h"
#include "data/tokenizer_config.h"
#include "data/tokenizer_file.h"
#include "kernels/error.h"

namespace qtrain::data {

namespace {

// What a post-processor does to a single sequence: ids before it and ids after it.
struct SpecialTokenFrame {
  std::vector<int64_t> prefix;
  std::vector<int64_t> suffix;
};

int64_t token_id_of_pair(const JsonNode& pair) {
  // BertProcessing / RobertaProcessing write a token as ["<s>", 0].
  if (pair.size() != 2) pair.fail("must be [token, id]");
  return pair.at(1).as_integer();
}

void apply_template(const JsonNode& config, SpecialTokenFrame& frame) {
  const JsonNode single = config.at("single");
  const std::optional<JsonNode> special_tokens = config.find("special_tokens");
  SpecialTokenFrame added;
  bool after_sequence = false;
  for (size_t i = 0; i < single.size(); ++i) {
    const JsonNode item = single.at(i);
    if (auto sequence = item.find("Sequence")) {
      const std::string name = sequence->at("id").as_string();
      if (name != "A" || after_sequence) sequence->fail("must be the one sequence 'A' of a single-text template");
      after_sequence = true;
    } else if (auto special = item.find("SpecialToken")) {
      const std::string name = special->at("id").as_string();
      if (!special_tokens) config.fail("uses the special token '" + name + "' but has no special_tokens");
      const JsonNode ids = special_tokens->at(name).at("ids");
      for (size_t j = 0; j < ids.size(); ++j) {
        (after_sequence ? added.suffix : added.prefix).push_back(ids.at(j).as_integer());
      }
    } else {
      item.fail("must be a {\"Sequence\": ...} or a {\"SpecialToken\": ...}");
    }
  }
  if (!after_sequence) single.fail("has no {\"Sequence\": {\"id\": \"A\"}}");
  frame.prefix.insert(frame.prefix.begin(), added.prefix.begin(), added.prefix.end());
  frame.suffix.insert(frame.suffix.end(), added.suffix.begin(), added.suffix.end());
}

// Post-processors apply in order, each wrapping what the previous one produced.
void apply_post_processor(const JsonNode& config, SpecialTokenFrame& frame) {
  const JsonNode type_node = config.at("type");
  const std::string type = type_node.as_string();
  if (type == "TemplateProcessing") {
    apply_template(config, frame);
  } else if (type == "ByteLevel") {
    // Only adjusts offsets; the ids stay as they are.
  } else if (type == "Sequence") {
    const JsonNode processors = config.at("processors");
    for (size_t i = 0; i < processors.size(); ++i) apply_post_processor(processors.at(i), frame);
  } else if (type == "BertProcessing" || type == "RobertaProcessing") {
    frame.prefix.insert(frame.prefix.begin(), token_id_of_pair(config.at("cls")));
    frame.suffix.push_back(token_id_of_pair(config.at("sep")));
  } else {
    type_node.fail("'" + type + "' is not supported (supported post-processors: TemplateProcessing, ByteLevel, "
                   "BertProcessing, RobertaProcessing, Sequence, or null)");
  }
}

}  // namespace

struct Tokenizer::Impl {
  AddedVocabulary added_vocabulary;
  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  std::unique_ptr<BpeModel> model;
  SpecialTokenFrame special_token_frame;
  Decoder decoder;
  std::optional<std::string> bos_token, eos_token, pad_token;
  std::optional<int64_t> bos_id, eos_id, pad_id;

  std::optional<int64_t> token_to_id(const std::string& token) const {
    if (auto id = added_vocabulary.token_to_id(token)) return id;
    return model->token_to_id(token);
  }

  bool has_id(int64_t id) const { return added_vocabulary.find(id) != nullptr || model->id_to_token(id) != nullptr; }

  static std::shared_ptr<Impl> load(const std::string& path) {
    if (!std::filesystem::exists(path)) {
      const auto directory = std::filesystem::path(path).parent_path();
      if (std::filesystem::exists(directory / "tokenizer.model")) {
        throw Error(ErrorCode::kTokenizer, path + ": not found; the directory has only a sentencepiece tokenizer.model, which qtrain does "
                    "not read yet (save the tokenizer with transformers to get tokenizer.json)");
      }
      throw Error(ErrorCode::kTokenizer, path + ": not found (qtrain needs the Hugging Face fast-tokenizer file tokenizer.json)");
    }
    TokenizerFile file = read_tokenizer_file(path);
    const JsonNode root(file.document, path);
    if (!file.document.is_object()) root.fail("must be a JSON object");
    auto impl = std::make_shared<Impl>();
    try {
      impl->normalizer = Normalizer::from_json(root.find("normalizer"));
      impl->model = std::make_unique<BpeModel>(root.at("model"), std::move(file.tables));
      impl->added_vocabulary = AddedVocabulary::from_json(root.find("added_tokens"), *impl->model, impl->normalizer);
      impl->pre_tokenizer = PreTokenizer::from_json(root.find("pre_tokenizer"));
      if (auto post_processor = root.find("post_processor")) {
        apply_post_processor(*post_processor, impl->special_token_frame);
        for (const auto* ids : {&impl->special_token_frame.prefix, &impl->special_token_frame.suffix}) {
          for (const int64_t id : *ids) {
            if (!impl->has_id(id)) post_processor->fail("adds the id " + std::to_string(id) + ", which is not a token");
          }
        }
      }
      impl->decoder = Decoder::from_json(root.find("decoder"));
    } catch (const nlohmann::json::exception& error) {
      throw Error(ErrorCode::kTokenizer, path + ": malformed tokenizer file (" + error.what() + ")");
    }
    return impl;
  }

  // The id of a special token named by tokenizer_config.json.
  std::optional<int64_t> special_token_id(const std::optional<std::string>& token, const std::string& config_path,
                                          const std::string& key) const {
    if (!token) return std::nullopt;
    auto id = token_to_id(*token);
    if (!id) {
      throw Error(ErrorCode::kTokenizer, config_path + ": " + key + " '" + *token + "' is not a token of tokenizer.json (fix " + key +
                  " or the tokenizer files)");
    }
    return id;
  }
};

Tokenizer Tokenizer::from_file(const std::string& tokenizer_json_path) {
  return Tokenizer(Impl::load(tokenizer_json_path));
}

Tokenizer Tokenizer::from_model_dir(const std::string& model_dir) {
  auto impl = Impl::load(model_dir + "/tokenizer.json");
  const TokenizerConfig config = TokenizerConfig::read_from_model_dir(model_dir);
  const std::string config_path = model_dir + "/tokenizer_config.json";
  impl->bos_token = config.bos_token;
  impl->eos_token = config.eos_token;
  impl->pad_token = config.pad_token;
  impl->bos_id = impl->special_token_id(config.bos_token, config_path, "bos_token");
  impl->eos_id = impl->special_token_id(config.eos_token, config_path, "eos_token");
  impl->pad_id = impl->special_token_id(config.pad_token, config_path, "pad_token");
  return Tokenizer(std::move(impl));
}

std::vector<int64_t> Tokenizer::encode(const std::string& text, bool add_special_tokens) const {
  std::vector<int64_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids = impl_->special_token_frame.prefix;
  const AddedVocabulary& added = impl_->added_vocabulary;
  for (const TextPiece& raw_piece : added.split(text, AddedVocabulary::Pass::kRawText)) {
    if (raw_piece.added_token_id) {
      ids.push_back(*raw_piece.added_token_id);
      continue;
    }
    std::string normalized_storage;
    std::string_view normalized = raw_piece.text;
    if (!impl_->normalizer.changes_nothing()) normalized = normalized_storage = impl_->normalizer.normalize(raw_piece.text);
    for (const TextPiece& piece : added.split(normalized, AddedVocabulary::Pass::kNormalizedText)) {
      if (piece.added_token_id) {
        ids.push_back(*piece.added_token_id);
        continue;
      }
      // Metaspace's prepend_scheme "first" needs to know whether this stretch opens the input.
      const bool starts_input = raw_piece.text.data() == text.data() && piece.text.data() == normalized.data();
      for (const std::string& pre_token : impl_->pre_tokenizer.split(piece.text, starts_input)) {
        impl_->model->encode(pre_token, ids);
      }
    }
  }
  if (add_special_tokens) {
    ids.insert(ids.end(), impl_->special_token_frame.suffix.begin(), impl_->special_token_frame.suffix.end());
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  const AddedVocabulary& added_vocabulary = impl_->added_vocabulary;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int64_t id : ids) {
    const std::string* token = nullptr;
    if (const AddedToken* added = added_vocabulary.find(id)) {
      token = &added->normalized_content;
    } else {
      token = impl_->model->id_to_token(id);
    }
    // As tokenizers, skip_special_tokens drops a token by its string, not its id.
    if (token != nullptr && !(skip_special_tokens && added_vocabulary.is_special_content(*token))) {
      tokens.push_back(*token);
    }
  }
  return impl_->decoder.decode(std::move(tokens));
}

int64_t Tokenizer::vocab_size() const {
  return std::max(impl_->model->id_limit(), impl_->added_vocabulary.id_limit());
}

std::optional<int64_t> Tokenizer::token_to_id(const std::string& token) const { return impl_->token_to_id(token); }

std::optional<std::string> Tokenizer::id_to_token(int64_t id) const {
  if (const AddedToken* added = impl_->added_vocabulary.find(id)) return added->content;
  if (const std::string* token = impl_->model->id_to_token(id)) return *token;
  return std::nullopt;
}

bool Tokenizer::is_special(int64_t id) const {
  const AddedToken* added = impl_->added_vocabulary.find(id);
  return added != nullptr && added->special;
}

bool Tokenizer::is_added(int64_t id) const { return impl_->added_vocabulary.find(id) != nullptr; }

std::vector<std::pair<std::string, std::string>> Tokenizer::merges() const { return impl_->model->merges(); }

std::optional<int64_t> Tokenizer::bos_id() const { return impl_->bos_id; }
std::optional<int64_t> Tokenizer::eos_id() const { return impl_->eos_id; }
std::optional<int64_t> Tokenizer::pad_id() const { return impl_->pad_id; }
std::optional<std::string> Tokenizer::bos_token() const { return impl_->bos_token; }
std::optional<std::string> Tokenizer::eos_token() const { return impl_->eos_token; }

}  // namespace qtrain::data
