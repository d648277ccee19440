// JSONL dataset records (data/jsonl.h, data/sample_formats.h) as training reads them: one
// object per line, turned into a tokenized example in each sample format (text, instruct,
// chat with tiny-llama's template). Bad lines are reported and skipped, as with data.skip_bad.
#include <sstream>

#include "data/jsonl.h"
#include "data/sample_formats.h"
#include "fuzz_support.h"

namespace {

const std::vector<qtrain::data::SampleBuilder>& builders() {
  static const auto made = [] {
    const std::string model = qtrain::fuzz::fixtures_directory() + "/tiny-llama";
    const auto tokenizer = qtrain::data::Tokenizer::from_model_dir(model);
    std::vector<qtrain::data::SampleBuilder> list;
    for (const char* format : {"text", "instruct", "chat"}) {
      qtrain::data::SampleFormatOptions options;
      options.format = format;
      list.emplace_back(options, tokenizer, model);
    }
    return list;
  }();
  return made;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::istringstream input(qtrain::fuzz::bytes_text(data, size));
  qtrain::fuzz::expect_only_qtrain_errors([&] {
    qtrain::data::for_each_jsonl_record(
        input, "fuzz.jsonl",
        [](const qtrain::data::JsonlRecord& record) {
          for (const auto& builder : builders()) {
            qtrain::fuzz::expect_only_qtrain_errors([&] { builder.from_record(record); });
          }
        },
        [](const std::string&) {});
  });
  return 0;
}
