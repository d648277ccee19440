#include "data/tokenizer_file.h"

#include "data/json_events.h"
#include "data/text_file.h"
#include "kernels/error.h"

namespace qtrain::data {

namespace {

using Json = nlohmann::json;

// nlohmann's SAX events, built into a tree as nlohmann's own parser builds it, except inside
// model.vocab and model.merges, whose entries go to the flat tables.
class TokenizerFileParser final : public nlohmann::json_sax<Json> {
 public:
  TokenizerFileParser(const std::string& file, TokenizerFile& out) : file_(file), out_(out) {}

  // Why the parse stopped, when a handler returned false ("" for a JSON syntax error).
  const std::string& error() const { return error_; }

  bool null() override { return value(nullptr, "null"); }
  bool boolean(bool flag) override { return value(flag, "boolean"); }
  bool number_integer(number_integer_t number) override {
    if (section_ == Section::kVocab) return vocab_entry(number);
    return value(number, "number");
  }
  bool number_unsigned(number_unsigned_t number) override {
    if (section_ == Section::kVocab) return vocab_entry(static_cast<int64_t>(number));
    return value(number, "number");
  }
  bool number_float(number_float_t number, const string_t&) override { return value(number, "number"); }
  bool binary(binary_t&) override { return value(nullptr, "binary"); }

  bool string(string_t& text) override {
    if (section_ == Section::kMerges) return merge_line(text);
    if (section_ == Section::kMergePair) {
      if (merge_pair_.size() == 2) return bad_merge();
      merge_pair_.push_back(std::move(text));
      return true;
    }
    return value(std::move(text), "string");
  }

  bool key(string_t& name) override {
    if (section_ == Section::kVocab) {
      vocab_token_ = std::move(name);
    } else {
      keys_.back() = std::move(name);
    }
    return true;
  }

  bool start_object(std::size_t) override {
    if (section_ != Section::kDocument) return value(nullptr, "object");
    return open_or_divert(Json::object(), "vocab", Section::kVocab);
  }
  bool end_object() override {
    if (section_ == Section::kVocab) {
      section_ = Section::kDocument;
    } else {
      close();
    }
    return true;
  }

  bool start_array(std::size_t) override {
    if (section_ == Section::kMerges) {
      section_ = Section::kMergePair;
      merge_pair_.clear();
      return true;
    }
    if (section_ != Section::kDocument) return value(nullptr, "array");
    return open_or_divert(Json::array(), "merges", Section::kMerges);
  }
  bool end_array() override {
    if (section_ == Section::kMergePair) {
      if (merge_pair_.size() != 2) return bad_merge();
      out_.tables.merges.emplace_back(std::move(merge_pair_[0]), std::move(merge_pair_[1]));
      section_ = Section::kMerges;
    } else if (section_ == Section::kMerges) {
      section_ = Section::kDocument;
    } else {
      close();
    }
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

 private:
  enum class Section { kDocument, kVocab, kMerges, kMergePair };

  // Whether the value about to open is the member `name` of the top-level "model" object.
  bool at_model_member(const char* name) const {
    return open_containers_.size() == 2 && open_containers_[0]->is_object() && keys_[0] == "model" &&
           open_containers_[1]->is_object() && keys_[1] == name;
  }

  // Puts a value where the tree expects the next one; returns where it went.
  Json* place(Json&& node) {
    if (open_containers_.empty()) {
      out_.document = std::move(node);
      return &out_.document;
    }
    Json& container = *open_containers_.back();
    if (container.is_array()) {
      container.push_back(std::move(node));
      return &container.back();
    }
    Json& member = container[keys_.back()];
    member = std::move(node);
    return &member;
  }
  // Opens an empty container in the document; when it is model.<member>, leaves it empty
  // and reads what follows into the tables instead.
  bool open_or_divert(Json&& empty, const char* member, Section section) {
    if (at_model_member(member)) {
      place(std::move(empty));
      section_ = section;
    } else {
      open(std::move(empty));
    }
    return true;
  }
  void open(Json&& container) {
    open_containers_.push_back(place(std::move(container)));
    keys_.emplace_back();
  }
  void close() {
    open_containers_.pop_back();
    keys_.pop_back();
  }

  // A scalar: in the document, or a complaint when it sits where a vocab id or a merge goes.
  bool value(Json&& node, const char* type_name) {
    if (section_ == Section::kVocab) {
      return fail("model.vocab[\"" + vocab_token_ + "\"] must be an integer, got " + type_name);
    }
    if (section_ == Section::kMerges || section_ == Section::kMergePair) return bad_merge();
    place(std::move(node));
    return true;
  }

  bool vocab_entry(int64_t id) {
    out_.tables.vocab.emplace_back(std::move(vocab_token_), id);
    return true;
  }

  // "left right": the form older files use.
  bool merge_line(const std::string& line) {
    const size_t space = line.find(' ');
    if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
      return fail(merge_path() + " must be two tokens separated by one space, got '" + line + "'");
    }
    out_.tables.merges.emplace_back(line.substr(0, space), line.substr(space + 1));
    return true;
  }
  bool bad_merge() { return fail(merge_path() + " must be \"left right\" or a list of two strings"); }
  std::string merge_path() const { return "model.merges[" + std::to_string(out_.tables.merges.size()) + "]"; }

  bool fail(const std::string& what) {
    error_ = file_ + ": " + what;
    return false;
  }

  const std::string& file_;
  TokenizerFile& out_;
  Section section_ = Section::kDocument;
  std::vector<Json*> open_containers_;
  std::vector<std::string> keys_;  // per open container: the member being read (objects)
  std::string vocab_token_;
  std::vector<std::string> merge_pair_;
  std::string error_;
};

}  // namespace

TokenizerFile read_tokenizer_file(const std::string& path) {
  const std::string text = read_text_file(path, "a tokenizer.json file");
  TokenizerFile file;
  TokenizerFileParser parser(path, file);
  if (!read_json_events(text, parser)) {
    if (!parser.error().empty()) throw Error(ErrorCode::kTokenizer, parser.error());
    throw Error(ErrorCode::kTokenizer, path + ": not valid JSON (is the file complete?)");
  }
  return file;
}

}  // namespace qtrain::data
