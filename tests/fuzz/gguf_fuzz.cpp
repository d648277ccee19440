// A GGUF file's bytes (trainer/formats/gguf_file.h): header, metadata values and arrays, tensor infos and
// their offsets into the data section. Property: every accepted tensor lies inside the file, its
// size is what its shape and type need, and its bytes can be read (AddressSanitizer watches).
#include <cstdlib>
#include <vector>

#include "fuzz_support.h"
#include "trainer/formats/gguf_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qtrain::fuzz::expect_only_qtrain_errors([&] {
    const auto file = qtrain::trainer::GgufFile::parse(std::vector<uint8_t>(data, data + size), "model.gguf");
    for (const auto& tensor : file.tensors()) {
      if (tensor.bytes > size || tensor.offset > size - tensor.bytes) std::abort();
      if (tensor.bytes != qtrain::trainer::gguf_tensor_bytes(tensor.type, tensor.shape, tensor.name)) std::abort();
      if (file.tensor_bytes(tensor.name).size() != tensor.bytes) std::abort();
    }
    for (const auto& [key, value] : file.metadata()) {
      if (!file.contains(key) || &file.value(key) != &value) std::abort();
    }
  });
  return 0;
}
