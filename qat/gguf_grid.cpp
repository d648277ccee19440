// The GGUF block types' grids as tensor ops (qat/gguf_grid.h): fitting a weight onto one, its values,
// and its bytes. One row per type holds everything that varies: the grid's integer ranges and
// where each number's bits sit in the block (ggml-common.h's structs, as data).
//
// Fitting works on the weight viewed as [rows, blocks, sub-blocks, sub-block values] (a legacy block
// is its own single sub-block), every step a tensor op over all sub-blocks at once:
//   1. each sub-block's affine fit x ~ scale * q + offset (offset 0 for the symmetric types): the
//      min/max one, then, with GgufGridOptions::search_scales, the least-squares refits of five other
//      roundings and of the best one's codes, each kept where its squared error is smaller;
//   2. the legacy types store scale and offset as fp16 d and m; the k-quants quantize the sub-block
//      scales (and minus the offsets, the mins) to integers against one fp16 d (and dmin) per
//      super-block of 256, as ggml's quantizers do;
//   3. each element's nearest code on the stored grid (requantize_gguf_grid).
//
// The fit gives the same grid, bit for bit, on the CPU and on CUDA, whatever the thread count, the
// weight's memory layout or the rows quantized with it: training runs on CUDA and the export may
// recompute the grid of its last forward on the CPU. So no reduction rounds in an order that a kernel
// chooses (sum, mean, matmul): a sub-block's sums of real numbers are added elementwise in one fixed
// pairwise tree (pairwise_sum); its sums of codes, integers below 2^24, and its min, max and argmax
// are exact in any order; every other step is one correctly rounded fp32 op (no fused multiply-add,
// no transcendental), and no tensor is divided by a C++ number, which CUDA turns into a
// multiplication by its rounded reciprocal (divided_by).
#include "qat/gguf_grid.h"

#include <cstring>
#include <string>
#include <utility>

#include "kernels/error.h"
#include "qat/gguf_fp16.h"

namespace qtrain::qat {

namespace {

constexpr double kLargestHalf = 65504.0;

// Where a number stored in a block sits: its low `bits` bits at bit `shift` of byte `byte`.
struct BitField {
  int64_t byte;
  int shift;
  int bits;
};

// A number stored in one bit field, or split in two: the low bits in `low`, the rest in `high`
// (high.bits == 0 when there is none).
struct Placement {
  BitField low;
  BitField high;
};

enum class Part { kCode, kScale, kMin };

// One quantized type's grid and layout. q is the integer the dequantization multiplies; the block
// stores q + code_offset. The k-quants' sub-block scale sc is stored as sc + scale_offset.
struct GridRow {
  const GgufBlockFormat* format;  // name, block_elements, block_bytes
  int64_t sub_block;              // values per scale: 16 or 32 (the block itself for legacy types)
  int64_t code_low;               // q in [code_low, code_high]
  int64_t code_high;
  int64_t code_offset;
  bool has_offset;       // value = scale * q + offset: Q4_1, Q5_1 (m), Q2_K, Q4_K, Q5_K (-dmin * mc)
  bool two_level;        // k-quants: integer sub-block scales (and mins) against one fp16 d (and dmin)
  int64_t scale_low;     // k-quants: sc in [scale_low, scale_high]; mins in [0, scale_high]
  int64_t scale_high;
  int64_t scale_offset;
  torch::ScalarType code_type;   // as the block stores codes: uint8, Q8_0's int8
  torch::ScalarType scale_type;  // uint8, Q6_K's int8
  int64_t d_byte;                // where the fp16 d sits in the block
  int64_t m_byte;                // where the fp16 m (legacy) or dmin (k-quants) sits; -1: none
  Placement (*locate)(Part part, int64_t index);  // code `index` of the block, or sub-block `index`'s scale / min
};

// Each type's block as ggml-common.h lays it out (the fp16 fields little-endian):
//   Q4_0  {d, qs[16]}: byte j of qs holds codes j (low nibble) and j + 16 (high).
//   Q4_1  {d, m, qs[16]}.
//   Q5_0  {d, qh[4], qs[16]}: qs as Q4_0's for the low 4 bits; bit j of qh (little-endian) is code j's fifth.
//   Q5_1  {d, m, qh[4], qs[16]}.
//   Q8_0  {d, qs[32]}: int8 codes.
//   Q2_K  {scales[16], qs[64], d, dmin}: scales byte j: sub-block j's scale (low nibble), min (high);
//         qs byte 32c + l holds codes 128c + l + 32s at bits 2s.
//   Q3_K  {hmask[32], qs[64], scales[12], d}: the low 2 bits of each code as Q2_K's qs, the third bit of
//         code e at bit e / 32 of hmask byte e % 32; 6-bit scales: low nibbles of 0-7 in bytes 0-7, of
//         8-15 in the high nibbles of bytes 0-7, top two bits of scale j at bit 2 (j / 4) of byte 8 + j % 4.
//   Q4_K  {d, dmin, scales[12], qs[128]}: qs byte 32c + l holds codes 64c + l (low nibble) and
//         64c + 32 + l (high); 6-bit scales and mins: those of sub-blocks 0-3 whole in bytes 0-3 (scale)
//         and 4-7 (min), those of 4-7 with their low nibbles in bytes 8-11 (scale low, min high) and
//         their top two bits in the top bits of bytes 0-3 (scale) and 4-7 (min).
//   Q5_K  {d, dmin, scales[12], qh[32], qs[128]}: as Q4_K, the fifth bit of code 64c + l (l < 32) at bit
//         2c of qh byte l, of code 64c + 32 + l at bit 2c + 1.
//   Q6_K  {ql[128], qh[64], scales[16], d}: per half of 128 codes (h), ql byte 64h + l holds codes
//         l (low nibble) and 64 + l (high), byte 64h + 32 + l codes 32 + l and 96 + l; qh byte 32h + l
//         holds the top two bits of codes l + 32s at bits 2s; int8 scales.
Placement at(BitField low, BitField high = {0, 0, 0}) { return {low, high}; }

// Legacy 4-bit codes in qs at `qs`: code e in byte e % 16, nibble e / 16.
BitField legacy_nibble(int64_t qs, int64_t e) { return {qs + e % 16, static_cast<int>(4 * (e / 16)), 4}; }

// Q2_K and Q3_K's 2-bit codes in qs at `qs`.
BitField two_bit_code(int64_t qs, int64_t e) {
  const int64_t within = e % 128;
  return {qs + 32 * (e / 128) + within % 32, static_cast<int>(2 * (within / 32)), 2};
}

// Q4_K and Q5_K's low nibbles in qs at `qs`.
BitField k_nibble(int64_t qs, int64_t e) { return {qs + 32 * (e / 64) + e % 32, static_cast<int>(4 * ((e % 64) / 32)), 4}; }

// Q4_K and Q5_K's 6-bit scales and mins in the 12 bytes at 4.
Placement k_scale_or_min(Part part, int64_t j) {
  constexpr int64_t kScales = 4;
  const int64_t whole = part == Part::kScale ? j : j + 4;  // sub-blocks 0-3
  if (j < 4) return at({kScales + whole, 0, 6});
  return at({kScales + j + 4, part == Part::kScale ? 0 : 4, 4}, {kScales + whole - 4, 6, 2});
}

// The legacy types store codes only (Part::kCode).
Placement locate_q4_0(Part, int64_t e) { return at(legacy_nibble(2, e)); }
Placement locate_q4_1(Part, int64_t e) { return at(legacy_nibble(4, e)); }
Placement locate_q5_0(Part, int64_t e) { return at(legacy_nibble(6, e), {2 + e / 8, static_cast<int>(e % 8), 1}); }
Placement locate_q5_1(Part, int64_t e) { return at(legacy_nibble(8, e), {4 + e / 8, static_cast<int>(e % 8), 1}); }
Placement locate_q8_0(Part, int64_t e) { return at({2 + e, 0, 8}); }

Placement locate_q2_k(Part part, int64_t index) {
  if (part == Part::kCode) return at(two_bit_code(16, index));
  return at({index, part == Part::kScale ? 0 : 4, 4});
}

Placement locate_q3_k(Part part, int64_t index) {
  constexpr int64_t kScales = 96;
  if (part == Part::kCode) return at(two_bit_code(32, index), {index % 32, static_cast<int>(index / 32), 1});
  return at({kScales + index % 8, static_cast<int>(4 * (index / 8)), 4}, {kScales + 8 + index % 4, static_cast<int>(2 * (index / 4)), 2});
}

Placement locate_q4_k(Part part, int64_t index) {
  if (part == Part::kCode) return at(k_nibble(16, index));
  return k_scale_or_min(part, index);
}

Placement locate_q5_k(Part part, int64_t index) {
  if (part == Part::kCode) {
    return at(k_nibble(48, index), {16 + index % 32, static_cast<int>(2 * (index / 64) + (index % 64) / 32), 1});
  }
  return k_scale_or_min(part, index);
}

Placement locate_q6_k(Part part, int64_t index) {
  if (part == Part::kScale) return at({192 + index, 0, 8});
  const int64_t half = index / 128;
  const int64_t within = index % 128;
  const int64_t l = within % 32;
  const int64_t quarter = within / 32;  // 0: ql[l] low, 1: ql[l + 32] low, 2: ql[l] high, 3: ql[l + 32] high
  return at({64 * half + l + 32 * (quarter % 2), static_cast<int>(4 * (quarter / 2)), 4},
            {128 + 32 * half + l, static_cast<int>(2 * quarter), 2});
}

#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"
GridRow grid_row(GgufBlockType type) {
  const GgufBlockFormat* format = &gguf_block_format(type);
  constexpr auto u8 = torch::kUInt8;
  constexpr auto i8 = torch::kInt8;
  // Legacy types: sub-block = block, no integer scales.
  auto legacy = [format](int64_t code_low, int64_t code_high, int64_t code_offset, bool has_offset,
                         torch::ScalarType code_type, int64_t m_byte, Placement (*locate)(Part, int64_t)) {
    return GridRow{format, format->block_elements, code_low, code_high, code_offset, has_offset, false, 0, 0, 0,
                   code_type, u8, 0, m_byte, locate};
  };
  auto k_quant = [format](int64_t sub_block, int64_t code_low, int64_t code_high, int64_t code_offset, bool has_offset,
                          int64_t scale_low, int64_t scale_high, int64_t scale_offset, torch::ScalarType scale_type,
                          int64_t d_byte, int64_t m_byte, Placement (*locate)(Part, int64_t)) {
    return GridRow{format, sub_block, code_low, code_high, code_offset, has_offset, true, scale_low, scale_high,
                   scale_offset, u8, scale_type, d_byte, m_byte, locate};
  };
  switch (type) {
    case GgufBlockType::kQ4_0: return legacy(-8, 7, 8, false, u8, -1, locate_q4_0);
    case GgufBlockType::kQ4_1: return legacy(0, 15, 0, true, u8, 2, locate_q4_1);
    case GgufBlockType::kQ5_0: return legacy(-16, 15, 16, false, u8, -1, locate_q5_0);
    case GgufBlockType::kQ5_1: return legacy(0, 31, 0, true, u8, 2, locate_q5_1);
    case GgufBlockType::kQ8_0: return legacy(-128, 127, 0, false, i8, -1, locate_q8_0);
    case GgufBlockType::kQ2_K: return k_quant(16, 0, 3, 0, true, 0, 15, 0, u8, 80, 82, locate_q2_k);
    case GgufBlockType::kQ3_K: return k_quant(16, -4, 3, 4, false, -32, 31, 32, u8, 108, -1, locate_q3_k);
    case GgufBlockType::kQ4_K: return k_quant(32, 0, 15, 0, true, 0, 63, 0, u8, 0, 2, locate_q4_k);
    case GgufBlockType::kQ5_K: return k_quant(32, 0, 31, 0, true, 0, 63, 0, u8, 0, 2, locate_q5_k);
    case GgufBlockType::kQ6_K: return k_quant(16, -32, 31, 32, false, -128, 127, 0, i8, 208, -1, locate_q6_k);
    case GgufBlockType::kF32:
    case GgufBlockType::kF16:
    case GgufBlockType::kBF16:
    case GgufBlockType::kMXFP4:  // E2M1 values, not integers times scales
    case GgufBlockType::kCount: break;
  }
  throw Error(ErrorCode::kInternal, std::string("GGUF type ") + format->name + " has no grid of integer codes");
}
#pragma GCC diagnostic pop

// --- Fitting ------------------------------------------------------------------------------------

// fp32 values rounded to fp16 (to nearest, ties to even), magnitudes past the largest half clamped to
// it, and -0 made +0 (adding +0 does that) so that a block of zeros of either sign gets d = +0 and
// dequantizes to +0 each time.
torch::Tensor round_to_half(const torch::Tensor& values) {
  return values.clamp(-kLargestHalf, kLargestHalf).to(torch::kHalf).to(torch::kFloat).add_(0.0);
}

torch::Tensor inverse_or_zero(const torch::Tensor& values) { return torch::where(values != 0, values.reciprocal(), 0.0); }

// values / divisor, correctly rounded on every device: the divisor is a tensor on the values' device,
// since CUDA multiplies by the fp32 reciprocal of a C++ number instead (up to an ulp off the quotient).
torch::Tensor divided_by(const torch::Tensor& values, double divisor) { return values / torch::full({}, divisor, values.options()); }

// The sum over the last dimension, kept, added in the same order on every device and thread count:
// the second half added elementwise to the first until one value is left (zeros pad the length to a
// power of two). A reduction kernel's order depends on the device, the memory layout and the threads.
torch::Tensor pairwise_sum(torch::Tensor values) {
  int64_t length = 1;
  while (length < values.size(-1)) length *= 2;
  if (length > values.size(-1)) values = torch::constant_pad_nd(values, {0, length - values.size(-1)});
  for (; length > 1; length /= 2) values = values.narrow(-1, 0, length / 2) + values.narrow(-1, length / 2, length / 2);
  return values;
}

// Along the last dimension (kept), the value of largest magnitude with its sign (the first of ties,
// as argmax documents on every device).
torch::Tensor signed_abs_max(const torch::Tensor& x) { return x.gather(-1, x.abs().argmax(-1, /*keepdim=*/true)); }

// x ~ scale * q + offset per sub-block, both [..., 1]; offset undefined for the symmetric types.
struct AffineFit {
  torch::Tensor scale;
  torch::Tensor offset;
};

// q = round((x - offset) / scale), clamped to the row's range; 0 where the scale is 0.
torch::Tensor nearest_codes(const torch::Tensor& x, const AffineFit& fit, const GridRow& row) {
  const auto inverse = inverse_or_zero(fit.scale);
  auto codes = fit.offset.defined() ? (x - fit.offset).mul_(inverse) : x * inverse;
  return codes.round_().clamp_(row.code_low, row.code_high);
}

// Sum over each sub-block of (scale * q + offset - x)^2, [..., 1].
torch::Tensor squared_error(const torch::Tensor& x, const AffineFit& fit, const torch::Tensor& codes) {
  auto values = codes * fit.scale;
  if (fit.offset.defined()) values.add_(fit.offset);
  values.sub_(x);
  return pairwise_sum(values * values);
}

// The least-squares scale (and offset) of x given the codes, and where it is defined. sum_x is
// pairwise_sum(x), the same for every candidate (undefined for the symmetric types).
std::pair<AffineFit, torch::Tensor> least_squares(const torch::Tensor& x, const torch::Tensor& sum_x, const torch::Tensor& codes,
                                                  const GridRow& row) {
  const auto sum_xq = pairwise_sum(x * codes);
  // Sums of integers below 2^24 (|q| <= 128, 32 of them: q^2 sums to at most 2^19) are exact in any order.
  const auto sum_qq = (codes * codes).sum(-1, /*keepdim=*/true);
  if (!row.has_offset) return {{sum_xq * inverse_or_zero(sum_qq), torch::Tensor()}, sum_qq > 0};
  // Normal equations of min over (scale, offset) of sum (scale q + offset - x)^2.
  const auto count = static_cast<double>(row.sub_block);
  const auto sum_q = codes.sum(-1, /*keepdim=*/true);
  const auto determinant = sum_qq * count - sum_q * sum_q;
  const auto inverse = inverse_or_zero(determinant);
  auto scale = (sum_xq * count - sum_x * sum_q) * inverse;
  auto offset = (sum_qq * sum_x - sum_q * sum_xq) * inverse;
  if (row.two_level) {
    // The k-quants' offset is -dmin * mc <= 0: where the best one is positive, the best scale with none.
    const auto positive = offset > 0;
    scale = torch::where(positive, sum_xq * inverse_or_zero(sum_qq), scale);
    offset = torch::where(positive, torch::zeros_like(offset), offset);
  }
  return {{scale, offset}, determinant > 0};
}

// Candidate roundings around the min/max one: the extreme value goes to code_low - delta (symmetric)
// or the range spans code_high + delta steps (with offset).
constexpr double kSearchDeltas[] = {-1.0, -0.5, 0.0, 0.5, 1.0};

// Step 1 of the file comment on x [rows, blocks, sub-blocks, sub-block].
AffineFit fit_sub_blocks(const torch::Tensor& x, const GridRow& row, const GgufGridOptions& options) {
  AffineFit best;
  torch::Tensor shifted;       // x - min (with offset): the candidates' codes scale it
  torch::Tensor inverse_unit;  // candidate delta's codes: shifted * inverse_unit * (code_high + delta), or
                               // x * inverse_unit * (code_low - delta) for the symmetric types
  if (row.has_offset) {
    // Adding +0 makes a zero extreme +0: amin and amax are exact, but for which of -0 and +0 they keep.
    auto low = x.amin(-1, true).add_(0.0);
    if (row.two_level) low.clamp_max_(0);
    const auto range = x.amax(-1, true).add_(0.0) - low;
    best = {divided_by(range, static_cast<double>(row.code_high)), low};
    shifted = x - low;
    inverse_unit = inverse_or_zero(range);
  } else {
    const auto extreme = signed_abs_max(x);  // to code_low, the longer side of [code_low, code_high]
    best = {divided_by(extreme, static_cast<double>(row.code_low)), torch::Tensor()};
    inverse_unit = inverse_or_zero(extreme);
  }
  if (!options.search_scales) return best;

  // Each fit is judged at fp16 precision, as a legacy block stores it (one that reproduces a block
  // exactly scores zero and stays); the k-quants requantize their scales later anyway.
  auto as_stored = [&row](const AffineFit& fit) {
    return AffineFit{round_to_half(fit.scale), row.has_offset ? round_to_half(fit.offset) : torch::Tensor()};
  };
  auto best_error = squared_error(x, as_stored(best), nearest_codes(x, as_stored(best), row));
  const auto sum_x = row.has_offset ? pairwise_sum(x) : torch::Tensor();
  auto consider = [&](const torch::Tensor& codes) {
    auto [fit, defined] = least_squares(x, sum_x, codes, row);
    const auto stored = as_stored(fit);
    const auto error = squared_error(x, stored, codes);
    const auto better = defined.logical_and_(error < best_error);
    best.scale = torch::where(better, fit.scale, best.scale);
    if (row.has_offset) best.offset = torch::where(better, fit.offset, best.offset);
    best_error = torch::where(better, error, best_error);
  };
  for (const double delta : kSearchDeltas) {
    auto codes = row.has_offset ? shifted * (inverse_unit * (static_cast<double>(row.code_high) + delta))
                                : x * (inverse_unit * (static_cast<double>(row.code_low) - delta));
    consider(codes.round_().clamp_(row.code_low, row.code_high));
  }
  consider(nearest_codes(x, as_stored(best), row));  // one more refit: the best fit's own codes
  return best;
}

// --- The stored grid ----------------------------------------------------------------------------

// The weight's [rows, blocks, sub-blocks, sub-block] view for `row`, after checking it.
torch::Tensor sub_block_view(const torch::Tensor& weight, const GridRow& row, const char* caller) {
  const int64_t block = row.format->block_elements;
  if (weight.dim() != 2 || weight.scalar_type() != torch::kFloat || weight.size(1) % block != 0) {
    throw Error(ErrorCode::kWeights, std::string(caller) + ": a " + row.format->name +
                                         " grid needs an fp32 weight [rows, cols] with cols a multiple of " + std::to_string(block) +
                                         ", got " + std::string(c10::toString(weight.scalar_type())) + " " + c10::str(weight.sizes()));
  }
  return weight.reshape({weight.size(0), weight.size(1) / block, block / row.sub_block, row.sub_block});
}

// The scale of each sub-block of a stored grid and what is added to or subtracted from scale * q,
// [rows, blocks, sub-blocks, 1], each as gguf-py and ggml compute them (exact products).
struct StoredScales {
  torch::Tensor scale;       // d, or d * sc for the k-quants
  torch::Tensor added;       // Q4_1, Q5_1: m (value = scale * q + m)
  torch::Tensor subtracted;  // Q2_K, Q4_K, Q5_K: dmin * mc (value = scale * q - dmin * mc)
};

StoredScales stored_scales(const GgufGridTensor& grid, const GridRow& row) {
  const int64_t rows = grid.d.size(0);
  const int64_t blocks = grid.d.size(1);
  const int64_t sub_blocks = row.format->block_elements / row.sub_block;
  const auto d = grid.d.reshape({rows, blocks, 1, 1});
  if (!row.two_level) return {d, row.has_offset ? grid.m.reshape({rows, blocks, 1, 1}) : torch::Tensor(), torch::Tensor()};
  auto sub_block_integers = [&](const torch::Tensor& stored, int64_t offset) {
    auto values = stored.reshape({rows, blocks, sub_blocks, 1}).to(torch::kFloat);
    return offset != 0 ? values.sub_(static_cast<double>(offset)) : values;
  };
  const auto scale = d * sub_block_integers(grid.scales, row.scale_offset);
  if (!row.has_offset) return {scale, torch::Tensor(), torch::Tensor()};
  return {scale, torch::Tensor(), grid.dmin.reshape({rows, blocks, 1, 1}) * sub_block_integers(grid.mins, 0)};
}

// Step 2 of the file comment: the stored scales of the fit, codes not yet set.
GgufGridTensor store_scales(const AffineFit& fit, const GridRow& row, GgufBlockType type) {
  const int64_t rows = fit.scale.size(0);
  const int64_t blocks = fit.scale.size(1);
  GgufGridTensor grid;
  grid.type = type;
  if (!row.two_level) {
    grid.d = round_to_half(fit.scale).reshape({rows, blocks});
    if (row.has_offset) grid.m = round_to_half(fit.offset).reshape({rows, blocks});
    return grid;
  }
  // sc = round(scale / d), the super-block's largest scale on the end of the range: ggml's choice.
  auto integers = [&](const torch::Tensor& values, const torch::Tensor& unit, int64_t low, int64_t high, int64_t offset) {
    auto codes = (values * inverse_or_zero(unit)).round_().clamp_(low, high);
    if (offset != 0) codes.add_(static_cast<double>(offset));
    return codes.to(row.scale_type).reshape({rows, -1});
  };
  if (row.has_offset) {
    const auto scale = fit.scale.clamp_min(0);
    const auto min = fit.offset.neg();  // >= 0
    const auto d = round_to_half(divided_by(scale.amax(2, true), static_cast<double>(row.scale_high)));
    const auto dmin = round_to_half(divided_by(min.amax(2, true), static_cast<double>(row.scale_high)));
    grid.scales = integers(scale, d, 0, row.scale_high, 0);
    grid.mins = integers(min, dmin, 0, row.scale_high, 0);
    grid.d = d.reshape({rows, blocks});
    grid.dmin = dmin.reshape({rows, blocks});
    return grid;
  }
  // Signed scales: the one of largest magnitude goes to scale_low (-32, -128), the longer side.
  const auto largest = signed_abs_max(fit.scale.squeeze(-1)).unsqueeze(-1);
  const auto d = round_to_half(divided_by(largest, static_cast<double>(row.scale_low)));
  grid.scales = integers(fit.scale, d, row.scale_low, row.scale_high, row.scale_offset);
  grid.d = d.reshape({rows, blocks});
  return grid;
}

// Step 3: each element's nearest code on the grid's stored scales, as stored.
torch::Tensor stored_codes(const torch::Tensor& x, const GgufGridTensor& grid, const GridRow& row) {
  const auto stored = stored_scales(grid, row);
  auto codes = nearest_codes(x, {stored.scale, stored.subtracted.defined() ? stored.subtracted.neg() : stored.added}, row);
  if (row.code_offset != 0) codes.add_(static_cast<double>(row.code_offset));
  return codes.to(row.code_type).reshape({x.size(0), -1});
}

// --- Bytes --------------------------------------------------------------------------------------

uint32_t field_mask(int bits) { return (1u << bits) - 1u; }

void store_number(uint8_t* block, const Placement& place, uint32_t value) {
  block[place.low.byte] = static_cast<uint8_t>(block[place.low.byte] | ((value & field_mask(place.low.bits)) << place.low.shift));
  if (place.high.bits > 0) {
    const uint32_t high = (value >> place.low.bits) & field_mask(place.high.bits);
    block[place.high.byte] = static_cast<uint8_t>(block[place.high.byte] | (high << place.high.shift));
  }
}

uint32_t load_number(const uint8_t* block, const Placement& place) {
  uint32_t value = (block[place.low.byte] >> place.low.shift) & field_mask(place.low.bits);
  if (place.high.bits > 0) value |= ((block[place.high.byte] >> place.high.shift) & field_mask(place.high.bits)) << place.low.bits;
  return value;
}

int stored_bits(const Placement& place) { return place.low.bits + place.high.bits; }

// A contiguous CPU copy of a grid tensor's bytes (int8 as their two's complement).
std::vector<uint8_t> host_bytes(const torch::Tensor& values) {
  const auto host = values.to(torch::kCPU).contiguous().view(torch::kUInt8);
  return std::vector<uint8_t>(host.data_ptr<uint8_t>(), host.data_ptr<uint8_t>() + host.numel());
}

// The fp16 bits of a tensor of fp16 values; an Error naming `what` when one is not.
std::vector<uint16_t> half_bits(const torch::Tensor& values, const GridRow& row, const char* what) {
  const auto host = values.to(torch::kCPU, torch::kFloat).contiguous();
  const float* data = host.data_ptr<float>();
  std::vector<uint16_t> bits(host.numel());
  for (int64_t index = 0; index < host.numel(); ++index) {
    bits[index] = gguf_quants::fp16_bits_from_float(data[index]);
    const float back = gguf_quants::float_from_fp16_bits(bits[index]);
    if (std::memcmp(&back, &data[index], sizeof back) != 0 && !(back != back && data[index] != data[index])) {
      throw Error(ErrorCode::kInternal, std::string(row.format->name) + " grid: " + what + " " + std::to_string(data[index]) +
                                            " is not an fp16 value");
    }
  }
  return bits;
}

// Throws unless every stored number in `values` (unsigned, or two's complement in an int8 tensor)
// fits `bits` bits.
void check_width(const torch::Tensor& values, int bits, const GridRow& row, const char* what) {
  const auto wide = values.to(torch::kCPU, torch::kInt);
  const int64_t high = values.scalar_type() == torch::kInt8 ? (1 << (bits - 1)) - 1 : (1 << bits) - 1;
  const int64_t low = values.scalar_type() == torch::kInt8 ? -(1 << (bits - 1)) : 0;
  if (wide.numel() > 0 && (wide.min().item<int64_t>() < low || wide.max().item<int64_t>() > high)) {
    throw Error(ErrorCode::kInternal,
                std::string(row.format->name) + " grid: " + what + " outside their " + std::to_string(bits) + " bits");
  }
}

// Throws unless the grid's tensors have the type's dtypes and fit one [rows, cols] tensor.
void check_layout(const GgufGridTensor& grid, const GridRow& row) {
  auto fail = [&row](const std::string& problem) {
    throw Error(ErrorCode::kInternal, std::string(row.format->name) + " grid: " + problem);
  };
  auto expect = [&](const torch::Tensor& part, const char* name, bool present, torch::ScalarType type, int64_t per_row) {
    if (part.defined() != present) fail(std::string(name) + (present ? " missing" : " where the type has none"));
    if (!present) return;
    if (part.scalar_type() != type || part.dim() != 2 || part.size(0) != grid.codes.size(0) || part.size(1) != per_row) {
      fail(std::string(name) + " is " + std::string(c10::toString(part.scalar_type())) + " " + c10::str(part.sizes()) + ", expected " +
           std::string(c10::toString(type)) + " [" + std::to_string(grid.codes.size(0)) + ", " + std::to_string(per_row) + "]");
    }
  };
  if (!grid.codes.defined() || grid.codes.dim() != 2 || grid.codes.size(1) % row.format->block_elements != 0) {
    fail("codes are not [rows, whole blocks]");
  }
  const int64_t cols = grid.codes.size(1);
  const bool has_min_codes = row.two_level && row.has_offset;
  expect(grid.codes, "codes", true, row.code_type, cols);
  expect(grid.scales, "scales", row.two_level, row.scale_type, cols / row.sub_block);
  expect(grid.mins, "mins", has_min_codes, torch::kUInt8, cols / row.sub_block);
  expect(grid.d, "d", true, torch::kFloat, cols / row.format->block_elements);
  expect(grid.m, "m", row.has_offset && !row.two_level, torch::kFloat, cols / row.format->block_elements);
  expect(grid.dmin, "dmin", has_min_codes, torch::kFloat, cols / row.format->block_elements);
}

void write_half(uint8_t* block, int64_t byte, uint16_t bits) { std::memcpy(block + byte, &bits, sizeof bits); }

uint16_t read_half(const uint8_t* block, int64_t byte) {
  uint16_t bits;
  std::memcpy(&bits, block + byte, sizeof bits);
  return bits;
}

}  // namespace

GgufGridTensor quantize_gguf_grid(const torch::Tensor& weight, GgufBlockType type, const GgufGridOptions& options) {
  torch::NoGradGuard no_grad;
  const GridRow row = grid_row(type);
  const auto x = sub_block_view(weight.detach(), row, "quantize_gguf_grid");
  auto grid = store_scales(fit_sub_blocks(x, row, options), row, type);
  grid.codes = stored_codes(x, grid, row);
  return grid;
}

GgufGridTensor requantize_gguf_grid(const torch::Tensor& weight, const GgufGridTensor& grid) {
  torch::NoGradGuard no_grad;
  const GridRow row = grid_row(grid.type);
  const auto x = sub_block_view(weight.detach(), row, "requantize_gguf_grid");
  if (x.size(0) != grid.d.size(0) || x.size(1) != grid.d.size(1)) {
    throw Error(ErrorCode::kInternal, std::string("requantize_gguf_grid: weight ") + c10::str(weight.sizes()) + " is not the " +
                                          row.format->name + " grid's shape " + c10::str(grid.codes.sizes()));
  }
  GgufGridTensor requantized = grid;
  requantized.codes = stored_codes(x, grid, row);
  return requantized;
}

torch::Tensor dequantize_gguf_grid(const GgufGridTensor& grid) {
  torch::NoGradGuard no_grad;
  const GridRow row = grid_row(grid.type);
  const auto stored = stored_scales(grid, row);
  const int64_t rows = grid.codes.size(0);
  auto q = grid.codes.reshape({rows, stored.scale.size(1), stored.scale.size(2), row.sub_block}).to(torch::kFloat);
  if (row.code_offset != 0) q.sub_(static_cast<double>(row.code_offset));
  // (d * sc) * q, then + m or - dmin * mc: one rounding each, in gguf-py's and ggml's order (the
  // subtraction as such: it keeps a NaN's sign where llama.cpp's own blocks have an infinite d).
  auto values = stored.scale * q;
  if (stored.added.defined()) values.add_(stored.added);
  if (stored.subtracted.defined()) values.sub_(stored.subtracted);
  return values.reshape({rows, -1});
}

std::vector<uint8_t> encode_gguf_grid(const GgufGridTensor& grid) {
  const GridRow row = grid_row(grid.type);
  check_layout(grid, row);
  const int64_t block_elements = row.format->block_elements;
  const int64_t sub_blocks = block_elements / row.sub_block;
  const int64_t blocks = grid.codes.numel() / block_elements;
  check_width(grid.codes, stored_bits(row.locate(Part::kCode, 0)), row, "codes");
  const auto codes = host_bytes(grid.codes);
  const auto d = half_bits(grid.d, row, "d");
  std::vector<uint8_t> scales, mins;
  std::vector<uint16_t> m;
  if (row.two_level) {
    check_width(grid.scales, stored_bits(row.locate(Part::kScale, 0)), row, "sub-block scales");
    scales = host_bytes(grid.scales);
  }
  if (row.two_level && row.has_offset) {
    check_width(grid.mins, stored_bits(row.locate(Part::kMin, 0)), row, "sub-block mins");
    mins = host_bytes(grid.mins);
  }
  if (row.m_byte >= 0) m = half_bits(row.two_level ? grid.dmin : grid.m, row, row.two_level ? "dmin" : "m");

  std::vector<uint8_t> bytes(blocks * row.format->block_bytes, 0);
  for (int64_t block = 0; block < blocks; ++block) {
    uint8_t* out = bytes.data() + block * row.format->block_bytes;
    write_half(out, row.d_byte, d[block]);
    if (row.m_byte >= 0) write_half(out, row.m_byte, m[block]);
    for (int64_t e = 0; e < block_elements; ++e) store_number(out, row.locate(Part::kCode, e), codes[block * block_elements + e]);
    for (int64_t j = 0; j < sub_blocks && row.two_level; ++j) {
      store_number(out, row.locate(Part::kScale, j), scales[block * sub_blocks + j]);
      if (!mins.empty()) store_number(out, row.locate(Part::kMin, j), mins[block * sub_blocks + j]);
    }
  }
  return bytes;
}

GgufGridTensor decode_gguf_grid(const std::vector<uint8_t>& bytes, GgufBlockType type, int64_t rows, int64_t cols) {
  const GridRow row = grid_row(type);
  const int64_t block_elements = row.format->block_elements;
  const int64_t sub_blocks = block_elements / row.sub_block;
  if (rows < 0 || cols < 0 || cols % block_elements != 0 ||
      static_cast<int64_t>(bytes.size()) != rows * (cols / block_elements) * row.format->block_bytes) {
    throw Error(ErrorCode::kWeights, std::string(row.format->name) + " data of " + std::to_string(bytes.size()) + " bytes is not a [" +
                                         std::to_string(rows) + ", " + std::to_string(cols) + "] tensor (blocks of " +
                                         std::to_string(block_elements) + " values in " + std::to_string(row.format->block_bytes) + " bytes)");
  }
  const int64_t blocks = rows * (cols / block_elements);
  auto codes = torch::empty({rows, cols}, torch::kUInt8);
  auto scales = torch::empty({rows, cols / row.sub_block}, torch::kUInt8);
  auto mins = torch::empty({rows, cols / row.sub_block}, torch::kUInt8);
  auto d = torch::empty({rows, cols / block_elements}, torch::kFloat);
  auto m = torch::empty({rows, cols / block_elements}, torch::kFloat);
  for (int64_t block = 0; block < blocks; ++block) {
    const uint8_t* in = bytes.data() + block * row.format->block_bytes;
    d.data_ptr<float>()[block] = gguf_quants::float_from_fp16_bits(read_half(in, row.d_byte));
    if (row.m_byte >= 0) m.data_ptr<float>()[block] = gguf_quants::float_from_fp16_bits(read_half(in, row.m_byte));
    for (int64_t e = 0; e < block_elements; ++e) {
      codes.data_ptr<uint8_t>()[block * block_elements + e] = static_cast<uint8_t>(load_number(in, row.locate(Part::kCode, e)));
    }
    for (int64_t j = 0; j < sub_blocks && row.two_level; ++j) {
      scales.data_ptr<uint8_t>()[block * sub_blocks + j] = static_cast<uint8_t>(load_number(in, row.locate(Part::kScale, j)));
      if (row.has_offset) mins.data_ptr<uint8_t>()[block * sub_blocks + j] = static_cast<uint8_t>(load_number(in, row.locate(Part::kMin, j)));
    }
  }
  GgufGridTensor grid;
  grid.type = type;
  grid.codes = codes.view(row.code_type);
  grid.d = d;
  if (row.two_level) grid.scales = scales.view(row.scale_type);
  if (row.two_level && row.has_offset) {
    grid.mins = mins;
    grid.dmin = m;
  } else if (row.has_offset) {
    grid.m = m;
  }
  return grid;
}

}  // namespace qtrain::qat
