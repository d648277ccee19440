#pragma once
// Records into labelled samples, one function per data.format:
//   text      {"<text_field>": ...} -> BOS + text + EOS, every token learned
//   instruct  {"instruction", "input", "output"} -> BOS + prompt + output + EOS; the loss sees the
//             output and EOS only, unless train_on_inputs
//   preference {"prompt", "chosen", "rejected"} -> a pair (data/example.h): prompt + chosen and
//             prompt + rejected, as TRL's DPOTrainer tokenizes them: plain strings get BOS and the
//             EOS token; message lists (and the implicit prompt, chosen and rejected as whole chats
//             that share their first messages) are rendered with the chat template, the prompt with
//             the generation prompt. The prompt is the ids that both sequences begin with; the loss
//             sees the completions only.
//   chat      {"messages": [{"role", "content"}]} (or ShareGPT's {"conversations": [{"from",
//             "value"}]}) rendered with the chat template; the loss sees assistant turns only
// Each part is tokenised on its own and the ids joined, so a label boundary is a token boundary.
// In every format, a record with "input_ids" (and optionally "labels", -100 where nothing is
// learned; what `qtrain data --json` prints, with "sample_lengths" for a preference pair) is taken as
// already tokenised.
#include <optional>
#include <string>
#include <vector>

#include "data/chat_template.h"
#include "data/example.h"
#include "data/jsonl.h"
#include "data/prompt_template.h"
#include "data/tokenizer.h"

namespace qtrain::data {

struct SampleFormatOptions {
  std::string format = "text";  // text | instruct | chat | preference
  std::string text_field = "text";
  std::string prompt_template = "alpaca";  // instruct: a name or a template text
  bool train_on_inputs = false;            // instruct and chat: learn the prompt / every turn too
  std::string chat_template;               // chat: empty = the model's; llama3 | chatml forces one
};

// The messages of a chat record ({"messages": [{"role", "content"}]} or ShareGPT's
// {"conversations": [{"from", "value"}]}); Error naming the record's file:line when malformed.
std::vector<ChatMessage> read_chat_messages(const JsonlRecord& record);

class SampleBuilder {
 public:
  // model_dir supplies the chat template (formats chat and preference).
  SampleBuilder(const SampleFormatOptions& options, Tokenizer tokenizer, const std::string& model_dir);

  // Error naming the record's file:line when a field is missing or of the wrong type.
  Example from_record(const JsonlRecord& record) const;
  // A whole plain-text document (format text, .txt files).
  Example from_text(const std::string& text) const;

  const Tokenizer& tokenizer() const { return tokenizer_; }

 private:
  Example from_token_ids(const JsonlRecord& record) const;
  Example from_instruct(const JsonlRecord& record) const;
  Example from_chat(const JsonlRecord& record) const;
  Example from_preference(const JsonlRecord& record) const;
  void append(Example& sample, const std::string& text, bool learned, bool add_special_tokens) const;
  void append_eos(Example& sample, bool learned, const JsonlRecord* record) const;

  SampleFormatOptions options_;
  Tokenizer tokenizer_;
  std::optional<PromptTemplate> prompt_template_;
  std::optional<ChatTemplate> chat_template_;
  // format preference: why the model has no chat template, said when a record needs one.
  std::string missing_chat_template_;
};

}  // namespace qtrain::data
