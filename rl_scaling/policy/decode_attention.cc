// One decode step's attention on XLA:CPU: each row's new query heads over its KV cache.
//
//   out[b, k, g, :] = softmax_s(mask[b, s] ? q[b, k, g, :] . key[b, k, s, :] * scale : lowest) @ value[b, k, s, :]
//
// the same softmax as model._attend (masked slots get the lowest float, then exp(x - max) / sum),
// in one pass over each (row, kv head)'s cache, rows split over XLA's intra-op threads. XLA
// runs these as tiny batched matmuls and softmax fusions (docs/benchmarks.md). AVX-512 only, head_dim a
// multiple of 16; cpu_kernels.py builds this file with the host's compiler and falls back
// to XLA's attention where it cannot.
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_kernels.h"

namespace ffi = xla::ffi;

namespace {

using rl_scaling::Exp;

struct Problem {
  int64_t B, K, G, H, S;
  const float *q, *k, *v;
  const bool* mask;
  float scale;
  float* out;
};

// Lane j of the result: the sum of the 16 lanes of r[j] (a transpose-and-add tree).
inline __m512 Sum16(const __m512* r) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]), _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xdd));
}

// One (row, kv head): its G queries over its first S slots. valid: the row's mask as 16-slot
// bit blocks (0 past S); p: G * S16 floats of scratch.
void AttendHead(const Problem& P, int64_t S, const float* q, const float* k, const float* v,
                const __mmask16* valid, float* o, float* p) {
  const int64_t G = P.G, H = P.H, S16 = (S + 15) / 16 * 16;
  const __m512 scale = _mm512_set1_ps(P.scale), lowest = _mm512_set1_ps(std::numeric_limits<float>::lowest());
  for (int64_t g = 0; g < G; ++g, p += S16) {
    const float* qg = q + g * H;
    for (int64_t s0 = 0; s0 < S; s0 += 16) {  // 16 slots' scores at a time
      __m512 acc[16];
      const int64_t n = S - s0 < 16 ? S - s0 : 16;
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t h = 0; h < H; h += 16) {
        const __m512 qh = _mm512_loadu_ps(qg + h);
        for (int64_t j = 0; j < n; ++j) acc[j] = _mm512_fmadd_ps(qh, _mm512_loadu_ps(k + (s0 + j) * H + h), acc[j]);
      }
      _mm512_storeu_ps(p + s0, Sum16(acc));
    }
    __m512 top = lowest;
    for (int64_t s0 = 0; s0 < S16; s0 += 16) {  // masked slots: lowest; slots past S: -inf, exp'd to 0
      const __mmask16 inside = S - s0 >= 16 ? 0xffff : static_cast<__mmask16>((1u << (S - s0)) - 1);
      __m512 x = _mm512_mask_mul_ps(lowest, valid[s0 / 16], _mm512_loadu_ps(p + s0), scale);
      x = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), inside, x);
      _mm512_storeu_ps(p + s0, x);
      top = _mm512_max_ps(top, x);
    }
    top = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t s0 = 0; s0 < S16; s0 += 16) {
      const __m512 e = Exp(_mm512_sub_ps(_mm512_loadu_ps(p + s0), top));
      _mm512_storeu_ps(p + s0, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
    for (int64_t h = 0; h < H; h += 16) {  // four partial sums, so the FMAs do not wait on each other
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      int64_t s = 0;
      for (; s + 4 <= S; s += 4)
        for (int j = 0; j < 4; ++j)
          acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(p[s + j]), _mm512_loadu_ps(v + (s + j) * H + h), acc[j]);
      for (; s < S; ++s) acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(p[s]), _mm512_loadu_ps(v + s * H + h), acc[0]);
      const __m512 total = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
      _mm512_storeu_ps(o + g * H + h, _mm512_mul_ps(total, inv));
    }
  }
}

void AttendRows(const Problem& P, int64_t b0, int64_t b1) {
  const int64_t K = P.K, G = P.G, H = P.H, S = P.S, S16 = (S + 15) / 16 * 16;
  std::vector<float> scratch(G * S16);
  std::vector<__mmask16> valid(S16 / 16);
  for (int64_t b = b0; b < b1; ++b) {
    const bool* m = P.mask + b * S;
    // Slots after the row's last valid one would get weight exp(lowest - max) = 0: skip them, so a
    // step reads the slots written so far, not the whole cache. No valid slot: all S, uniform.
    int64_t used = S;
    while (used > 0 && !m[used - 1]) --used;
    if (used == 0) used = S;
    for (int64_t s0 = 0; s0 < used; s0 += 16) {
      unsigned bits = 0;
      for (int64_t j = 0; j < 16 && s0 + j < used; ++j) bits |= m[s0 + j] ? 1u << j : 0u;
      valid[s0 / 16] = static_cast<__mmask16>(bits);
    }
    for (int64_t kh = 0; kh < K; ++kh) {
      const int64_t i = b * K + kh;
      AttendHead(P, used, P.q + i * G * H, P.k + i * S * H, P.v + i * S * H, valid.data(), P.out + i * G * H,
                 scratch.data());
    }
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, float scale,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || qd[3] % 16 != 0)
    return ffi::Error::InvalidArgument("decode_attention: q [B, K, G, H] and k [B, K, S, H] with H % 16 == 0");
  const Problem P{qd[0], qd[1], qd[2], qd[3], kd[2], q.typed_data(), k.typed_data(), v.typed_data(),
                  mask.typed_data(), scale, out->typed_data()};
  // One block of rows per pool thread (the caller takes any a busy pool has not started).
  const int64_t n = pool.num_threads() < 1 ? 1 : pool.num_threads() < P.B ? pool.num_threads() : P.B;
  rl_scaling::ParallelFor(pool, n, [&P, n](int64_t i) { AttendRows(P, P.B * i / n, P.B * (i + 1) / n); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlScalingDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
