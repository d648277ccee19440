#pragma once
// GPT-2's byte-level alphabet: every byte 0..255 is shown as one printable Unicode character
// (printable ASCII and most of Latin-1 as themselves, the rest as U+0100.. in order), so BPE
// can work on any byte string and every byte has a token. 'Ġ' (U+0120) is the space byte.
#include <cstdint>
#include <string>
#include <string_view>

namespace qtrain::data::byte_level {

// Each byte of `bytes` replaced by its character.
std::string encode(std::string_view bytes);

// The bytes a byte-level string stands for, appended to out. False (out unchanged) when a
// character is outside the alphabet; HF's ByteLevel decoder then keeps the token's own bytes.
bool decode(std::string_view characters, std::string& out);

}  // namespace qtrain::data::byte_level
