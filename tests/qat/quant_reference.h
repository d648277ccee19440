#pragma once
// Float64 references for the QAT tests, written from the formulas (torchao's affine integer
// quantization, the LSQ paper), element by element, independent of qat/quantize.cpp.
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "qat/quant_spec.h"

namespace qtrain::qat::reference {

// x as [blocks, block length] doubles, for a spec (the blocks of quant_spec.h).
// An integer spec in one line.
inline QuantSpec int_spec(int64_t bits, bool symmetric, Granularity granularity, int64_t group_size = 32,
                          torch::ScalarType scale_dtype = torch::kFloat32) {
  QuantSpec spec;
  spec.bits = bits;
  spec.symmetric = symmetric;
  spec.granularity = granularity;
  spec.group_size = group_size;
  spec.scale_dtype = scale_dtype;
  return spec;
}

inline std::vector<std::vector<double>> blocks_of(const QuantSpec& spec, const torch::Tensor& x) {
  const auto flat = x.to(torch::kFloat64).contiguous();
  const int64_t last = x.size(-1);
  const int64_t length = spec.granularity == Granularity::kPerTensor ? x.numel()
                         : spec.granularity == Granularity::kPerGroup ? spec.group_size
                                                                      : last;
  const double* data = flat.data_ptr<double>();
  std::vector<std::vector<double>> blocks;
  for (int64_t start = 0; start < x.numel(); start += length) blocks.emplace_back(data + start, data + start + length);
  return blocks;
}

struct IntParams {
  double scale;
  double zero_point;
};

// torchao's choose_qparams_affine (SYMMETRIC / ASYMMETRIC, INT zero point) in float64, for one block.
inline IntParams int_params(const QuantSpec& spec, const std::vector<double>& block) {
  double min = 0.0, max = 0.0;  // the range always holds 0
  for (const double value : block) {
    min = std::min(min, value);
    max = std::max(max, value);
  }
  const double quant_min = -std::ldexp(1.0, static_cast<int>(spec.bits) - 1);
  const double quant_max = std::ldexp(1.0, static_cast<int>(spec.bits) - 1) - 1.0;
  const double eps = std::ldexp(1.0, -23);
  if (spec.symmetric) return {std::max(std::max(-min, max) / ((quant_max - quant_min) / 2.0), eps), 0.0};
  const double scale = std::max((max - min) / (quant_max - quant_min), eps);
  const double zero_point = std::min(std::max(quant_min - std::nearbyint(min / scale), quant_min), quant_max);
  return {scale, zero_point};
}

// q = clamp(round_half_even(x / s) + z); nullopt-like flag when x / s lies within `tie_margin`
// of a rounding tie, where fp32 and float64 may legitimately round apart.
struct IntCode {
  double q;
  bool near_tie;
};

inline IntCode int_code(const QuantSpec& spec, double x, const IntParams& params, double tie_margin = 1e-4) {
  const double quant_min = -std::ldexp(1.0, static_cast<int>(spec.bits) - 1);
  const double quant_max = std::ldexp(1.0, static_cast<int>(spec.bits) - 1) - 1.0;
  const double steps = x / params.scale;
  const double fraction = steps - std::floor(steps);
  const double q = std::min(std::max(std::nearbyint(steps) + params.zero_point, quant_min), quant_max);
  return {q, std::abs(fraction - 0.5) < tie_margin};
}

}  // namespace qtrain::qat::reference
