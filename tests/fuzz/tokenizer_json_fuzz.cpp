// A tokenizer.json (data/tokenizer.h): normalizer, pre-tokenizer, BPE model, added tokens,
// post-processor, decoder. A file that loads must then encode and decode text without failing.
#include "data/tokenizer.h"
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = qtrain::fuzz::write_scratch_file("tokenizer.json", qtrain::fuzz::bytes_text(data, size));
  qtrain::fuzz::expect_only_qtrain_errors([&] {
    const auto tokenizer = qtrain::data::Tokenizer::from_file(path);
    for (const std::string text : {std::string("Hello world, it's 1961!"), std::string(" \t\n  x"),
                                   std::string("caf\xc3\xa9 \xe2\x96\x81 \xff\xfe"), std::string("<s></s><unk>")}) {
      const auto ids = tokenizer.encode(text, true);
      tokenizer.decode(ids, false);
      tokenizer.decode(ids, true);
    }
  });
  return 0;
}
