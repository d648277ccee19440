#include "qat/observer.h"

#include <array>
#include <limits>
#include <utility>

#include "kernels/error.h"

namespace qtrain::qat {

namespace {

const std::array<std::pair<ObserverKind, const char*>, 3> kObserverNames = {{
    {ObserverKind::kDynamic, "dynamic"},
    {ObserverKind::kMinMax, "minmax"},
    {ObserverKind::kMovingAverage, "moving_average"},
}};

}  // namespace

ObserverKind parse_observer_kind(const std::string& name, const std::string& what) {
  std::string choices;
  for (const auto& [kind, text] : kObserverNames) {
    if (name == text) return kind;
    choices += (choices.empty() ? "" : ", ") + std::string(text);
  }
  throw Error(ErrorCode::kRecipe, what + ": unknown observer '" + name + "' (expected one of " + choices + ")");
}

const char* observer_kind_name(ObserverKind kind) {
  for (const auto& [candidate, text] : kObserverNames) {
    if (candidate == kind) return text;
  }
  throw Error(ErrorCode::kInternal, "unknown observer kind (internal error)");
}

MinMaxObserver::MinMaxObserver(const QuantSpec& spec, std::vector<int64_t> params_shape, ObserverKind kind,
                               double momentum)
    : spec_(spec), kind_(kind), momentum_(momentum) {
  if (kind == ObserverKind::kDynamic) throw Error(ErrorCode::kInternal, "a dynamic quantizer has no observer (internal error)");
  if (!(momentum > 0.0 && momentum <= 1.0)) {
    throw Error(ErrorCode::kRecipe, "observer momentum " + std::to_string(momentum) + " must be in (0, 1]");
  }
  const auto options = torch::TensorOptions().dtype(torch::kFloat32);
  min_value_ = register_buffer("min_val", torch::full(params_shape, std::numeric_limits<float>::infinity(), options));
  max_value_ = register_buffer("max_val", torch::full(params_shape, -std::numeric_limits<float>::infinity(), options));
}

void MinMaxObserver::observe(const torch::Tensor& x) {
  torch::NoGradGuard no_grad;
  spec_.validate_for_shape("observer", x.sizes());
  const auto range = block_min_max(spec_, x);
  if (range.min.sizes() != min_value_.sizes()) {
    throw Error(ErrorCode::kInternal, "observer for " + spec_.describe() + " keeps a range of shape " + shape_text(min_value_.sizes()) +
                ", a tensor of shape " + shape_text(x.sizes()) + " gives " + shape_text(range.min.sizes()));
  }
  if (kind_ == ObserverKind::kMovingAverage && has_observed()) {
    min_value_.add_(momentum_ * (range.min - min_value_));
    max_value_.add_(momentum_ * (range.max - max_value_));
  } else {
    min_value_.copy_(torch::minimum(min_value_, range.min));
    max_value_.copy_(torch::maximum(max_value_, range.max));
  }
}

bool MinMaxObserver::has_observed() const { return torch::isfinite(min_value_).all().item<bool>(); }

QuantParams MinMaxObserver::qparams() const {
  if (!has_observed()) {
    throw Error(ErrorCode::kRecipe, "the " + std::string(observer_kind_name(kind_)) + " observer of " + spec_.describe() +
                " has seen no data yet: observe (calibrate) before enabling fake quantization");
  }
  return choose_qparams(spec_, {min_value_, max_value_});
}

void MinMaxObserver::pretty_print(std::ostream& stream) const {
  stream << "qtrain::qat::MinMaxObserver(" << observer_kind_name(kind_) << ", " << spec_.describe();
  if (kind_ == ObserverKind::kMovingAverage) stream << ", momentum=" << momentum_;
  stream << ")";
}

}  // namespace qtrain::qat
