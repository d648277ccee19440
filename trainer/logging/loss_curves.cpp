#include "trainer/logging/loss_curves.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "trainer/base/file_system.h"
#include "trainer/logging/metrics_file.h"

namespace qtrain::trainer {

namespace {

using Points = std::vector<std::pair<int64_t, double>>;

constexpr double kWidth = 860, kLeft = 78, kRight = 24;
constexpr double kLossTop = 48, kLossHeight = 300, kRateTop = 410, kRateHeight = 150, kLegendTop = 612, kLegendLine = 16;
const char* const kColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};

struct Range {
  double low = std::numeric_limits<double>::infinity(), high = -std::numeric_limits<double>::infinity();
  void add(double value) {
    low = std::min(low, value);
    high = std::max(high, value);
  }
  bool empty() const { return !(low <= high); }
  // Widened so that a flat series still has a height, and padded by 5%.
  Range padded() const {
    if (empty()) return {0, 1};
    const double span = high > low ? high - low : std::max(std::abs(high), 1e-12);
    return {low - 0.05 * span, high + 0.05 * span};
  }
};

std::string number(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.5g", value);
  return text;
}

std::string escape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// About five round tick values (1, 2 or 5 times a power of ten apart) inside the range.
// None where the range is not a finite width that doubles can split (a huge loss, say).
std::vector<double> ticks(const Range& range) {
  const double rough = (range.high - range.low) / 5;
  if (!std::isfinite(rough) || !(rough > 0)) return {};
  const double power = std::pow(10.0, std::floor(std::log10(rough)));
  const double step = rough / power >= 5 ? 5 * power : rough / power >= 2 ? 2 * power : power;
  const double first = std::ceil(range.low / step), last = std::floor(range.high / step);
  if (!std::isfinite(first) || !std::isfinite(last) || last - first > 20) return {};
  std::vector<double> values;
  for (int offset = 0; offset <= static_cast<int>(last - first); ++offset) {
    const double index = first + offset;
    values.push_back(index == 0 ? 0.0 : index * step);
  }
  return values;
}

struct Panel {
  std::string title;
  double top, height;
  Range steps, values;

  double x(double step) const { return kLeft + (step - steps.low) / (steps.high - steps.low) * (kWidth - kLeft - kRight); }
  double y(double value) const { return top + height - (value - values.low) / (values.high - values.low) * height; }

  std::string frame() const {
    std::string svg = "<text x=\"" + number(kLeft) + "\" y=\"" + number(top - 10) +
                      "\" font-size=\"14\" font-weight=\"bold\">" + escape(title) + "</text>\n";
    svg += "<rect x=\"" + number(kLeft) + "\" y=\"" + number(top) + "\" width=\"" + number(kWidth - kLeft - kRight) +
           "\" height=\"" + number(height) + "\" fill=\"none\" stroke=\"#888\"/>\n";
    for (const double value : ticks(values)) {
      svg += "<line x1=\"" + number(kLeft) + "\" x2=\"" + number(kWidth - kRight) + "\" y1=\"" + number(y(value)) +
             "\" y2=\"" + number(y(value)) + "\" stroke=\"#eee\"/>\n";
      svg += "<text x=\"" + number(kLeft - 6) + "\" y=\"" + number(y(value) + 4) +
             "\" font-size=\"11\" text-anchor=\"end\">" + number(value) + "</text>\n";
    }
    for (const double step : ticks(steps)) {
      svg += "<text x=\"" + number(x(step)) + "\" y=\"" + number(top + height + 16) +
             "\" font-size=\"11\" text-anchor=\"middle\">" + number(step) + "</text>\n";
    }
    return svg;
  }

  std::string series(const Points& points, const std::string& kind, const std::string& label, const char* colour,
                     bool dashed) const {
    if (points.empty()) return "";
    std::string coordinates;
    for (const auto& [step, value] : points) {
      coordinates += (coordinates.empty() ? "" : " ") + number(x(static_cast<double>(step))) + "," + number(y(value));
    }
    std::string svg = "<polyline class=\"" + kind + "\" data-run=\"" + escape(label) + "\" fill=\"none\" stroke=\"" +
                      colour + "\" stroke-width=\"1.6\"" + (dashed ? " stroke-dasharray=\"6 4\"" : "") +
                      " points=\"" + coordinates + "\"/>\n";
    if (dashed) {  // evaluations are few: each is marked
      for (const auto& [step, value] : points) {
        svg += "<circle cx=\"" + number(x(static_cast<double>(step))) + "\" cy=\"" + number(y(value)) + "\" r=\"3\" fill=\"" +
               colour + "\"/>\n";
      }
    }
    return svg;
  }
};

Points finite_points(const std::vector<nlohmann::json>& lines, const char* key) {
  Points points;
  for (const auto& line : lines) {
    const double value = metric_value(line, key);
    if (std::isfinite(value)) points.emplace_back(line["step"].get<int64_t>(), value);
  }
  return points;
}

}  // namespace

RunCurves run_curves(const std::vector<nlohmann::json>& lines, std::string label) {
  RunCurves curves;
  curves.label = std::move(label);
  curves.train_loss = finite_points(lines, "loss");
  curves.eval_loss = finite_points(lines, "eval_loss");
  curves.learning_rate = finite_points(lines, "lr");
  return curves;
}

std::string loss_curves_svg(const std::vector<RunCurves>& runs) {
  Range steps, losses, rates;
  for (const auto& run : runs) {
    for (const auto* points : {&run.train_loss, &run.eval_loss, &run.learning_rate}) {
      for (const auto& point : *points) steps.add(static_cast<double>(point.first));
    }
    for (const auto* points : {&run.train_loss, &run.eval_loss}) {
      for (const auto& point : *points) losses.add(point.second);
    }
    for (const auto& point : run.learning_rate) rates.add(point.second);
  }
  if (steps.empty()) steps = {0, 1};
  if (steps.high == steps.low) steps.high = steps.low + 1;
  const Panel loss_panel{"loss (train solid, eval dashed)", kLossTop, kLossHeight, steps, losses.padded()};
  const Panel rate_panel{"learning rate", kRateTop, kRateHeight, steps, rates.padded()};
  const double height = kLegendTop + kLegendLine * static_cast<double>(runs.size()) + 8;
  std::string svg = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" +
                    number(kWidth) + "\" height=\"" + number(height) + "\" viewBox=\"0 0 " + number(kWidth) + " " +
                    number(height) + "\" font-family=\"sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  svg += loss_panel.frame() + rate_panel.frame();
  svg += "<text x=\"" + number((kLeft + kWidth - kRight) / 2) + "\" y=\"" + number(kRateTop + kRateHeight + 36) +
         "\" font-size=\"12\" text-anchor=\"middle\">step</text>\n";
  for (size_t index = 0; index < runs.size(); ++index) {
    const auto& run = runs[index];
    const char* colour = kColours[index % (sizeof kColours / sizeof kColours[0])];
    svg += loss_panel.series(run.train_loss, "train-loss", run.label, colour, false);
    svg += loss_panel.series(run.eval_loss, "eval-loss", run.label, colour, true);
    svg += rate_panel.series(run.learning_rate, "learning-rate", run.label, colour, false);
    const double legend_y = kLegendTop + kLegendLine * static_cast<double>(index + 1);
    svg += "<rect x=\"" + number(kLeft) + "\" y=\"" + number(legend_y - 9) + "\" width=\"14\" height=\"4\" fill=\"" +
           colour + "\"/><text x=\"" + number(kLeft + 20) + "\" y=\"" + number(legend_y - 4) + "\" font-size=\"11\">" +
           escape(run.label) + "</text>\n";
  }
  return svg + "</svg>\n";
}

void write_loss_curves_svg(const std::vector<RunCurves>& runs, const std::string& path) {
  write_file_atomically(path, loss_curves_svg(runs));
}

}  // namespace qtrain::trainer
