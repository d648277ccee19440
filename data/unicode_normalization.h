#pragma once
// Unicode normalization forms D (canonical decomposition) and C (decomposition, then canonical
// composition), as the "NFD" and "NFC" normalizers of tokenizer.json (NFC: Qwen) apply them
// before pre-tokenization. The tables
// come from Python's unicodedata (unicode_nfc_tables.inc). Invalid UTF-8 bytes are kept as
// they are and block composition across them.
#include <string>
#include <string_view>

namespace qtrain::data {

std::string normalize_nfc(std::string_view text);
std::string normalize_nfd(std::string_view text);

}  // namespace qtrain::data
