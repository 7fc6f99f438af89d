// Weight-only int8 and int4 products on the CPU with float32 activations:
// y (M, N) = x (M, K) @ W^T, W dequantized in registers, float32 throughout.
//
// int8: q (N, K) int8 and scales (N, K / G) float32 per group of G input
//   columns, W[n, k] = q[n, k] * scales[n, k / G]; G = K is one scale per
//   output channel, and G = 32 is GGUF Q8_0's blocks.
// int4: codes (N, K / 2) uint8 and dm (N, K / G, 2) float16 bits (d, m) per
//   group of G input columns, W[n, k] = c * d + m with c in 0..15 (GGUF
//   Q4_1's form). Codes are packed per block of 32 columns: byte j of a block
//   holds column j in its low nibble and column j + 16 in its high nibble.
//
// int8_dequant / int4_dequant write the float32 weight (N, K) itself, for
// products of many rows, which then go to torch's float32 GEMM.
//
// K must be a multiple of 32 (and of G); the Python side checks it. Work is
// split over output rows (at::parallel_for, torch's intra-op threads). Each
// thread walks tiles of TILE_M activation rows, so a tile stays in L2 while
// every weight row of the thread's range is read from memory once per tile;
// within a tile, MB rows at a time share each dequantized weight vector.
// With AVX-512 the inner loops are vectorised by hand; elsewhere a scalar
// loop computes the same products (summed in another order).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE_M = 64;
// Software prefetch distance, in weight bytes ahead of the current block. A
// decode step reads every weight once from memory; the hardware prefetcher
// alone left the int4 product slower than torch's, and prefetching a few KiB
// ahead (across row ends: a thread's rows are contiguous) made it faster
// (docs/quantization.md); a short distance did not help.
constexpr int64_t PREFETCH_BYTES = 2048;

float half_to_float(uint16_t h) {
  // IEEE binary16 to binary32, exact (subnormals included).
#if defined(__F16C__)
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX512F__)

// MB activation rows x one int8 weight row (scales s: one per group of G).
template <int MB>
void int8_row(float* y, int64_t ldy, const float* x, int64_t K, const int8_t* w, const float* s, int64_t G) {
  __m512 acc0[MB], acc1[MB];
  for (int i = 0; i < MB; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  const bool per_row = G == K;  // one scale: applied once, at the end
  for (int64_t g = 0; g < K / G; ++g) {
    const __m512 sg = _mm512_set1_ps(per_row ? 1.0f : s[g]);
    for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k + PREFETCH_BYTES), _MM_HINT_T0);
      __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k))));
      __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k + 16))));
      if (!per_row) {  // loop-invariant: the compiler unswitches it
        w0 = _mm512_mul_ps(sg, w0);
        w1 = _mm512_mul_ps(sg, w1);
      }
      for (int i = 0; i < MB; ++i) {
        acc0[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i * K + k), acc0[i]);
        acc1[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + i * K + k + 16), acc1[i]);
      }
    }
  }
  const float scale = per_row ? s[0] : 1.0f;
  for (int i = 0; i < MB; ++i) y[i * ldy] = scale * _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i]));
}

// MB activation rows x one int4 weight row.
template <int MB>
void int4_row(float* y, int64_t ldy, const float* x, int64_t K, const uint8_t* c, const uint16_t* dm, int64_t G) {
  __m512 acc0[MB], acc1[MB];
  for (int i = 0; i < MB; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(0xF);
  const int64_t blocks = G / 32;
  for (int64_t g = 0; g < K / G; ++g) {
    const __m512 d = _mm512_set1_ps(half_to_float(dm[2 * g])), m = _mm512_set1_ps(half_to_float(dm[2 * g + 1]));
    _mm_prefetch(reinterpret_cast<const char*>(dm + 2 * g) + PREFETCH_BYTES / 4, _MM_HINT_T0);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t k = (g * blocks + b) * 32;
      _mm_prefetch(reinterpret_cast<const char*>(c + k / 2) + PREFETCH_BYTES, _MM_HINT_T0);
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + k / 2)));
      const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), d, m);
      const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d, m);
      for (int i = 0; i < MB; ++i) {
        acc0[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i * K + k), acc0[i]);
        acc1[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + i * K + k + 16), acc1[i]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) y[i * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i]));
}

#else

template <int MB>
void int8_row(float* y, int64_t ldy, const float* x, int64_t K, const int8_t* w, const float* s, int64_t G) {
  const bool per_row = G == K;
  for (int i = 0; i < MB; ++i) {
    float acc = 0.0f;
    for (int64_t k = 0; k < K; ++k) acc += static_cast<float>(w[k]) * (per_row ? 1.0f : s[k / G]) * x[i * K + k];
    y[i * ldy] = (per_row ? s[0] : 1.0f) * acc;
  }
}

template <int MB>
void int4_row(float* y, int64_t ldy, const float* x, int64_t K, const uint8_t* c, const uint16_t* dm, int64_t G) {
  for (int i = 0; i < MB; ++i) {
    float acc = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = k / G, j = k % 32;
      const uint8_t byte = c[(k - j) / 2 + (j % 16)];
      const float code = static_cast<float>(j < 16 ? (byte & 0xF) : (byte >> 4));
      acc += (code * half_to_float(dm[2 * g]) + half_to_float(dm[2 * g + 1])) * x[i * K + k];
    }
    y[i * ldy] = acc;
  }
}

#endif

// Rows [n0, n1) of the output for every activation row, tile by tile.
template <typename Row>
void rows(int64_t M, int64_t n0, int64_t n1, const Row& row) {
  for (int64_t t0 = 0; t0 < M; t0 += TILE_M) {
    const int64_t t1 = std::min(M, t0 + TILE_M);
    for (int64_t n = n0; n < n1; ++n) {
      int64_t m = t0;
      for (; m + 8 <= t1; m += 8) row(std::integral_constant<int, 8>{}, m, n);
      if (m + 4 <= t1) row(std::integral_constant<int, 4>{}, m, n), m += 4;
      if (m + 2 <= t1) row(std::integral_constant<int, 2>{}, m, n), m += 2;
      if (m < t1) row(std::integral_constant<int, 1>{}, m, n);
    }
  }
}

void check_common(const torch::Tensor& out, const torch::Tensor& x, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 (M, K)");
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == torch::kFloat32 && out.is_contiguous() &&
                  out.size(0) == x.size(0) && out.size(1) == N,
              "out: contiguous float32 (M, N)");
}

int64_t grain(int64_t N) {
  // Every thread gets whole rows; at least 16 per task so tiny layers do not split.
  return std::max<int64_t>(16, N / (4 * std::max(1, at::get_num_threads())));
}

}  // namespace

void int8_gemm(torch::Tensor out, torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t group_size) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  check_common(out, x, N);
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.is_contiguous() && q.size(1) == K, "q: contiguous int8 (N, K)");
  TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0, "group_size must be a multiple of 32 dividing K");
  const int64_t groups = K / group_size;
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == N * groups,
              "scales: contiguous float32 (N, K / group_size)");
  float* y = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const int8_t* w = q.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
    rows(M, n0, n1, [&](auto mb, int64_t m, int64_t n) {
      int8_row<decltype(mb)::value>(y + m * N + n, N, xp + m * K, K, w + n * K, s + n * groups, group_size);
    });
  });
}

void int4_gemm(torch::Tensor out, torch::Tensor x, torch::Tensor codes, torch::Tensor dm, int64_t group_size) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  check_common(out, x, N);
  TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0, "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.size(1) == K / 2,
              "codes: contiguous uint8 (N, K / 2)");
  TORCH_CHECK(dm.scalar_type() == torch::kFloat16 && dm.is_contiguous() && dm.numel() == N * (K / group_size) * 2,
              "dm: contiguous float16 (N, K / group_size, 2)");
  float* y = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* h = reinterpret_cast<const uint16_t*>(dm.data_ptr());
  const int64_t groups = K / group_size;
  at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
    rows(M, n0, n1, [&](auto mb, int64_t m, int64_t n) {
      int4_row<decltype(mb)::value>(y + m * N + n, N, xp + m * K, K, c + n * (K / 2), h + n * groups * 2, group_size);
    });
  });
}

void int8_dequant(torch::Tensor out, torch::Tensor q, torch::Tensor scales, int64_t group_size) {
  const int64_t N = q.size(0), K = q.size(1), groups = K / group_size;
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.size(0) == N && out.size(1) == K,
              "out: contiguous float32 (N, K)");
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.is_contiguous() && K % group_size == 0, "q: contiguous int8");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.numel() == N * groups, "scales: float32 (N, K / G)");
  float* o = out.data_ptr<float>();
  const int8_t* w = q.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t g = 0; g < groups; ++g) {
        const float sg = s[n * groups + g];
        for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 16) {
#if defined(__AVX512F__)
          const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + n * K + k))));
          _mm512_storeu_ps(o + n * K + k, _mm512_mul_ps(v, _mm512_set1_ps(sg)));
#else
          for (int j = 0; j < 16; ++j) o[n * K + k + j] = static_cast<float>(w[n * K + k + j]) * sg;
#endif
        }
      }
    }
  });
}

void int4_dequant(torch::Tensor out, torch::Tensor codes, torch::Tensor dm, int64_t group_size) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2, groups = K / group_size;
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.size(0) == N && out.size(1) == K,
              "out: contiguous float32 (N, K)");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && K % group_size == 0 &&
                  group_size % 32 == 0, "codes: contiguous uint8 (N, K / 2)");
  TORCH_CHECK(dm.scalar_type() == torch::kFloat16 && dm.numel() == N * groups * 2, "dm: float16 (N, K / G, 2)");
  float* o = out.data_ptr<float>();
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* h = reinterpret_cast<const uint16_t*>(dm.data_ptr());
  at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t g = 0; g < groups; ++g) {
        const float d = half_to_float(h[(n * groups + g) * 2]), m = half_to_float(h[(n * groups + g) * 2 + 1]);
        for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 32) {
          const uint8_t* b = c + n * (K / 2) + k / 2;
          float* dst = o + n * K + k;
#if defined(__AVX512F__)
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)b));
          const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
          _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF))), dv, mv));
          _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), dv, mv));
#else
          for (int j = 0; j < 16; ++j) {
            dst[j] = static_cast<float>(b[j] & 0xF) * d + m;
            dst[j + 16] = static_cast<float>(b[j] >> 4) * d + m;
          }
#endif
        }
      }
    }
  });
}
