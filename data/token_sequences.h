#pragma once
// Evaluation sequences from JSONL: `{"text": ...}` records are tokenised with the special
// tokens (BOS) and cut into windows of at most max_seq_len tokens; `{"input_ids": [...]}`
// records are used as given, one sequence each.
#include <cstdint>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace qtrain::data {

using TokenSequence = std::vector<int64_t>;

std::vector<TokenSequence> read_token_sequences(const std::string& path, const Tokenizer& tokenizer,
                                                int64_t max_seq_len);

}  // namespace qtrain::data
