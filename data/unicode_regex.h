#pragma once
// A Unicode-aware regular expression (PCRE2 with UTF + UCP, JIT-compiled where available)
// for the tokenizer's pre-split patterns, which use \p{L}, \p{N} and look-ahead like the
// Oniguruma patterns of HF tokenizers. Subjects may hold invalid UTF-8: no match covers an
// invalid byte, so such bytes fall into the gaps between matches.
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/error.h"

namespace qtrain::data {

struct TextSpan {
  size_t begin;
  size_t end;
};

class UnicodeRegex {
 public:
  // `where` names the pattern's origin for the error messages; `code` is theirs (a pattern from
  // a tokenizer, an adapter config or a recipe).
  UnicodeRegex(const std::string& pattern, const std::string& where, ErrorCode code = ErrorCode::kTokenizer);

  // All non-overlapping, non-empty matches, left to right. Safe to call from many threads.
  std::vector<TextSpan> find_all(std::string_view subject) const;
  // Whether the pattern matches the whole subject. PCRE2's match limit bounds the work a
  // pattern from a file may make (no catastrophic backtracking, no stack overflow): a subject
  // that hits it is an Error naming `where`.
  bool full_match(std::string_view subject) const;

 private:
  struct Compiled;
  std::shared_ptr<const Compiled> compiled_;
};

}  // namespace qtrain::data
