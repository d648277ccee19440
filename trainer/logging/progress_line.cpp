#include "trainer/logging/progress_line.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace qtrain::trainer {

namespace {

int terminal_columns() {
  winsize size{};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;
  return 80;
}

}  // namespace

std::string format_duration(double seconds) {
  char text[32];
  const auto whole = static_cast<int64_t>(std::isfinite(seconds) ? std::max(seconds, 0.0) : 0.0);
  if (whole >= 3600) {
    std::snprintf(text, sizeof text, "%lldh%02lldm", static_cast<long long>(whole / 3600),
                  static_cast<long long>(whole % 3600 / 60));
  } else {
    std::snprintf(text, sizeof text, "%lldm%02llds", static_cast<long long>(whole / 60),
                  static_cast<long long>(whole % 60));
  }
  return text;
}

bool stdout_is_terminal() { return isatty(STDOUT_FILENO) == 1; }

void ProgressLine::update(int64_t done, int64_t total, double loss, double tokens_per_second, double eta_seconds) {
  if (!enabled_) return;
  constexpr int kBarWidth = 20;
  const int filled = total > 0 ? static_cast<int>(kBarWidth * std::min<int64_t>(done, total) / total) : 0;
  char text[160];
  std::snprintf(text, sizeof text, "[%s%s] %lld/%lld | loss %.4f | %.0f tokens/s | eta %s",
                std::string(filled, '#').c_str(), std::string(kBarWidth - filled, '.').c_str(),
                static_cast<long long>(done), static_cast<long long>(total), loss, tokens_per_second,
                format_duration(eta_seconds).c_str());
  std::string line = text;
  const auto columns = static_cast<size_t>(std::max(terminal_columns() - 1, 10));
  if (line.size() > columns) line.resize(columns);
  std::printf("\r\033[K%s", line.c_str());
  std::fflush(stdout);
  drawn_ = line;
}

void ProgressLine::clear() {
  if (drawn_.empty()) return;
  std::printf("\r\033[K");
}

void ProgressLine::print(const std::string& line) {
  clear();
  std::printf("%s\n", line.c_str());
  if (!drawn_.empty()) std::printf("%s", drawn_.c_str());
  std::fflush(stdout);
}

void ProgressLine::finish() {
  clear();
  drawn_.clear();
  std::fflush(stdout);
}

}  // namespace qtrain::trainer
