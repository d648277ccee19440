#include "data/unicode_normalization.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <tuple>
#include <vector>

#include "data/utf8.h"

namespace qtrain::data {

namespace {

struct CanonicalDecomposition {
  char32_t code_point;
  char32_t first;
  char32_t second;  // 0 for a singleton
};
struct CombiningClassRange {
  char32_t first;
  char32_t last;
  uint8_t combining_class;
};
struct PrimaryComposite {
  char32_t first;
  char32_t second;
  char32_t composite;
};

#include "data/unicode_nfc_tables.inc"

// Hangul syllables decompose and compose by arithmetic (Unicode 3.12).
constexpr char32_t kHangulSyllableBase = 0xAC00, kLeadingBase = 0x1100, kVowelBase = 0x1161, kTrailingBase = 0x11A7;
constexpr char32_t kLeadingCount = 19, kVowelCount = 21, kTrailingCount = 28;
constexpr char32_t kSyllablesPerLeading = kVowelCount * kTrailingCount;
constexpr char32_t kHangulSyllableCount = kLeadingCount * kSyllablesPerLeading;

// An invalid byte of the input travels through as a value above the Unicode range: a starter
// that neither decomposes nor composes.
constexpr char32_t kRawByteBase = 0x110000;

uint8_t combining_class(char32_t code_point) {
  auto it = std::upper_bound(std::begin(kCombiningClassRanges), std::end(kCombiningClassRanges), code_point,
                             [](char32_t value, const CombiningClassRange& range) { return value < range.first; });
  if (it == std::begin(kCombiningClassRanges)) return 0;
  --it;
  return code_point <= it->last ? it->combining_class : 0;
}

void decompose(char32_t code_point, std::vector<char32_t>& out) {
  if (code_point >= kHangulSyllableBase && code_point < kHangulSyllableBase + kHangulSyllableCount) {
    const char32_t index = code_point - kHangulSyllableBase;
    out.push_back(kLeadingBase + index / kSyllablesPerLeading);
    out.push_back(kVowelBase + (index % kSyllablesPerLeading) / kTrailingCount);
    if (index % kTrailingCount != 0) out.push_back(kTrailingBase + index % kTrailingCount);
    return;
  }
  auto it = std::lower_bound(std::begin(kCanonicalDecompositions), std::end(kCanonicalDecompositions), code_point,
                             [](const CanonicalDecomposition& entry, char32_t value) { return entry.code_point < value; });
  if (it == std::end(kCanonicalDecompositions) || it->code_point != code_point) {
    out.push_back(code_point);
    return;
  }
  decompose(it->first, out);
  if (it->second != 0) decompose(it->second, out);
}

// The primary composite of a pair, or 0.
char32_t compose(char32_t first, char32_t second) {
  if (first >= kLeadingBase && first < kLeadingBase + kLeadingCount && second >= kVowelBase &&
      second < kVowelBase + kVowelCount) {
    return kHangulSyllableBase + ((first - kLeadingBase) * kVowelCount + (second - kVowelBase)) * kTrailingCount;
  }
  if (first >= kHangulSyllableBase && first < kHangulSyllableBase + kHangulSyllableCount &&
      (first - kHangulSyllableBase) % kTrailingCount == 0 && second > kTrailingBase &&
      second < kTrailingBase + kTrailingCount) {
    return first + (second - kTrailingBase);
  }
  auto it = std::lower_bound(std::begin(kPrimaryComposites), std::end(kPrimaryComposites), std::make_pair(first, second),
                             [](const PrimaryComposite& entry, const std::pair<char32_t, char32_t>& pair) {
                               return entry.first != pair.first ? entry.first < pair.first : entry.second < pair.second;
                             });
  if (it == std::end(kPrimaryComposites) || it->first != first || it->second != second) return 0;
  return it->composite;
}

// Text whose code points are all below U+0300 is already in NFC (nothing there combines), and
// below U+00C0 in NFD too (nothing there decomposes canonically).
constexpr char32_t kFirstCombining = 0x300, kFirstCanonicallyDecomposable = 0xC0;
bool all_code_points_below(std::string_view text, char32_t limit) {
  for (size_t position = 0; position < text.size();) {
    const utf8::Character c = utf8::character_at(text, position);
    if (c.code_point >= limit) return false;  // also catches invalid bytes (kInvalid)
    position += c.length;
  }
  return true;
}

// Canonical decomposition and ordering: NFD, as code points with their combining classes.
struct Decomposed {
  std::vector<char32_t> code_points;
  std::vector<uint8_t> classes;
};

Decomposed decompose_canonically(std::string_view text) {
  Decomposed decomposed;
  std::vector<char32_t>& code_points = decomposed.code_points;
  code_points.reserve(text.size());
  // 1. Full canonical decomposition.
  for (size_t position = 0; position < text.size();) {
    const utf8::Character c = utf8::character_at(text, position);
    if (c.code_point == utf8::kInvalid) {
      code_points.push_back(kRawByteBase + static_cast<unsigned char>(text[position]));
    } else {
      decompose(c.code_point, code_points);
    }
    position += c.length;
  }
  // 2. Canonical ordering: every run of non-starters sorted stably by combining class.
  std::vector<uint8_t>& classes = decomposed.classes;
  classes.resize(code_points.size());
  for (size_t i = 0; i < code_points.size(); ++i) {
    classes[i] = code_points[i] >= kRawByteBase ? 0 : combining_class(code_points[i]);
  }
  for (size_t begin = 0; begin < code_points.size();) {
    if (classes[begin] == 0) {
      ++begin;
      continue;
    }
    size_t end = begin;
    while (end < code_points.size() && classes[end] != 0) ++end;
    std::vector<std::pair<uint8_t, char32_t>> run;
    for (size_t i = begin; i < end; ++i) run.emplace_back(classes[i], code_points[i]);
    std::stable_sort(run.begin(), run.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t i = begin; i < end; ++i) std::tie(classes[i], code_points[i]) = run[i - begin];
    begin = end;
  }
  return decomposed;
}

std::string encode(const std::vector<char32_t>& code_points, size_t size_hint) {
  std::string out;
  out.reserve(size_hint);
  for (const char32_t code_point : code_points) {
    if (code_point >= kRawByteBase) {
      out += static_cast<char>(code_point - kRawByteBase);
    } else {
      utf8::append(out, code_point);
    }
  }
  return out;
}

}  // namespace

std::string normalize_nfd(std::string_view text) {
  if (all_code_points_below(text, kFirstCanonicallyDecomposable)) return std::string(text);
  return encode(decompose_canonically(text).code_points, text.size());
}

std::string normalize_nfc(std::string_view text) {
  if (all_code_points_below(text, kFirstCombining)) return std::string(text);
  const Decomposed decomposed = decompose_canonically(text);
  const std::vector<char32_t>& code_points = decomposed.code_points;
  const std::vector<uint8_t>& classes = decomposed.classes;
  // 3. Canonical composition: a character joins the last starter unless a character of
  // the same or higher class (or a starter) stands between them.
  std::vector<char32_t> composed;
  composed.reserve(code_points.size());
  std::ptrdiff_t starter = -1;  // index in `composed` of the last starter
  int last_class = 0;           // class of the last character appended
  for (size_t i = 0; i < code_points.size(); ++i) {
    const char32_t code_point = code_points[i];
    const int current_class = classes[i];
    if (starter >= 0 && code_point < kRawByteBase && composed[starter] < kRawByteBase &&
        (last_class < current_class || last_class == 0)) {
      if (const char32_t composite = compose(composed[starter], code_point)) {
        composed[starter] = composite;
        continue;
      }
    }
    if (current_class == 0) starter = static_cast<std::ptrdiff_t>(composed.size());
    last_class = current_class;
    composed.push_back(code_point);
  }
  return encode(composed, text.size());
}

}  // namespace qtrain::data
