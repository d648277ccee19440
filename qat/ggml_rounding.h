#pragma once
// ggml's reference quantizers round every product and every sum: a contracted a*b + c (an FMA,
// one rounding) differs in the last bit, and that bit can flip a code. Compilers contract in C++
// where the target has FMA (GCC even at -std=c++17: -march=native on x86-64, aarch64 by default);
// ggml's own reference build has none. The code between these two marks is not contracted, and
// the setting ends at the second (so that the next file of a unity build keeps the default):
//
//     QTRAIN_GGML_ROUNDING_BEGIN
//     namespace ... { ... }
//     QTRAIN_GGML_ROUNDING_END
#if defined(__clang__)
#define QTRAIN_GGML_ROUNDING_BEGIN _Pragma("float_control(push)") _Pragma("clang fp contract(off)")
#define QTRAIN_GGML_ROUNDING_END _Pragma("float_control(pop)")
#elif defined(__GNUC__)
#define QTRAIN_GGML_ROUNDING_BEGIN _Pragma("GCC push_options") _Pragma("GCC optimize(\"fp-contract=off\")")
#define QTRAIN_GGML_ROUNDING_END _Pragma("GCC pop_options")
#else
#define QTRAIN_GGML_ROUNDING_BEGIN
#define QTRAIN_GGML_ROUNDING_END
#endif
