// A run's metrics.jsonl (trainer/logging/metrics_file.h) as `qtrain plot` reads it, and the SVG
// picture drawn from it (trainer/logging/loss_curves.h). Accepted lines must draw; the picture
// must hold one train-loss point per line with a finite loss.
#include <cmath>

#include "fuzz_support.h"
#include "trainer/logging/loss_curves.h"
#include "trainer/logging/metrics_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qtrain::fuzz::expect_only_qtrain_errors([&] {
    const auto lines = qtrain::trainer::parse_metrics_lines(qtrain::fuzz::bytes_text(data, size), "metrics.jsonl");
    const auto curves = qtrain::trainer::run_curves(lines, "fuzz");
    size_t finite = 0;
    for (const auto& line : lines) finite += std::isfinite(qtrain::trainer::metric_value(line, "loss")) ? 1 : 0;
    if (curves.train_loss.size() != finite) std::abort();
    const std::string svg = qtrain::trainer::loss_curves_svg({curves});
    if (svg.find("</svg>") == std::string::npos) std::abort();
  });
  return 0;
}
