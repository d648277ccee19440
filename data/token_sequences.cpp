#include "data/token_sequences.h"

#include "data/jsonl.h"
#include "kernels/error.h"

namespace qtrain::data {

std::vector<TokenSequence> read_token_sequences(const std::string& path, const Tokenizer& tokenizer,
                                                int64_t max_seq_len) {
  if (max_seq_len < 2) throw Error("max_seq_len must be at least 2, got " + std::to_string(max_seq_len));
  const int64_t vocab_size = tokenizer.vocab_size();
  std::vector<TokenSequence> sequences;
  for_each_jsonl_record(path, [&](const JsonlRecord& record) {
    auto ids = record.value.find("input_ids");
    if (ids != record.value.end()) {
      if (!ids->is_array()) record.fail("field \"input_ids\" must be a list of token ids");
      TokenSequence sequence;
      for (const auto& id : *ids) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab_size) {
          record.fail("\"input_ids\" holds " + id.dump() + ", expected token ids in [0, " +
                      std::to_string(vocab_size) + ")");
        }
        sequence.push_back(id.get<int64_t>());
      }
      if (sequence.size() >= 2) sequences.push_back(std::move(sequence));
      return;
    }
    if (!record.value.contains("text")) record.fail("expected a \"text\" or an \"input_ids\" field");
    const auto tokens = tokenizer.encode(record.string_field("text"), /*add_special_tokens=*/true);
    for (size_t begin = 0; begin < tokens.size(); begin += static_cast<size_t>(max_seq_len)) {
      const size_t end = std::min(tokens.size(), begin + static_cast<size_t>(max_seq_len));
      if (end - begin >= 2) sequences.emplace_back(tokens.begin() + begin, tokens.begin() + end);
    }
  });
  return sequences;
}

}  // namespace qtrain::data
