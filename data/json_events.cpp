#include "data/json_events.h"

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include "data/utf8.h"

namespace qtrain::data {

namespace {

using Json = nlohmann::json;

class JsonEventReader {
 public:
  JsonEventReader(std::string_view text, nlohmann::json_sax<Json>& handler) : text_(text), handler_(handler) {}

  bool read_document() {
    // nlohmann skips a UTF-8 byte order mark.
    if (text_.substr(0, 3) == "\xEF\xBB\xBF") position_ = 3;
    skip_whitespace();
    if (!read_value(0)) return false;
    skip_whitespace();
    return position_ == text_.size();
  }

 private:
  void skip_whitespace() {
    while (position_ < text_.size()) {
      const char c = text_[position_];
      if (c != ' ' && c != '\n' && c != '\r' && c != '\t') return;
      ++position_;
    }
  }

  bool consume(char expected) {
    if (position_ >= text_.size() || text_[position_] != expected) return false;
    ++position_;
    return true;
  }

  bool consume_word(std::string_view word) {
    if (text_.substr(position_, word.size()) != word) return false;
    position_ += word.size();
    return true;
  }

  bool read_value(size_t depth) {
    if (position_ >= text_.size()) return false;
    switch (text_[position_]) {
      case '{':
        return read_object(depth + 1);
      case '[':
        return read_array(depth + 1);
      case '"': {
        std::string value;
        return read_string(value) && handler_.string(value);
      }
      case 't':
        return consume_word("true") && handler_.boolean(true);
      case 'f':
        return consume_word("false") && handler_.boolean(false);
      case 'n':
        return consume_word("null") && handler_.null();
      default:
        return read_number();
    }
  }

  bool read_object(size_t depth) {
    if (depth > kMaxJsonDepth) return false;
    ++position_;  // '{'
    if (!handler_.start_object(static_cast<size_t>(-1))) return false;
    skip_whitespace();
    if (consume('}')) return handler_.end_object();
    std::string key;
    while (true) {
      skip_whitespace();
      if (position_ >= text_.size() || text_[position_] != '"' || !read_string(key) || !handler_.key(key)) return false;
      skip_whitespace();
      if (!consume(':')) return false;
      skip_whitespace();
      if (!read_value(depth)) return false;
      skip_whitespace();
      if (consume('}')) return handler_.end_object();
      if (!consume(',')) return false;
    }
  }

  bool read_array(size_t depth) {
    if (depth > kMaxJsonDepth) return false;
    ++position_;  // '['
    if (!handler_.start_array(static_cast<size_t>(-1))) return false;
    skip_whitespace();
    if (consume(']')) return handler_.end_array();
    while (true) {
      skip_whitespace();
      if (!read_value(depth)) return false;
      skip_whitespace();
      if (consume(']')) return handler_.end_array();
      if (!consume(',')) return false;
    }
  }

  // Four hex digits of a \u escape.
  bool read_hex4(char32_t& value) {
    if (position_ + 4 > text_.size()) return false;
    value = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[position_++];
      value <<= 4;
      if (c >= '0' && c <= '9') {
        value |= static_cast<char32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        value |= static_cast<char32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        value |= static_cast<char32_t>(c - 'A' + 10);
      } else {
        return false;
      }
    }
    return true;
  }

  // A string from its opening quote; invalid UTF-8, raw control characters and lone
  // surrogates are errors, as in nlohmann.
  bool read_string(std::string& out) {
    out.clear();
    ++position_;  // '"'
    while (true) {
      // The plain run up to the next quote, backslash or control byte, copied at once.
      const size_t run_begin = position_;
      while (position_ < text_.size()) {
        const auto byte = static_cast<unsigned char>(text_[position_]);
        if (byte == '"' || byte == '\\' || byte < 0x20) break;
        if (byte < 0x80) {
          ++position_;
          continue;
        }
        const utf8::Character character = utf8::character_at(text_, position_);
        if (character.code_point == utf8::kInvalid) return false;
        position_ += character.length;
      }
      out.append(text_.data() + run_begin, position_ - run_begin);
      if (position_ >= text_.size()) return false;
      const auto byte = static_cast<unsigned char>(text_[position_]);
      if (byte == '"') {
        ++position_;
        return true;
      }
      if (byte < 0x20) return false;
      if (!read_escape(out)) return false;
    }
  }

  bool read_escape(std::string& out) {
    ++position_;  // '\'
    if (position_ >= text_.size()) return false;
    const char escaped = text_[position_++];
    switch (escaped) {
      case '"': out += '"'; return true;
      case '\\': out += '\\'; return true;
      case '/': out += '/'; return true;
      case 'b': out += '\b'; return true;
      case 'f': out += '\f'; return true;
      case 'n': out += '\n'; return true;
      case 'r': out += '\r'; return true;
      case 't': out += '\t'; return true;
      case 'u': break;
      default: return false;
    }
    char32_t code_point = 0;
    if (!read_hex4(code_point)) return false;
    if (code_point >= 0xDC00 && code_point <= 0xDFFF) return false;  // a low surrogate first
    if (code_point >= 0xD800 && code_point <= 0xDBFF) {
      char32_t low = 0;
      if (!consume('\\') || !consume('u') || !read_hex4(low) || low < 0xDC00 || low > 0xDFFF) return false;
      code_point = 0x10000 + ((code_point - 0xD800) << 10) + (low - 0xDC00);
    }
    utf8::append(out, code_point);
    return true;
  }

  // JSON's number grammar; an integer too large for 64 bits becomes a double, as in nlohmann.
  bool read_number() {
    const size_t begin = position_;
    const bool negative = consume('-');
    auto digits = [&] {
      const size_t start = position_;
      while (position_ < text_.size() && text_[position_] >= '0' && text_[position_] <= '9') ++position_;
      return position_ - start;
    };
    const size_t integer_digits = digits();
    if (integer_digits == 0) return false;
    if (integer_digits > 1 && text_[position_ - integer_digits] == '0') return false;  // no leading zeros
    bool is_integer = true;
    if (consume('.')) {
      is_integer = false;
      if (digits() == 0) return false;
    }
    if (position_ < text_.size() && (text_[position_] == 'e' || text_[position_] == 'E')) {
      is_integer = false;
      ++position_;
      if (!consume('+')) consume('-');
      if (digits() == 0) return false;
    }
    // Vocabulary ids: up to 18 digits cannot overflow 64 bits, so no strtoull is needed.
    if (is_integer && !negative && integer_digits <= 18) {
      uint64_t value = 0;
      for (size_t i = position_ - integer_digits; i < position_; ++i) value = value * 10 + static_cast<uint64_t>(text_[i] - '0');
      return handler_.number_unsigned(value);
    }
    const std::string number(text_.substr(begin, position_ - begin));
    if (is_integer) {
      errno = 0;
      char* end = nullptr;
      if (negative) {
        const long long value = std::strtoll(number.c_str(), &end, 10);
        if (errno == 0) return handler_.number_integer(value);
      } else {
        const unsigned long long value = std::strtoull(number.c_str(), &end, 10);
        if (errno == 0) return handler_.number_unsigned(value);
      }
    }
    const double value = std::strtod(number.c_str(), nullptr);
    // nlohmann refuses a number that does not fit a double (1e999).
    if (value == std::numeric_limits<double>::infinity() || value == -std::numeric_limits<double>::infinity()) return false;
    std::string raw = number;
    return handler_.number_float(value, raw);
  }

  std::string_view text_;
  nlohmann::json_sax<Json>& handler_;
  size_t position_ = 0;
};

}  // namespace

bool read_json_events(std::string_view text, nlohmann::json_sax<Json>& handler) {
  return JsonEventReader(text, handler).read_document();
}

}  // namespace qtrain::data
