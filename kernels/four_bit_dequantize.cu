// bitsandbytes' 4-bit dequantize kernel (kDequantizeBlockwise for NF4/FP4), with a double-quantized
// absmax rebuilt on the fly instead of in a separate 8-bit dequantize, so that a FourBitLinear's
// weight is one kernel away from its packed bytes. The CPU reference it must equal is
// qat/four_bit_codec.cpp; see kernels/blockwise_quantize.h.
//
// Each thread turns 4 packed bytes into 8 values: blocksizes are powers of two of at least 8, so
// the 8 share one absmax, and a full group is one 32-bit load and one 16- or 32-byte store. The
// FP8 variant codes the same 8 bf16 values at their row's scale into one 8-byte store. Its work is
// the division by the row's scale, and a thread's values (one absmax, one row) take only 16
// distinct codes: it codes those 16 once (two neighbouring threads of one block and row share the
// work) and picks each value's code by its nibble with byte permutes.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <string>

#include "kernels/blockwise_quantize.h"
#include "kernels/bnb_fast_math.cuh"
#include "kernels/cuda_entry.cuh"
#include "kernels/float8_code.cuh"

namespace qtrain::kernels {

namespace {

namespace fast = bnb_fast_math;

constexpr int kValuesPerThread = 8;    // the narrow kernel: one 4-byte load per thread
constexpr int kWideValuesPerThread = 32;  // the wide one: one 16-byte load, for enough bytes in flight
constexpr int kThreadsPerCudaBlock = 256;

struct DecodeTable {
  float values[16];
};

// A thread's outputs, stored at once (the output is freshly allocated, so aligned). Stores wider
// than 16 bytes become several 16-byte ones.
template <typename out_t, int kValues>
struct alignas(sizeof(out_t) * kValues < 16 ? sizeof(out_t) * kValues : 16) ThreadValues {
  out_t values[kValues];
};

// The packed bytes of a thread's values, loaded at once.
template <int kValues>
struct alignas(kValues / 2) PackedBytes {
  uint8_t bytes[kValues / 2];
};

// Where a block's absmax comes from: stored in fp32, or double-quantized.
struct BlockScales {
  const float* absmax;          // fp32 [blocks], or null when double quantized
  const uint8_t* absmax_codes;  // double quantized: uint8 [blocks]
  const float* nested_absmax;
  const float* nested_code;
  float offset;
  int64_t nested_blocksize;
};

template <bool kDoubleQuantized>
__device__ __forceinline__ float absmax_of(const BlockScales& scales, int64_t block) {
  if (kDoubleQuantized) {
    // bnb's 8-bit dequantize (a mul.ftz) then torch's `absmax += offset`: two roundings, never an fma.
    const float centred = fast::multiply(__ldg(scales.nested_code + __ldg(scales.absmax_codes + block)),
                                         __ldg(scales.nested_absmax + block / scales.nested_blocksize));
    return __fadd_rn(centred, scales.offset);
  }
  return __ldg(scales.absmax + block);
}

// What the kernel writes for bnb's value table[code] * absmax (a mul.ftz): the value rounded to
// scalar_t (dequantize_4bit_cuda)...
template <typename scalar_t>
struct WriteValues {
  using out_t = scalar_t;
  scalar_t* out;
  static constexpr int64_t row_length = 0;  // no rows
  __device__ float row_scale(int64_t) const { return 0.0f; }
  __device__ scalar_t operator()(float value, float) const { return static_cast<scalar_t>(value); }
};

// ...or its bf16 rounding coded as e4m3 at its row's scale (dequantize_4bit_to_float8_cuda). Rows
// are whole groups of a thread's values, so one scale serves them all.
struct WriteFloat8Codes {
  using out_t = c10::Float8_e4m3fn;
  c10::Float8_e4m3fn* out;
  const float* row_scales;
  int64_t row_length;
  __device__ float row_scale(int64_t first) const { return __ldg(row_scales + first / row_length); }
  __device__ c10::Float8_e4m3fn operator()(float value, float row_scale) const {
    return float8_code_of(static_cast<float>(c10::BFloat16(value)), row_scale);
  }
};

// A thread's 16 one-byte codes, the code for 4-bit value c in byte c % 4 of words[c / 4].
struct CodeTable {
  uint32_t words[4];
};

// The codes of four 4-bit values, value i in nibble i of `nibbles`, as the bytes of one word: two
// permutes pick from codes 0-7 and 8-15 by each value's low 3 bits, a third by its high bit.
__device__ __forceinline__ uint32_t four_codes(uint32_t nibbles, const CodeTable& codes) {
  const uint32_t low_bits = nibbles & 0x7777u;
  const uint32_t from_low = __byte_perm(codes.words[0], codes.words[1], low_bits);
  const uint32_t from_high = __byte_perm(codes.words[2], codes.words[3], low_bits);
  return __byte_perm(from_low, from_high, 0x3210u | ((nibbles >> 1) & 0x4444u));
}

// The codes of the 8 values of 4 packed bytes (high nibble first, as bnb packs), in order.
__device__ __forceinline__ uint2 eight_codes(uint32_t packed_bytes, const CodeTable& codes) {
  const uint32_t in_order = ((packed_bytes >> 4) & 0x0F0F0F0Fu) | ((packed_bytes << 4) & 0xF0F0F0F0u);
  return {four_codes(in_order & 0xFFFFu, codes), four_codes(in_order >> 16, codes)};
}

// The thread's 16 codes. With `shared_with_neighbour` (the threads 2j and 2j + 1 hold values of one
// absmax block and one row) each codes 8 and they swap halves; every lane of the warp must call it.
template <typename Writer>
__device__ __forceinline__ CodeTable code_table(const float* table, float scale, float row_scale, const Writer& write,
                                                bool shared_with_neighbour) {
  const auto codes_from = [&](int code) {
    uint32_t word = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) word |= static_cast<uint32_t>(write(fast::multiply(table[code + b], scale), row_scale).x) << (8 * b);
    return word;
  };
  CodeTable codes;
  if (shared_with_neighbour) {
    const bool upper = threadIdx.x & 1;
    const uint32_t mine0 = codes_from(upper ? 8 : 0), mine1 = codes_from(upper ? 12 : 4);
    const uint32_t theirs0 = __shfl_xor_sync(0xffffffffu, mine0, 1), theirs1 = __shfl_xor_sync(0xffffffffu, mine1, 1);
    codes.words[0] = upper ? theirs0 : mine0;
    codes.words[1] = upper ? theirs1 : mine1;
    codes.words[2] = upper ? mine0 : theirs0;
    codes.words[3] = upper ? mine1 : theirs1;
  } else {
#pragma unroll
    for (int w = 0; w < 4; ++w) codes.words[w] = codes_from(4 * w);
  }
  return codes;
}

// One thread's kValues values from `first` (< n), each coded as it is written.
template <typename Writer, bool kDoubleQuantized, int kValues>
__device__ __forceinline__ void write_values(const uint8_t* packed, bool packed_aligned, int64_t n, int64_t first,
                                             int blocksize_log2, const float* table, const BlockScales& scales,
                                             const Writer& write) {
  using out_t = typename Writer::out_t;
  const float scale = absmax_of<kDoubleQuantized>(scales, first >> blocksize_log2);
  const float row_scale = write.row_scale(first);
  const auto value = [&](uint32_t code) { return write(fast::multiply(table[code], scale), row_scale); };
  if (first + kValues <= n && packed_aligned) {
    const auto loaded = *reinterpret_cast<const PackedBytes<kValues>*>(packed + first / 2);
    ThreadValues<out_t, kValues> group;
#pragma unroll
    for (int k = 0; k < kValues / 2; ++k) {
      const uint32_t byte = loaded.bytes[k];  // high nibble first, as bnb packs
      group.values[2 * k] = value(byte >> 4);
      group.values[2 * k + 1] = value(byte & 0xF);
    }
    *reinterpret_cast<ThreadValues<out_t, kValues>*>(write.out + first) = group;
    return;
  }
  const int64_t last = min(n, first + kValues);
  for (int64_t i = first; i < last; ++i) {
    const uint32_t byte = __ldg(packed + i / 2);
    write.out[i] = value(i % 2 == 0 ? byte >> 4 : byte & 0xF);
  }
}

// The same values picked from the thread's 16 one-byte codes. Every thread of the grid calls it
// (the table's building may shuffle with the neighbour); past the end, a thread helps build its
// neighbour's table from the last value's scales and writes nothing.
template <typename Writer, bool kDoubleQuantized, int kValues>
__device__ __forceinline__ void write_table_codes(const uint8_t* packed, bool packed_aligned, int64_t n, int64_t first,
                                                  int blocksize_log2, const float* table, const BlockScales& scales,
                                                  const Writer& write, bool pairs_share) {
  const int64_t scaled = first < n ? first : n - 1;
  const CodeTable codes = code_table(table, absmax_of<kDoubleQuantized>(scales, scaled >> blocksize_log2),
                                     write.row_scale(scaled), write, pairs_share);
  if (first >= n) return;
  auto* out = reinterpret_cast<uint8_t*>(write.out);
  if (first + kValues <= n && packed_aligned) {
    const auto loaded = *reinterpret_cast<const PackedBytes<kValues>*>(packed + first / 2);
    ThreadValues<uint2, kValues / 8> group;
#pragma unroll
    for (int w = 0; w < kValues / 8; ++w) {
      group.values[w] = eight_codes(reinterpret_cast<const uint32_t*>(loaded.bytes)[w], codes);
    }
    *reinterpret_cast<ThreadValues<uint2, kValues / 8>*>(out + first) = group;
    return;
  }
  const int64_t last = min(n, first + kValues);
  for (int64_t i = first; i < last; ++i) {
    const uint32_t byte = __ldg(packed + i / 2);
    out[i] = static_cast<uint8_t>(four_codes(i % 2 == 0 ? byte >> 4 : byte & 0xF, codes));
  }
}

// The FP8 codes. kValues a power of two from 8, at most the blocksize (the values share one
// absmax); the vector path needs packed aligned to kValues / 2 bytes. `pairs_share`: blocks and
// rows hold whole pairs of threads' values.
template <typename Writer, bool kDoubleQuantized, int kValues>
__global__ void dequantize_4bit_kernel(const uint8_t* __restrict__ packed, bool packed_aligned, int64_t n,
                                       int blocksize_log2, DecodeTable decode, BlockScales scales, Writer write,
                                       bool pairs_share) {
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = decode.values[threadIdx.x];
  __syncthreads();
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kValues;
  write_table_codes<Writer, kDoubleQuantized, kValues>(packed, packed_aligned, n, first, blocksize_log2, table, scales,
                                                       write, pairs_share);
}

// The values (dequantize_4bit_cuda). Each thread writes kGroupsPerThread groups of 8 values, group
// g of thread t in CUDA block b from value ((b * kGroupsPerThread + g) * blockDim + t) * 8: each of
// a warp's loads and stores is one contiguous stretch (128 bytes in, 512 out in bf16), and a thread
// has kGroupsPerThread loads in flight before its first store. (One thread's 32 consecutive values
// made each warp store 32 pieces of 16 bytes 64 bytes apart: about a third of HBM's bandwidth.)
// The vector path needs packed aligned to 4 bytes.
constexpr int kGroupsPerThread = 4;

template <typename scalar_t, bool kDoubleQuantized>
__global__ void dequantize_4bit_values_kernel(const uint8_t* __restrict__ packed, bool packed_aligned, int64_t n,
                                              int blocksize_log2, DecodeTable decode, BlockScales scales,
                                              WriteValues<scalar_t> write) {
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = decode.values[threadIdx.x];
  __syncthreads();
  int64_t first[kGroupsPerThread];
#pragma unroll
  for (int g = 0; g < kGroupsPerThread; ++g) {
    first[g] = ((static_cast<int64_t>(blockIdx.x) * kGroupsPerThread + g) * blockDim.x + threadIdx.x) * kValuesPerThread;
  }
  if (!packed_aligned || first[kGroupsPerThread - 1] + kValuesPerThread > n) {
    // the grid's last CUDA block, or a view at an odd offset: group by group, a tail value by value
#pragma unroll
    for (int g = 0; g < kGroupsPerThread; ++g) {
      if (first[g] < n) {
        write_values<WriteValues<scalar_t>, kDoubleQuantized, kValuesPerThread>(packed, packed_aligned, n, first[g],
                                                                              blocksize_log2, table, scales, write);
      }
    }
    return;
  }
  uint32_t words[kGroupsPerThread];
  float scale[kGroupsPerThread];
#pragma unroll
  for (int g = 0; g < kGroupsPerThread; ++g) {
    words[g] = __ldg(reinterpret_cast<const unsigned int*>(packed + first[g] / 2));
    scale[g] = absmax_of<kDoubleQuantized>(scales, first[g] >> blocksize_log2);
  }
#pragma unroll
  for (int g = 0; g < kGroupsPerThread; ++g) {
    ThreadValues<scalar_t, kValuesPerThread> group;
#pragma unroll
    for (int k = 0; k < kValuesPerThread / 2; ++k) {
      const uint32_t byte = (words[g] >> (8 * k)) & 0xFFu;  // byte k in memory; high nibble first, as bnb packs
      group.values[2 * k] = write(fast::multiply(table[byte >> 4], scale[g]), 0.0f);
      group.values[2 * k + 1] = write(fast::multiply(table[byte & 0xFu], scale[g]), 0.0f);
    }
    *reinterpret_cast<ThreadValues<scalar_t, kValuesPerThread>*>(write.out + first[g]) = group;
  }
}

int log2_of(int64_t power_of_two) {
  int log2 = 0;
  while ((int64_t{1} << log2) < power_of_two) ++log2;
  return log2;
}

void check_scales(const FourBitScales& scales, const at::Tensor& packed, int64_t blocks) {
  const std::string what = "dequantize_4bit_cuda: ";
  check_cuda_tensor(scales.absmax, what + "absmax");
  check_same_device(scales.absmax, packed, what + "absmax");
  if (scales.absmax.numel() != blocks) {
    throw Error(ErrorCode::kWeights, what + "absmax has " + std::to_string(scales.absmax.numel()) + " values, the packed weight has " +
                std::to_string(blocks) + " blocks");
  }
  if (!scales.nested_absmax.defined()) {
    check_scalar_type(scales.absmax, at::kFloat, what + "absmax (without nested_absmax)");
    return;
  }
  check_scalar_type(scales.absmax, at::kByte, what + "absmax (double quantized)");
  check_cuda_tensor(scales.nested_absmax, what + "nested_absmax");
  check_cuda_tensor(scales.nested_code, what + "nested_code");
  check_same_device(scales.nested_absmax, packed, what + "nested_absmax");
  check_same_device(scales.nested_code, packed, what + "nested_code");
  check_scalar_type(scales.nested_absmax, at::kFloat, what + "nested_absmax");
  check_scalar_type(scales.nested_code, at::kFloat, what + "nested_code");
  if (scales.nested_blocksize < 1) throw Error(ErrorCode::kWeights, what + "nested_blocksize must be positive");
  const int64_t nested_blocks = ceil_div(blocks, scales.nested_blocksize);
  if (scales.nested_absmax.numel() != nested_blocks || scales.nested_code.numel() != 256) {
    throw Error(ErrorCode::kWeights, what + "nested_absmax has " + std::to_string(scales.nested_absmax.numel()) + " values (expected " +
                std::to_string(nested_blocks) + ") and nested_code " + std::to_string(scales.nested_code.numel()) +
                " (expected 256)");
  }
}

BlockScales block_scales(const FourBitScales& scales) {
  const bool double_quantized = scales.nested_absmax.defined();
  return {double_quantized ? nullptr : scales.absmax.data_ptr<float>(),
          double_quantized ? scales.absmax.data_ptr<uint8_t>() : nullptr,
          double_quantized ? scales.nested_absmax.data_ptr<float>() : nullptr,
          double_quantized ? scales.nested_code.data_ptr<float>() : nullptr, scales.offset, scales.nested_blocksize};
}

// The checks both entry points make; the table to decode with.
DecodeTable checked_table(const at::Tensor& packed, int64_t numel, int64_t blocksize, c10::ArrayRef<float> decode,
                          const FourBitScales& scales, const std::string& what) {
  check_cuda_tensor(packed, what + ": packed");
  check_scalar_type(packed, at::kByte, what + ": packed");
  if (numel < 0 || packed.numel() != ceil_div(numel, 2)) {
    throw Error(ErrorCode::kWeights, what + ": packed has " + std::to_string(packed.numel()) + " bytes, " +
                std::to_string(numel) + " values need " + std::to_string(ceil_div(numel, 2)));
  }
  if (!is_power_of_two(blocksize) || blocksize < kValuesPerThread) {
    throw Error(ErrorCode::kWeights, what + ": blocksize " + std::to_string(blocksize) + " must be a power of two, at least 8");
  }
  if (decode.size() != 16) {
    throw Error(ErrorCode::kInternal, what + ": the decode table must have 16 values, got " + std::to_string(decode.size()));
  }
  check_scales(scales, packed, ceil_div(numel, blocksize));
  DecodeTable table{};
  for (int code = 0; code < 16; ++code) table.values[code] = decode[code];
  return table;
}

template <typename scalar_t>
void launch_values(const at::Tensor& packed, int64_t numel, int64_t blocksize, const DecodeTable& table,
                   const FourBitScales& scales, scalar_t* out) {
  const auto* bytes = packed.data_ptr<uint8_t>();
  const auto grid =
      static_cast<unsigned>(ceil_div(numel, int64_t{kValuesPerThread} * kGroupsPerThread * kThreadsPerCudaBlock));
  const bool aligned = reinterpret_cast<uintptr_t>(bytes) % (kValuesPerThread / 2) == 0;
  auto kernel = scales.nested_absmax.defined() ? dequantize_4bit_values_kernel<scalar_t, true>
                                               : dequantize_4bit_values_kernel<scalar_t, false>;
  kernel<<<grid, kThreadsPerCudaBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(
      bytes, aligned, numel, log2_of(blocksize), table, block_scales(scales), WriteValues<scalar_t>{out});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The FP8 codes: the wide kernel where its 32 values share an absmax and one of the writer's rows
// and its 16-byte loads are aligned; the narrow one otherwise. Either finishes a tail value by value.
template <typename Writer>
void launch(const at::Tensor& packed, int64_t numel, int64_t blocksize, const DecodeTable& table,
            const FourBitScales& scales, const Writer& write) {
  const auto* bytes = packed.data_ptr<uint8_t>();
  const bool double_quantized = scales.nested_absmax.defined();
  const bool wide = blocksize >= kWideValuesPerThread && write.row_length % kWideValuesPerThread == 0 &&
                    reinterpret_cast<uintptr_t>(bytes) % (kWideValuesPerThread / 2) == 0;
  const int values = wide ? kWideValuesPerThread : kValuesPerThread;
  const auto grid = static_cast<unsigned>(ceil_div(ceil_div(numel, values), kThreadsPerCudaBlock));
  const bool aligned = reinterpret_cast<uintptr_t>(bytes) % (values / 2) == 0;
  auto kernel = wide ? (double_quantized ? dequantize_4bit_kernel<Writer, true, kWideValuesPerThread>
                                         : dequantize_4bit_kernel<Writer, false, kWideValuesPerThread>)
                     : (double_quantized ? dequantize_4bit_kernel<Writer, true, kValuesPerThread>
                                         : dequantize_4bit_kernel<Writer, false, kValuesPerThread>);
  const bool pairs_share = blocksize >= 2 * values && write.row_length % (2 * values) == 0;
  kernel<<<grid, kThreadsPerCudaBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(
      bytes, aligned, numel, log2_of(blocksize), table, block_scales(scales), write, pairs_share);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor dequantize_4bit_cuda(const at::Tensor& packed, int64_t numel, int64_t blocksize,
                                c10::ArrayRef<float> decode, const FourBitScales& scales, c10::ScalarType dtype) {
  const auto table = checked_table(packed, numel, blocksize, decode, scales, "dequantize_4bit_cuda");

  const c10::cuda::CUDAGuard device_guard(packed.device());
  at::Tensor out;
  dispatch_float_type(dtype, "dequantize_4bit_cuda: dtype", [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    out = at::empty({numel}, packed.options().dtype(dtype));
    if (numel == 0) return;
    launch_values(packed, numel, blocksize, table, scales, out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor dequantize_4bit_to_float8_cuda(const at::Tensor& packed, int64_t numel, int64_t blocksize,
                                          c10::ArrayRef<float> decode, const FourBitScales& scales,
                                          const at::Tensor& row_scales, int64_t row_length) {
  const std::string what = "dequantize_4bit_to_float8_cuda";
  const auto table = checked_table(packed, numel, blocksize, decode, scales, what);
  check_cuda_operands(packed, {{&row_scales, "row_scales"}}, what + ": ");
  check_scalar_type(row_scales, at::kFloat, what + ": row_scales");
  if (row_length <= 0 || row_length % kValuesPerThread != 0 || numel % row_length != 0 ||
      row_scales.numel() != numel / row_length) {
    throw Error(ErrorCode::kInternal, what + ": rows of " + std::to_string(row_length) + " values (a multiple of 8) must "
                "tile the " + std::to_string(numel) + " values, one scale each; got " +
                std::to_string(row_scales.numel()) + " scales");
  }
  const c10::cuda::CUDAGuard device_guard(packed.device());
  auto out = at::empty({numel}, packed.options().dtype(at::kFloat8_e4m3fn));
  if (numel == 0) return out;
  launch(packed, numel, blocksize, table, scales,
         WriteFloat8Codes{out.data_ptr<c10::Float8_e4m3fn>(), row_scales.data_ptr<float>(), row_length});
  return out;
}

}  // namespace qtrain::kernels
