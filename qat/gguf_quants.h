#pragma once
// llama.cpp's post-training quantizers for GGUF's block types, and their dequantization, ported
// from ggml (ggml/src/ggml-quants.c) so that a tensor quantized here has the same bytes as
// llama.cpp's `llama-quantize` gives it without an importance matrix (ggml_quantize_chunk with
// imatrix == NULL runs the quantize_row_*_ref functions), and dequantizes to the same floats as
// ggml's dequantize_row_*. Free of LibTorch: qat/gguf_block_format.cpp's rows point at these, and
// the GGUF reader's fuzz target links them.
//
// Every function takes `n` values (a multiple of the type's block: 32 for the legacy types, 256
// for the K-quants), row-major, and writes n / block blocks of the type's struct (ggml-common.h),
// or reads them back into n floats.
#include <cstdint>

namespace qtrain::qat::gguf_quants {

// Legacy types (qat/gguf_quants_legacy.cpp): blocks of 32.
void quantize_q4_0(const float* x, uint8_t* out, int64_t n);
void quantize_q4_1(const float* x, uint8_t* out, int64_t n);
void quantize_q5_0(const float* x, uint8_t* out, int64_t n);
void quantize_q5_1(const float* x, uint8_t* out, int64_t n);
void quantize_q8_0(const float* x, uint8_t* out, int64_t n);
void dequantize_q4_0(const uint8_t* in, float* y, int64_t n);
void dequantize_q4_1(const uint8_t* in, float* y, int64_t n);
void dequantize_q5_0(const uint8_t* in, float* y, int64_t n);
void dequantize_q5_1(const uint8_t* in, float* y, int64_t n);
void dequantize_q8_0(const uint8_t* in, float* y, int64_t n);

// K-quants (qat/gguf_k_quants.cpp): super-blocks of 256.
void quantize_q2_k(const float* x, uint8_t* out, int64_t n);
void quantize_q3_k(const float* x, uint8_t* out, int64_t n);
void quantize_q4_k(const float* x, uint8_t* out, int64_t n);
void quantize_q5_k(const float* x, uint8_t* out, int64_t n);
void quantize_q6_k(const float* x, uint8_t* out, int64_t n);
void dequantize_q2_k(const uint8_t* in, float* y, int64_t n);
void dequantize_q3_k(const uint8_t* in, float* y, int64_t n);
void dequantize_q4_k(const uint8_t* in, float* y, int64_t n);
void dequantize_q5_k(const uint8_t* in, float* y, int64_t n);
void dequantize_q6_k(const uint8_t* in, float* y, int64_t n);

// MXFP4 (qat/gguf_quants_mxfp4.cpp): blocks of 32, an E8M0 scale and E2M1 codes.
void quantize_mxfp4(const float* x, uint8_t* out, int64_t n);
void dequantize_mxfp4(const uint8_t* in, float* y, int64_t n);

// Block sizes in bytes (sizeof ggml's block_q4_1 etc.).
constexpr int64_t kQ4_1Bytes = 2 + 2 + 16;
constexpr int64_t kQ5_0Bytes = 2 + 4 + 16;
constexpr int64_t kQ5_1Bytes = 2 + 2 + 4 + 16;
constexpr int64_t kSuperBlock = 256;  // QK_K
constexpr int64_t kQ2_KBytes = 16 + 64 + 2 + 2;
constexpr int64_t kQ3_KBytes = 32 + 64 + 12 + 2;
constexpr int64_t kQ4_KBytes = 2 + 2 + 12 + 128;
constexpr int64_t kQ5_KBytes = 2 + 2 + 12 + 32 + 128;
constexpr int64_t kQ6_KBytes = 128 + 64 + 16 + 2;
constexpr int64_t kMxfp4Bytes = 1 + 16;

}  // namespace qtrain::qat::gguf_quants
