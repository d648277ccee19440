#pragma once
// Unicode normalization form C (canonical decomposition, then canonical composition), as the
// "NFC" normalizer of tokenizer.json (Qwen) applies it before pre-tokenization. The tables
// come from Python's unicodedata (unicode_nfc_tables.inc). Invalid UTF-8 bytes are kept as
// they are and block composition across them.
#include <string>
#include <string_view>

namespace qtrain::data {

std::string normalize_nfc(std::string_view text);

}  // namespace qtrain::data
