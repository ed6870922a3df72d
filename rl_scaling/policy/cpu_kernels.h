// What the CPU kernels (decode_attention.cc, decode_matmul.cc) share: a vectorized exp and a
// parallel loop over XLA's intra-op threads. AVX-512; cpu_kernels.py compiles them together.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace rl_scaling {

// exp(x) for x <= 0 (Cephes' polynomial, ~1 ulp); 0 below ln(FLT_MIN), as XLA's exp underflows.
inline __m512 Exp(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3365447505531f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), _mm512_scalef_ps(y, n));
}

// fn(0), ..., fn(n - 1) on XLA's intra-op pool and the calling thread. Each part goes to whichever
// thread claims it first, so a busy pool never leaves the caller waiting on a part not started;
// the caller returns once every part is done.
template <typename Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto work = [counters, n, fn] {
    for (int64_t i; (i = counters->next.fetch_add(1)) < n;) {
      fn(i);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = pool.num_threads() < n - 1 ? pool.num_threads() : n - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work(); });
  work();
  while (counters->done.load(std::memory_order_acquire) < n) _mm_pause();
}

}  // namespace rl_scaling
