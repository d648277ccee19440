#pragma once
// An HF fast tokenizer (tokenizer.json) with a BPE model, giving the ids that the tokenizers
// library gives: byte-level files (Llama 3, GPT-2, Qwen) and sentencepiece-style ones with
// "▁" for spaces and <0xXX> byte fallback (Llama 2, Mistral, TinyLlama). Pipeline, as in
// tokenizers:
//   added tokens found in the raw text -> normalizer (normalizer.h) on each stretch between
//   them -> pre-tokenizer (pre_tokenizer.h) -> BPE per pre-token (bpe_model.h) ->
//   post-processor (e.g. BOS first) when add_special_tokens.
// Decoding runs the file's decoder (decoder.h) on the token strings.
// A Tokenizer is cheap to copy (copies share one immutable model) and safe to use from
// several threads at once.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace qtrain::data {

class Tokenizer {
 public:
  // Reads DIR/tokenizer.json, and DIR/tokenizer_config.json when present (bos_token,
  // eos_token, pad_token names).
  static Tokenizer from_model_dir(const std::string& model_dir);
  // Reads one tokenizer.json; bos/eos/pad ids stay unset (no tokenizer_config.json).
  static Tokenizer from_file(const std::string& tokenizer_json_path);

  // add_special_tokens is transformers' flag: apply the post-processor template (e.g. BOS).
  // Special-token text in `text` ("<|eot_id|>") is recognised either way.
  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens = true) const;
  // Ids the tokenizer does not know are left out, as tokenizers does.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;

  // One past the largest id, added tokens included (transformers' len(tokenizer)).
  int64_t vocab_size() const;
  std::optional<int64_t> token_to_id(const std::string& token) const;
  std::optional<std::string> id_to_token(int64_t id) const;
  bool is_special(int64_t id) const;
  // Whether the id is one of tokenizer.json's added_tokens (special or not).
  bool is_added(int64_t id) const;
  // The BPE merges by rank, as (left token, right token): what a GGUF file stores.
  std::vector<std::pair<std::string, std::string>> merges() const;

  std::optional<int64_t> bos_id() const;
  std::optional<int64_t> eos_id() const;
  std::optional<int64_t> pad_id() const;
  // The token strings named by tokenizer_config.json (chat templates render bos_token).
  std::optional<std::string> bos_token() const;
  std::optional<std::string> eos_token() const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace qtrain::data
