#pragma once
// The numerics of a QuantSpec (conventions in quant_spec.h), without autograd: block min / max,
// scale and zero point, quantize to codes, dequantize codes. Fake quantization is literally
// dequantize(quantize(x)), so the codes `convert` produces dequantize bit for bit to what the
// fake-quant forward computed. Everything runs in fp32 on x's device.
#include <torch/types.h>

#include "qat/quant_spec.h"

namespace qtrain::qat {

struct BlockMinMax {
  torch::Tensor min;  // fp32, params_shape(spec, x.shape)
  torch::Tensor max;
  // The dtype an integer zero point's scale and zero point are computed in (quant_spec.h): x's
  // when it is bf16 or fp16, as torchao's choose_qparams_affine does; fp32 otherwise.
  torch::ScalarType dtype = torch::kFloat32;
};

struct QuantParams {
  torch::Tensor scale;  // fp32, params_shape; each value exactly representable in spec.scale_dtype
  // fp32, params_shape: integers z (zeros for symmetric specs); with a float zero point the
  // block's minimum m, the value code quant_min starts from (quant_spec.h).
  torch::Tensor zero_point;
};

// Per block min and max of x (detached, in fp32), and the dtype its parameters are computed in.
BlockMinMax block_min_max(const QuantSpec& spec, const torch::Tensor& x);

// The scale and zero point for blocks spanning [min, max] (quant_spec.h's formulas).
QuantParams choose_qparams(const QuantSpec& spec, const BlockMinMax& range);

// A raw fp32 scale as the quantizer uses it: at least eps, then rounded to spec.scale_dtype
// (fp16: clamped to its largest finite value first).
torch::Tensor effective_scale(const QuantSpec& spec, const torch::Tensor& scale);

// Codes in x's shape: int8 q for int formats; uint8 for float formats, the minifloat's bit
// pattern (sign, exponent, mantissa: for fp8 the bytes of torch's float8 dtypes) or the index
// into bitsandbytes' 4-bit table.
torch::Tensor quantize(const QuantSpec& spec, const torch::Tensor& x, const QuantParams& params);
// fp32 values of `codes` (codes' shape): (q - z) * s, q * s + z with a float zero point, or grid
// value * s.
torch::Tensor dequantize(const QuantSpec& spec, const torch::Tensor& codes, const QuantParams& params);

struct FakeQuantized {
  torch::Tensor values;  // fp32, x's shape: dequantize(quantize(x))
  // bool, block view shape: where x lies inside the grid's clipping range, the straight-through
  // estimator's gradient mask. int: round(x / s) + z (float zero point: round((x - m) / s) +
  // quant_min) within [quant_min, quant_max] before clamping (torchao's mask); float grids:
  // |x / s| <= max_value.
  torch::Tensor inside;
};
// On CUDA, int grids with an integer zero point take the one-pass kernel of
// kernels/fake_quantize.h, which gives the reference's bits; everything else (float grids, the
// float zero point) runs the reference, in torch operations.
FakeQuantized fake_quantize_values(const QuantSpec& spec, const torch::Tensor& x, const QuantParams& params);
FakeQuantized fake_quantize_values_reference(const QuantSpec& spec, const torch::Tensor& x, const QuantParams& params);

// A tensor in its quantized form (what `convert` hands to an exporter): codes + scale (+ zero
// point). dequantize() equals fake_quantize_values(spec, x, params).values bit for bit.
struct QuantizedTensor {
  QuantSpec spec;
  torch::Tensor codes;  // quantize()'s codes, the original shape
  QuantParams params;   // params_shape(spec, codes.shape)
  torch::Tensor dequantize() const;  // fp32
};
QuantizedTensor quantize_tensor(const QuantSpec& spec, const torch::Tensor& x, const QuantParams& params);

// Each code's value for a float format: fp32 [2^bits]. Minifloats: every bit pattern decoded
// (NaN where the format has NaN or infinity, codes quantize never produces); tables: the values
// bitsandbytes' kernels decode to.
torch::Tensor float_grid_values(QuantFormat format);

}  // namespace qtrain::qat
