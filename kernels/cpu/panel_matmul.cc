// out[M, N] = x[M, K] @ W for few rows M (a decode step, a verify block), float32, on the CPU.
//
// W arrives packed in panels of 16 columns, [N / 16, K, 16] (prepared once at load time), so each panel is one
// contiguous stream: the kernel reads two panels at a time once per group of up to 8 rows, keeping the group's
// 8 × 32 partial sums in vector registers (each x element loaded once for both panels). XLA:CPU's general
// matmul packs W on every call for M > 1, which is what makes a verify of a few tokens cost far more than a
// one-token step.
//
// Every output element is the sum over k = 0 … K-1, in that order, of x[m, k] · W[k, n] (one multiply-add
// each): the same operations whatever M is and whichever group a row falls in, so a row's result is the same
// bits in a one-token step and in any verify block.
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

constexpr int64_t kPanel = 16;  // columns per panel
constexpr int kGroup = 8;       // rows per pass over a panel
typedef float Lanes __attribute__((vector_size(kPanel * sizeof(float))));

template <int R>
static inline void Rows(const float* __restrict x, const float* __restrict panel, float* __restrict out,
                        int64_t k_dim, int64_t n_dim) {
  Lanes acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Lanes{};
  for (int64_t k = 0; k < k_dim; ++k) {
    Lanes w;
    std::memcpy(&w, panel + k * kPanel, sizeof(Lanes));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] += x[r * k_dim + k] * w;
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * n_dim, &acc[r], sizeof(Lanes));
}

// Two panels at once: one broadcast of x[r, k] feeds both (the loads, not the multiply-adds, limit wide blocks).
template <int R>
static inline void Rows2(const float* __restrict x, const float* __restrict p0, const float* __restrict p1,
                         float* __restrict out, int64_t k_dim, int64_t n_dim) {
  Lanes a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = Lanes{};
  for (int64_t k = 0; k < k_dim; ++k) {
    Lanes w0, w1;
    std::memcpy(&w0, p0 + k * kPanel, sizeof(Lanes));
    std::memcpy(&w1, p1 + k * kPanel, sizeof(Lanes));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * k_dim + k];
      a0[r] += xr * w0;
      a1[r] += xr * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    std::memcpy(out + r * n_dim, &a0[r], sizeof(Lanes));
    std::memcpy(out + r * n_dim + kPanel, &a1[r], sizeof(Lanes));
  }
}

// Rows [m, m + R) against panels [first, last).
template <int R>
static inline void Group(const float* x, const float* ws, float* os, int64_t k_dim, int64_t n_dim, int64_t first,
                         int64_t last) {
  int64_t p = first;
  for (; p + 2 <= last; p += 2)
    Rows2<R>(x, ws + p * k_dim * kPanel, ws + (p + 1) * k_dim * kPanel, os + p * kPanel, k_dim, n_dim);
  if (p < last) Rows<R>(x, ws + p * k_dim * kPanel, os + p * kPanel, k_dim, n_dim);
}

static void Span(const float* xs, const float* ws, float* os, int64_t m_dim, int64_t k_dim, int64_t n_dim,
                 int64_t first, int64_t last) {
  int64_t m = 0;
  for (; m + kGroup <= m_dim; m += kGroup) Group<kGroup>(xs + m * k_dim, ws, os + m * n_dim, k_dim, n_dim, first, last);
  const float* xr = xs + m * k_dim;
  float* orow = os + m * n_dim;
  switch (m_dim - m) {
    case 7: Group<7>(xr, ws, orow, k_dim, n_dim, first, last); break;
    case 6: Group<6>(xr, ws, orow, k_dim, n_dim, first, last); break;
    case 5: Group<5>(xr, ws, orow, k_dim, n_dim, first, last); break;
    case 4: Group<4>(xr, ws, orow, k_dim, n_dim, first, last); break;
    case 3: Group<3>(xr, ws, orow, k_dim, n_dim, first, last); break;
    case 2: Group<2>(xr, ws, orow, k_dim, n_dim, first, last); break;
    case 1: Group<1>(xr, ws, orow, k_dim, n_dim, first, last); break;
    default: break;
  }
}

// The panels split into chunks that the calling thread and pool tasks claim one at a time. The caller waits
// only for chunks already claimed (running somewhere), never for a task still queued: a pool busy with other
// work cannot deadlock it. A task that starts after every chunk is claimed finds nothing to do; it holds the
// shared state (not the caller's stack), so it may outlive the call.
struct Work {
  const float* x;
  const float* w;
  float* out;
  int64_t m_dim, k_dim, n_dim, panels, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      Span(x, w, out, m_dim, k_dim, n_dim, panels * c / chunks, panels * (c + 1) / chunks);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

static ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                              ffi::ResultBuffer<ffi::F32> out) {
  // W is [..., N / 16, K, 16] with leading axes of size 1 (vmap adds one).
  const auto dims = w.dimensions();
  const size_t rank = dims.size();
  if (rank < 3 || dims[rank - 1] != kPanel) return ffi::Error::InvalidArgument("W must be packed [N / 16, K, 16]");
  for (size_t i = 0; i + 3 < rank; ++i) {
    if (dims[i] != 1) return ffi::Error::InvalidArgument("W must be one matrix (leading axes of size 1)");
  }
  const int64_t panels = dims[rank - 3], k_dim = dims[rank - 2];
  if (k_dim == 0 || x.element_count() % k_dim) return ffi::Error::InvalidArgument("x's last axis must be K");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->out = out->typed_data();
  work->m_dim = x.element_count() / k_dim;
  work->k_dim = k_dim;
  work->n_dim = panels * kPanel;
  work->panels = panels;
  // Up to 4 chunks per pool thread, at least 8 panels each.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  work->chunks = std::max<int64_t>(1, std::min<int64_t>(4 * threads, panels / 8));
  for (int64_t i = 1; i < std::min(threads, work->chunks); ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DspinePanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // W [N / 16, K, 16]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [..., N]
