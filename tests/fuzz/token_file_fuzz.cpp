// An llm.c .bin token file (data/token_file.h): header magic, version, count, then tokens.
// Whatever is read must encode back to a file that reads the same.
#include "data/token_file.h"
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr int64_t kVocabSize = 70'000;  // over 65,536: both variants are legal
  const std::string path = qtrain::fuzz::write_scratch_file("tokens.bin", qtrain::fuzz::bytes_text(data, size));
  qtrain::fuzz::expect_only_qtrain_errors([&] {
    const auto tokens = qtrain::data::read_token_file(path, kVocabSize);
    const std::string again_path =
        qtrain::fuzz::write_scratch_file("again.bin", qtrain::data::encode_token_file(tokens, kVocabSize));
    if (qtrain::data::read_token_file(again_path, kVocabSize) != tokens) std::abort();
    qtrain::data::split_documents(tokens, 1);
  });
  return 0;
}
