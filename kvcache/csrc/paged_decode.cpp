// Paged decode attention on CPU: one query token per sequence, read straight
// from the paged KV pool (no gather copy).
//
// Work item = (sequence, run of kv heads). An item walks its sequence's page
// table in blocks of kBlock tokens: for each query head, the block's scores
// (dot products summed eight at a time, hsum8), one online-softmax rescale
// per block, then the weighted sum of the block's V rows. The query heads
// that share a kv head run back to back over the same K/V rows while they sit
// in L1, so the pool is read from memory once; all math is fp32.
//
// Vectors are GCC vector extensions of 8 floats (AVX registers under
// -march=native, SSE or NEON pairs otherwise): head_dim % 8 == 0, <= 256.
//
// Sliding window (`window` > 0): the query, at position ctx - 1, sees the last
// `window` keys only (kvcache/attention/backend.py states the rule), so the
// page walk starts at token max(0, ctx - window): pages before it are neither
// read nor checked.
//
// Quantized pools (int8 or fp8 e4m3 pages, one bf16 scale per token and kv
// head): rows are converted to fp32 as they are loaded, the K scale of a row
// multiplies its score (a dot product is linear in the row) and the V scale
// its probability, so no dequantized copy is made. `quantize_write` stores a
// step's k and v that way: per (token, kv head), scale = bf16(absmax / qmax),
// values = round(x / scale) clamped (int8) or cast (fp8), the same arithmetic
// as kvcache/kv_quant.py's torch reference.
//
// Threads: one `omp parallel` region of at::get_num_threads() threads pulls
// items from an atomic counter (contexts differ, so static splits would
// idle). Only GOMP_parallel and omp_get_* are used, so the extension works
// against the libgomp that torch ships, whatever gcc built it.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // tokens per online-softmax rescale (multiple of 8)

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef int8_t v8c __attribute__((vector_size(8)));

// Unaligned loads and stores (memcpy compiles to one vector move).
inline v8f load8(const float* p) { v8f r; std::memcpy(&r, p, sizeof(r)); return r; }
inline v8f load8(const c10::BFloat16* p) {  // bf16 is the top half of a float
  v8h h;
  std::memcpy(&h, p, sizeof(h));
  return (v8f)(__builtin_convertvector(h, v8u) << 16);
}
inline v8f load8(const int8_t* p) {
#if defined(__AVX2__)
  // One sign-extend and one convert; GCC's generic conversion below is scalarised.
  const __m256 r = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  v8f out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
#else
  v8c c;
  std::memcpy(&c, p, sizeof(c));
  return __builtin_convertvector(__builtin_convertvector(c, v8i), v8f);
#endif
}
// fp8 e4m3fn to fp32. With F16C: e4m3's sign, exponent and mantissa bits moved
// into an fp16's places give the value times 2^-8 (the biases are 7 and 15),
// subnormals included, and vcvtph2ps widens 8 of them exactly. Without it, a
// 256-entry table. Stored values are never NaN (the writer clamps to +-448).
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i)
      v[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  }
};
const Fp8Table kFp8;
inline v8f load8(const c10::Float8_e4m3fn* p) {
#if defined(__F16C__) && defined(__AVX2__)
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                    _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  const __m256 r = _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
  v8f out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
#else
  uint8_t b[8];
  std::memcpy(b, p, sizeof(b));
  return v8f{kFp8.v[b[0]], kFp8.v[b[1]], kFp8.v[b[2]], kFp8.v[b[3]],
             kFp8.v[b[4]], kFp8.v[b[5]], kFp8.v[b[6]], kFp8.v[b[7]]};
#endif
}
template <typename C, typename T>
constexpr bool kQuantized = std::is_same<C, int8_t>::value || std::is_same<C, c10::Float8_e4m3fn>::value;
inline void store8(float* p, v8f x) { std::memcpy(p, &x, sizeof(x)); }
inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
inline float hsum(v8f x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }
inline float hmax(v8f x) { float m = x[0]; for (int i = 1; i < 8; ++i) m = std::max(m, x[i]); return m; }

// Eight horizontal sums at once: out[i] = sum of x[i]'s lanes.
inline v8f hsum8(const v8f* x) {
  v8f t[4], u[2];
  for (int k = 0; k < 4; ++k)
    t[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(x[2 * k], x[2 * k + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int k = 0; k < 2; ++k)
    u[k] = __builtin_shufflevector(t[2 * k], t[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(t[2 * k], t[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// exp(x) for x <= 0, vectorised (libm's expf is scalar). Cephes expf:
// Cody-Waite reduction by ln 2, degree-5 polynomial, ~2 ulp; x below -87
// gives ~1e-38 rather than 0, which callers mask where it matters.
inline v8f exp8(v8f x) {
  const v8f lo = splat(-87.0f), magic = splat(12582912.0f);  // 1.5 * 2^23 rounds
  x = x < lo ? lo : x;
  const v8f n = (x * 1.44269504088896341f + magic) - magic;
  const v8f r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v8f y = splat(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                  5.0000001201e-1f})
    y = y * r + c;
  y = y * r * r + r + 1.0f;
  return y * (v8f)((__builtin_convertvector(n, v8i) + 127) << 23);
}

// First token that the query of a sequence of `ctx` tokens sees under `window` (0: none).
inline int64_t first_key(int64_t ctx, int64_t window) {
  return window > 0 && ctx > window ? ctx - window : 0;
}

struct Problem {
  const void *q, *k, *v;
  void* out;
  const c10::BFloat16 *k_scales, *v_scales;  // (P * page, KVH) for quantized pages, else null
  const int32_t *page_table, *context_lens;
  int64_t q_stride0, q_stride1, out_stride0, out_stride1, pt_stride0;
  int64_t page_size, num_kv_heads, group_size, head_dim;
  float scale;
  int64_t window;  // keys a query sees, itself included; 0: all of them

  // Floats of scratch for an item over `kv_heads` kv heads: q and acc
  // (heads, D), scores (heads, kBlock), running max and sum (heads,).
  int64_t workspace(int64_t kv_heads) const {
    return kv_heads * group_size * (2 * head_dim + kBlock + 2) + 2 * kv_heads * kBlock;
  }
};

// Scores of one head against a block's n K rows, into s[0, n8); padding -inf.
// `ks` (quantized pages only): each row's K scale, multiplied into its score.
template <typename T, int NV>
void block_scores(const float* qf, const T* const* krow, int64_t koff, int64_t n, int64_t nv,
                  float* s, const float* ks) {
  v8f qv[NV > 0 ? NV : 32];
  for (int64_t j = 0; j < nv; ++j) qv[j] = load8(qf + 8 * j);
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    v8f dots[8];
    for (int64_t i = 0; i < 8; ++i) {
      dots[i] = splat(0.0f);
      if (i0 + i >= n) continue;
      const T* kr = krow[i0 + i] + koff;
      for (int64_t j = 0; j < nv; ++j) dots[i] += qv[j] * load8(kr + 8 * j);
    }
    const v8f idx = v8f{0, 1, 2, 3, 4, 5, 6, 7} + static_cast<float>(i0);
    v8f sc = hsum8(dots);
    if (ks != nullptr) sc *= load8(ks + i0);
    store8(s + i0, idx < static_cast<float>(n) ? sc : splat(-INFINITY));
  }
}

// Online softmax over one block for one head: turns s into exp(s - m_new),
// rescales acc and the running sum l by exp(m - m_new), then adds the block's
// probability-weighted V rows to acc.
// `vs` (quantized pages only): each row's V scale, folded into its probability.
template <typename T, int NV>
void block_update(float* s, const T* const* vrow, int64_t koff, int64_t n, int64_t nv, float* m,
                  float* l, float* acc, const float* vs) {
  const int64_t n8 = (n + 7) & ~int64_t{7};
  v8f vmax = load8(s);
  for (int64_t i0 = 8; i0 < n8; i0 += 8) {
    const v8f x = load8(s + i0);
    vmax = x > vmax ? x : vmax;
  }
  const float m_new = std::max(*m, hmax(vmax));
  const float alpha = std::exp(*m - m_new);  // exactly 0 on the first block (m = -inf)
  v8f vsum = splat(0.0f);
  for (int64_t i0 = 0; i0 < n8; i0 += 8) {
    const v8f idx = v8f{0, 1, 2, 3, 4, 5, 6, 7} + static_cast<float>(i0);
    const v8f e = idx < static_cast<float>(n) ? exp8(load8(s + i0) - m_new) : splat(0.0f);
    store8(s + i0, e);
    vsum += e;
  }
  *l = *l * alpha + hsum(vsum);
  *m = m_new;
  if (vs != nullptr)
    for (int64_t i0 = 0; i0 < n8; i0 += 8) store8(s + i0, load8(s + i0) * load8(vs + i0));
  // Two accumulator sets (even and odd tokens) halve the FMA dependency chains.
  v8f a[NV > 0 ? NV : 32], b[NV > 0 ? NV : 32];
  for (int64_t j = 0; j < nv; ++j) a[j] = load8(acc + 8 * j) * alpha, b[j] = splat(0.0f);
  int64_t i = 0;
  for (; i + 1 < n; i += 2) {
    const v8f p0 = splat(s[i]), p1 = splat(s[i + 1]);
    const T* v0 = vrow[i] + koff;
    const T* v1 = vrow[i + 1] + koff;
    for (int64_t j = 0; j < nv; ++j) {
      a[j] += p0 * load8(v0 + 8 * j);
      b[j] += p1 * load8(v1 + 8 * j);
    }
  }
  if (i < n)
    for (int64_t j = 0; j < nv; ++j) a[j] += splat(s[i]) * load8(vrow[i] + koff + 8 * j);
  for (int64_t j = 0; j < nv; ++j) store8(acc + 8 * j, a[j] + b[j]);
}

// One item: sequence b, kv heads [kv0, kv1). NV = head_dim / 8 when fixed
// at compile time (full unroll), 0 = read at run time. Blocks of kBlock
// tokens: every head of the item runs over the block's rows while they sit
// in L1, so each K/V row comes from memory once.
template <typename T, typename C, int NV>
void decode_item(const Problem& p, int64_t b, int64_t kv0, int64_t kv1, float* ws) {
  constexpr bool quant = kQuantized<C, T>;
  const int64_t nv = NV > 0 ? NV : p.head_dim / 8, D = nv * 8, gs = p.group_size;
  const int64_t nh = (kv1 - kv0) * gs;  // query heads of this item
  float* qf = ws;              // (nh, D) scaled queries
  float* acc = qf + nh * D;    // (nh, D) unnormalised outputs
  float* s = acc + nh * D;     // (nh, kBlock) scores, then probabilities
  float* m = s + nh * kBlock;  // (nh,) running max
  float* l = m + nh;           // (nh,) running sum
  float* ks = l + nh;          // (kv heads, kBlock) K scales of the block's rows (quantized)
  float* vs = ks + (kv1 - kv0) * kBlock;  // (kv heads, kBlock) V scales
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride0 + kv0 * gs * p.q_stride1;
  for (int64_t h = 0; h < nh; ++h) {
    for (int64_t j = 0; j < nv; ++j) {
      store8(qf + h * D + 8 * j, load8(q + h * p.q_stride1 + 8 * j) * p.scale);
      store8(acc + h * D + 8 * j, splat(0.0f));
    }
    m[h] = -INFINITY;
    l[h] = 0.0f;
  }
  const int32_t* pages = p.page_table + b * p.pt_stride0;
  const int64_t ctx = p.context_lens[b], row = p.num_kv_heads * D;  // row: token stride
  const C* kbase = static_cast<const C*>(p.k) + kv0 * D;
  const C* vbase = static_cast<const C*>(p.v) + kv0 * D;
  const C *krow[kBlock], *vrow[kBlock];
  // The next token's place: the window's first token, then walked without division.
  const int64_t first = first_key(ctx, p.window);
  int64_t page_idx = first / p.page_size, offset = first % p.page_size;
  for (int64_t t0 = first; t0 < ctx; t0 += kBlock) {
    const int64_t n = std::min(kBlock, ctx - t0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t slot = static_cast<int64_t>(pages[page_idx]) * p.page_size + offset;
      krow[i] = kbase + slot * row;
      vrow[i] = vbase + slot * row;
      if constexpr (quant)
        for (int64_t c = 0; c < kv1 - kv0; ++c) {
          ks[c * kBlock + i] = static_cast<float>(p.k_scales[slot * p.num_kv_heads + kv0 + c]);
          vs[c * kBlock + i] = static_cast<float>(p.v_scales[slot * p.num_kv_heads + kv0 + c]);
        }
      if (++offset == p.page_size) offset = 0, ++page_idx;
    }
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t koff = (h / gs) * D;  // this head's kv head within the rows
      const float* hks = quant ? ks + (h / gs) * kBlock : nullptr;
      const float* hvs = quant ? vs + (h / gs) * kBlock : nullptr;
      block_scores<C, NV>(qf + h * D, krow, koff, n, nv, s + h * kBlock, hks);
      block_update<C, NV>(s + h * kBlock, vrow, koff, n, nv, m + h, l + h, acc + h * D, hvs);
    }
  }
  T* out = static_cast<T*>(p.out) + b * p.out_stride0 + kv0 * gs * p.out_stride1;
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t d = 0; d < D; ++d)
      out[h * p.out_stride1 + d] = static_cast<T>(acc[h * D + d] / l[h]);
}

// Kv heads per item: as many as keep >= 4 items per thread (whole token rows
// read in one go stream best), down to one for small batches.
int64_t heads_per_item(int64_t num_seqs, int64_t kv_heads, int64_t threads) {
  for (int64_t c = kv_heads; c > 1; --c)
    if (kv_heads % c == 0 && num_seqs * (kv_heads / c) >= 4 * threads) return c;
  return 1;
}

template <typename T, typename C, int NV>
void run(const Problem& p, int64_t num_seqs) {
  const int64_t max_threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t chunk = heads_per_item(num_seqs, p.num_kv_heads, max_threads);
  const int64_t per_seq = p.num_kv_heads / chunk, items = num_seqs * per_seq;
  const int64_t threads = std::min(max_threads, items);
  std::atomic<int64_t> next{0};
  auto drain = [&] {  // each thread takes items until none is left
    std::vector<float> ws(p.workspace(chunk));
    for (int64_t it = next++; it < items; it = next++) {
      const int64_t kv0 = (it % per_seq) * chunk;
      decode_item<T, C, NV>(p, it / per_seq, kv0, kv0 + chunk, ws.data());
    }
  };
  if (threads <= 1) return drain();
#pragma omp parallel num_threads(static_cast<int>(threads))
  drain();
}

template <typename T, typename C>
void dispatch_head_dim(const Problem& p, int64_t num_seqs) {
  switch (p.head_dim) {
    case 32: return run<T, C, 4>(p, num_seqs);
    case 64: return run<T, C, 8>(p, num_seqs);
    case 128: return run<T, C, 16>(p, num_seqs);
    default: return run<T, C, 0>(p, num_seqs);
  }
}

template <typename T>
void dispatch_cache(const Problem& p, int64_t num_seqs, at::ScalarType cache) {
  if (cache == at::kChar) return dispatch_head_dim<T, int8_t>(p, num_seqs);
  if (cache == at::kFloat8_e4m3fn) return dispatch_head_dim<T, c10::Float8_e4m3fn>(p, num_seqs);
  return dispatch_head_dim<T, T>(p, num_seqs);
}

// One (token, kv head) row: scale = bf16(absmax / qmax); values = x / scale,
// rounded half to even and clamped (int8) or clamped and cast (fp8).
template <typename T, typename C>
void quantize_row(const T* x, int64_t D, C* out, c10::BFloat16* scale) {
  constexpr bool is_int8 = std::is_same<C, int8_t>::value;
  constexpr float qmax = is_int8 ? 127.0f : 448.0f;
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const c10::BFloat16 s(std::max(amax / qmax, 1e-30f));
  *scale = s;
  const float sf = static_cast<float>(s);
  for (int64_t d = 0; d < D; ++d) {
    const float y = std::min(std::max(static_cast<float>(x[d]) / sf, -qmax), qmax);
    if constexpr (is_int8) out[d] = static_cast<int8_t>(std::nearbyint(y));
    else out[d] = C(y);
  }
}

template <typename T, typename C>
void quantize_write_impl(const torch::Tensor& k, const torch::Tensor& v, const int64_t* slots,
                         torch::Tensor& kc, torch::Tensor& vc, torch::Tensor& ks, torch::Tensor& vs) {
  const int64_t T_ = k.size(0), KVH = k.size(1), D = k.size(2);
  const T* kp = static_cast<const T*>(k.data_ptr());
  const T* vp = static_cast<const T*>(v.data_ptr());
  C* kcp = static_cast<C*>(kc.data_ptr());
  C* vcp = static_cast<C*>(vc.data_ptr());
  auto* ksp = static_cast<c10::BFloat16*>(ks.data_ptr());
  auto* vsp = static_cast<c10::BFloat16*>(vs.data_ptr());
  const int64_t k0 = k.stride(0), k1 = k.stride(1), v0 = v.stride(0), v1 = v.stride(1);
  at::parallel_for(0, T_ * KVH, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / KVH, h = i % KVH, dst = slots[t] * KVH + h;
      quantize_row<T, C>(kp + t * k0 + h * k1, D, kcp + dst * D, ksp + dst);
      quantize_row<T, C>(vp + t * v0 + h * v1, D, vcp + dst * D, vsp + dst);
    }
  });
}

}  // namespace

// out/q: (B, H, D), last dim contiguous (other strides free); k/v_cache:
// (P, page, KVH, D) contiguous; page_table: (B, max_pages) and context_lens:
// (B,), int32 or int64, each context in [1, max_pages * page]. Head h uses
// kv head h / (H / KVH). Every index is checked before any is followed.
// window >= 0: keys a query sees (0: all); page_table entries of pages wholly
// before a sequence's window are never read, so they may hold anything.
// Quantized pools: k_cache/v_cache int8 or float8_e4m3fn and k_scales/v_scales
// (P, page, KVH) bfloat16; otherwise the caches are in q's dtype and the
// scales None.
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                  torch::Tensor v_cache, torch::Tensor page_table,
                  torch::Tensor context_lens, double scale,
                  c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales,
                  int64_t window) {
  const auto dtype = q.scalar_type();
  const auto cache = k_cache.scalar_type();
  const bool quant = cache == at::kChar || cache == at::kFloat8_e4m3fn;
  for (const auto* t : {&out, &q, &k_cache, &v_cache, &page_table, &context_lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_decode: every tensor must be on the CPU");
  TORCH_CHECK(out.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kBFloat16),
              "paged_decode: out and q must both be float32 or both bfloat16");
  TORCH_CHECK(v_cache.scalar_type() == cache && (quant || cache == dtype),
              "paged_decode: k_cache and v_cache must be in q's dtype, or both int8 / float8_e4m3fn");
  TORCH_CHECK(quant == (k_scales.has_value() && v_scales.has_value()),
              "paged_decode: k_scales and v_scales are required with quantized caches, and only then");
  if (quant)
    for (const auto* t : {&*k_scales, &*v_scales})
      TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->dim() == 3 &&
                      t->size(0) == k_cache.size(0) && t->size(1) == k_cache.size(1) &&
                      t->size(2) == k_cache.size(2),
                  "paged_decode: scales must be contiguous bfloat16 (P, page, KVH)");
  for (const auto* t : {&page_table, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong,
                "paged_decode: page_table and context_lens must be int32 or int64");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "paged_decode: q and out must be (B, H, D) with a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: k_cache and v_cache must be contiguous (P, page, KVH, D)");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t P = k_cache.size(0), page = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 8 == 0 && D <= 256,
              "paged_decode: head_dim must match and be a multiple of 8 up to 256, got ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "paged_decode: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == B && context_lens.dim() == 1 &&
                  context_lens.size(0) == B,
              "paged_decode: page_table must be (B, max_pages) and context_lens (B,)");
  TORCH_CHECK(window >= 0, "paged_decode: window must be >= 0 (0: no window), got ", window);
  if (B == 0 || H == 0) return;
  const auto pt = page_table.to(at::kInt).contiguous();
  const auto ctx = context_lens.to(at::kInt).contiguous();
  const int64_t max_pages = pt.size(1);
  const int32_t* pt_data = pt.data_ptr<int32_t>();
  const int32_t* ctx_data = ctx.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t c = ctx_data[b];
    TORCH_CHECK(c >= 1 && c <= max_pages * page, "paged_decode: context_lens[", b, "] = ", c,
                " outside [1, ", max_pages * page, "]");
    for (int64_t j = first_key(c, window) / page; j < (c + page - 1) / page; ++j)
      TORCH_CHECK(pt_data[b * max_pages + j] >= 0 && pt_data[b * max_pages + j] < P,
                  "paged_decode: page_table[", b, "][", j, "] = ", pt_data[b * max_pages + j],
                  " outside [0, ", P, ")");
  }
  const auto* ksd = quant ? static_cast<const c10::BFloat16*>(k_scales->data_ptr()) : nullptr;
  const auto* vsd = quant ? static_cast<const c10::BFloat16*>(v_scales->data_ptr()) : nullptr;
  const Problem p{q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), ksd, vsd,
                  pt_data, ctx_data, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                  max_pages, page, KVH, H / KVH, D, static_cast<float>(scale), window};
  dtype == at::kFloat ? dispatch_cache<float>(p, B, cache) : dispatch_cache<c10::BFloat16>(p, B, cache);
}

// k, v: (T, KVH, D) float32 or bfloat16, last dim contiguous; slots: (T,) int64;
// k_cache/v_cache: (slots, KVH, D) int8 or float8_e4m3fn; k_scales/v_scales:
// (slots, KVH) bfloat16; all contiguous but k and v. Every slot is checked.
void quantize_write(torch::Tensor k, torch::Tensor v, torch::Tensor slots, torch::Tensor k_cache,
                    torch::Tensor v_cache, torch::Tensor k_scales, torch::Tensor v_scales) {
  const auto dtype = k.scalar_type(), cache = k_cache.scalar_type();
  for (const auto* t : {&k, &v, &slots, &k_cache, &v_cache, &k_scales, &v_scales})
    TORCH_CHECK(t->device().is_cpu(), "quantize_write: every tensor must be on the CPU");
  TORCH_CHECK(v.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kBFloat16),
              "quantize_write: k and v must both be float32 or both bfloat16");
  TORCH_CHECK(v_cache.scalar_type() == cache && (cache == at::kChar || cache == at::kFloat8_e4m3fn),
              "quantize_write: caches must both be int8 or both float8_e4m3fn");
  TORCH_CHECK(k_scales.scalar_type() == at::kBFloat16 && v_scales.scalar_type() == at::kBFloat16,
              "quantize_write: scales must be bfloat16");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "quantize_write: k and v must be (T, KVH, D) with a contiguous last dim");
  for (const auto* t : {&k_cache, &v_cache, &k_scales, &v_scales})
    TORCH_CHECK(t->is_contiguous(), "quantize_write: caches and scales must be contiguous");
  const int64_t T_ = k.size(0), KVH = k.size(1), D = k.size(2), S = k_cache.size(0);
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == KVH && k_cache.size(2) == D &&
                  v_cache.sizes() == k_cache.sizes() && k_scales.dim() == 2 &&
                  k_scales.size(0) == S && k_scales.size(1) == KVH &&
                  v_scales.sizes() == k_scales.sizes(),
              "quantize_write: cache shapes must be (slots, KVH, D) and scales (slots, KVH)");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T_, "quantize_write: slots must be (T,)");
  const auto sl = slots.to(at::kLong).contiguous();
  const int64_t* sd = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(sd[t] >= 0 && sd[t] < S, "quantize_write: slot ", sd[t], " outside [0, ", S, ")");
  if (dtype == at::kFloat)
    cache == at::kChar ? quantize_write_impl<float, int8_t>(k, v, sd, k_cache, v_cache, k_scales, v_scales)
                       : quantize_write_impl<float, c10::Float8_e4m3fn>(k, v, sd, k_cache, v_cache, k_scales, v_scales);
  else
    cache == at::kChar ? quantize_write_impl<c10::BFloat16, int8_t>(k, v, sd, k_cache, v_cache, k_scales, v_scales)
                       : quantize_write_impl<c10::BFloat16, c10::Float8_e4m3fn>(k, v, sd, k_cache, v_cache, k_scales, v_scales);
}

// The extension's other sources (one module for all): quant_gemm.cpp, weight-only int8/int4 products.
void int8_gemm(torch::Tensor out, torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t group_size);
void int4_gemm(torch::Tensor out, torch::Tensor x, torch::Tensor codes, torch::Tensor dm, int64_t group_size);
void int8_dequant(torch::Tensor out, torch::Tensor q, torch::Tensor scales, int64_t group_size);
void int4_dequant(torch::Tensor out, torch::Tensor codes, torch::Tensor dm, int64_t group_size);
// And gemv.cpp: float32 products of one or two rows (batch-1 decode's linear layers).
void gemv_f32(torch::Tensor out, torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
std::string gemv_isa();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention into out, in place",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("page_table"),
        py::arg("context_lens"), py::arg("scale"), py::arg("k_scales") = py::none(),
        py::arg("v_scales") = py::none(), py::arg("window") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("quantize_write", &quantize_write, "Quantize k and v per token and head into their slots",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_gemm", &int8_gemm, "out = x @ (q * scales per group)^T, float32", py::call_guard<py::gil_scoped_release>());
  m.def("int4_gemm", &int4_gemm, "out = x @ (codes * d + m)^T, float32", py::call_guard<py::gil_scoped_release>());
  m.def("int8_dequant", &int8_dequant, "out = q * scales per group", py::call_guard<py::gil_scoped_release>());
  m.def("int4_dequant", &int4_dequant, "out = codes * d + m", py::call_guard<py::gil_scoped_release>());
  m.def("gemv_f32", &gemv_f32, "out = x @ weight^T (+ bias), float32, one or two rows", py::arg("out"),
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("gemv_isa", &gemv_isa, "The vector path gemv_f32 was built with: avx512, avx2 or scalar");
}
