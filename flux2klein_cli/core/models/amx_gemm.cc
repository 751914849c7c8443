// XLA FFI handlers on oneMKL's bf16 GEMM (cblas_gemm_bf16bf16f32), which runs on AMX tiles where the
// CPU has them:
//   flux2klein_amx_gemm:      bf16 (M, K) x bf16 (K, N) -> f32 (M, N);
//   flux2klein_amx_attention: unmasked attention, bf16 (B, Sq, H, D) queries (already scaled) against
//                             (B, Sk, H, D) keys and values -> bf16 (B, Sq, H, D), a block of queries
//                             at a time so its scores stay in the core's cache;
//   flux2klein_amx_conv3x3:   a 3x3 'same' convolution with bias, NHWC bf16 -> bf16, as nine products
//                             per tile of output rows (no copy of the taps).
// MKL is opened at run time (dlopen), so this file builds with no MKL headers and the shim loads only
// where the Python side found libmkl_rt. Built with AVX-512 on: it is loaded on AMX CPUs only.
#include <dlfcn.h>
#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using GemmBf16 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const void*, int64_t, const void*,
                          int64_t, float, float*, int64_t);
using SetThreadsLocal = int (*)(int);
// The packed-operand form: a right-hand matrix packed once serves every block of rows after it.
using PackSizeBf16 = size_t (*)(int, int64_t, int64_t, int64_t);
using PackBf16 = void (*)(int, int, int, int64_t, int64_t, int64_t, const void*, int64_t, void*);
using ComputeBf16 = void (*)(int, int64_t, int64_t, int64_t, int64_t, int64_t, float, const void*, int64_t,
                             const void*, int64_t, float, float*, int64_t);
static GemmBf16 gemm_bf16 = nullptr;
static SetThreadsLocal set_threads_local = nullptr;
static PackSizeBf16 pack_size_bf16 = nullptr;
static PackBf16 pack_bf16 = nullptr;
static ComputeBf16 compute_bf16 = nullptr;

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;
constexpr int64_t kQueryBlock = 128;  // 128 x 1536 float32 scores: 768 KB, inside a core's L2

extern "C" int flux2klein_amx_open(const char* path) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) return 1;
  gemm_bf16 = reinterpret_cast<GemmBf16>(dlsym(lib, "cblas_gemm_bf16bf16f32"));
  set_threads_local = reinterpret_cast<SetThreadsLocal>(dlsym(lib, "MKL_Set_Num_Threads_Local"));
  pack_size_bf16 = reinterpret_cast<PackSizeBf16>(dlsym(lib, "cblas_gemm_bf16bf16f32_pack_get_size"));
  pack_bf16 = reinterpret_cast<PackBf16>(dlsym(lib, "cblas_gemm_bf16bf16f32_pack"));
  compute_bf16 = reinterpret_cast<ComputeBf16>(dlsym(lib, "cblas_gemm_bf16bf16f32_compute"));
  if (pack_size_bf16 == nullptr || pack_bf16 == nullptr || compute_bf16 == nullptr) compute_bf16 = nullptr;
  return gemm_bf16 == nullptr || set_threads_local == nullptr ? 2 : 0;
}

static int worker_count() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// One thread per core (at most one per task).
static int workers_for(int64_t tasks) { return static_cast<int>(std::min<int64_t>(worker_count(), tasks)); }

// Runs work(task, worker) for every task in [0, tasks) on `workers` threads, MKL single-threaded
// inside each: the cores take separate tasks (and keep their data in their own caches) instead of
// MKL's threads splitting every small product.
template <typename Work>
static void parallel_tasks(int64_t tasks, int workers, Work work) {
  std::atomic<int64_t> next{0};
  auto run = [&](int worker) {
    set_threads_local(1);
    for (int64_t t = next++; t < tasks; t = next++) work(t, worker);
    set_threads_local(0);
  };
  std::vector<std::thread> threads;
  for (int i = 1; i < workers; ++i) threads.emplace_back(run, i);
  run(0);
  for (auto& t : threads) t.join();
}

static ffi::Error Gemm(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  if (gemm_bf16 == nullptr) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "oneMKL is not loaded");
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "expected (M, K) x (K, N)");
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  float* yp = y->typed_data();
  // MKL's own threads: with them sleeping between products (KMP_BLOCKTIME=0, set in cpu_matmul.py)
  // they were as fast as splitting the rows between the cores, or faster, at every width.
  gemm_bf16(kRowMajor, kNoTrans, kNoTrans, m, n, k, 1.0f, xp, k, w.untyped_data(), n, 0.0f, yp, n);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_amx_gemm, Gemm,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// float32 -> bfloat16 bits, rounding to nearest even as XLA's convert does; a NaN stays a (quiet)
// NaN, where rounding its payload could carry it into the infinity's bits.
static inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>((bits >> 16) | 0x40u) : rounded;
}

static inline float from_bf16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Sixteen float32 lanes at a time (AVX-512; this file is built for AMX CPUs only).
static inline __mmask16 lanes_left(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// to_bf16 on sixteen lanes, in integers: VCVTNEPS2BF16 would flush subnormals to zero.
static inline __m256i to_bf16x16(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f), high = _mm512_srli_epi32(bits, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  rounded = _mm512_mask_or_epi32(rounded, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), high, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(rounded);
}

// exp(x) for x <= 0: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p of degree 6 (relative error under
// 2e-7). Below -87, where expf leaves the normal range, it gives exp(-87) (1.6e-38) instead of a
// subnormal: nothing a softmax weight or its sum can tell apart. A NaN stays NaN (the clamp's max
// returns its second operand when either is NaN).
static inline __m512 exp_nonpositive(__m512 x) {
  const __m512 clamped = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

static float row_max(const float* x, int64_t n) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, lanes_left(n - j), x + j));
  return _mm512_reduce_max_ps(top);
}

// weights[j] = bf16(exp(x[j] - top)); returns the sum of the float32 exponentials.
static float exp_row(const float* x, int64_t n, float top, uint16_t* weights) {
  const __m512 shift = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = lanes_left(n - j);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x + j), shift));
    sum = _mm512_mask_add_ps(sum, lanes, sum, e);
    _mm256_mask_storeu_epi16(weights + j, lanes, to_bf16x16(e));
  }
  return _mm512_reduce_add_ps(sum);
}

struct AttentionShape {
  int64_t batch, sq, sk, heads, dim;
};

// A worker's scratch for one block of queries, and the keys and values of the head it last packed.
struct AttentionScratch {
  std::vector<float> scores, sums, acc;
  std::vector<uint16_t> weights;
  std::unique_ptr<uint8_t[]> keys, values;  // MKL's packed forms; uninitialised, MKL writes what it reads
  int64_t packed_head = -1;                 // batch * heads + head, or -1
};

// One block of `rows` queries of head h in batch b: scores, softmax, P @ V, normalised. With MKL's
// packed form the keys (transposed) and values of a head are packed once per worker, not per block.
static void attend_block(const AttentionShape& s, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                         uint16_t* out, int64_t b, int64_t h, int64_t row0, int64_t rows, AttentionScratch& w) {
  const int64_t stride = s.heads * s.dim;  // between tokens, in elements
  const uint16_t* qb = q + (b * s.sq + row0) * stride + h * s.dim;
  const uint16_t* kb = k + b * s.sk * stride + h * s.dim;
  const uint16_t* vb = v + b * s.sk * stride + h * s.dim;
  float* scores = w.scores.data();
  uint16_t* weights = w.weights.data();
  if (w.keys) {
    if (w.packed_head != b * s.heads + h) {
      pack_bf16(kRowMajor, kBMatrix, kTrans, kQueryBlock, s.sk, s.dim, kb, stride, w.keys.get());
      pack_bf16(kRowMajor, kBMatrix, kNoTrans, kQueryBlock, s.dim, s.sk, vb, stride, w.values.get());
      w.packed_head = b * s.heads + h;
    }
    compute_bf16(kRowMajor, kNoTrans, kPacked, rows, s.sk, s.dim, 1.0f, qb, stride, w.keys.get(), s.sk, 0.0f,
                 scores, s.sk);
  } else {
    gemm_bf16(kRowMajor, kNoTrans, kTrans, rows, s.sk, s.dim, 1.0f, qb, stride, kb, stride, 0.0f, scores, s.sk);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = scores + i * s.sk;
    w.sums[i] = exp_row(row, s.sk, row_max(row, s.sk), weights + i * s.sk);
  }
  float* acc = w.acc.data();
  if (w.values)
    compute_bf16(kRowMajor, kNoTrans, kPacked, rows, s.dim, s.sk, 1.0f, weights, s.sk, w.values.get(), s.dim, 0.0f,
                 acc, s.dim);
  else
    gemm_bf16(kRowMajor, kNoTrans, kNoTrans, rows, s.dim, s.sk, 1.0f, weights, s.sk, vb, stride, 0.0f, acc, s.dim);
  for (int64_t i = 0; i < rows; ++i) {
    uint16_t* o = out + (b * s.sq + row0 + i) * stride + h * s.dim;
    const __m512 sum = _mm512_set1_ps(w.sums[i]);
    for (int64_t d = 0; d < s.dim; d += 16) {
      const __mmask16 lanes = lanes_left(s.dim - d);
      _mm256_mask_storeu_epi16(o + d, lanes, to_bf16x16(_mm512_div_ps(_mm512_maskz_loadu_ps(lanes, acc + i * s.dim + d), sum)));
    }
  }
}

static ffi::Error Attention(ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k, ffi::Buffer<ffi::BF16> v,
                            ffi::ResultBuffer<ffi::BF16> out) {
  if (gemm_bf16 == nullptr) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "oneMKL is not loaded");
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || qd[0] != kd[0] || qd[2] != kd[2] ||
      qd[3] != kd[3] || !std::equal(kd.begin(), kd.end(), vd.begin()))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "expected (B, Sq, H, D) and two (B, Sk, H, D)");
  const AttentionShape s{qd[0], qd[1], kd[1], qd[2], qd[3]};
  const int64_t blocks = (s.sq + kQueryBlock - 1) / kQueryBlock;
  const int64_t tasks = s.batch * s.heads * blocks;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.untyped_data());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.untyped_data());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.untyped_data());
  auto* op = reinterpret_cast<uint16_t*>(out->untyped_data());
  // Tasks are (batch, head, query block), in that order, so a worker mostly keeps the head it packed.
  const int workers = workers_for(tasks);
  std::vector<AttentionScratch> scratch(workers);
  for (auto& w : scratch) {
    w.scores.resize(kQueryBlock * s.sk), w.weights.resize(kQueryBlock * s.sk);
    w.sums.resize(kQueryBlock), w.acc.resize(kQueryBlock * s.dim);
    if (compute_bf16 != nullptr) {
      w.keys.reset(new uint8_t[pack_size_bf16(kBMatrix, kQueryBlock, s.sk, s.dim)]);
      w.values.reset(new uint8_t[pack_size_bf16(kBMatrix, kQueryBlock, s.dim, s.sk)]);
    }
  }
  parallel_tasks(tasks, workers, [&](int64_t t, int worker) {
    const int64_t block = t % blocks, bh = t / blocks;
    const int64_t row0 = block * kQueryBlock, rows = std::min(kQueryBlock, s.sq - row0);
    attend_block(s, qp, kp, vp, op, bh / s.heads, bh % s.heads, row0, rows, scratch[worker]);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_amx_attention, Attention,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Ret<ffi::Buffer<ffi::BF16>>());

// Rows of output per task: a tile's float32 sums stay within about 512 KB.
constexpr int64_t kConvTileFloats = 128 * 1024;

// x: the input padded by the caller, (B, H + 3, W + 2, Cin): one row above and two below, one column
// each side. Output position (y, c) of a tile is row y of the padded width; tap (dy, dx) of all of them
// is then one (rows x Wp, Cin) matrix starting dy rows and dx columns further on, so each tap is one
// product accumulated into the tile (the two columns past W are computed and dropped; the second row
// below keeps the last tap of the last one inside the buffer).
static ffi::Error Conv3x3(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> kernel, ffi::Buffer<ffi::BF16> bias,
                          ffi::ResultBuffer<ffi::BF16> out) {
  if (gemm_bf16 == nullptr) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "oneMKL is not loaded");
  auto xd = x.dimensions(), kd = kernel.dimensions(), od = out->dimensions();
  if (xd.size() != 4 || kd.size() != 4 || od.size() != 4 || kd[0] != 3 || kd[1] != 3 || kd[2] != xd[3] ||
      od[0] != xd[0] || od[1] + 3 != xd[1] || od[2] + 2 != xd[2] || od[3] != kd[3] || bias.element_count() != kd[3])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "expected (B, H+3, W+2, Cin), (3, 3, Cin, Cout), (Cout,)");
  const int64_t batch = od[0], h = od[1], w = od[2], c_in = xd[3], c_out = kd[3], wp = xd[2];
  const int64_t tile_rows = std::max<int64_t>(1, std::min(h, kConvTileFloats / (wp * c_out)));
  const int64_t tiles = (h + tile_rows - 1) / tile_rows, tasks = batch * tiles;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const auto* kp = reinterpret_cast<const uint16_t*>(kernel.untyped_data());
  const auto* bp = reinterpret_cast<const uint16_t*>(bias.untyped_data());
  auto* op = reinterpret_cast<uint16_t*>(out->untyped_data());
  std::vector<float> bias32(c_out);
  for (int64_t c = 0; c < c_out; ++c) bias32[c] = from_bf16(bp[c]);
  const int workers = workers_for(tasks);
  std::vector<std::vector<float>> sums(workers, std::vector<float>(tile_rows * wp * c_out));
  parallel_tasks(tasks, workers, [&](int64_t t, int worker) {
    const int64_t b = t / tiles, y0 = (t % tiles) * tile_rows, rows = std::min(tile_rows, h - y0);
    float* tile = sums[worker].data();
    for (int64_t tap = 0; tap < 9; ++tap) {
      const int64_t dy = tap / 3, dx = tap % 3;
      const uint16_t* a = xp + ((b * (h + 3) + y0 + dy) * wp + dx) * c_in;
      gemm_bf16(kRowMajor, kNoTrans, kNoTrans, rows * wp, c_out, c_in, 1.0f, a, c_in, kp + tap * c_in * c_out,
                c_out, tap == 0 ? 0.0f : 1.0f, tile, c_out);
    }
    // As nnx.Conv in bf16: the sums rounded to bf16, then the bias added and rounded again.
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t col = 0; col < w; ++col) {
        const float* src = tile + (r * wp + col) * c_out;
        uint16_t* dst = op + ((b * h + y0 + r) * w + col) * c_out;
        for (int64_t c = 0; c < c_out; ++c) dst[c] = to_bf16(from_bf16(to_bf16(src[c])) + bias32[c]);
      }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_amx_conv3x3, Conv3x3,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Ret<ffi::Buffer<ffi::BF16>>());
