#include "data/unicode_regex.h"

#include <pcre2.h>

#include "data/utf8.h"
#include "kernels/error.h"

namespace qtrain::data {

struct UnicodeRegex::Compiled {
  pcre2_code* code = nullptr;
  std::string pattern;
  std::string where;
  ErrorCode error_code = ErrorCode::kTokenizer;
  ~Compiled() { pcre2_code_free(code); }
};

namespace {

std::string pcre2_message(int error_code) {
  PCRE2_UCHAR buffer[256];
  if (pcre2_get_error_message(error_code, buffer, sizeof(buffer)) < 0) return "error " + std::to_string(error_code);
  return reinterpret_cast<const char*>(buffer);
}

// Per-thread match state: a JIT stack larger than PCRE2's 32 KiB default (long runs of
// whitespace backtrack through `\s+(?!\S)`), and match data for the whole-match offsets.
struct ThreadMatchState {
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* jit_stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
  pcre2_match_data* match_data = pcre2_match_data_create(1, nullptr);

  ThreadMatchState() {
    if (context != nullptr && jit_stack != nullptr) pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~ThreadMatchState() {
    pcre2_match_data_free(match_data);
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
  }
  ThreadMatchState(const ThreadMatchState&) = delete;
  ThreadMatchState& operator=(const ThreadMatchState&) = delete;
};

ThreadMatchState& thread_match_state() {
  thread_local ThreadMatchState state;
  if (state.match_data == nullptr) throw Error(ErrorCode::kTokenizer, "tokenizer: out of memory for regular-expression matching");
  return state;
}

}  // namespace

UnicodeRegex::UnicodeRegex(const std::string& pattern, const std::string& where, ErrorCode code) {
  auto compiled = std::make_shared<Compiled>();
  compiled->pattern = pattern;
  compiled->where = where;
  compiled->error_code = code;
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  compiled->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                 PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error_code,
                                 &error_offset, nullptr);
  if (compiled->code == nullptr) {
    throw Error(code, where + ": the regular expression does not compile (" + pcre2_message(error_code) +
                " at offset " + std::to_string(error_offset) + "): " + pattern);
  }
  // Without JIT support (some builds) pcre2_match interprets the pattern: slower, same result.
  pcre2_jit_compile(compiled->code, PCRE2_JIT_COMPLETE);
  compiled_ = std::move(compiled);
}

std::vector<TextSpan> UnicodeRegex::find_all(std::string_view subject) const {
  ThreadMatchState& state = thread_match_state();
  const auto* data = reinterpret_cast<PCRE2_SPTR>(subject.data());
  std::vector<TextSpan> matches;
  size_t start = 0;
  while (start < subject.size()) {
    int result = pcre2_match(compiled_->code, data, subject.size(), start, 0, state.match_data, state.context);
    if (result == PCRE2_ERROR_JIT_STACKLIMIT) {
      // The interpreter keeps its backtracking state on the heap: slower but not limited
      // by the JIT stack.
      result = pcre2_match(compiled_->code, data, subject.size(), start, PCRE2_NO_JIT, state.match_data,
                           state.context);
    }
    if (result == PCRE2_ERROR_NOMATCH) break;
    if (result < 0) {
      throw Error(ErrorCode::kTokenizer, "tokenizer: the pre-tokenizer pattern failed on a " + std::to_string(subject.size()) +
                  "-byte text (" + pcre2_message(result) + "); pattern: " + compiled_->pattern);
    }
    const PCRE2_SIZE* offsets = pcre2_get_ovector_pointer(state.match_data);
    const size_t begin = offsets[0];
    const size_t end = offsets[1];
    if (end > begin) {
      matches.push_back({begin, end});
      start = end;
    } else if (begin < subject.size()) {
      // An empty match yields no piece; step over one character (or one invalid byte).
      start = begin + utf8::character_at(subject, begin).length;
    } else {
      break;
    }
  }
  return matches;
}

bool UnicodeRegex::full_match(std::string_view subject) const {
  ThreadMatchState& state = thread_match_state();
  // Anchoring at match time runs PCRE2's interpreter, which keeps its backtracking on the heap.
  const int result = pcre2_match(compiled_->code, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), 0,
                                 PCRE2_ANCHORED | PCRE2_ENDANCHORED | PCRE2_NO_JIT, state.match_data, state.context);
  if (result == PCRE2_ERROR_NOMATCH) return false;
  if (result < 0) {
    throw Error(compiled_->error_code, compiled_->where + ": the regular expression gave up on '" + std::string(subject) + "' (" +
                pcre2_message(result) + "); simplify it: " + compiled_->pattern);
  }
  return true;
}

}  // namespace qtrain::data
