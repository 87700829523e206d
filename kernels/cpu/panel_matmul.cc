// out[M, N] = x[M, K] @ W for few rows M (a decode step, a verify block), float32, on the CPU.
//
// W arrives packed in panels of 16 columns, [N / 16, K, 16] (prepared once at load time), so each panel is one
// contiguous stream: the kernel reads a few panels at a time once per group of rows (up to 8), keeping the group's
// partial sums in vector registers (each x element broadcast once for all of them). XLA:CPU's general matmul
// packs W on every call for M > 1, which is what makes a verify of a few tokens cost far more than a one-token
// step.
//
// How many panels at a time, and the prefetch: a row of 16 lanes is one cache line per k, so a pass is as fast
// as its streams arrive. With AVX-512, four streams (three for 5–8 rows: 24 accumulators, the most that fit 32
// registers beside the panels' lanes) keep more lines in flight than two, and a software prefetch kAhead lines
// ahead hides the latency the multiply-adds of several rows no longer cover. Measured on a 2-core AVX-512 Xeon
// over SmolLM2-135M's products (experiments/adaptive/RESULTS.md, 2026-12-06 fourth run): from two panels
// without prefetch, the products of 1 / 4 / 8 rows ~5 / 16 / 22 % faster.
//
// Without AVX-512 (AVX2: 16 registers of 8 lanes) a panel row is two vectors, so the shapes differ: groups of 6
// rows, 4 / 2 / 1 panels per pass for 1 / 2–4 / 5–6 rows. Built with the AVX-512 shapes (16-lane vectors, groups
// of 8 rows), AVX2 spilled its sums to the stack: on a 2-core AMD EPYC (Zen 3) a SmolLM2-135M step took 65 ms
// (XLA's products: ~32 ms) and each verified token added ~55 % of a step; with these shapes a step takes ~25 ms
// and the products of 4 rows cost 1.10–1.12× one row's (experiments/adaptive/RESULTS.md, ninth run).
//
// Rows beyond one group (a long verify, a prefill) take every group over a block of kBlock panels before the next
// block, so each block comes from memory once and from cache for the other groups.
//
// Every output element is the sum over k = 0 … K-1, in that order, of x[m, k] · W[k, n] (one multiply-add
// each): the same operations whatever M is and whichever group a row falls in, so a row's result is the same
// bits in a one-token step and in any verify block.
//
// W may also arrive as bfloat16 (the upper halves of float32 values, for a matrix whose values all are
// bfloat16, e.g. a checkpoint stored in it): each is widened to its float32 value, exactly, before the same
// multiply-adds, so the products are the same bits as with the float32 matrix, from half the bytes.
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

constexpr int64_t kPanel = 16;  // columns per panel
constexpr int64_t kAheadBytes = 64 * 64;  // each stream is prefetched 64 cache lines ahead
// The machine's vectors: a panel row of 16 floats is kParts of them. Each pass keeps R rows × P panels of partial
// sums in registers (R · P · kParts of them) beside one panel row per panel; the row group and the panels per pass
// are chosen to fit the register file, or nearly (AVX2 with AVX-512's shapes spilled most of its sums).
#if defined(__AVX512F__)
constexpr int kLanes = 16;  // 32 registers of 16 lanes
constexpr int kGroup = 8;   // rows per pass over a panel
template <int R> constexpr int Wide() { return R <= 4 ? 4 : 3; }  // 5–8 rows: 24 sums, the most that fit
constexpr int64_t kBlock = 12;  // panels per block: whole passes of 4 and of 3
#else
constexpr int kLanes = 8;  // AVX2's 16 registers of 8 lanes (two SSE / NEON registers per vector elsewhere)
constexpr int kGroup = 6;
// ≤ 16 sums: 4 rows × 2 panels spill a few, yet two streams beat one (experiments/adaptive/panel_products.py, three
// alternating builds: SmolLM2's products of 4 rows 22.8–23.9 ms with one panel per pass, 20.0–21.0 ms with two).
template <int R> constexpr int Wide() { return R == 1 ? 4 : R <= 4 ? 2 : 1; }
constexpr int64_t kBlock = 4;
#endif
constexpr int kParts = kPanel / kLanes;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// kLanes values of W as float32 lanes: float32 as stored, bfloat16 (uint16_t) widened exactly.
static inline __attribute__((always_inline)) Lanes LoadLanes(const float* row) {
  Lanes v;
  std::memcpy(&v, row, sizeof(Lanes));
  return v;
}
static inline __attribute__((always_inline)) Lanes LoadLanes(const uint16_t* row) {
  Halves h;
  std::memcpy(&h, row, sizeof(Halves));
  const Words bits = __builtin_convertvector(h, Words) << 16;
  Lanes v;
  std::memcpy(&v, &bits, sizeof(Lanes));
  return v;
}

// R rows against P consecutive panels: one broadcast of x[r, k] feeds all P.
template <int R, int P, typename W>
static inline void Panels(const float* __restrict x, const W* __restrict panel, float* __restrict out,
                          int64_t k_dim, int64_t n_dim) {
  const int64_t stride = k_dim * kPanel;
  Lanes acc[P][R][kParts];
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kParts; ++v) acc[p][r][v] = Lanes{};
  for (int64_t k = 0; k < k_dim; ++k) {
    Lanes w[P][kParts];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const W* row = panel + p * stride + k * kPanel;
      __builtin_prefetch(reinterpret_cast<const char*>(row) + kAheadBytes);
#pragma GCC unroll 2
      for (int v = 0; v < kParts; ++v) w[p][v] = LoadLanes(row + v * kLanes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * k_dim + k];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p)
#pragma GCC unroll 2
        for (int v = 0; v < kParts; ++v) acc[p][r][v] += xr * w[p][v];
    }
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kParts; ++v) std::memcpy(out + r * n_dim + p * kPanel + v * kLanes, &acc[p][r][v], sizeof(Lanes));
}

// Rows [0, R) against panels [p, end): Wide<R>() panels per pass, then pairs (where two fit), then one.
template <int R, typename W>
static inline void Block(const float* x, const W* ws, float* os, int64_t k_dim, int64_t n_dim, int64_t p,
                         int64_t end) {
  constexpr int kWide = Wide<R>();
  for (; p + kWide <= end; p += kWide) Panels<R, kWide>(x, ws + p * k_dim * kPanel, os + p * kPanel, k_dim, n_dim);
  if constexpr (kWide > 2) {
    for (; p + 2 <= end; p += 2) Panels<R, 2>(x, ws + p * k_dim * kPanel, os + p * kPanel, k_dim, n_dim);
  }
  for (; p < end; ++p) Panels<R, 1>(x, ws + p * k_dim * kPanel, os + p * kPanel, k_dim, n_dim);
}

// The rows left after the whole groups (fewer than kGroup): one group of that many.
template <int R, typename W>
static inline void Tail(int64_t rows, const float* x, const W* ws, float* os, int64_t k_dim, int64_t n_dim,
                        int64_t p, int64_t end) {
  if constexpr (R > 0) {
    if (rows == R) return Block<R>(x, ws, os, k_dim, n_dim, p, end);
    Tail<R - 1>(rows, x, ws, os, k_dim, n_dim, p, end);
  }
}

// Rows [0, m_dim) against panels [first, last), kBlock panels at a time, every row group over a block before the
// next block: a block is read from memory once, then from cache for the other row groups (a prefill's).
template <typename W>
static void Span(const float* xs, const W* ws, float* os, int64_t m_dim, int64_t k_dim, int64_t n_dim,
                 int64_t first, int64_t last) {
  for (int64_t p = first; p < last; p += kBlock) {
    const int64_t end = std::min<int64_t>(p + kBlock, last);
    int64_t m = 0;
    for (; m + kGroup <= m_dim; m += kGroup) Block<kGroup>(xs + m * k_dim, ws, os + m * n_dim, k_dim, n_dim, p, end);
    Tail<kGroup - 1>(m_dim - m, xs + m * k_dim, ws, os + m * n_dim, k_dim, n_dim, p, end);
  }
}

// The panels split into chunks that the calling thread and pool tasks claim one at a time. The caller waits
// only for chunks already claimed (running somewhere), never for a task still queued: a pool busy with other
// work cannot deadlock it. A task that starts after every chunk is claimed finds nothing to do; it holds the
// shared state (not the caller's stack), so it may outlive the call.
template <typename W>
struct Work {
  const float* x;
  const W* w;
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

template <ffi::DataType D>
static ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<D> w,
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
  auto work = std::make_shared<Work<ffi::NativeType<D>>>();
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(DspinePanelMatmul, PanelMatmul<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // W [N / 16, K, 16]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [..., N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DspinePanelMatmulBf16, PanelMatmul<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [..., K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // W [N / 16, K, 16], bfloat16
                                  .Ret<ffi::Buffer<ffi::F32>>());   // out [..., N]
