#include "qat/four_bit_codec.h"

#include <torch/torch.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <sstream>

#include "kernels/blockwise_quantize.h"
#include "kernels/blockwise_reference.h"
#include "kernels/error.h"

namespace qtrain::qat {

namespace {

using kernels::block_absmax;
using kernels::ceil_div;
using kernels::for_each_block;

torch::Tensor contiguous_fp32_cpu(const torch::Tensor& input) {
  return input.detach().to(torch::kCPU, torch::kFloat32).contiguous().view(-1);
}

// CUDA tensors go to the kernels (kernels/blockwise_quantize.h) when this build has them; everything
// else takes the CPU reference path below.
bool on_cuda_kernels(const torch::Tensor& tensor) { return kernels::kCudaKernelsBuilt && tensor.is_cuda(); }

// What the kernels read: the tensor flat and contiguous on its device, in a dtype they take.
torch::Tensor cuda_kernel_input(const torch::Tensor& input) {
  const auto type = input.scalar_type();
  const bool readable = type == torch::kFloat32 || type == torch::kFloat16 || type == torch::kBFloat16;
  return (readable ? input.detach() : input.detach().to(torch::kFloat32)).contiguous().view(-1);
}

kernels::FourBitQuantizer kernel_quantizer(const FourBitFormat& format) {
  return {format.thresholds, format.code_of_rank, format.sign_magnitude};
}

struct BlockCodes {
  torch::Tensor packed;  // uint8 [ceil(n / 2)]
  torch::Tensor absmax;  // fp32 [blocks]
};

BlockCodes quantize_4bit_on_cpu(const torch::Tensor& input, const FourBitFormat& format, int64_t blocksize) {
  const auto values = contiguous_fp32_cpu(input);
  const int64_t n = values.numel();
  auto packed = torch::zeros({ceil_div(n, 2)}, torch::kUInt8);
  auto absmax = torch::empty({ceil_div(n, blocksize)}, torch::kFloat32);
  const float* x = values.data_ptr<float>();
  uint8_t* bytes = packed.data_ptr<uint8_t>();
  float* absmax_out = absmax.data_ptr<float>();
  // Blocksizes are even, so a byte never straddles two blocks.
  for_each_block(n, blocksize, [&](int64_t block, int64_t first, int64_t last) {
    const float block_max = block_absmax(x, first, last);
    absmax_out[block] = block_max;
    const float inverse = 1.0f / block_max;
    for (int64_t i = first; i < last; i += 2) {
      const uint8_t high = format.quantize(x[i] * inverse);
      // bnb pads a partial block with zeros and quantizes them like the rest.
      const uint8_t low = format.quantize((i + 1 < last ? x[i + 1] : 0.0f) * inverse);
      bytes[i / 2] = static_cast<uint8_t>((high << 4) | low);
    }
  });
  return {packed.to(input.device()), absmax.to(input.device())};
}

// The mean that double quantization centres the absmax by, as bnb takes it (torch.mean on the
// absmax's device). On CUDA that is torch's own reduction; on the CPU, the sum times the fp32
// reciprocal of the count (CUDA's torch.mean does not divide), the sum taken in float64 and
// rounded, which the fixtures' offsets all equal.
float absmax_mean(const torch::Tensor& absmax) {
  if (absmax.is_cuda()) return absmax.mean().item<float>();
  const float sum = static_cast<float>(absmax.sum(torch::kDouble).item<double>());
  return sum * (1.0f / static_cast<float>(absmax.numel()));
}

}  // namespace

void check_four_bit_blocksize(int64_t blocksize) {
  for (int64_t allowed = 64; allowed <= 4096; allowed *= 2) {
    if (blocksize == allowed) return;
  }
  throw Error(ErrorCode::kRecipe, "4-bit blocksize " + std::to_string(blocksize) +
              " is not supported (bitsandbytes' blocksizes: 64, 128, 256, 512, 1024, 2048, 4096)");
}

int64_t FourBitQuantState::numel() const {
  int64_t count = 1;
  for (const int64_t size : shape) count *= size;
  return count;
}

int64_t FourBitQuantState::blocks() const { return ceil_div(numel(), blocksize); }

void FourBitQuantState::check(const torch::Tensor& packed, const std::string& what) const {
  check_four_bit_blocksize(blocksize);
  auto fail = [&](const std::string& problem) { throw Error(ErrorCode::kWeights, what + ": inconsistent 4-bit quant state: " + problem); };
  for (const int64_t size : shape) {
    if (size < 0) fail("negative size in shape " + shape_text(shape));
  }
  if (!packed.defined() || packed.scalar_type() != torch::kUInt8) fail("the packed weight must be uint8");
  const int64_t packed_bytes = ceil_div(numel(), 2);
  if (packed.numel() != packed_bytes) {
    fail("the packed weight has " + std::to_string(packed.numel()) + " bytes, shape " + shape_text(shape) +
         " needs " + std::to_string(packed_bytes));
  }
  if (!code.defined() || code.numel() != 16 || code.scalar_type() != torch::kFloat32) {
    fail("the quant_map must be 16 fp32 values");
  }
  if (!absmax.defined() || absmax.numel() != blocks()) {
    fail("absmax has " + std::to_string(absmax.defined() ? absmax.numel() : 0) + " values, " +
         std::to_string(numel()) + " weights in blocks of " + std::to_string(blocksize) + " need " +
         std::to_string(blocks()));
  }
  if (double_quant()) {
    if (absmax.scalar_type() != torch::kUInt8) fail("a double-quantized absmax must be uint8");
    const int64_t nested_blocks = ceil_div(blocks(), kNestedBlocksize);
    if (nested_absmax.numel() != nested_blocks || nested_absmax.scalar_type() != torch::kFloat32) {
      fail("nested_absmax has " + std::to_string(nested_absmax.numel()) + " values, expected " +
           std::to_string(nested_blocks) + " fp32 (one per 256 absmax values)");
    }
    if (!nested_code.defined() || nested_code.numel() != 256 || nested_code.scalar_type() != torch::kFloat32) {
      fail("the nested_quant_map must be 256 fp32 values");
    }
  } else if (absmax.scalar_type() != torch::kFloat32) {
    fail("absmax must be fp32 (or uint8 with nested_absmax for double quantization)");
  }
}

FourBitTensor quantize_4bit(const torch::Tensor& input, FourBitType quant_type, int64_t blocksize,
                            bool double_quant) {
  check_four_bit_blocksize(blocksize);
  if (!input.is_floating_point()) {
    throw Error(ErrorCode::kInternal, "quantize_4bit: expected a floating-point tensor, got " +
                std::string(c10::toString(input.scalar_type())));
  }
  const auto& format = four_bit_format(quant_type);
  BlockCodes codes;
  if (on_cuda_kernels(input)) {
    auto quantized = kernels::quantize_4bit_cuda(cuda_kernel_input(input), kernel_quantizer(format), blocksize);
    codes = {quantized.codes, quantized.absmax};
  } else {
    codes = quantize_4bit_on_cpu(input, format, blocksize);
  }

  FourBitTensor result;
  result.state.quant_type = quant_type;
  result.state.blocksize = blocksize;
  result.state.shape = input.sizes().vec();
  result.state.dtype = input.scalar_type();
  result.state.code = four_bit_code_tensor(quant_type).to(input.device());
  if (double_quant) {
    const float offset = absmax_mean(codes.absmax);
    auto nested = quantize_blockwise_8bit(codes.absmax - offset, signed_dynamic_map(), kNestedBlocksize);
    result.state.offset = offset;
    result.state.absmax = nested.codes;
    result.state.nested_absmax = nested.absmax;
    result.state.nested_code = signed_dynamic_map().to(input.device());
  } else {
    result.state.absmax = codes.absmax;
  }
  result.packed = codes.packed.view({-1, 1});
  return result;
}

torch::Tensor dequantize_absmax(const FourBitQuantState& state) {
  if (!state.double_quant()) return state.absmax.to(torch::kFloat32);
  return dequantize_blockwise_8bit(state.absmax, state.nested_absmax, state.nested_code, kNestedBlocksize) +
         state.offset;
}

namespace {

// The block scales as the CUDA kernels read them, on packed's device.
kernels::FourBitScales kernel_scales(const torch::Tensor& packed, const FourBitQuantState& state) {
  const auto on_device = [&](const torch::Tensor& tensor) {
    return tensor.defined() ? tensor.to(packed.device()).contiguous() : tensor;
  };
  kernels::FourBitScales scales;
  scales.absmax = on_device(state.absmax);
  scales.nested_absmax = on_device(state.nested_absmax);
  scales.nested_code = on_device(state.nested_code);
  scales.offset = state.offset;
  scales.nested_blocksize = kNestedBlocksize;
  return scales;
}

}  // namespace

torch::Tensor dequantize_4bit(const torch::Tensor& packed, const FourBitQuantState& state, torch::ScalarType dtype) {
  const int64_t n = state.numel();
  const int64_t blocks = state.blocks();
  // Like bnb's kernels, decode with the format's own table (state.code is only carried along).
  if (on_cuda_kernels(packed)) {
    const auto scales = kernel_scales(packed, state);
    const auto& decode = four_bit_format(state.quant_type).decode;
    // The kernel writes fp32 / fp16 / bf16; any other dtype is a cast of the fp32 values, as below.
    const bool written_by_kernel = dtype == torch::kFloat32 || dtype == torch::kFloat16 || dtype == torch::kBFloat16;
    const auto values = kernels::dequantize_4bit_cuda(packed.reshape({-1}).contiguous(), n, state.blocksize, decode,
                                                      scales, written_by_kernel ? dtype : torch::kFloat32);
    return (written_by_kernel ? values : values.to(dtype)).view(state.shape);
  }
  const auto code = four_bit_decode_tensor(state.quant_type).to(packed.device());
  // [256, 2]: the two values a byte holds, high nibble first.
  const auto byte_values = torch::arange(256, torch::TensorOptions().dtype(torch::kLong).device(packed.device()));
  const auto pair_table = torch::stack({code.index_select(0, torch::bitwise_right_shift(byte_values, 4)),
                                       code.index_select(0, torch::bitwise_and(byte_values, 15))}, 1);
  auto values = pair_table.index_select(0, packed.reshape({-1}).to(torch::kLong)).view({-1}).narrow(0, 0, n);
  values = torch::constant_pad_nd(values, {0, blocks * state.blocksize - n}).view({blocks, state.blocksize});
  values = values * dequantize_absmax(state).to(packed.device()).view({blocks, 1});
  return values.view({-1}).narrow(0, 0, n).to(dtype).view(state.shape);
}

torch::Tensor dequantize_4bit_blocks(const torch::Tensor& packed, const FourBitQuantState& state, int64_t first,
                                     int64_t count, torch::ScalarType dtype) {
  const int64_t blocks = state.blocks();
  if (first < 0 || count <= 0 || first + count > blocks || state.blocksize % 2 != 0) {
    throw Error(ErrorCode::kInternal, "blocks [" + std::to_string(first) + ", " + std::to_string(first + count) +
                                          ") of a 4-bit tensor of " + std::to_string(blocks) + " blocks of " +
                                          std::to_string(state.blocksize) + " are not blocks of it");
  }
  const int64_t begin = first * state.blocksize;
  const int64_t end = std::min(state.numel(), (first + count) * state.blocksize);
  FourBitQuantState piece;
  piece.quant_type = state.quant_type;
  piece.blocksize = state.blocksize;
  piece.shape = {end - begin};
  piece.dtype = state.dtype;
  piece.code = state.code;
  const bool whole_nested_blocks =
      first % kNestedBlocksize == 0 && (count % kNestedBlocksize == 0 || first + count == blocks);
  if (state.double_quant() && whole_nested_blocks) {  // the piece's codes and nested blocks, as they are
    piece.absmax = state.absmax.narrow(0, first, count);
    piece.nested_absmax = state.nested_absmax.narrow(0, first / kNestedBlocksize, ceil_div(count, kNestedBlocksize));
    piece.nested_code = state.nested_code;
    piece.offset = state.offset;
  } else if (state.double_quant()) {  // the nested blocks that hold the piece's codes, then the piece's
    const int64_t nested_first = first / kNestedBlocksize;
    const int64_t nested_end = ceil_div(first + count, kNestedBlocksize);
    const int64_t codes_begin = nested_first * kNestedBlocksize;
    const auto codes = state.absmax.narrow(0, codes_begin, std::min(blocks, nested_end * kNestedBlocksize) - codes_begin);
    const auto nested = state.nested_absmax.narrow(0, nested_first, nested_end - nested_first);
    piece.absmax = (dequantize_blockwise_8bit(codes, nested, state.nested_code, kNestedBlocksize) + state.offset)
                       .narrow(0, first - codes_begin, count);
  } else {
    piece.absmax = state.absmax.narrow(0, first, count);
  }
  return dequantize_4bit(packed.reshape({-1}).narrow(0, begin / 2, ceil_div(end - begin, 2)), piece, dtype);
}

torch::Tensor dequantize_4bit_to_float8(const torch::Tensor& packed, const FourBitQuantState& state,
                                        const torch::Tensor& row_scales) {
  if (state.shape.size() != 2 || row_scales.numel() != state.shape[0] || row_scales.scalar_type() != torch::kFloat32) {
    throw Error(ErrorCode::kInternal, "dequantize_4bit_to_float8: needs a 2-d weight and one fp32 scale per row");
  }
  const int64_t in = state.shape[1];
  if (on_cuda_kernels(packed) && in % 8 == 0) {
    const auto codes = kernels::dequantize_4bit_to_float8_cuda(
        packed.reshape({-1}).contiguous(), state.numel(), state.blocksize, four_bit_format(state.quant_type).decode,
        kernel_scales(packed, state), row_scales.to(packed.device()).contiguous().view({-1}), in);
    return codes.view(state.shape);
  }
  // The divisor is a tensor: CUDA divides by a scalar as a product with its rounded reciprocal.
  const auto values = dequantize_4bit(packed, state, torch::kBFloat16).to(torch::kFloat32);
  return (values / row_scales.to(values.device()).view({-1, 1}))
      .clamp(-448.0, 448.0)
      .to(torch::kFloat8_e4m3fn);
}

}  // namespace qtrain::qat
