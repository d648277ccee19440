// The first bytes of a downloaded .safetensors file: the header length, the JSON header, and
// data_offsets checked against the file's size (trainer/formats/safetensors_header.h).
#include "fuzz_support.h"
#include "trainer/formats/safetensors_header.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qtrain::fuzz::expect_only_qtrain_errors([&] {
    const auto header = qtrain::trainer::read_safetensors_header("fuzz.safetensors", data, size);
    // Whatever was accepted must lie inside the file: the loader maps tensors from these offsets.
    const uint64_t data_bytes = size - 8 - header.header_bytes;
    for (const auto& tensor : header.tensors) {
      if (tensor.begin > tensor.end || tensor.end > data_bytes) std::abort();
    }
  });
  return 0;
}
