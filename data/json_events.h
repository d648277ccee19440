#pragma once
// JSON text read as events (start_object, key, string, ...) into an nlohmann SAX handler, for
// the files where nlohmann's own lexer is the slow part: a Llama 3 tokenizer.json is 17 MB of
// about 700k short strings, which nlohmann reads a byte at a time through its input adapter
// (0.09 s of a 0.3 s load). This reader copies runs of plain characters at once. It accepts
// and rejects what nlohmann::json::sax_parse does and gives the handler the same events
// (tests/data/json_events_test.cpp compares the two), except that it refuses nesting deeper
// than kMaxJsonDepth instead of going on (no tokenizer file comes near it).
#include <cstddef>
#include <nlohmann/json.hpp>
#include <string_view>

namespace qtrain::data {

inline constexpr size_t kMaxJsonDepth = 512;

// Whether the text was one valid JSON value and the handler accepted every event. A syntax
// error gives false without a call to the handler's parse_error.
bool read_json_events(std::string_view text, nlohmann::json_sax<nlohmann::json>& handler);

}  // namespace qtrain::data
