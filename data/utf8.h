#pragma once
// UTF-8 helpers for the tokenizer. Text handed to the tokenizer may hold invalid UTF-8 (a
// truncated file, binary junk); nothing here crashes on it: an invalid byte is read as a
// one-byte character of its own, the way a byte-level tokenizer sees it.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace qtrain::data::utf8 {

inline constexpr char32_t kInvalid = 0xFFFFFFFF;

// The code point at text[position] and its length in bytes (>= 1). An invalid or truncated
// sequence gives {kInvalid, 1}.
struct Character {
  char32_t code_point;
  size_t length;
};
Character character_at(std::string_view text, size_t position);

// Where the character that ends at `position` (> 0) starts: the start of a valid sequence
// ending there, else position - 1 (an invalid byte is a character of its own).
size_t start_of_character_before(std::string_view text, size_t position);

// Appends the UTF-8 encoding of a code point (< 0x110000) to out.
void append(std::string& out, char32_t code_point);

// Rust's String::from_utf8_lossy: each maximal invalid subsequence becomes U+FFFD.
std::string replace_invalid(std::string_view bytes);
// Rust's String::from_utf8 succeeds: well-formed UTF-8 throughout.
bool is_valid(std::string_view bytes);

// Unicode White_Space (Rust's char::is_whitespace).
bool is_whitespace(char32_t code_point);
// Python's str.isspace, which Jinja's |trim uses: White_Space plus the separators U+001C..U+001F.
bool is_python_space(char32_t code_point);

// Python's str.strip() with no argument.
std::string strip_python_space(std::string_view text);

}  // namespace qtrain::data::utf8
