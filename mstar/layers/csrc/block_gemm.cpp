// Weight-only block-quantised products on the CPU: y[m, n] = sum_k x[m, k] * w[n, k] with w
// stored as 4-bit or 8-bit codes in blocks of 32 input features, each block of a row with its
// own scale (and, for 4 bits, offset): GGUF's Q4_0 / Q4_1 / Q8_0 as the file stores them.
//
// Layout (made by mstar/layers/native.py): output rows in tiles of 16; for a tile, codes are
// stored input feature by input feature, the 16 rows' codes side by side, so one vector load
// gives the weights of 16 outputs at one (4-bit: two) input features.
//   int4: codes uint8 [N/16, K/2, 16], byte = code(n, 2p) | code(n, 2p + 1) << 4;
//   int8: codes int8  [N/16, K, 16];
//   scales (and offsets) float32 [N/16, K/32, 16].
// A tile's block is decoded once and used for every row of x (up to ROWS at a time, their
// sums in registers), so a step of several sequences reads and decodes each weight once,
// unlike a kernel that decodes per block of a few rows. Each row's sums are made in the same
// order whatever the number of rows: a row's result does not depend on the rows beside it.
// The vectors are GCC/Clang vector extensions, lowered to the machine's own (AVX-512, AVX2,
// NEON) by -march=native; threads are ATen's (at::parallel_for over tiles).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int8_t v16s8 __attribute__((vector_size(16)));

constexpr int64_t TILE = 16;   // output rows per tile: one vector
constexpr int64_t BLOCK = 32;  // input features per scale
constexpr int ROWS = 8;        // rows of x whose sums stay in registers

// 16 codes as floats: unsigned bytes (4-bit pairs) or signed ones. GCC scalarises the generic
// byte-to-int conversion, so x86 with AVX-512 takes the instruction that does it.
inline v16i widen_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  v16u8 b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, v16i);
#endif
}

inline v16i widen_s8(const int8_t* p) {
#if defined(__AVX512F__)
  return (v16i)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  v16s8 b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, v16i);
#endif
}

inline v16f splat(float v) { return v16f{v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}; }

// a * b + c rounded once where the machine has fused multiply-add. The library is built with
// -ffp-contract=off, so the compiler fuses nothing on its own: every row's sums are made by the
// same instructions whatever the number of rows beside it.
inline v16f fmadd(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
  return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return a * b + c;
#endif
}

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// One tile, rows [m0, m0 + R) of x: R accumulators, each block's partial sums scaled at its end.
template <int R, bool INT4>
inline void tile_rows(const float* x, int64_t ldx, const float* xsum, int64_t groups,
                      const uint8_t* codes, const float* scales, const float* offsets,
                      float* y, int64_t ldy, int64_t valid) {
  v16f acc[R];
  for (int r = 0; r < R; ++r) acc[r] = v16f{};
  for (int64_t g = 0; g < groups; ++g) {
    v16f part[R];
    for (int r = 0; r < R; ++r) part[r] = v16f{};
    const float* xg = x + g * BLOCK;
    if constexpr (INT4) {
      const uint8_t* c = codes + g * (BLOCK / 2) * TILE;
      for (int64_t p = 0; p < BLOCK / 2; ++p) {
        v16i bi = widen_u8(c + p * TILE);
        v16f lo = __builtin_convertvector(bi & 15, v16f);
        v16f hi = __builtin_convertvector(bi >> 4, v16f);
        for (int r = 0; r < R; ++r) {
          part[r] = fmadd(splat(xg[r * ldx + 2 * p]), lo, part[r]);
          part[r] = fmadd(splat(xg[r * ldx + 2 * p + 1]), hi, part[r]);
        }
      }
    } else {
      const int8_t* c = reinterpret_cast<const int8_t*>(codes) + g * BLOCK * TILE;
      for (int64_t k = 0; k < BLOCK; ++k) {
        v16f w = __builtin_convertvector(widen_s8(c + k * TILE), v16f);
        for (int r = 0; r < R; ++r) part[r] = fmadd(splat(xg[r * ldx + k]), w, part[r]);
      }
    }
    v16f s = load16(scales + g * TILE);
    if (offsets != nullptr) {
      v16f o = load16(offsets + g * TILE);
      for (int r = 0; r < R; ++r) acc[r] = fmadd(part[r], s, fmadd(splat(xsum[r * groups + g]), o, acc[r]));
    } else {
      for (int r = 0; r < R; ++r) acc[r] = fmadd(part[r], s, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, &acc[r], valid * sizeof(float));
}

template <bool INT4>
void run_rows(int R, const float* x, int64_t ldx, const float* xsum, int64_t groups,
              const uint8_t* codes, const float* scales, const float* offsets, float* y, int64_t ldy, int64_t valid) {
  switch (R) {
#define MSTAR_ROWS_CASE(n) \
  case n: tile_rows<n, INT4>(x, ldx, xsum, groups, codes, scales, offsets, y, ldy, valid); break;
    MSTAR_ROWS_CASE(1) MSTAR_ROWS_CASE(2) MSTAR_ROWS_CASE(3) MSTAR_ROWS_CASE(4)
    MSTAR_ROWS_CASE(5) MSTAR_ROWS_CASE(6) MSTAR_ROWS_CASE(7) MSTAR_ROWS_CASE(8)
#undef MSTAR_ROWS_CASE
    default: TORCH_CHECK(false, "row chunk ", R);
  }
}

at::Tensor block_mm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& offsets, int64_t out_features, bool int4) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [rows, in]");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), "codes and scales must be contiguous");
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "scales must be float32");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), in = x.size(1), tiles = codes.size(0), groups = in / BLOCK;
  TORCH_CHECK(in % BLOCK == 0, "in_features must be a multiple of ", BLOCK);
  TORCH_CHECK(codes.size(1) == (int4 ? in / 2 : in) && codes.size(2) == TILE, "codes do not match x");
  TORCH_CHECK(scales.size(0) == tiles && scales.size(1) == groups, "scales do not match the codes");
  TORCH_CHECK(tiles * TILE >= out_features && out_features > (tiles - 1) * TILE, "out_features do not match the codes");
  const float* off = nullptr;
  at::Tensor offs;
  at::Tensor xsum;
  if (offsets.has_value()) {
    offs = offsets->contiguous();
    TORCH_CHECK(offs.scalar_type() == at::kFloat && offs.sizes() == scales.sizes(), "offsets must match scales");
    off = offs.data_ptr<float>();
    xsum = x.view({rows, groups, BLOCK}).sum(-1).contiguous();
  }
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* xs = xsum.defined() ? xsum.data_ptr<float>() : nullptr;
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t code_stride = codes.size(1) * TILE, scale_stride = groups * TILE;
  // a few tiles per task: at one row a tile is ~1-2 us of work
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t m = 0; m < rows; m += ROWS) {
        const int r = static_cast<int>(std::min<int64_t>(ROWS, rows - m));
        const float* xr = xp + m * in;
        const float* xsr = xs != nullptr ? xs + m * groups : nullptr;
        float* yr = yp + m * out_features + t * TILE;
        const int64_t valid = std::min<int64_t>(TILE, out_features - t * TILE);
        const float* o = off != nullptr ? off + t * scale_stride : nullptr;
        if (int4)
          run_rows<true>(r, xr, in, xsr, groups, cp + t * code_stride, sp + t * scale_stride, o, yr, out_features, valid);
        else
          run_rows<false>(r, xr, in, xsr, groups, cp + t * code_stride, sp + t * scale_stride, o, yr, out_features, valid);
      }
    }
  });
  return y;
}

at::Tensor int4_block_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& offsets, int64_t out_features) {
  return block_mm(x, codes, scales, offsets, out_features, true);
}

at::Tensor int8_block_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         int64_t out_features) {
  return block_mm(x, codes, scales, c10::nullopt, out_features, false);
}

}  // namespace

TORCH_LIBRARY(mstar_cpu, m) {
  m.def("int4_block_mm(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int out_features) -> Tensor");
  m.def("int8_block_mm(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(mstar_cpu, CPU, m) {
  m.impl("int4_block_mm", &int4_block_mm);
  m.impl("int8_block_mm", &int8_block_mm);
}
