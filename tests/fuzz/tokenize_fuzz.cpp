// Tokenizing arbitrary bytes (invalid UTF-8 included) with tiny-llama's real tokenizer, and
// decoding the ids again. Every id must be in the vocabulary.
#include "data/tokenizer.h"
#include "fuzz_support.h"

namespace {

const qtrain::data::Tokenizer& tokenizer() {
  static const auto loaded = qtrain::data::Tokenizer::from_model_dir(qtrain::fuzz::fixtures_directory() + "/tiny-llama");
  return loaded;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = qtrain::fuzz::bytes_text(data, size);
  for (const bool special : {true, false}) {
    const auto ids = tokenizer().encode(text, special);
    for (const int64_t id : ids) {
      if (id < 0 || id >= tokenizer().vocab_size()) std::abort();
    }
    tokenizer().decode(ids, !special);
  }
  return 0;
}
