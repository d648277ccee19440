// Streaming decoding: the pieces join to the decoded text, and none ends inside a character.
#include <gtest/gtest.h>

#include "data/streaming_decoder.h"
#include "support.h"

namespace qtrain::data {
namespace {

TEST(StreamingDecoder, PiecesJoinToTheDecodedTextAndHoldBackPartialCharacters) {
  const auto tokenizer = Tokenizer::from_model_dir(testing::fixture("tiny-llama"));
  // Accents, a CJK character and an emoji: byte-level BPE splits their bytes across tokens.
  auto ids = tokenizer.encode("Caf\xC3\xA9 \xE6\x97\xA5 \xF0\x9F\x98\x80 done.", /*add_special_tokens=*/true);
  ids.push_back(*tokenizer.token_to_id("<|eot_id|>"));
  StreamingDecoder stream(tokenizer);
  std::string joined;
  for (const int64_t id : ids) {
    const auto piece = stream.push(id);
    EXPECT_EQ(piece.find("\xEF\xBF\xBD"), std::string::npos) << "a piece ends inside a character";
    joined += piece;
  }
  joined += stream.finish();
  EXPECT_EQ(joined, tokenizer.decode(ids, /*skip_special_tokens=*/true));
  EXPECT_EQ(joined, "Caf\xC3\xA9 \xE6\x97\xA5 \xF0\x9F\x98\x80 done.");
}

}  // namespace
}  // namespace qtrain::data
