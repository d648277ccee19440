#pragma once
// The training progress on a terminal: one line redrawn after every step
//   [########............] 37/200 | loss 4.5327 | 3810 tokens/s | eta 0m25s
// with every other line (the periodic step lines, evaluations, checkpoints) printed above it.
// Off (stdout not a terminal, `qtrain train --no-progress`, every rank but 0) nothing is redrawn
// and lines print as they are.
#include <cstdint>
#include <string>

namespace qtrain::trainer {

class ProgressLine {
 public:
  explicit ProgressLine(bool enabled = false) : enabled_(enabled) {}
  bool enabled() const { return enabled_; }

  void update(int64_t done, int64_t total, double loss, double tokens_per_second, double eta_seconds);
  // Prints `line` (with its newline added) above the progress line.
  void print(const std::string& line);
  // Clears the progress line, leaving the terminal as plain lines.
  void finish();

 private:
  void clear();

  bool enabled_ = false;
  std::string drawn_;
};

// Whether stdout is a terminal (where `qtrain train` draws the progress line by default).
bool stdout_is_terminal();

// "0m25s", "1h05m".
std::string format_duration(double seconds);

}  // namespace qtrain::trainer
