// Float32 products of one or two activation rows: y (M, N) = x (M, K) @ W^T (+ b), M <= 2, W (N, K)
// row-major, as torch keeps a linear weight: batch-1 decode's linear layers. Such a product reads
// each weight once for two flops, so it is bound by memory bandwidth: the kernel's job is to stream
// W at the memory's speed. MKL's GEMV does on some CPUs and takes a slow path on others
// (actors/models/cpu_linear.py times both on the machine at hand and keeps the faster).
//
// Work is split over output rows (at::parallel_for: torch's intra-op OpenMP threads), whole rows
// per thread, so a thread's rows are one contiguous stream of W that software prefetching runs
// ahead of, across row ends (as quant_gemm.cpp does). A thread takes ROWS weight rows at a time, so
// each x vector loaded serves ROWS rows. AVX-512 (masked tail) and AVX2 + FMA (scalar tail) are
// vectorised by hand; elsewhere a scalar loop computes the same sums in another order. Any K.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <string>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int ROWS = 4;
// Prefetch distance in weight bytes ahead of each row's current position (quant_gemm.cpp's: a
// decode step's weights come from memory, and the hardware prefetcher alone falls behind).
constexpr int64_t PREFETCH_BYTES = 2048;

inline void prefetch_ahead(const float* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES, 0, 3);
}

#if defined(__AVX512F__)

const char* const kIsa = "avx512";

// y[i * ldy + r] = x_i . w_r (+ b[r]) for MB activation rows and R weight rows.
template <int MB, int R>
void block(float* y, int64_t ldy, const float* x, int64_t K, const float* w, const float* b) {
  __m512 acc[MB][R];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[MB];
    for (int i = 0; i < MB; ++i) xv[i] = _mm512_loadu_ps(x + i * K + k);
    for (int r = 0; r < R; ++r) {
      prefetch_ahead(w + r * K + k);
      const __m512 wv = _mm512_loadu_ps(w + r * K + k);
      for (int i = 0; i < MB; ++i) acc[i][r] = _mm512_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  if (k < K) {  // the last K % 16 columns, masked: no read past a row's end
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 xv[MB];
    for (int i = 0; i < MB; ++i) xv[i] = _mm512_maskz_loadu_ps(m, x + i * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(m, w + r * K + k);
      for (int i = 0; i < MB; ++i) acc[i][r] = _mm512_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < R; ++r) y[i * ldy + r] = _mm512_reduce_add_ps(acc[i][r]) + (b ? b[r] : 0.0f);
}

#elif defined(__AVX2__) && defined(__FMA__)

const char* const kIsa = "avx2";

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <int MB, int R>
void block(float* y, int64_t ldy, const float* x, int64_t K, const float* w, const float* b) {
  __m256 acc[MB][R];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {  // two vectors a step: one prefetch per 64-byte line
    __m256 x0[MB], x1[MB];
    for (int i = 0; i < MB; ++i) x0[i] = _mm256_loadu_ps(x + i * K + k), x1[i] = _mm256_loadu_ps(x + i * K + k + 8);
    for (int r = 0; r < R; ++r) {
      prefetch_ahead(w + r * K + k);
      const __m256 w0 = _mm256_loadu_ps(w + r * K + k), w1 = _mm256_loadu_ps(w + r * K + k + 8);
      for (int i = 0; i < MB; ++i) acc[i][r] = _mm256_fmadd_ps(w1, x1[i], _mm256_fmadd_ps(w0, x0[i], acc[i][r]));
    }
  }
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MB];
    for (int i = 0; i < MB; ++i) xv[i] = _mm256_loadu_ps(x + i * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(w + r * K + k);
      for (int i = 0; i < MB; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[i][r]);
      for (int64_t j = k; j < K; ++j) s += w[r * K + j] * x[i * K + j];
      y[i * ldy + r] = s + (b ? b[r] : 0.0f);
    }
}

#else

const char* const kIsa = "scalar";

template <int MB, int R>
void block(float* y, int64_t ldy, const float* x, int64_t K, const float* w, const float* b) {
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < R; ++r) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        if ((k & 15) == 0) prefetch_ahead(w + r * K + k);
        s += w[r * K + k] * x[i * K + k];
      }
      y[i * ldy + r] = s + (b ? b[r] : 0.0f);
    }
}

#endif

template <int MB>
void gemv(float* y, const float* x, const float* w, const float* b, int64_t N, int64_t K) {
  // Whole rows per task, at least 16 so tiny layers do not split (as quant_gemm.cpp's grain).
  const int64_t grain = std::max<int64_t>(16, N / (4 * std::max(1, at::get_num_threads())));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + ROWS <= n1; n += ROWS) block<MB, ROWS>(y + n, N, x, K, w + n * K, b ? b + n : nullptr);
    for (; n < n1; ++n) block<MB, 1>(y + n, N, x, K, w + n * K, b ? b + n : nullptr);
  });
}

}  // namespace

void gemv_f32(torch::Tensor out, torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  const auto f32 = [](const torch::Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous();
  };
  TORCH_CHECK(f32(x) && x.dim() == 2 && (x.size(0) == 1 || x.size(0) == 2),
              "gemv_f32: x must be contiguous float32 (M, K) on the CPU with M 1 or 2");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(f32(weight) && weight.dim() == 2 && weight.size(1) == K, "gemv_f32: weight must be contiguous float32 (N, K)");
  TORCH_CHECK(f32(out) && out.dim() == 2 && out.size(0) == M && out.size(1) == N, "gemv_f32: out must be contiguous float32 (M, N)");
  TORCH_CHECK(!bias.has_value() || (f32(*bias) && bias->dim() == 1 && bias->size(0) == N),
              "gemv_f32: bias must be contiguous float32 (N,)");
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (M == 1)
    gemv<1>(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(), b, N, K);
  else
    gemv<2>(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(), b, N, K);
}

std::string gemv_isa() { return kIsa; }
