#include "data/byte_level.h"

#include <array>

#include "data/utf8.h"

namespace qtrain::data::byte_level {

namespace {

struct Alphabet {
  std::array<std::string, 256> character_of_byte;
  std::array<int16_t, 512> byte_of_code_point;  // -1 outside the alphabet; code points < 512

  Alphabet() {
    byte_of_code_point.fill(-1);
    int next_unprintable = 0;
    for (int byte = 0; byte < 256; ++byte) {
      const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
      const char32_t code_point = printable ? byte : 256 + next_unprintable++;
      utf8::append(character_of_byte[byte], code_point);
      byte_of_code_point[code_point] = static_cast<int16_t>(byte);
    }
  }
};

const Alphabet& alphabet() {
  static const Alphabet instance;
  return instance;
}

}  // namespace


std::string encode(std::string_view bytes) {
  const Alphabet& table = alphabet();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const char byte : bytes) out += table.character_of_byte[static_cast<uint8_t>(byte)];
  return out;
}

bool decode(std::string_view characters, std::string& out) {
  const Alphabet& table = alphabet();
  const size_t original_size = out.size();
  for (size_t position = 0; position < characters.size();) {
    const utf8::Character c = utf8::character_at(characters, position);
    position += c.length;
    if (c.code_point >= table.byte_of_code_point.size() || table.byte_of_code_point[c.code_point] < 0) {
      out.resize(original_size);
      return false;
    }
    out += static_cast<char>(table.byte_of_code_point[c.code_point]);
  }
  return true;
}

}  // namespace qtrain::data::byte_level
