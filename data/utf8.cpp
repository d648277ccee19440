#include "data/utf8.h"

namespace qtrain::data::utf8 {

namespace {

bool is_continuation(unsigned char byte) { return (byte & 0xC0) == 0x80; }

// Length of the maximal prefix of text[position..] that could start a valid sequence
// (the Unicode "maximal subpart"), and whether the whole sequence is complete and valid.
struct Scan {
  size_t length;
  bool valid;
  char32_t code_point;
};

Scan scan(std::string_view text, size_t position) {
  const auto byte = static_cast<unsigned char>(text[position]);
  if (byte < 0x80) return {1, true, byte};
  size_t needed = 0;
  char32_t code_point = 0;
  // The allowed range of the second byte excludes overlong forms and surrogates (Table 3-7).
  unsigned char second_low = 0x80, second_high = 0xBF;
  if (byte >= 0xC2 && byte <= 0xDF) {
    needed = 1;
    code_point = byte & 0x1F;
  } else if (byte >= 0xE0 && byte <= 0xEF) {
    needed = 2;
    code_point = byte & 0x0F;
    if (byte == 0xE0) second_low = 0xA0;
    if (byte == 0xED) second_high = 0x9F;
  } else if (byte >= 0xF0 && byte <= 0xF4) {
    needed = 3;
    code_point = byte & 0x07;
    if (byte == 0xF0) second_low = 0x90;
    if (byte == 0xF4) second_high = 0x8F;
  } else {
    return {1, false, kInvalid};
  }
  size_t length = 1;
  for (size_t i = 0; i < needed; ++i) {
    if (position + length >= text.size()) return {length, false, kInvalid};
    const auto next = static_cast<unsigned char>(text[position + length]);
    const bool in_range = i == 0 ? (next >= second_low && next <= second_high) : is_continuation(next);
    if (!in_range) return {length, false, kInvalid};
    code_point = (code_point << 6) | (next & 0x3F);
    ++length;
  }
  return {length, true, code_point};
}

}  // namespace

Character character_at(std::string_view text, size_t position) {
  const Scan result = scan(text, position);
  if (!result.valid) return {kInvalid, 1};
  return {result.code_point, result.length};
}

size_t start_of_character_before(std::string_view text, size_t position) {
  for (size_t length = 1; length <= 4 && length <= position; ++length) {
    const size_t start = position - length;
    const auto byte = static_cast<unsigned char>(text[start]);
    if ((byte & 0xC0) == 0x80) continue;  // a continuation byte: the start lies further back
    const Scan result = scan(text, start);
    return result.valid && result.length == length ? start : position - 1;
  }
  return position - 1;
}

void append(std::string& out, char32_t code_point) {
  if (code_point < 0x80) {
    out += static_cast<char>(code_point);
  } else if (code_point < 0x800) {
    out += static_cast<char>(0xC0 | (code_point >> 6));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else if (code_point < 0x10000) {
    out += static_cast<char>(0xE0 | (code_point >> 12));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (code_point >> 18));
    out += static_cast<char>(0x80 | ((code_point >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  }
}

std::string replace_invalid(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t position = 0;
  while (position < bytes.size()) {
    const Scan result = scan(bytes, position);
    if (result.valid) {
      out.append(bytes.substr(position, result.length));
    } else {
      append(out, 0xFFFD);
    }
    position += result.length;
  }
  return out;
}

bool is_valid(std::string_view bytes) {
  for (size_t position = 0; position < bytes.size();) {
    const Scan result = scan(bytes, position);
    if (!result.valid) return false;
    position += result.length;
  }
  return true;
}

bool is_whitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

bool is_python_space(char32_t c) { return is_whitespace(c) || (c >= 0x1C && c <= 0x1F); }

std::string strip_python_space(std::string_view text) {
  size_t begin = 0;
  size_t end = text.size();
  while (begin < end) {
    const Character c = character_at(text, begin);
    if (!is_python_space(c.code_point)) break;
    begin += c.length;
  }
  // Find the last non-space character by walking forward once over the rest.
  size_t last_end = begin;
  for (size_t position = begin; position < end;) {
    const Character c = character_at(text, position);
    position += c.length;
    if (!is_python_space(c.code_point)) last_end = position;
  }
  return std::string(text.substr(begin, last_end - begin));
}

}  // namespace qtrain::data::utf8
