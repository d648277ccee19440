// Gemma 2's soft-capped causal attention, flash-style (kernels/softcapped_flash_attention.h).
//
// Tiles of 64 (forward: 128) queries x 64 keys. Products are mma.sync m16n8k16 (bf16 / fp16 in,
// fp32 sums) on operands read from shared memory with ldmatrix; the rows of each shared tile are
// padded by 16 bytes so that ldmatrix's eight rows fall in distinct banks. Packed samples (the
// batch's rows end to end) limit each query to its run's keys and skip the blocks outside it.
//   forward: a CUDA block per (128 queries, head), 8 warps of 16 queries each; the probabilities
//     stay in registers and feed the product with v directly (an accumulator fragment of m16n8 is
//     the A fragment of the next product); the next key and value tiles load while a tile computes.
//   backward: a CUDA block per (64 keys, query head), 8 warps, that recomputes each 64 x 64 block of
//     probabilities from the saved base-2 log-sum-exp and shares it and dS through shared memory:
//     dK and dV sum in registers over the query blocks, dQ's share of each block is added to fp32
//     sums in global memory (float2 atomics, as flash attention 2 does), and so are dK and dV at
//     the end (the query heads of a group share a key / value head); the next query block's tiles
//     load while a block computes.
// Derivative of the cap: d(cap * tanh(s * scale / cap)) / ds = scale * (1 - tanh^2).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda_entry.cuh"
#include "kernels/softcapped_flash_attention.h"

namespace qtrain::kernels {

namespace softcapped_flash {

constexpr int kBlock = 64;                       // queries, and keys, per tile
constexpr int kPad = 8;                          // values after each shared row (16 bytes)
constexpr int kScoreStride = kBlock + kPad;      // a shared 64 x 64 tile of probabilities / dS
constexpr int kForwardRows = 128;                // queries per forward CUDA block
constexpr int kForwardThreads = 256;             // 8 warps x 16 queries
constexpr int kBackwardThreads = 256;            // 8 warps
constexpr float kLog2e = 1.4426950408889634f;

template <int D>
constexpr int kTileStride = D + kPad;
template <int D>
constexpr int kTileValues = kBlock * kTileStride<D>;

struct Strides {
  int64_t b = 0, h = 0, t = 0;  // in values; head_dim is contiguous
};

template <typename T>
struct Params {
  const T* q;
  const T* k;
  const T* v;
  const T* out;       // the forward's output (backward only)
  const T* grad_out;  // backward only
  T* result;          // forward: out
  float* lse;         // [batch, heads, T], base 2
  const float* delta; // [batch, heads, T]: rowsum(grad_out * out), backward only
  float* dq;          // backward: the gradients' fp32 sums, zeroed before
  float* dk;
  float* dv;
  const int* run_start;  // packed samples: each token's run [start, end); null: one sequence
  const int* run_end;
  Strides qs, ks, vs, os, gs, rs, dqs, dks, dvs;
  int heads, kv_heads, tokens, window;
  float scale, scale_over_cap, cap;
};

// --- The tensor-core and copy instructions -------------------------------------------------------

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16 bytes global -> shared without the registers; zeros where !valid.
__device__ __forceinline__ void copy_async16(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared)), "l"(global),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void load_matrices(uint32_t (&r)[4], const void* shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(shared)));
}
__device__ __forceinline__ void load_matrices_transposed(uint32_t (&r)[4], const void* shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(shared)));
}

// c += a (16 x 16, row-major) * b (16 x 8, column-major), for T = __nv_bfloat16 or __half.
#define QTRAIN_MMA_16816(TYPE)                                                                          \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                                  \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                 \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

template <typename T>
struct Mma {
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  static_assert(kBf16 || std::is_same_v<T, __half>, "bf16 or fp16 operands");

  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (kBf16) {
      QTRAIN_MMA_16816("bf16");
    } else {
      QTRAIN_MMA_16816("f16");
    }
  }
  // Two values as one 32-bit register of the A / B fragments, `low` at the lower column.
  static __device__ __forceinline__ uint32_t pack(float low, float high) {
    if constexpr (kBf16) {
      __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
      return *reinterpret_cast<uint32_t*>(&pair);
    } else {
      __half2 pair = __floats2half2_rn(low, high);
      return *reinterpret_cast<uint32_t*>(&pair);
    }
  }
};

#undef QTRAIN_MMA_16816

__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ldmatrix addresses, for lane `lane` of a warp (each lane names one row of one of four 8 x 8
// matrices). A fragment of rows [row, row + 16) x columns [col, col + 16) of a row-major tile:
__device__ __forceinline__ int a_row(int lane) { return (lane % 8) + ((lane / 8) % 2) * 8; }
__device__ __forceinline__ int a_col(int lane) { return (lane / 16) * 8; }
// Two B fragments (n 0-7 and 8-15) from a tile stored [n][k] (k^T's rows: keys of K, the B of
// q k^T), non-transposed:
__device__ __forceinline__ int bt_row(int lane) { return (lane % 8) + (lane / 16) * 8; }
__device__ __forceinline__ int bt_col(int lane) { return ((lane / 8) % 2) * 8; }
// Two B fragments (n 0-7 and 8-15) from a tile stored [k][n] (v's rows, the B of p v), transposed:
// the same addresses as an A fragment's. And an A fragment of a tile stored [k][m] (p^T for dV),
// transposed: the addresses of bt_row / bt_col.

// --- Tiles -----------------------------------------------------------------------------------------

// Rows [0, valid_rows) of a kRows x D tile from global rows `row_stride` apart; zeros below.
template <int D, int kThreadsPerBlock, int kRows = kBlock, typename T>
__device__ __forceinline__ void load_tile(T* tile, const T* rows, int64_t row_stride, int valid_rows) {
  constexpr int kChunksPerRow = D / 8;
  for (int chunk = threadIdx.x; chunk < kRows * kChunksPerRow; chunk += kThreadsPerBlock) {
    const int row = chunk / kChunksPerRow;
    const int col = (chunk % kChunksPerRow) * 8;
    const bool valid = row < valid_rows;
    copy_async16(tile + row * kTileStride<D> + col, valid ? rows + row * row_stride + col : rows, valid);
  }
}

// The first key block that the queries from q0 on see through the window, and the last query
// block that sees keys [k0, k0 + 64) (the runs of packed samples narrow both further).
__device__ __forceinline__ int first_key_block(int q0, int window) {
  return window > 0 ? max(0, q0 - window + 1) / kBlock : 0;
}
__device__ __forceinline__ int last_query_block(int k0, int window, int tokens) {
  const int last_block = (tokens - 1) / kBlock;
  return window > 0 ? min(last_block, (k0 + kBlock - 1 + window - 1) / kBlock) : last_block;
}

// The first key that `query` may see through its run (packed samples), 0 past the last token.
template <typename T>
__device__ __forceinline__ int run_start(const Params<T>& p, int query) {
  return p.run_start != nullptr && query < p.tokens ? p.run_start[query] : 0;
}

__device__ __forceinline__ bool visible(int query, int key, int tokens, int window, int start) {
  return query < tokens && key <= query && key >= start && (window <= 0 || key > query - window);
}

// --- Forward ---------------------------------------------------------------------------------------

// The grids put the heads first (blockIdx.x) and launch the CUDA blocks with the most key blocks
// first, so the short ones fill in behind them.
template <typename T, int D>
__global__ void __launch_bounds__(kForwardThreads, 1) forward_kernel(Params<T> p) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* q_tile = reinterpret_cast<T*>(shared_bytes);
  T* k_tile = q_tile + kForwardRows * kTileStride<D>;
  T* v_tile = k_tile + kTileValues<D>;
  constexpr int S = kTileStride<D>;

  const int query_block = gridDim.y - 1 - blockIdx.y;
  const int head = blockIdx.x, batch = blockIdx.z;
  const int kv_head = head / (p.heads / p.kv_heads);
  const int q0 = query_block * kForwardRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
  const T* q = p.q + batch * p.qs.b + head * p.qs.h + q0 * p.qs.t;
  const T* k = p.k + batch * p.ks.b + kv_head * p.ks.h;
  const T* v = p.v + batch * p.vs.b + kv_head * p.vs.h;
  const int first = max(first_key_block(q0, p.window), run_start(p, q0) / kBlock);
  const int last = min(q0 + kForwardRows - 1, p.tokens - 1) / kBlock;

  load_tile<D, kForwardThreads, kForwardRows>(q_tile, q, p.qs.t, min(kForwardRows, p.tokens - q0));
  load_tile<D, kForwardThreads>(k_tile, k + first * kBlock * p.ks.t, p.ks.t, min(kBlock, p.tokens - first * kBlock));
  commit_copies();
  load_tile<D, kForwardThreads>(v_tile, v + first * kBlock * p.vs.t, p.vs.t, min(kBlock, p.tokens - first * kBlock));
  commit_copies();

  float o[D / 8][4];
#pragma unroll
  for (int t = 0; t < D / 8; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};  // base 2
  float row_sum[2] = {0.0f, 0.0f};            // this lane's share
  const int row0 = q0 + warp * 16 + group;    // this lane's rows: row0 and row0 + 8
  const int starts[2] = {run_start(p, row0), run_start(p, row0 + 8)};

  for (int kb = first; kb <= last; ++kb) {
    wait_copies<1>();  // q and this block's k
    __syncthreads();
    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      load_matrices(a, q_tile + (warp * 16 + a_row(lane)) * S + kk * 16 + a_col(lane));
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b[4];
        load_matrices(b, k_tile + (np * 16 + bt_row(lane)) * S + kk * 16 + bt_col(lane));
        Mma<T>::run(s[2 * np], a, b[0], b[1]);
        Mma<T>::run(s[2 * np + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with k
    const bool more = kb < last;
    if (more) {
      const int next = (kb + 1) * kBlock;
      load_tile<D, kForwardThreads>(k_tile, k + next * p.ks.t, p.ks.t, min(kBlock, p.tokens - next));
      commit_copies();
    }

    // Cap, mask, and the online softmax in base 2.
    float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int query = row0 + (e / 2) * 8;
        const int key = kb * kBlock + j * 8 + quad * 2 + (e % 2);
        const float capped = p.cap * fast_tanh(s[j][e] * p.scale_over_cap) * kLog2e;
        s[j][e] = visible(query, key, p.tokens, p.window, starts[e / 2]) ? capped : -INFINITY;
        block_max[e / 2] = fmaxf(block_max[e / 2], s[j][e]);
      }
    }
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      block_max[r] = fmaxf(block_max[r], __shfl_xor_sync(0xffffffffu, block_max[r], 1));
      block_max[r] = fmaxf(block_max[r], __shfl_xor_sync(0xffffffffu, block_max[r], 2));
      const float new_max = fmaxf(row_max[r], block_max[r]);
      base[r] = new_max == -INFINITY ? 0.0f : new_max;  // a row with nothing visible yet stays at 0
      const float correction = exp2f(row_max[r] - base[r]);
      row_max[r] = new_max;
      row_sum[r] *= correction;
#pragma unroll
      for (int t = 0; t < D / 8; ++t) {
        o[t][2 * r] *= correction;
        o[t][2 * r + 1] *= correction;
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = exp2f(s[j][e] - base[e / 2]);
        row_sum[e / 2] += s[j][e];
      }
    }

    if (more) {
      wait_copies<1>();  // this block's v (the next k may still be on its way)
    } else {
      wait_copies<0>();
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // 16 keys at a time
      const uint32_t a[4] = {Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]), Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]),
                             Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        load_matrices_transposed(b, v_tile + (kk * 16 + a_row(lane)) * S + dp * 16 + a_col(lane));
        Mma<T>::run(o[2 * dp], a, b[0], b[1]);
        Mma<T>::run(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with v
    if (more) {
      const int next = (kb + 1) * kBlock;
      load_tile<D, kForwardThreads>(v_tile, v + next * p.vs.t, p.vs.t, min(kBlock, p.tokens - next));
      commit_copies();
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    const int query = row0 + r * 8;
    if (query >= p.tokens) continue;
    const float inverse = 1.0f / row_sum[r];
    T* out = p.result + batch * p.rs.b + head * p.rs.h + query * p.rs.t;
#pragma unroll
    for (int t = 0; t < D / 8; ++t) {
      *reinterpret_cast<uint32_t*>(out + t * 8 + quad * 2) =
          Mma<T>::pack(o[t][2 * r] * inverse, o[t][2 * r + 1] * inverse);
    }
    if (quad == 0) p.lse[(static_cast<int64_t>(batch) * p.heads + head) * p.tokens + query] = row_max[r] + log2f(row_sum[r]);
  }
}

// --- Backward --------------------------------------------------------------------------------------

// Shared memory of the backward: k and v of the key block, q and grad_out of the query block twice
// (the next block loads while this one computes), the 64 x 64 probabilities and dS.
template <typename T, int D>
struct BackwardShared {
  T* k;
  T* v;
  T* q[2];
  T* grad_out[2];
  T* probabilities;
  T* grad_scores;

  static constexpr size_t bytes() { return (6 * kTileValues<D> + 2 * kBlock * kScoreStride) * sizeof(T); }
  __device__ explicit BackwardShared(unsigned char* base) {
    k = reinterpret_cast<T*>(base);
    v = k + kTileValues<D>;
    q[0] = v + kTileValues<D>;
    q[1] = q[0] + kTileValues<D>;
    grad_out[0] = q[1] + kTileValues<D>;
    grad_out[1] = grad_out[0] + kTileValues<D>;
    probabilities = grad_out[1] + kTileValues<D>;
    grad_scores = probabilities + kBlock * kScoreStride;
  }
};

// For the 64 x 64 block (queries q0.., keys k0..) with q, grad_out, k and v in shared memory: the
// probabilities and dS = P * (dP - delta) * scale * (1 - tanh^2), the gradient to the raw scores
// q k^T, into shared memory as [query][key]. Warp w computes the 16 queries (w % 4) x 32 keys (w / 4).
template <typename T, int D>
__device__ __forceinline__ void block_gradients(const T* q_tile, const T* grad_out_tile, const BackwardShared<T, D>& shared,
                                                const float* lse, const float* delta, const Params<T>& p, int q0,
                                                int k0) {
  constexpr int S = kTileStride<D>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
  const int query_group = warp % 4, key_half = warp / 4;
  float s[4][4], dp[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.0f;
  }
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4], g[4];
    load_matrices(a, q_tile + (query_group * 16 + a_row(lane)) * S + kk * 16 + a_col(lane));
    load_matrices(g, grad_out_tile + (query_group * 16 + a_row(lane)) * S + kk * 16 + a_col(lane));
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      uint32_t b[4];
      load_matrices(b, shared.k + (key_half * 32 + np * 16 + bt_row(lane)) * S + kk * 16 + bt_col(lane));
      Mma<T>::run(s[2 * np], a, b[0], b[1]);
      Mma<T>::run(s[2 * np + 1], a, b[2], b[3]);
      load_matrices(b, shared.v + (key_half * 32 + np * 16 + bt_row(lane)) * S + kk * 16 + bt_col(lane));
      Mma<T>::run(dp[2 * np], g, b[0], b[1]);
      Mma<T>::run(dp[2 * np + 1], g, b[2], b[3]);
    }
  }
  // This lane's two rows' log-sum-exp and delta (none past the last token).
  float row_lse[2], row_delta[2];
  int starts[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int query = q0 + query_group * 16 + group + r * 8;
    row_lse[r] = query < p.tokens ? lse[query] : 0.0f;
    row_delta[r] = query < p.tokens ? delta[query] : 0.0f;
    starts[r] = run_start(p, query);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = query_group * 16 + group + (e / 2) * 8;
      const int col = key_half * 32 + j * 8 + quad * 2 + (e % 2);
      const float t = fast_tanh(s[j][e] * p.scale_over_cap);
      const float probability =
          visible(q0 + row, k0 + col, p.tokens, p.window, starts[e / 2]) ? exp2f(p.cap * t * kLog2e - row_lse[e / 2])
                                                                         : 0.0f;
      s[j][e] = probability;
      dp[j][e] = probability * (dp[j][e] - row_delta[e / 2]) * p.scale * (1.0f - t * t);
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int col = key_half * 32 + j * 8 + quad * 2;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = query_group * 16 + group + r * 8;
      *reinterpret_cast<uint32_t*>(shared.probabilities + row * kScoreStride + col) =
          Mma<T>::pack(s[j][2 * r], s[j][2 * r + 1]);
      *reinterpret_cast<uint32_t*>(shared.grad_scores + row * kScoreStride + col) =
          Mma<T>::pack(dp[j][2 * r], dp[j][2 * r + 1]);
    }
  }
}

// Adds a warp's kTiles x 8 columns of fp32 sums over 16 rows (from row0; columns from col0) into
// global fp32 sums, rows past the last token left out.
template <int kTiles>
__device__ __forceinline__ void add_rows(float* base, int64_t row_stride, int row0, int col0, int tokens,
                                         const float (&sums)[kTiles][4]) {
  const int lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + group + r * 8;
    if (row >= tokens) continue;
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      atomicAdd(reinterpret_cast<float2*>(base + row * row_stride + col0 + t * 8 + quad * 2),
                make_float2(sums[t][2 * r], sums[t][2 * r + 1]));
    }
  }
}

// One CUDA block per (64 keys, query head): over the query blocks that see the keys, dK and dV in
// registers (warp w: keys 32 (w % 2) x columns D / 4 (w / 2)), added to the key / value head's fp32
// sums at the end (the group's query heads add into the same); each query block's dQ share (warp w:
// queries 32 (w % 2) x columns D / 4 (w / 2), 32 columns at a time) added to dQ's fp32 sums. Warps of
// 32 rows read each B fragment from shared memory once for two products: shared memory's bandwidth,
// not the tensor cores, bounds these kernels.
template <typename T, int D>
__global__ void __launch_bounds__(kBackwardThreads, 1) backward_kernel(Params<T> p) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const BackwardShared<T, D> shared(shared_bytes);
  constexpr int S = kTileStride<D>;
  const int key_block = blockIdx.y, head = blockIdx.x, batch = blockIdx.z;  // key block 0 sees the most
  const int kv_head = head / (p.heads / p.kv_heads);
  const int k0 = key_block * kBlock;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_pair = warp % 2, column_quarter = warp / 2;
  constexpr int kColumns = D / 4, kTiles = kColumns / 8;
  const int valid_keys = min(kBlock, p.tokens - k0);
  const T* q = p.q + batch * p.qs.b + head * p.qs.h;
  const T* grad_out = p.grad_out + batch * p.gs.b + head * p.gs.h;
  const int64_t row_stats = (static_cast<int64_t>(batch) * p.heads + head) * p.tokens;
  float* dq = p.dq + batch * p.dqs.b + head * p.dqs.h;

  const auto load_queries = [&](int query_block, int buffer) {
    const int q0 = query_block * kBlock;
    const int valid_queries = min(kBlock, p.tokens - q0);
    load_tile<D, kBackwardThreads>(shared.q[buffer], q + q0 * p.qs.t, p.qs.t, valid_queries);
    load_tile<D, kBackwardThreads>(shared.grad_out[buffer], grad_out + q0 * p.gs.t, p.gs.t, valid_queries);
  };
  load_tile<D, kBackwardThreads>(shared.k, p.k + batch * p.ks.b + kv_head * p.ks.h + k0 * p.ks.t, p.ks.t, valid_keys);
  load_tile<D, kBackwardThreads>(shared.v, p.v + batch * p.vs.b + kv_head * p.vs.h + k0 * p.vs.t, p.vs.t, valid_keys);
  // The queries that see these keys end with the run of the block's last key (packed samples).
  const int first = key_block;
  const int last = p.run_end != nullptr
                       ? min(last_query_block(k0, p.window, p.tokens), (p.run_end[k0 + valid_keys - 1] - 1) / kBlock)
                       : last_query_block(k0, p.window, p.tokens);
  load_queries(first, 0);
  commit_copies();

  float dk[2][kTiles][4], dv[2][kTiles][4];
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[m][t][e] = dv[m][t][e] = 0.0f;
    }
  }
  for (int qb = first; qb <= last; ++qb) {
    const int buffer = (qb - first) % 2;
    const int q0 = qb * kBlock;
    wait_copies<0>();
    __syncthreads();  // this block's tiles are in; every warp is done with the other buffer
    if (qb < last) {
      load_queries(qb + 1, 1 - buffer);
      commit_copies();
    }
    block_gradients<T, D>(shared.q[buffer], shared.grad_out[buffer], shared, p.lse + row_stats, p.delta + row_stats, p,
                          q0, k0);
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {  // 16 queries at a time
      // P^T and dS^T as A fragments: the [query][key] tiles read transposed.
      uint32_t a_p[2][4], a_ds[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int offset = (ks * 16 + bt_row(lane)) * kScoreStride + row_pair * 32 + m * 16 + bt_col(lane);
        load_matrices_transposed(a_p[m], shared.probabilities + offset);
        load_matrices_transposed(a_ds[m], shared.grad_scores + offset);
      }
#pragma unroll
      for (int dp = 0; dp < kTiles / 2; ++dp) {
        const int col = column_quarter * kColumns + dp * 16;
        uint32_t b[4];
        load_matrices_transposed(b, shared.grad_out[buffer] + (ks * 16 + a_row(lane)) * S + col + a_col(lane));
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          Mma<T>::run(dv[m][2 * dp], a_p[m], b[0], b[1]);
          Mma<T>::run(dv[m][2 * dp + 1], a_p[m], b[2], b[3]);
        }
        load_matrices_transposed(b, shared.q[buffer] + (ks * 16 + a_row(lane)) * S + col + a_col(lane));
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          Mma<T>::run(dk[m][2 * dp], a_ds[m], b[0], b[1]);
          Mma<T>::run(dk[m][2 * dp + 1], a_ds[m], b[2], b[3]);
        }
      }
    }
    // dQ's share: dS (64 queries x 64 keys) k, 32 columns at a time.
#pragma unroll 1
    for (int chunk = 0; chunk < kColumns / 32; ++chunk) {
      float sums[2][4][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int t = 0; t < 4; ++t) sums[m][t][0] = sums[m][t][1] = sums[m][t][2] = sums[m][t][3] = 0.0f;
      }
      const int col = column_quarter * kColumns + chunk * 32;
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {  // 16 keys at a time
        uint32_t a[2][4];
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          load_matrices(a[m], shared.grad_scores + (row_pair * 32 + m * 16 + a_row(lane)) * kScoreStride + ks * 16 +
                                  a_col(lane));
        }
#pragma unroll
        for (int dp = 0; dp < 2; ++dp) {
          uint32_t b[4];
          load_matrices_transposed(b, shared.k + (ks * 16 + a_row(lane)) * S + col + dp * 16 + a_col(lane));
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            Mma<T>::run(sums[m][2 * dp], a[m], b[0], b[1]);
            Mma<T>::run(sums[m][2 * dp + 1], a[m], b[2], b[3]);
          }
        }
      }
#pragma unroll
      for (int m = 0; m < 2; ++m) add_rows<4>(dq, p.dqs.t, q0 + row_pair * 32 + m * 16, col, p.tokens, sums[m]);
    }
  }
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    const int row0 = k0 + row_pair * 32 + m * 16, col0 = column_quarter * kColumns;
    add_rows<kTiles>(p.dk + batch * p.dks.b + kv_head * p.dks.h, p.dks.t, row0, col0, p.tokens, dk[m]);
    add_rows<kTiles>(p.dv + batch * p.dvs.b + kv_head * p.dvs.h, p.dvs.t, row0, col0, p.tokens, dv[m]);
  }
}

// delta = rowsum(grad_out * out) in fp32, a warp per row of D values.
template <typename T, int D>
__global__ void row_dot_kernel(Params<T> p, float* delta, int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t query = row % p.tokens, head = (row / p.tokens) % p.heads, batch = row / (p.tokens * p.heads);
  const T* g = p.grad_out + batch * p.gs.b + head * p.gs.h + query * p.gs.t;
  const T* o = p.out + batch * p.os.b + head * p.os.h + query * p.os.t;
  float sum = 0.0f;
  for (int d = lane; d < D; d += 32) sum += static_cast<float>(g[d]) * static_cast<float>(o[d]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) delta[row] = sum;
}

// --- Host ------------------------------------------------------------------------------------------

Strides strides_of(const at::Tensor& tensor) { return {tensor.stride(0), tensor.stride(1), tensor.stride(2)}; }

// The operand as the kernels read it: head_dim contiguous, rows on 16 bytes.
at::Tensor readable(const at::Tensor& tensor) {
  const bool aligned = tensor.stride(3) == 1 && tensor.stride(0) % 8 == 0 && tensor.stride(1) % 8 == 0 &&
                       tensor.stride(2) % 8 == 0 && reinterpret_cast<uintptr_t>(tensor.data_ptr()) % 16 == 0;
  return aligned ? tensor : tensor.contiguous();
}

// [batch, heads, T, head_dim] laid out as [batch, T, heads, head_dim].
at::Tensor heads_inside_tokens(const at::Tensor& like, int64_t heads, at::ScalarType dtype) {
  return at::empty({like.size(0), like.size(2), heads, like.size(3)}, like.options().dtype(dtype)).transpose(1, 2);
}

template <typename T>
Params<T> params_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const SoftcappedFlash& options) {
  Params<T> p{};
  p.q = reinterpret_cast<const T*>(q.data_ptr());
  p.k = reinterpret_cast<const T*>(k.data_ptr());
  p.v = reinterpret_cast<const T*>(v.data_ptr());
  p.qs = strides_of(q);
  p.ks = strides_of(k);
  p.vs = strides_of(v);
  p.heads = static_cast<int>(q.size(1));
  p.kv_heads = static_cast<int>(k.size(1));
  p.tokens = static_cast<int>(q.size(2));
  p.window = options.window > 0 && options.window < q.size(2) ? static_cast<int>(options.window) : 0;
  p.scale = static_cast<float>(options.scale);
  p.cap = static_cast<float>(options.cap);
  p.scale_over_cap = static_cast<float>(options.scale / options.cap);
  if (options.run_bounds.defined()) {
    p.run_start = options.run_bounds.data_ptr<int>();
    p.run_end = p.run_start + p.tokens;
  }
  return p;
}

template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// Calls function(T{}, std::integral_constant<int, D>{}) for the operands' dtype and head_dim.
template <typename Function>
void dispatch(const at::Tensor& query, const std::string& what, const Function& function) {
  const auto with_dim = [&](auto type_tag) {
    switch (query.size(3)) {
      case 128:
        return function(type_tag, std::integral_constant<int, 128>{});
      case 256:
        return function(type_tag, std::integral_constant<int, 256>{});
      default:
        throw Error(ErrorCode::kInternal, what + ": head_dim " + std::to_string(query.size(3)) + " is not 128 or 256");
    }
  };
  if (query.scalar_type() == at::kBFloat16) return with_dim(__nv_bfloat16{});
  if (query.scalar_type() == at::kHalf) return with_dim(__half{});
  throw Error(ErrorCode::kInternal, what + ": the operands must be bf16 or fp16, got " +
              std::string(c10::toString(query.scalar_type())));
}

void check_operands(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    const SoftcappedFlash& options, const std::string& what) {
  if (!softcapped_flash_takes(query, key) || !value.sizes().equals(key.sizes()) ||
      value.scalar_type() != query.scalar_type() || key.size(0) != query.size(0) || key.size(3) != query.size(3)) {
    throw Error(ErrorCode::kInternal, what + ": query [batch, heads, T, 128 | 256] and key / value [batch, kv_heads, T, "
                "head_dim] on CUDA in bf16 or fp16 expected");
  }
  if (!(options.cap > 0) || !(options.scale > 0)) throw Error(ErrorCode::kInternal, what + ": the cap and scale must be positive");
  const auto& runs = options.run_bounds;
  if (runs.defined() && (query.size(0) != 1 || !runs.is_cuda() || runs.device() != query.device() ||
                         runs.scalar_type() != at::kInt || !runs.is_contiguous() || runs.dim() != 2 ||
                         runs.size(0) != 2 || runs.size(1) != query.size(2))) {
    throw Error(ErrorCode::kInternal, what + ": packed samples need batch 1 and run bounds int32 [2, T] on the query's device");
  }
  if (query.size(2) > INT32_MAX / 2) throw Error(ErrorCode::kInternal, what + ": too many tokens");
}

}  // namespace softcapped_flash

bool softcapped_flash_takes(at::ScalarType dtype, int64_t head_dim) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && (head_dim == 128 || head_dim == 256);
}

namespace softcapped_flash {

// Whether `device` runs the kernels at this head_dim: bf16 tensor-core products (compute
// capability 8.0 on) and the backward's shared memory in one CUDA block (head_dim 256 needs 217
// KiB: Hopper's 227 fit, the A100's 163 do not).
bool device_runs(int device, int64_t head_dim) {
  // The device's compute capability and shared memory, asked once per device (every layer's call
  // asks this): 0 not asked yet, else shared bytes + 1 with the sign of the capability test.
  constexpr int kDevices = 64;
  static std::atomic<int64_t> answers[kDevices] = {};
  int64_t answer = device >= 0 && device < kDevices ? answers[device].load() : 0;
  if (answer == 0) {
    int major = 0, shared = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    answer = (major >= 8 ? 1 : -1) * (static_cast<int64_t>(shared) + 1);
    if (device >= 0 && device < kDevices) answers[device].store(answer);
  }
  const size_t needed = head_dim == 256 ? BackwardShared<__nv_bfloat16, 256>::bytes()
                                        : BackwardShared<__nv_bfloat16, 128>::bytes();
  return answer > 0 && static_cast<size_t>(answer - 1) >= needed;
}

}  // namespace softcapped_flash

bool softcapped_flash_takes(const at::Tensor& query, const at::Tensor& key) {
  return query.is_cuda() && key.is_cuda() && query.dim() == 4 && key.dim() == 4 &&
         softcapped_flash_takes(query.scalar_type(), query.size(3)) && key.scalar_type() == query.scalar_type() &&
         key.size(2) == query.size(2) && key.size(1) > 0 && query.size(1) % key.size(1) == 0 &&
         softcapped_flash::device_runs(query.get_device(), query.size(3));
}

std::tuple<at::Tensor, at::Tensor> softcapped_flash_forward_cuda(const at::Tensor& query_in, const at::Tensor& key_in,
                                                                 const at::Tensor& value_in,
                                                                 const SoftcappedFlash& options) {
  using namespace softcapped_flash;
  const std::string what = "softcapped_flash_forward_cuda";
  check_operands(query_in, key_in, value_in, options, what);
  const c10::cuda::CUDAGuard device_guard(query_in.device());
  const auto query = readable(query_in), key = readable(key_in), value = readable(value_in);
  auto out = heads_inside_tokens(query, query.size(1), query.scalar_type());
  auto lse = at::empty({query.size(0), query.size(1), query.size(2)}, query.options().dtype(at::kFloat));
  if (query.numel() == 0) return {out, lse};
  dispatch(query, what, [&](auto type_tag, auto dim_tag) {
    using T = decltype(type_tag);
    constexpr int D = decltype(dim_tag)::value;
    auto p = params_of<T>(query, key, value, options);
    p.result = reinterpret_cast<T*>(out.data_ptr());
    p.rs = strides_of(out);
    p.lse = lse.data_ptr<float>();
    const size_t shared = (kForwardRows + 2 * kBlock) * kTileStride<D> * sizeof(T);
    allow_shared(forward_kernel<T, D>, shared);
    const dim3 grid(static_cast<unsigned>(query.size(1)), static_cast<unsigned>(ceil_div(query.size(2), kForwardRows)),
                    static_cast<unsigned>(query.size(0)));
    forward_kernel<T, D><<<grid, kForwardThreads, shared, c10::cuda::getCurrentCUDAStream()>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> softcapped_flash_backward_cuda(
    const at::Tensor& grad_out_in, const at::Tensor& query_in, const at::Tensor& key_in, const at::Tensor& value_in,
    const at::Tensor& out_in, const at::Tensor& lse, const SoftcappedFlash& options) {
  using namespace softcapped_flash;
  const std::string what = "softcapped_flash_backward_cuda";
  check_operands(query_in, key_in, value_in, options, what);
  if (!grad_out_in.sizes().equals(query_in.sizes()) || !out_in.sizes().equals(query_in.sizes()) ||
      grad_out_in.scalar_type() != query_in.scalar_type() || out_in.scalar_type() != query_in.scalar_type()) {
    throw Error(ErrorCode::kInternal, what + ": grad_out and out must have query's shape and dtype");
  }
  if (lse.scalar_type() != at::kFloat || !lse.is_contiguous() || lse.numel() != query_in.numel() / query_in.size(3)) {
    throw Error(ErrorCode::kInternal, what + ": the log-sum-exp must be the forward's fp32 [batch, heads, T]");
  }
  const c10::cuda::CUDAGuard device_guard(query_in.device());
  const auto query = readable(query_in), key = readable(key_in), value = readable(value_in);
  const auto grad_out = readable(grad_out_in), out = readable(out_in);
  // fp32 sums of the gradients (the kernel adds into them), rounded to the dtype at the end.
  const auto sums_like = [](const at::Tensor& operand) {
    return heads_inside_tokens(operand, operand.size(1), at::kFloat).zero_();
  };
  auto dq = sums_like(query), dk = sums_like(key), dv = sums_like(value);
  auto delta = at::empty_like(lse);
  if (query.numel() > 0) {
    dispatch(query, what, [&](auto type_tag, auto dim_tag) {
      using T = decltype(type_tag);
      constexpr int D = decltype(dim_tag)::value;
      const auto stream = c10::cuda::getCurrentCUDAStream();
      auto p = params_of<T>(query, key, value, options);
      p.out = reinterpret_cast<const T*>(out.data_ptr());
      p.os = strides_of(out);
      p.grad_out = reinterpret_cast<const T*>(grad_out.data_ptr());
      p.gs = strides_of(grad_out);
      p.lse = lse.data_ptr<float>();
      p.delta = delta.data_ptr<float>();
      p.dq = dq.data_ptr<float>();
      p.dk = dk.data_ptr<float>();
      p.dv = dv.data_ptr<float>();
      p.dqs = strides_of(dq);
      p.dks = strides_of(dk);
      p.dvs = strides_of(dv);
      const int64_t rows = lse.numel();
      constexpr int kRowsPerBlock = 8;
      row_dot_kernel<T, D><<<static_cast<unsigned>(ceil_div(rows, kRowsPerBlock)), kRowsPerBlock * 32, 0, stream>>>(
          p, delta.data_ptr<float>(), rows);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const size_t shared = BackwardShared<T, D>::bytes();
      allow_shared(backward_kernel<T, D>, shared);
      const dim3 grid(static_cast<unsigned>(query.size(1)), static_cast<unsigned>(ceil_div(query.size(2), kBlock)),
                      static_cast<unsigned>(query.size(0)));
      backward_kernel<T, D><<<grid, kBackwardThreads, shared, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  const auto dtype = query.scalar_type();
  return {dq.to(dtype), dk.to(dtype), dv.to(dtype)};
}

}  // namespace qtrain::kernels
