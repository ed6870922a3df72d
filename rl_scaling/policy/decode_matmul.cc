// Matmuls of few rows on XLA:CPU: a decode step's projections, SwiGLU and LM head, [M, K] @ [K, N]
// for M of one sampling batch (64-256 rows).
//
// XLA's YNN runs these well below the float32 peak in the decode loop (docs/benchmarks.md): a weight matrix does not fit
// in L2, and its column blocks, read row by row 4 KiB apart, defeat the hardware prefetcher. Here
// the weights come as contiguous 32-column panels ([N / 32, K, 32], laid out once per sampling
// call by cpu_kernels.py) and each panel is multiplied by 12 rows at a time, 24 accumulators in
// registers. SwiGLU: a panel holds 16 gate and 16 up columns, and the output is silu(gate) * up.
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;  // columns per panel: two 16-float vectors

// silu(g) = g * sigmoid(g), from exp(-|g|) so the exponent never overflows.
inline __m512 Silu(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = rl_scaling::Exp(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __m512 sigmoid_abs = _mm512_div_ps(one, _mm512_add_ps(one, e));  // sigmoid(|g|)
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mul_ps(g, _mm512_mask_mul_ps(sigmoid_abs, negative, sigmoid_abs, e));  // sigmoid(g) = e / (1 + e) if g < 0
}

// Rows [0, R) of y (row stride ldy) from x's rows (stride K) and one [K, 32] panel.
template <int R, bool kSwiglu>
inline void RowsTimesPanel(const float* x, const float* panel, int64_t K, float* y, int64_t ldy) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel), w1 = _mm512_loadu_ps(panel + k * kPanel + 16);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (kSwiglu) {
      _mm512_storeu_ps(y + r * ldy, _mm512_mul_ps(Silu(acc[r][0]), acc[r][1]));
    } else {
      _mm512_storeu_ps(y + r * ldy, acc[r][0]);
      _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
  }
}

template <bool kSwiglu>
void PanelRange(const float* x, const float* panels, float* y, int64_t M, int64_t K, int64_t n_panels,
                int64_t p0, int64_t p1) {
  const int64_t width = kSwiglu ? kPanel / 2 : kPanel, ldy = n_panels * width;
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = panels + p * K * kPanel;
    float* out = y + p * width;
    int64_t m = 0;
    for (; m + 12 <= M; m += 12) RowsTimesPanel<12, kSwiglu>(x + m * K, panel, K, out + m * ldy, ldy);
    for (; m + 4 <= M; m += 4) RowsTimesPanel<4, kSwiglu>(x + m * K, panel, K, out + m * ldy, ldy);
    for (; m < M; ++m) RowsTimesPanel<1, kSwiglu>(x + m * K, panel, K, out + m * ldy, ldy);
  }
}

// x [M, K] @ panels [P, K, 32] -> y [M, 32 P] (kSwiglu: [M, 16 P]); panels split over threads.
template <bool kSwiglu>
ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), pd = panels.dimensions();
  if (xd.size() != 2 || pd.size() != 3 || pd[1] != xd[1] || pd[2] != kPanel)
    return ffi::Error::InvalidArgument("decode_matmul: x [M, K] and panels [P, K, 32]");
  const int64_t M = xd[0], K = xd[1], P = pd[0];
  const float* xp = x.typed_data();
  const float* wp = panels.typed_data();
  float* yp = y->typed_data();
  const int64_t parts = P < 8 ? P : 8;  // a few parts per thread, claimed as threads free up
  rl_scaling::ParallelFor(pool, parts, [=](int64_t i) {
    PanelRange<kSwiglu>(xp, wp, yp, M, K, P, P * i / parts, P * (i + 1) / parts);
  });
  return ffi::Error::Success();
}

// panels [P, K, 32] <- the column concatenation of `sources` (stacks [L, K, N_i], their layer
// `layer`); with `interleave`, two sources and each panel 16 columns of the first then the same
// 16 of the second (SwiGLU's gate and up). Reads each weight row once, front to back.
ffi::Error LayOutPanels(ffi::ThreadPool pool, ffi::RemainingArgs sources, int64_t layer, int64_t interleave,
                        ffi::ResultBuffer<ffi::F32> panels) {
  std::vector<const float*> rows;  // each source's layer, [K, N_i]
  std::vector<int64_t> widths;
  int64_t K = -1, N = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    auto source = sources.get<ffi::Buffer<ffi::F32>>(i);
    if (!source.has_value()) return source.error();
    auto d = source->dimensions();
    if (d.size() != 3 || layer < 0 || layer >= d[0] || (K >= 0 && d[1] != K))
      return ffi::Error::InvalidArgument("panel layout: sources [L, K, N_i] with one K and 0 <= layer < L");
    K = d[1];
    widths.push_back(d[2]);
    rows.push_back(source->typed_data() + layer * d[1] * d[2]);
    N += d[2];
  }
  const int64_t half = kPanel / 2;
  if (N % kPanel || (interleave && (rows.size() != 2 || widths[0] != widths[1] || widths[0] % half)))
    return ffi::Error::InvalidArgument("panel layout: columns a multiple of 32 (interleave: two sources of equal width)");
  const int64_t P = N / kPanel, parts = K < 8 ? K : 8;
  float* out = panels->typed_data();
  rl_scaling::ParallelFor(pool, parts, [&, K, N, P](int64_t part) {
    std::vector<float> row(N);
    for (int64_t k = K * part / parts; k < K * (part + 1) / parts; ++k) {
      if (interleave) {
        for (int64_t c = 0; c < widths[0]; c += half)
          for (int s = 0; s < 2; ++s)
            _mm512_storeu_ps(row.data() + 2 * c + s * half, _mm512_loadu_ps(rows[s] + k * widths[0] + c));
      } else {
        float* at = row.data();
        for (size_t s = 0; s < rows.size(); at += widths[s], ++s)
          for (int64_t c = 0; c < widths[s]; ++c) at[c] = rows[s][k * widths[s] + c];
      }
      for (int64_t p = 0; p < P; ++p)
        for (int64_t c = 0; c < kPanel; c += 16)
          _mm512_storeu_ps(out + (p * K + k) * kPanel + c, _mm512_loadu_ps(row.data() + p * kPanel + c));
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlScalingPanelLayout, LayOutPanels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("interleave")
                                  .Ret<ffi::Buffer<ffi::F32>>());

#define RL_SCALING_PANEL_HANDLER(name, swiglu)                                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, PanelMatmul<swiglu>,                                              \
                                ffi::Ffi::Bind()                                                        \
                                    .Ctx<ffi::ThreadPool>()                                             \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                       \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                       \
                                    .Ret<ffi::Buffer<ffi::F32>>());

RL_SCALING_PANEL_HANDLER(RlScalingPanelMatmul, false)
RL_SCALING_PANEL_HANDLER(RlScalingPanelSwiglu, true)
