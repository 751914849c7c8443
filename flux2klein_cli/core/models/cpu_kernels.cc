// XLA FFI handlers for bf16 and float32 work on x86 CPUs with AVX-512, for the three kernel plugins:
//
// The AMX plugin (core/models/cpu_matmul.py), on the AMX tiles through oneMKL's bf16 GEMM
// (cblas_gemm_bf16bf16f32) or the tiles' intrinsics directly where MKL's products are too small to
// reach their rate:
//   flux2klein_amx_gemm:              bf16 (M, K) x bf16 (K, N) -> f32 (M, N), on MKL;
//   flux2klein_amx_sgemm:             f32 (M, K) x f32 (K, N) -> f32 (M, N), on MKL;
//   flux2klein_amx_attention:         unmasked attention, bf16 (B, Sq, H, D) queries (already scaled)
//                                     against (B, Sk, H, D) keys and values -> bf16 (B, Sq, H, D), a
//                                     block of queries at a time so its scores stay in the core's
//                                     cache, the products on the tiles;
//   flux2klein_amx_masked_attention:  the same with a (B, Sq, Sk) mask and grouped keys and values
//                                     (the text encoder's);
//   flux2klein_amx_conv3x3:           a 3x3 'same' convolution with bias, NHWC bf16 -> bf16, per tile of
//                                     output rows (on the tiles for input widths of whole tiles, else
//                                     nine MKL products);
//   flux2klein_amx_norm_silu_conv3x3: the same convolution of SiLU(GroupNorm(x)), normalised as each
//                                     tile reads its rows.
// The AVX-512 bf16 plugin (core/models/avx512_bf16.py), on CPUs with the VDPBF16PS instruction and no
// AMX (AMD Zen 4 and later): the same attention and convolutions, their products in VDPBF16PS (pairs of
// bf16 products summed into float32 lanes), where XLA widens a bf16 convolution to float32 and runs
// attention's small blocked products well below the unit's rate:
//   flux2klein_avx512_attention, flux2klein_avx512_masked_attention, flux2klein_avx512_conv3x3,
//   flux2klein_avx512_norm_silu_conv3x3, flux2klein_avx512_conv1x1 (the VAE's 1x1 shortcuts), and
//   flux2klein_avx512_upsample_conv3x3 (the decoder's nearest 2x upsample and its convolution, in 2.25x
//   fewer products), flux2klein_avx512_swiglu (the transformer's SwiGLU), flux2klein_avx512_qkv_heads (the
//   single block's q/k norms and rotations), and flux2klein_avx512_gemm (the Linear layers' products,
//   rounded to bf16 as they are stored). Attention and the convolutions have float32 forms too, the
//   same loops in FMAs (flux2klein_avx512_attention_f32, _masked_attention_f32, _conv3x3_f32,
//   _norm_silu_conv3x3_f32, _conv1x1_f32, _upsample_conv3x3_f32; the 3x3 ones in Winograd's F(4x4, 3x3)
//   where height and width are multiples of 4, 4x fewer products, the upsample's as four such convolutions
//   of its input, 1.8x fewer than its merged taps; other even sizes in F(2x2, 3x3), 2.25x fewer), which the
//   AVX-512 float32 plugin (core/models/float32_kernels.py) takes on CPUs with AVX-512 and no bf16, and the
//   AVX2 float32 plugin on CPUs with AVX2 and no AVX-512.
// MKL is opened at run time (dlopen) by the AMX plugin only, so this file builds with no MKL headers.
// Built three ways (core/models/cpu_shim.py): with AVX-512, bf16 and AMX on, for CPUs with AVX-512 bf16
// (the AMX instructions run only in the AMX plugin's handlers); and with AVX-512 alone (F, BW, VL, DQ,
// FMA: Skylake-SP's set) for the float32 plugin (core/models/float32_kernels.py) on CPUs without bf16, where
// only the float32 handlers and the transposing copy are compiled in (FLUX2KLEIN_BF16 0); and with AVX2
// and FMA alone for the AVX2 float32 plugin, the same handlers (their symbols keep their avx512 names)
// with each sixteen-lane vector a pair of 8-lane registers (FLUX2KLEIN_WIDE 0, below).
#include <dlfcn.h>
#include <immintrin.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define FLUX2KLEIN_BF16 1
#else
#define FLUX2KLEIN_BF16 0
#endif
#if defined(__AVX512F__)
#define FLUX2KLEIN_WIDE 1
#else
#define FLUX2KLEIN_WIDE 0
#endif

namespace ffi = xla::ffi;

// The element type of a handler's buffers: float32, or bf16 as its 16-bit pattern.
template <ffi::DataType D>
using Element = std::conditional_t<D == ffi::DataType::F32, float, uint16_t>;

using GemmBf16 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const void*, int64_t, const void*,
                          int64_t, float, float*, int64_t);
using GemmF32 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                         int64_t, float, float*, int64_t);
using SetThreadsLocal = int (*)(int);
static GemmBf16 gemm_bf16 = nullptr;
static GemmF32 gemm_f32 = nullptr;
static SetThreadsLocal set_threads_local = nullptr;
constexpr int kRowMajor = 101, kNoTrans = 111;
constexpr int64_t kQueryBlock = 128;  // 128 x 1536 float32 scores: 768 KB, inside a core's L2

#if FLUX2KLEIN_BF16
extern "C" int flux2klein_amx_open(const char* path) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) return 1;
  gemm_bf16 = reinterpret_cast<GemmBf16>(dlsym(lib, "cblas_gemm_bf16bf16f32"));
  gemm_f32 = reinterpret_cast<GemmF32>(dlsym(lib, "cblas_sgemm"));
  set_threads_local = reinterpret_cast<SetThreadsLocal>(dlsym(lib, "MKL_Set_Num_Threads_Local"));
  if (gemm_bf16 == nullptr || gemm_f32 == nullptr || set_threads_local == nullptr) return 2;
  // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: a process asks Linux (5.16 and later) once before its
  // first tile instruction. MKL asks too; the attention's own tile code needs it granted here.
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : 3;
}
#endif

static int worker_count() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// One thread per core (at most one per task).
static int workers_for(int64_t tasks) { return static_cast<int>(std::min<int64_t>(worker_count(), tasks)); }

// The XLA runtime's thread pool of the handler running on this thread (null outside a handler). The
// kernels' helpers run on it: a kernel then shares the cores with the XLA ops that run beside it (the
// double blocks' image and text products are independent, and XLA runs them at once) instead of
// starting threads of its own on top of them.
static thread_local ffi::ThreadPool* current_pool = nullptr;

struct PoolScope {
  explicit PoolScope(ffi::ThreadPool& pool) : saved(current_pool) { current_pool = &pool; }
  ~PoolScope() { current_pool = saved; }
  ffi::ThreadPool* saved;
};

// Runs work(task, worker) for every task in [0, tasks) on up to `workers` threads, MKL single-threaded
// inside each: the cores take separate tasks (and keep their data in their own caches) instead of
// MKL's threads splitting every small product. Each worker first takes its own contiguous share of the
// tasks in order, then helps with the others' shares from their fronts: neighbouring tasks share data
// (attention's blocks of one head share its packed keys and values), and a core slowed by other work
// is still helped. The calling thread is worker 0; the others are helpers on the XLA pool (threads of
// their own outside a handler). A helper that starts only once every task is taken (its pool thread
// was busy) finds nothing to do, so the call returns when the tasks are done, not when every helper
// has run: the counters live in shared state a late helper still holds.
template <typename Work>
static void parallel_tasks(int64_t tasks, int workers, Work work) {
  struct Shares {
    std::vector<std::atomic<int64_t>> next;
    std::vector<int64_t> end;
    std::atomic<int64_t> done{0};
    explicit Shares(int workers) : next(workers), end(workers) {}
  };
  auto shares = std::make_shared<Shares>(std::max(workers, 1));
  for (int i = 0; i < workers; ++i)
    shares->next[i] = tasks * i / workers, shares->end[i] = tasks * (i + 1) / workers;
  // `work` is reached only through a task taken while the caller still waits for it.
  auto run = [shares, workers, &work](int worker) {
    if (set_threads_local != nullptr) set_threads_local(1);  // MKL is loaded by the AMX plugin only
    for (int i = 0; i < workers; ++i) {
      const int share = (worker + i) % workers;
      for (int64_t t = shares->next[share]++; t < shares->end[share]; t = shares->next[share]++) {
        work(t, worker);
        shares->done.fetch_add(1, std::memory_order_release);
      }
    }
    if (set_threads_local != nullptr) set_threads_local(0);
  };
  std::vector<std::thread> threads;
  for (int i = 1; i < workers; ++i) {
    if (current_pool != nullptr)
      current_pool->Schedule([run, i] { run(i); });
    else
      threads.emplace_back(run, i);
  }
  run(0);
  for (int spins = 0; shares->done.load(std::memory_order_acquire) < tasks; ++spins) {
    if (spins < 4096)
      _mm_pause();
    else
      sched_yield();
  }
  for (auto& t : threads) t.join();
}

#if FLUX2KLEIN_BF16
// (M, K) x (K, N) -> float32 (M, N) on oneMKL: bf16 operands on its bf16 GEMM, float32 ones on its sgemm.
template <ffi::DataType D>
static ffi::Error Gemm(ffi::Buffer<D> x, ffi::Buffer<D> w, ffi::ResultBuffer<ffi::F32> y) {
  constexpr bool kFloat32 = D == ffi::DataType::F32;
  if ((kFloat32 ? gemm_f32 == nullptr : gemm_bf16 == nullptr))
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "oneMKL is not loaded");
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "expected (M, K) x (K, N)");
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  float* yp = y->typed_data();
  // MKL's own threads: with them sleeping between products (KMP_BLOCKTIME=0, set in cpu_matmul.py)
  // they were as fast as splitting the rows between the cores, or faster, at every width.
  if constexpr (kFloat32)
    gemm_f32(kRowMajor, kNoTrans, kNoTrans, m, n, k, 1.0f, x.typed_data(), k, w.typed_data(), n, 0.0f, yp, n);
  else
    gemm_bf16(kRowMajor, kNoTrans, kNoTrans, m, n, k, 1.0f, x.untyped_data(), k, w.untyped_data(), n, 0.0f, yp, n);
  return ffi::Error::Success();
}

#define FLUX2KLEIN_GEMM_BINDING(D) \
  ffi::Ffi::Bind().Arg<ffi::Buffer<D>>().Arg<ffi::Buffer<D>>().Ret<ffi::Buffer<ffi::F32>>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_amx_gemm, Gemm<ffi::DataType::BF16>, FLUX2KLEIN_GEMM_BINDING(ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_amx_sgemm, Gemm<ffi::DataType::F32>, FLUX2KLEIN_GEMM_BINDING(ffi::F32));
#endif

// Sixteen float32 lanes, the unit every float32 loop below works in: one AVX-512 register, or in the
// shim's AVX2 build (FLUX2KLEIN_WIDE 0: AMD Zen 2 and 3, Intel client CPUs) a pair of AVX2 registers, a
// lane mask then a pair of all-ones or zero vectors. Both forms compute the same values (vsum may add
// in another order).
#if FLUX2KLEIN_WIDE
using Vec = __m512;
using Lanes = __mmask16;

static inline Lanes lanes_left(int64_t left) {
  return left >= 16 ? static_cast<Lanes>(0xFFFF) : static_cast<Lanes>((1u << left) - 1u);
}
static inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline Vec vload(const float* p, Lanes m) { return _mm512_maskz_loadu_ps(m, p); }
static inline Vec vload_or(const float* p, Lanes m, Vec rest) { return _mm512_mask_loadu_ps(rest, m, p); }
static inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
static inline void vstore(float* p, Lanes m, Vec v) { _mm512_mask_storeu_ps(p, m, v); }
static inline Vec vset1(float x) { return _mm512_set1_ps(x); }
static inline Vec vzero() { return _mm512_setzero_ps(); }
static inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
static inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
static inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
static inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
static inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
static inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
static inline Vec vfnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
static inline Vec vabs(Vec a) { return _mm512_abs_ps(a); }
static inline Vec vround(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline Vec vscale2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n whole
static inline Vec vselect(Lanes m, Vec yes, Vec no) { return _mm512_mask_blend_ps(m, no, yes); }
static inline Vec vkeep(Lanes m, Vec v) { return _mm512_maskz_mov_ps(m, v); }  // v where m, else 0
static inline Vec vadd_where(Lanes m, Vec a, Vec b) { return _mm512_mask_add_ps(a, m, a, b); }
static inline Vec vmax_where(Lanes m, Vec a, Vec b) { return _mm512_mask_max_ps(a, m, a, b); }
static inline Lanes vless(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
static inline Lanes vequal(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline bool vany(Lanes m) { return m != 0; }
static inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
static inline float vtop(Vec a) { return _mm512_reduce_max_ps(a); }

// The lanes of the first min(left, 16) whose key is allowed (mask bytes, nonzero for true).
static inline Lanes allowed_lanes(const bool* allowed, int64_t left) {
  const Lanes lanes = lanes_left(left);
  return _mm_mask_cmpneq_epi8_mask(lanes, _mm_maskz_loadu_epi8(lanes, allowed), _mm_setzero_si128());
}

// Bit i set where byte i of the 64 at p is nonzero.
static inline uint64_t nonzero_bytes64(const void* p) {
  const __m512i bytes = _mm512_loadu_si512(p);
  return _mm512_test_epi8_mask(bytes, bytes);
}
#else
struct Vec {
  __m256 lo, hi;
};
struct Lanes {
  __m256i lo, hi;
};

static inline Lanes lanes_left(int64_t left) {
  const __m256i n = _mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(left, 0, 16)));
  return {_mm256_cmpgt_epi32(n, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
          _mm256_cmpgt_epi32(n, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15))};
}
static inline Vec vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
// VMASKMOVPS reads no masked-off lane, so a row's last lanes may end where its memory does.
static inline Vec vload(const float* p, Lanes m) {
  return {_mm256_maskload_ps(p, m.lo), _mm256_maskload_ps(p + 8, m.hi)};
}
static inline Vec vselect(Lanes m, Vec yes, Vec no) {
  return {_mm256_blendv_ps(no.lo, yes.lo, _mm256_castsi256_ps(m.lo)),
          _mm256_blendv_ps(no.hi, yes.hi, _mm256_castsi256_ps(m.hi))};
}
static inline Vec vload_or(const float* p, Lanes m, Vec rest) { return vselect(m, vload(p, m), rest); }
static inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline void vstore(float* p, Lanes m, Vec v) {
  _mm256_maskstore_ps(p, m.lo, v.lo), _mm256_maskstore_ps(p + 8, m.hi, v.hi);
}
static inline Vec vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline Vec vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline Vec vadd(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline Vec vsub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline Vec vmul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline Vec vdiv(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
// MAXPS returns its second operand when either is a NaN, as AVX-512's does.
static inline Vec vmax(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline Vec vfmadd(Vec a, Vec b, Vec c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline Vec vfnmadd(Vec a, Vec b, Vec c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
static inline Vec vabs(Vec a) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude)};
}
static inline Vec vround(Vec a) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kNearest), _mm256_round_ps(a.hi, kNearest)};
}
// p * 2^n for whole n in [-126, 127], through 2^n's exponent bits (the product is exact, as VSCALEFPS's).
static inline __m256 scale2(__m256 p, __m256 n) {
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}
static inline Vec vscale2(Vec p, Vec n) { return {scale2(p.lo, n.lo), scale2(p.hi, n.hi)}; }
static inline Vec vkeep(Lanes m, Vec v) {
  return {_mm256_and_ps(v.lo, _mm256_castsi256_ps(m.lo)), _mm256_and_ps(v.hi, _mm256_castsi256_ps(m.hi))};
}
static inline Vec vadd_where(Lanes m, Vec a, Vec b) { return vadd(a, vkeep(m, b)); }
static inline Vec vmax_where(Lanes m, Vec a, Vec b) { return vselect(m, vmax(a, b), a); }
static inline Lanes vless(Vec a, Vec b) {
  return {_mm256_castps_si256(_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ)),
          _mm256_castps_si256(_mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ))};
}
static inline Lanes vequal(Vec a, Vec b) {
  return {_mm256_castps_si256(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ)),
          _mm256_castps_si256(_mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ))};
}
static inline bool vany(Lanes m) {
  const __m256i either = _mm256_or_si256(m.lo, m.hi);
  return !_mm256_testz_si256(either, either);
}
static inline float vsum(Vec a) {
  const __m256 eight = _mm256_add_ps(a.lo, a.hi);
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
}
static inline float vtop(Vec a) {
  const __m256 eight = _mm256_max_ps(a.lo, a.hi);
  __m128 four = _mm_max_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  four = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
}

// The lanes of the first min(left, 16) whose key is allowed (mask bytes, nonzero for true); a row's
// last bytes are copied out first rather than read past its end.
static inline Lanes allowed_lanes(const bool* allowed, int64_t left) {
  alignas(16) uint8_t tail[16] = {};
  const void* bytes = allowed;
  if (left < 16) bytes = std::memcpy(tail, allowed, std::max<int64_t>(left, 0));
  const __m128i zero = _mm_cmpeq_epi8(_mm_loadu_si128(static_cast<const __m128i*>(bytes)), _mm_setzero_si128());
  const __m128i set = _mm_xor_si128(zero, _mm_set1_epi8(-1));  // all ones where nonzero
  return {_mm256_cvtepi8_epi32(set), _mm256_cvtepi8_epi32(_mm_srli_si128(set, 8))};
}

// Bit i set where byte i of the 64 at p is nonzero.
static inline uint64_t nonzero_bytes64(const void* p) {
  const auto* at = static_cast<const __m256i*>(p);
  const auto zero_bits = [](const __m256i* half) {  // bit i set where byte i is zero
    const __m256i zeros = _mm256_cmpeq_epi8(_mm256_loadu_si256(half), _mm256_setzero_si256());
    return static_cast<uint32_t>(_mm256_movemask_epi8(zeros));
  };
  return static_cast<uint64_t>(~zero_bits(at + 1)) << 32 | ~zero_bits(at);
}
#endif

// float32 -> bfloat16 bits, rounding to nearest even as XLA's convert does; a NaN stays a (quiet) NaN.
static inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>(bits >> 16 | 0x40);
  return static_cast<uint16_t>((bits + ((bits >> 16) & 1u) + 0x7FFFu) >> 16);
}

static inline float from_bf16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if FLUX2KLEIN_WIDE
// float32 -> bfloat16 bits on sixteen lanes, rounding to nearest even as XLA's convert does, in
// integers (VCVTNEPS2BF16 would flush subnormals to zero); a NaN stays a (quiet) NaN, where rounding
// its payload could carry it into the infinity's bits.
static inline __m256i to_bf16x16(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f), high = _mm512_srli_epi32(bits, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  rounded = _mm512_mask_or_epi32(rounded, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), high, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(rounded);
}

static inline __m512 from_bf16x16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Sixteen bf16 values as float32 lanes, and back (rounded to nearest even).
static inline __m512 load16(const uint16_t* x, __mmask16 lanes) {
  return from_bf16x16(_mm256_maskz_loadu_epi16(lanes, x));
}
static inline void store16(uint16_t* out, __mmask16 lanes, __m512 v) {
  _mm256_mask_storeu_epi16(out, lanes, to_bf16x16(v));
}
#endif
// The float32 forms of load16 and store16, which the loops share with bf16's.
static inline Vec load16(const float* x, Lanes lanes) { return vload(x, lanes); }
static inline void store16(float* out, Lanes lanes, Vec v) { vstore(out, lanes, v); }

// exp(x) for x <= 0: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p of degree 6 (relative error under
// 2e-7). Below -87, where expf leaves the normal range, it gives exp(-87) (1.6e-38) instead of a
// subnormal: nothing a softmax weight or its sum can tell apart. A NaN stays NaN (the clamp's max
// returns its second operand when either is NaN).
static inline Vec exp_nonpositive(Vec x) {
  const Vec clamped = vmax(vset1(-87.0f), x);
  const Vec n = vround(vmul(clamped, vset1(1.44269504088896341f)));
  Vec r = vfnmadd(n, vset1(0.693145751953125f), clamped);
  r = vfnmadd(n, vset1(1.42860682030941723e-6f), r);
  Vec p = vset1(1.0f / 720.0f);
  for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}) p = vfmadd(p, r, vset1(c));
  return vscale2(p, n);
}

static float row_max(const float* x, int64_t n) {
  Vec top = vset1(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) top = vmax(top, vload_or(x + j, lanes_left(n - j), top));
  return vtop(top);
}

#if FLUX2KLEIN_BF16
// weights[j] = bf16(exp(x[j] - top)); returns the sum of the float32 exponentials.
static float exp_row(const float* x, int64_t n, float top, uint16_t* weights) {
  const __m512 shift = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = lanes_left(n - j);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x + j), shift));
    sum = _mm512_mask_add_ps(sum, lanes, sum, e);
    // VCVTNEPS2BF16 flushes subnormals, and no weight is one (they are at least exp(-87)).
    _mm256_mask_storeu_epi16(weights + j, lanes, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  return _mm512_reduce_add_ps(sum);
}
#endif

// The float32 form, in place: x[j] = exp(x[j] - top) (the row is then its own weights).
static float exp_row(float* x, int64_t n, float top) {
  const Vec shift = vset1(top);
  Vec sum = vzero();
  for (int64_t j = 0; j < n; j += 16) {
    const Lanes lanes = lanes_left(n - j);
    const Vec e = exp_nonpositive(vsub(vload(x + j, lanes), shift));
    sum = vadd_where(lanes, sum, e);
    vstore(x + j, lanes, e);
  }
  return vsum(sum);
}

// The masked form's softmax of one row, in place: x[j] = exp(scale * x[j] - top) where allowed, else
// 0; weights[j] = x[j] / sum (bf16: rounded; float32 weights may be x itself). Returns false when no key
// is allowed (the row's output is zero).
template <typename T>
static bool masked_softmax_row(float* x, int64_t n, float scale, const bool* allowed, T* weights) {
  const Vec factor = vset1(scale);
  Vec top = vset1(-INFINITY);
  bool any = false;
  for (int64_t j = 0; j < n; j += 16) {
    const Lanes lanes = lanes_left(n - j), keep = allowed_lanes(allowed + j, n - j);
    const Vec scaled = vmul(vload(x + j, lanes), factor);
    vstore(x + j, lanes, scaled);
    top = vmax_where(keep, top, scaled);
    any = any || vany(keep);
  }
  if (!any) return false;
  const Vec shift = vset1(vtop(top));
  Vec sum = vzero();
  for (int64_t j = 0; j < n; j += 16) {
    const Lanes lanes = lanes_left(n - j), keep = allowed_lanes(allowed + j, n - j);
    const Vec e = vkeep(keep, exp_nonpositive(vsub(vload(x + j, lanes), shift)));
    vstore(x + j, lanes, e);
    sum = vadd(sum, e);
  }
  const Vec total = vset1(vsum(sum));
  for (int64_t j = 0; j < n; j += 16) {
    const Lanes lanes = lanes_left(n - j);
    store16(weights + j, lanes, vdiv(vload(x + j, lanes), total));
  }
  return true;
}

struct AttentionShape {
  int64_t batch, sq, sk, heads, kv_heads, dim;
  bool avx512 = false;  // the AVX-512 bf16 plugin's call: the products in VDPBF16PS (FMAs in float32)
  int64_t group() const { return heads / kv_heads; }  // query heads per key/value head
};

// What a masked attention adds (jax.nn.dot_product_attention's XLA form, as the text encoder calls it):
// the scores scaled after the product, a (B, Sq, Sk) mask of allowed keys, the weights normalised
// before P @ V, and a zero output for a query with no allowed key. Without a mask: queries already
// scaled, every key allowed, normalised after P @ V (the transformer's and the VAE's form).
struct Masking {
  const bool* allowed = nullptr;
  float scale = 1.0f;
};

constexpr int64_t kPanel = 32;  // columns of a packed right-hand panel: two B tiles side by side

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#if FLUX2KLEIN_BF16
// The attention's products on the AMX tiles directly. MKL's bf16 GEMM on blocks this small (128 queries
// by a head's keys) ran at a fifth of the tiles' rate; here the queries of a block and one packed panel
// of keys stay in L1 while the tiles work through them.
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 all 16 rows of 64 bytes: A tiles 16 x 32 bf16, B tiles 16 pairs x 16 columns (pairs of
// bf16 along the inner dimension), C tiles 16 x 16 float32.
static void configure_tiles() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) config.rows[i] = 16, config.colsb[i] = 64;
  _tile_loadconfig(&config);
}

// C (tiles 4-7: 32 x 32 float32) += a (32 x depth bf16, row stride lda) x one packed panel (depth / 2
// pairs x 32 columns x 2); depth a multiple of 32. Each A and B tile is loaded just before its first
// use, so the loads overlap the products before them.
static inline void tiles_accumulate(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t depth) {
  for (int64_t k = 0; k < depth; k += 32) {
    _tile_loadd(0, a + k, lda * 2);
    _tile_loadd(2, panel + k * kPanel, kPanel * 4);
    _tile_dpbf16ps(4, 0, 2);
    _tile_loadd(3, panel + k * kPanel + 32, kPanel * 4);
    _tile_dpbf16ps(5, 0, 3);
    _tile_loadd(1, a + 16 * lda + k, lda * 2);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
  }
}

static inline void tiles_zero() {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
}

// C into c, 32 x 32 float32 with row stride ldc.
static inline void tiles_store(float* c, int64_t ldc) {
  _tile_stored(4, c, ldc * 4);
  _tile_stored(5, c + 16, ldc * 4);
  _tile_stored(6, c + 16 * ldc, ldc * 4);
  _tile_stored(7, c + 16 * ldc + 16, ldc * 4);
}

// c (32 x 32 float32, row stride ldc) = a (32 x depth bf16, row stride lda) x one packed panel.
static void tile_product(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t depth, float* c,
                         int64_t ldc) {
  tiles_zero();
  tiles_accumulate(a, lda, panel, depth);
  tiles_store(c, ldc);
}

// A thread's tiles around the AMX plugin's products (`amx`); the float32-only build has neither.
static inline void tiles_begin(bool amx) {
  if (amx) configure_tiles();
}
static inline void tiles_end(bool amx) {
  if (amx) _tile_release();
}
#else
static inline void tiles_begin(bool) {}
static inline void tiles_end(bool) {}
#endif

// The same products in registers, for CPUs without AMX: c (Rows x 32 float32, row stride ldc) += a
// (Rows x depth, row stride lda) x one packed panel, Rows x 2 sixteen-lane accumulators kept in registers.
// bf16 (uint16_t bits): each VDPBF16PS sums a pair of bf16 products into each of sixteen float32 lanes;
// a step loads the panel's two vectors for one pair of the depth and broadcasts each row's pair (depth
// even). float32: a step loads the panel's two vectors for one index of the depth, broadcasts each row's
// value and runs two FMAs. A panel holds depth x 32 values in both forms. With Add false, c = the
// product instead (the same bits: the sums start at +0).
// AVX-512: 24 accumulators, 2 panel vectors and a broadcast, within 32 registers. AVX2 (each lane group
// two registers): 12 accumulator registers and a broadcast, the panel's four read where the FMAs use them,
// within 16.
constexpr int kDotRows = FLUX2KLEIN_WIDE ? 12 : 3;

template <int Rows, bool Add = true, typename T>
static inline void accumulate(const T* a, int64_t lda, const T* panel, int64_t depth, float* c, int64_t ldc) {
  Vec acc[Rows][2];
  for (int i = 0; i < Rows; ++i) acc[i][0] = acc[i][1] = vzero();
#if FLUX2KLEIN_BF16
  if constexpr (std::is_same_v<T, uint16_t>) {
    for (int64_t k = 0; k < depth; k += 2, panel += 2 * kPanel) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel), w1 = (__m512bh)_mm512_loadu_si512(panel + kPanel);
      for (int i = 0; i < Rows; ++i) {
        int32_t pair;
        std::memcpy(&pair, a + i * lda + k, 4);
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, w0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, w1);
      }
    }
  } else
#endif
  {
    for (int64_t k = 0; k < depth; ++k, panel += kPanel) {
      const Vec w0 = vload(panel), w1 = vload(panel + 16);
      for (int i = 0; i < Rows; ++i) {
        const Vec x = vset1(a[i * lda + k]);
        acc[i][0] = vfmadd(x, w0, acc[i][0]);
        acc[i][1] = vfmadd(x, w1, acc[i][1]);
      }
    }
  }
  for (int i = 0; i < Rows; ++i) {
    if (Add) {
      acc[i][0] = vadd(vload(c + i * ldc), acc[i][0]);
      acc[i][1] = vadd(vload(c + i * ldc + 16), acc[i][1]);
    }
    vstore(c + i * ldc, acc[i][0]);
    vstore(c + i * ldc + 16, acc[i][1]);
  }
}

// The last `rows` (fewer than kDotRows, Rows at most) of a product, in one block of that many.
template <int Rows, typename T>
static void product_rest(const T* a, int64_t lda, const T* panel, int64_t depth, float* c, int64_t ldc, int64_t rows) {
  if constexpr (Rows > 0) {
    if (rows == Rows)
      accumulate<Rows, false>(a, lda, panel, depth, c, ldc);
    else
      product_rest<Rows - 1>(a, lda, panel, depth, c, ldc, rows);
  }
}

// c (rows x 32 float32, row stride ldc) = a (rows x depth) x one packed panel, the rows kDotRows at a
// time (tile_product's work, all of a block's rows in one call).
template <typename T>
static void product(const T* a, int64_t lda, const T* panel, int64_t depth, float* c, int64_t ldc, int64_t rows) {
  int64_t r = 0;
  for (; r + kDotRows <= rows; r += kDotRows)
    accumulate<kDotRows, false>(a + r * lda, lda, panel, depth, c + r * ldc, ldc);
  product_rest<kDotRows - 1>(a + r * lda, lda, panel, depth, c + r * ldc, ldc, rows - r);
}

#if FLUX2KLEIN_WIDE
// A head's keys as the right-hand side of Q K^T: panels of 32 keys, each [dim pair][key][2], i.e. the
// keys' 32-bit pairs of dims transposed; dims zero-padded to `depth`, keys to a whole panel. A pair is
// copied as one 32-bit word where the dims need no padding (the heads' 128), element by element else.
static void pack_keys(const uint16_t* k, int64_t stride, int64_t sk, int64_t dim, int64_t depth, uint16_t* out) {
  const int64_t keys = round_up(sk, kPanel);
  if (dim == depth) {
    const int64_t pairs = dim / 2;
    auto* words = reinterpret_cast<uint32_t*>(out);
    for (int64_t key = 0; key < keys; ++key) {
      uint32_t* column = words + (key / kPanel) * pairs * kPanel + key % kPanel;
      if (key >= sk) {  // padding keys are zeros, not read past the array
        for (int64_t d = 0; d < pairs; ++d) column[d * kPanel] = 0;
        continue;
      }
      const uint16_t* row = k + key * stride;
      for (int64_t d = 0; d < pairs; ++d) std::memcpy(column + d * kPanel, row + 2 * d, 4);
    }
    return;
  }
  for (int64_t p = 0; p < keys; p += kPanel)
    for (int64_t d = 0; d < depth; d += 2)
      for (int64_t c = 0; c < kPanel; ++c, out += 2) {
        const bool real = p + c < sk;
        out[0] = real && d < dim ? k[(p + c) * stride + d] : 0;
        out[1] = real && d + 1 < dim ? k[(p + c) * stride + d + 1] : 0;
      }
}
#endif

// The float32 form (accumulate's float32 panels): panels of 32 keys, each [dim][key]; dims zero-padded to
// `depth`, keys to a whole panel.
static void pack_keys(const float* k, int64_t stride, int64_t sk, int64_t dim, int64_t depth, float* out) {
  const int64_t keys = round_up(sk, kPanel);
  for (int64_t p = 0; p < keys; p += kPanel, out += depth * kPanel)
    for (int64_t c = 0; c < kPanel; ++c) {
      const bool real = p + c < sk;
      for (int64_t d = 0; d < depth; ++d) out[d * kPanel + c] = real && d < dim ? k[(p + c) * stride + d] : 0.0f;
    }
}

#if FLUX2KLEIN_WIDE
// A head's values as the right-hand side of P V: panels of 32 dims, each [key pair][dim][2]; keys
// zero-padded to a whole panel (their weights are zero too), dims to a whole panel. Where the dims fill
// whole panels, a key pair's two rows of 32 dims are interleaved in two vector permutes.
static void pack_values(const uint16_t* v, int64_t stride, int64_t sk, int64_t dim, uint16_t* out) {
  const int64_t keys = round_up(sk, kPanel);
  if (dim % kPanel == 0) {
    alignas(64) uint16_t first[32], second[32];
    for (int i = 0; i < 16; ++i) first[2 * i] = i, first[2 * i + 1] = 32 + i, second[2 * i] = 16 + i,
                                 second[2 * i + 1] = 48 + i;
    const __m512i low_half = _mm512_load_si512(first), high_half = _mm512_load_si512(second);
    for (int64_t p = 0; p < dim; p += kPanel)
      for (int64_t key = 0; key < keys; key += 2, out += 2 * kPanel) {
        const __m512i a = key < sk ? _mm512_loadu_si512(v + key * stride + p) : _mm512_setzero_si512();
        const __m512i b = key + 1 < sk ? _mm512_loadu_si512(v + (key + 1) * stride + p) : _mm512_setzero_si512();
        _mm512_storeu_si512(out, _mm512_permutex2var_epi16(a, low_half, b));
        _mm512_storeu_si512(out + kPanel, _mm512_permutex2var_epi16(a, high_half, b));
      }
    return;
  }
  for (int64_t p = 0; p < round_up(dim, kPanel); p += kPanel)
    for (int64_t key = 0; key < keys; key += 2)
      for (int64_t c = 0; c < kPanel; ++c, out += 2) {
        const bool real = p + c < dim;
        out[0] = real && key < sk ? v[key * stride + p + c] : 0;
        out[1] = real && key + 1 < sk ? v[(key + 1) * stride + p + c] : 0;
      }
}
#endif

// The float32 form (accumulate's float32 panels): panels of 32 dims, each [key][dim]; keys zero-padded to a
// whole panel, dims to a whole panel.
static void pack_values(const float* v, int64_t stride, int64_t sk, int64_t dim, float* out) {
  const int64_t keys = round_up(sk, kPanel);
  for (int64_t p = 0; p < round_up(dim, kPanel); p += kPanel) {
    const Lanes low = lanes_left(dim - p), high = lanes_left(std::max<int64_t>(0, dim - p - 16));
    for (int64_t key = 0; key < keys; ++key, out += kPanel) {
      const bool real = key < sk;
      vstore(out, real ? vload(v + key * stride + p, low) : vzero());
      vstore(out + 16, real ? vload(v + key * stride + p + 16, high) : vzero());
    }
  }
}

// The last key index that any of the block's rows allows (-1 when none does): each row's mask is scanned
// from its end, 64 bytes at a time, down to the last index found so far.
static int64_t last_allowed_key(const AttentionShape& s, const Masking& m, int64_t b, int64_t row0, int64_t rows) {
  int64_t last = -1;
  for (int64_t i = 0; i < rows; ++i) {
    const bool* allowed = m.allowed + (b * s.sq + row0 + i) * s.sk;
    int64_t end = s.sk;  // indices [end, s.sk) of this row hold no allowed key
    for (; end - 64 > last; end -= 64) {
      const uint64_t set = nonzero_bytes64(allowed + end - 64);
      if (set != 0) {
        last = end - 64 + 63 - __builtin_clzll(set);
        end = last;  // nothing left to find in this row
        break;
      }
    }
    for (int64_t j = end - 1; j > last; --j)
      if (allowed[j]) last = j;
  }
  return last;
}

// A number for each kernel call of the process (never 0): a worker's scratch kept from call to call
// records the call whose packed data it holds.
static uint64_t next_call() {
  static std::atomic<uint64_t> calls{0};
  return calls.fetch_add(1, std::memory_order_relaxed) + 1;
}

// A worker's scratch for one block of queries, and the keys and values of the head it last packed (in the
// call it last served). In float32 the softmax weights overwrite the scores (no second array). Every
// element a block reads is written first, so a scratch kept from an earlier call needs no clearing.
template <typename T>
struct AttentionScratch {
  static constexpr bool kSeparateWeights = std::is_same_v<T, uint16_t>;
  int64_t depth = 0, keys = 0, dims = 0;  // the head dim, the keys and the value dims, each padded for the tiles
  std::vector<T> queries, packed_keys, packed_values, weights;
  std::vector<float> scores, acc;
  int64_t packed_head = -1;
  uint64_t call = 0;
  AttentionScratch() = default;
  explicit AttentionScratch(const AttentionShape& s) { fit(s, 0); }
  struct Padded {
    int64_t depth, keys, dims;
  };
  static Padded padded(const AttentionShape& s) {
    return {round_up(s.dim, 32), round_up(s.sk, kPanel), round_up(s.dim, kPanel)};
  }
  static int64_t bytes(const AttentionShape& s) {
    const auto [depth, keys, dims] = padded(s);
    return (kQueryBlock * depth + keys * (depth + dims) + (kSeparateWeights ? kQueryBlock * keys : 0)) * sizeof(T) +
           kQueryBlock * (keys + dims) * sizeof(float);
  }
  // Sized for shape s in call `for_call`; a head packed in another call is packed again.
  void fit(const AttentionShape& s, uint64_t for_call) {
    const Padded sizes = padded(s);
    depth = sizes.depth, keys = sizes.keys, dims = sizes.dims;
    queries.resize(kQueryBlock * depth), packed_keys.resize(keys * depth), packed_values.resize(dims * keys);
    weights.resize(kSeparateWeights ? kQueryBlock * keys : 0), scores.resize(kQueryBlock * keys);
    acc.resize(kQueryBlock * dims);
    if (call != for_call) call = for_call, packed_head = -1;
  }
  T* weight_rows() {
    if constexpr (kSeparateWeights) return weights.data();
    else return scores.data();
  }
};

// Each thread keeps its attention scratch from call to call where it is small (the transformer's and the
// text encoder's heads: about 2.5 MB at 1536 keys). Allocated per call, every worker's scratch was fresh
// memory, zeroed by the calling thread: on 13 cores about 32 MB of first touches a call, which cost more
// than the attention itself saved there. A VAE's one-head attention over a large image keeps allocating
// per call (hundreds of MB, against seconds of products). The convolutions' tiles are kept the same way.
// A call holds as much scratch as before (one per worker); it now stays between calls.
constexpr int64_t kKeptScratchBytes = 16 << 20;

template <typename T>
static AttentionScratch<T>& kept_scratch(const AttentionShape& s, uint64_t call) {
  thread_local AttentionScratch<T> kept;
  kept.fit(s, call);
  return kept;
}

// One block of `rows` queries of head h in batch b: scores, softmax, P @ V, normalised. The keys and
// values of a head are packed once per worker, not per block.
template <typename T>
static void attend_block(const AttentionShape& s, const Masking& m, const T* q, const T* k, const T* v, T* out,
                         int64_t b, int64_t h, int64_t row0, int64_t rows, AttentionScratch<T>& w) {
  const int64_t q_stride = s.heads * s.dim, kv_stride = s.kv_heads * s.dim, kv_head = h / s.group();
  if (w.packed_head != b * s.kv_heads + kv_head) {
    const int64_t offset = b * s.sk * kv_stride + kv_head * s.dim;
    pack_keys(k + offset, kv_stride, s.sk, s.dim, w.depth, w.packed_keys.data());
    pack_values(v + offset, kv_stride, s.sk, s.dim, w.packed_values.data());
    w.packed_head = b * s.kv_heads + kv_head;
  }
  // The block's queries, contiguous and zero-padded to whole tiles (rows past the last stay zero).
  const int64_t tile_rows = round_up(rows, 32);
  std::fill(w.queries.begin(), w.queries.begin() + tile_rows * w.depth, T{0});
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(w.queries.data() + i * w.depth, q + (b * s.sq + row0 + i) * q_stride + h * s.dim,
                s.dim * sizeof(T));
  // c (tile_rows x 32) = a (tile_rows x depth) x a packed panel: on the tiles 32 rows at a time, or in
  // VDPBF16PS (FMAs in float32).
  const auto block_product = [&](const T* a, int64_t lda, const T* panel, int64_t depth, float* c, int64_t ldc) {
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (!s.avx512) {
        for (int64_t r = 0; r < tile_rows; r += 32) tile_product(a + r * lda, lda, panel, depth, c + r * ldc, ldc);
        return;
      }
    }
    product(a, lda, panel, depth, c, ldc, tile_rows);
  };
  // A masked block's products stop at the panel of the last key any of its rows may see: the keys past it
  // weigh zero (the text encoder's prompts are padded on the right to 512 tokens, most of them padding).
  const int64_t keys = m.allowed == nullptr ? w.keys : round_up(last_allowed_key(s, m, b, row0, rows) + 1, kPanel);
  const int64_t seen = std::min(keys, s.sk);
  tiles_begin(!s.avx512);
  for (int64_t p = 0; p < keys; p += kPanel)
    block_product(w.queries.data(), w.depth, w.packed_keys.data() + p * w.depth, w.depth, w.scores.data() + p, w.keys);
  // Per row: the divisor of its P @ V (1 where the weights are normalised already, 0 for no key).
  std::vector<float> divisors(tile_rows, 1.0f);
  for (int64_t i = 0; i < tile_rows; ++i) {
    T* weights = w.weight_rows() + i * w.keys;
    float* row = w.scores.data() + i * w.keys;
    bool filled = i < rows;
    if (filled && m.allowed == nullptr) {
      if constexpr (std::is_same_v<T, float>)
        divisors[i] = exp_row(row, s.sk, row_max(row, s.sk));
      else
        divisors[i] = exp_row(row, s.sk, row_max(row, s.sk), weights);
    } else if (filled) {
      filled = masked_softmax_row(row, seen, m.scale, m.allowed + (b * s.sq + row0 + i) * s.sk, weights);
      if (!filled) divisors[i] = 0.0f;
    }
    std::fill(weights + (filled ? seen : 0), weights + w.keys, T{0});
  }
  for (int64_t p = 0; p < w.dims; p += kPanel)
    block_product(w.weight_rows(), w.keys, w.packed_values.data() + p * w.keys, keys, w.acc.data() + p, w.dims);
  tiles_end(!s.avx512);
  for (int64_t i = 0; i < rows; ++i) {
    T* o = out + (b * s.sq + row0 + i) * q_stride + h * s.dim;
    const Vec divisor = vset1(divisors[i]);
    for (int64_t d = 0; d < s.dim; d += 16) {
      const Lanes lanes = lanes_left(s.dim - d);
      const Vec sums = vload(w.acc.data() + i * w.dims + d, lanes);
      // A row with no allowed key: its weights are all zero, and so is its output.
      const Vec value = divisors[i] == 0.0f ? vzero() : vdiv(sums, divisor);
      store16(o + d, lanes, value);
    }
  }
}

template <ffi::DataType D>
static ffi::Error attend(const AttentionShape& s, const Masking& m, ffi::Buffer<D> q, ffi::Buffer<D> k,
                         ffi::Buffer<D> v, ffi::ResultBuffer<D> out) {
  using T = Element<D>;
  const int64_t blocks = (s.sq + kQueryBlock - 1) / kQueryBlock;
  const int64_t tasks = s.batch * s.heads * blocks;
  const auto* qp = reinterpret_cast<const T*>(q.untyped_data());
  const auto* kp = reinterpret_cast<const T*>(k.untyped_data());
  const auto* vp = reinterpret_cast<const T*>(v.untyped_data());
  auto* op = reinterpret_cast<T*>(out->untyped_data());
  // Tasks are (batch, head, query block), in that order, so a worker's share is mostly whole heads:
  // it packs each of them once (and the heads of a group share it).
  const int workers = workers_for(tasks);
  const uint64_t call = next_call();
  const bool keep = AttentionScratch<T>::bytes(s) <= kKeptScratchBytes;
  std::vector<AttentionScratch<T>> scratch;
  if (!keep)
    for (int i = 0; i < workers; ++i) scratch.emplace_back(s);
  parallel_tasks(tasks, workers, [&](int64_t t, int worker) {
    const int64_t block = t % blocks, bh = t / blocks;
    const int64_t row0 = block * kQueryBlock, rows = std::min(kQueryBlock, s.sq - row0);
    attend_block(s, m, qp, kp, vp, op, bh / s.heads, bh % s.heads, row0, rows,
                 keep ? kept_scratch<T>(s, call) : scratch[worker]);
  });
  return ffi::Error::Success();
}

// (B, Sq, H, D) queries against (B, Sk, Hkv, D) keys and values, H a multiple of Hkv.
template <ffi::DataType D>
static bool attention_shapes(ffi::Buffer<D>& q, ffi::Buffer<D>& k, ffi::Buffer<D>& v, AttentionShape* s) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || qd[0] != kd[0] || qd[3] != kd[3] || kd[2] == 0 ||
      qd[2] % kd[2] != 0 || !std::equal(kd.begin(), kd.end(), vd.begin()))
    return false;
  *s = AttentionShape{qd[0], qd[1], kd[1], qd[2], kd[2], qd[3]};
  return true;
}

template <bool Avx512, ffi::DataType D = ffi::DataType::BF16>
static ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<D> q, ffi::Buffer<D> k, ffi::Buffer<D> v,
                            ffi::ResultBuffer<D> out) {
  PoolScope scope(pool);
  AttentionShape s;
  if (!attention_shapes(q, k, v, &s) || s.kv_heads != s.heads)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "expected (B, Sq, H, D) and two (B, Sk, H, D)");
  s.avx512 = Avx512;
  return attend(s, Masking{}, q, k, v, out);
}

#define FLUX2KLEIN_ATTENTION_BINDING(D)                                                                        \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<D>>().Arg<ffi::Buffer<D>>().Arg<ffi::Buffer<D>>() \
      .Ret<ffi::Buffer<D>>()
#if FLUX2KLEIN_BF16
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_amx_attention, Attention<false>, FLUX2KLEIN_ATTENTION_BINDING(ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_attention, Attention<true>, FLUX2KLEIN_ATTENTION_BINDING(ffi::BF16));
#endif
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_attention_f32, (Attention<true, ffi::DataType::F32>),
                              FLUX2KLEIN_ATTENTION_BINDING(ffi::F32));

template <bool Avx512, ffi::DataType D = ffi::DataType::BF16>
static ffi::Error MaskedAttention(ffi::ThreadPool pool, ffi::Buffer<D> q, ffi::Buffer<D> k, ffi::Buffer<D> v,
                                  ffi::Buffer<ffi::PRED> allowed, float scale, ffi::ResultBuffer<D> out) {
  PoolScope scope(pool);
  AttentionShape s;
  auto md = allowed.dimensions();
  if (!attention_shapes(q, k, v, &s) || md.size() != 3 || md[0] != s.batch || md[1] != s.sq || md[2] != s.sk)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "expected (B, Sq, H, D), two (B, Sk, Hkv, D) with H a multiple of Hkv, and a (B, Sq, Sk) mask");
  s.avx512 = Avx512;
  return attend(s, Masking{allowed.typed_data(), scale}, q, k, v, out);
}

#define FLUX2KLEIN_MASKED_ATTENTION_BINDING(D)                                                                 \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<D>>().Arg<ffi::Buffer<D>>().Arg<ffi::Buffer<D>>() \
      .Arg<ffi::Buffer<ffi::PRED>>().Attr<float>("scale").Ret<ffi::Buffer<D>>()
#if FLUX2KLEIN_BF16
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_amx_masked_attention, MaskedAttention<false>,
                              FLUX2KLEIN_MASKED_ATTENTION_BINDING(ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_masked_attention, MaskedAttention<true>,
                              FLUX2KLEIN_MASKED_ATTENTION_BINDING(ffi::BF16));
#endif
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_masked_attention_f32, (MaskedAttention<true, ffi::DataType::F32>),
                              FLUX2KLEIN_MASKED_ATTENTION_BINDING(ffi::F32));

// Which products a convolution's tiles run on: the AMX tiles, MKL's GEMM, or the panels' register block
// (VDPBF16PS; FMAs in float32).
enum class ConvProducts { kAmx, kMkl, kPanels };

struct ConvShape {
  int64_t batch, h, w, c_in, c_out;
  bool avx512 = false;  // the AVX-512 bf16 plugin's call: VDPBF16PS (or FMAs in float32), no AMX or MKL
  // A nearest 2x upsample first (the AVX-512 plugins' only): h and w are the input's, the output is (2h, 2w),
  // and the kernel is packed as the sixteen merged taps of upsample_conv_tile_panels (or, in Winograd's form,
  // as four phases, pack_winograd_kernel).
  bool upsample = false;
  bool f32 = false;  // float32 input, kernel and output (the AVX-512 plugin's FMA form)
  int64_t wp() const { return w + 2; }
  int64_t scale() const { return upsample ? 2 : 1; }
  // The tiles take whole A tiles of input channels; other widths take MKL's products.
  ConvProducts products() const {
    if (avx512) return ConvProducts::kPanels;
    return c_in % 32 == 0 ? ConvProducts::kAmx : ConvProducts::kMkl;
  }
  // The kernel packed in panels of 32 output channels (the tiles' and VDPBF16PS's layout).
  bool packed() const { return products() != ConvProducts::kMkl; }
};

// A tile of output rows reads its input as `padded`: rows + 3 rows of (W + 2) x Cin, one row above the
// tile and two below, one column each side, then kSlackPositions zero positions. Output position (y, c)
// of the tile is row y of the padded width; tap (dy, dx) of all of them is then one (rows x Wp, Cin)
// matrix starting dy rows and dx columns further on (the two columns past W are computed and dropped;
// the second row below and the slack keep the last taps of the last positions inside the buffer).
constexpr int64_t kSlackPositions = 32;

static int64_t padded_size(const ConvShape& s, int64_t rows) {
  return ((rows + 3) * s.wp() + kSlackPositions) * s.c_in;
}

#if FLUX2KLEIN_WIDE
// As nnx.Conv in bf16: the sums rounded to bf16, then the bias added and rounded again.
static inline void store_conv_outputs(const float* sums, const float* bias, int64_t channels, uint16_t* out) {
  for (int64_t c = 0; c < channels; c += 16) {
    const __mmask16 lanes = lanes_left(channels - c);
    const __m512 rounded = from_bf16x16(to_bf16x16(_mm512_maskz_loadu_ps(lanes, sums + c)));
    const __m512 biased = _mm512_add_ps(rounded, _mm512_maskz_loadu_ps(lanes, bias + c));
    _mm256_mask_storeu_epi16(out + c, lanes, to_bf16x16(biased));
  }
}
#endif

// As nnx.Conv in float32: the sums plus the bias.
static inline void store_conv_outputs(const float* sums, const float* bias, int64_t channels, float* out) {
  for (int64_t c = 0; c < channels; c += 16) {
    const Lanes lanes = lanes_left(channels - c);
    vstore(out + c, lanes, vadd(vload(sums + c, lanes), vload(bias + c, lanes)));
  }
}

// A bias in float32, zero-padded to a whole panel (the epilogues read whole panels' worth).
template <typename T>
static std::vector<float> widened_bias(const T* bias, int64_t count) {
  std::vector<float> wide(round_up(count, kPanel), 0.0f);
  for (int64_t c = 0; c < count; c += 16) {
    const Lanes lanes = lanes_left(count - c);
    vstore(wide.data() + c, lanes, load16(bias + c, lanes));
  }
  return wide;
}

// The kernel (3, 3, Cin, Cout) (or (1, 1, Cin, Cout): one tap) for the tiles: panels of 32 output
// channels, each [tap][Cin pair][32][2] in bf16 (VDPBF16PS's pairs), [tap][Cin][32] in float32; output
// channels zero-padded to a whole panel.
template <typename T>
static std::vector<T> pack_conv_kernel(const T* kernel, int64_t c_in, int64_t c_out, int64_t taps = 9) {
  constexpr int64_t pair = sizeof(T) == 2 ? 2 : 1;
  std::vector<T> packed(round_up(c_out, kPanel) * taps * c_in);
  T* out = packed.data();
  for (int64_t p = 0; p < c_out; p += kPanel)
    for (int64_t tap = 0; tap < taps; ++tap)
      for (int64_t c = 0; c < c_in; c += pair)
        for (int64_t col = 0; col < kPanel; ++col, out += pair) {
          const bool real = p + col < c_out;
          const T* k = kernel + (tap * c_in + c) * c_out + p + col;
          for (int64_t i = 0; i < pair; ++i) out[i] = real ? k[i * c_out] : T{0};
        }
  return packed;
}

// A 3x3 kernel (3, 3, Cin, Cout) as the sixteen taps of a nearest 2x upsample then that convolution
// (upsample_conv_tile_panels), packed as pack_conv_kernel packs nine: tap (dy, dx) of phase (a, b) is the
// sum of the kernel's rows kRows[a][dy] and columns kRows[b][dx], in float32; a bf16 kernel's is rounded
// to bf16 once (the one rounding this form adds to nnx.Conv's). Output row 2r + a reads input rows
// r - 1 + a and r + a: for a = 0, kernel row 0 falls on the first and rows 1 and 2 on the second; for
// a = 1, rows 0 and 1 on the first and row 2 on the second.
template <typename T>
static std::vector<T> pack_upsample_kernel(const T* kernel, int64_t c_in, int64_t c_out) {
  static constexpr int kRows[2][2][2] = {{{0, 0}, {1, 2}}, {{0, 1}, {2, 2}}};  // [phase][tap]: first, last
  const int64_t size = c_in * c_out;
  std::vector<T> merged(16 * size);
  for (int tap = 0; tap < 16; ++tap) {
    const int a = tap / 8, b = tap / 4 % 2, dy = tap / 2 % 2, dx = tap % 2;
    for (int64_t i = 0; i < size; i += 16) {  // sixteen weights at a time: this runs on every call
      const Lanes lanes = lanes_left(size - i);
      Vec sum = vzero();
      for (int ky = kRows[a][dy][0]; ky <= kRows[a][dy][1]; ++ky)
        for (int kx = kRows[b][dx][0]; kx <= kRows[b][dx][1]; ++kx)
          sum = vadd(sum, load16(kernel + (ky * 3 + kx) * size + i, lanes));
      store16(merged.data() + tap * size + i, lanes, sum);
    }
  }
  return pack_conv_kernel(merged.data(), c_in, c_out, 16);
}

#if FLUX2KLEIN_BF16
// One tile on the AMX tiles: per block of 32 positions and panel of 32 output channels, the nine taps
// and all input channels accumulate in the tiles (A tiles are 16 consecutive positions x 32 channels,
// contiguous in `padded`), so no float32 sums leave them until the block is done.
static void conv_tile_amx(const ConvShape& s, const uint16_t* padded, const uint16_t* packed, const float* bias,
                          int64_t rows, uint16_t* out) {
  const int64_t wp = s.wp(), positions = rows * wp;
  alignas(64) float block[32 * 32];
  configure_tiles();
  for (int64_t p = 0; p < s.c_out; p += kPanel) {
    const uint16_t* panel = packed + p * 9 * s.c_in;
    for (int64_t p0 = 0; p0 < positions; p0 += 32) {
      tiles_zero();
      for (int64_t tap = 0; tap < 9; ++tap)
        tiles_accumulate(padded + (p0 + (tap / 3) * wp + tap % 3) * s.c_in, s.c_in, panel + tap * s.c_in * kPanel,
                         s.c_in);
      tiles_store(block, 32);
      for (int64_t i = 0; i < 32 && p0 + i < positions; ++i) {
        const int64_t r = (p0 + i) / wp, col = (p0 + i) % wp;
        if (col < s.w)
          store_conv_outputs(block + i * 32, bias + p, std::min(kPanel, s.c_out - p),
                             out + (r * s.w + col) * s.c_out + p);
      }
    }
  }
  _tile_release();
}

// One tile on MKL's GEMM: nine products accumulated into `sums` (rows x Wp x Cout float32).
static void conv_tile_mkl(const ConvShape& s, const uint16_t* padded, const uint16_t* kernel, const float* bias,
                          int64_t rows, float* sums, uint16_t* out) {
  const int64_t wp = s.wp();
  for (int64_t tap = 0; tap < 9; ++tap) {
    const int64_t dy = tap / 3, dx = tap % 3;
    gemm_bf16(kRowMajor, kNoTrans, kNoTrans, rows * wp, s.c_out, s.c_in, 1.0f, padded + (dy * wp + dx) * s.c_in,
              s.c_in, kernel + tap * s.c_in * s.c_out, s.c_out, tap == 0 ? 0.0f : 1.0f, sums, s.c_out);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t col = 0; col < s.w; ++col)
      store_conv_outputs(sums + (r * wp + col) * s.c_out, bias, s.c_out, out + (r * s.w + col) * s.c_out);
}
#endif

// One tile in VDPBF16PS (or float32 FMAs): per panel of 32 output channels and block of kDotRows
// consecutive positions, the nine taps and all input channels accumulate in float32 (`accumulate`).
// Positions run along the padded width, as on the tiles: the two columns past W are computed and dropped.
template <typename T>
static void conv_tile_panels(const ConvShape& s, const T* padded, const T* packed, const float* bias, int64_t rows,
                             T* out) {
  const int64_t wp = s.wp(), positions = rows * wp;
  alignas(64) float block[kDotRows * kPanel];
  for (int64_t p = 0; p < s.c_out; p += kPanel) {
    const T* panel = packed + p * 9 * s.c_in;
    for (int64_t p0 = 0; p0 < positions; p0 += kDotRows) {
      std::fill(block, block + kDotRows * kPanel, 0.0f);
      for (int64_t tap = 0; tap < 9; ++tap)
        accumulate<kDotRows>(padded + (p0 + (tap / 3) * wp + tap % 3) * s.c_in, s.c_in,
                             panel + tap * s.c_in * kPanel, s.c_in, block, kPanel);
      for (int64_t i = 0; i < kDotRows && p0 + i < positions; ++i) {
        const int64_t r = (p0 + i) / wp, col = (p0 + i) % wp;
        if (col < s.w)
          store_conv_outputs(block + i * kPanel, bias + p, std::min(kPanel, s.c_out - p),
                             out + (r * s.w + col) * s.c_out + p);
      }
    }
  }
}

// One tile of a nearest 2x upsample then a 3x3 'same' convolution, in VDPBF16PS, computed on the input's
// rows: output pixel (2r + a, 2c + b) sees only input rows r - 1 + a .. r + a and columns c - 1 + b ..
// c + b, so each of the four phases (a, b) is a 2x2 convolution of the input, its taps the sums of the 3x3
// taps that fall on the same input pixel (pack_upsample_kernel): 4 x 4 products per input pixel instead of
// 9 per output pixel (2.25x fewer), and no upsampled copy of the input. The sixteen taps are packed
// [a][b][dy][dx]; tap (dy, dx) of phase (a, b) reads padded row r + a + dy, column c + b + dx.
template <typename T>
static void upsample_conv_tile_panels(const ConvShape& s, const T* padded, const T* packed, const float* bias,
                                      int64_t rows, T* out) {
  const int64_t wp = s.wp(), positions = rows * wp, out_w = 2 * s.w;
  alignas(64) float block[kDotRows * kPanel];
  for (int64_t p = 0; p < s.c_out; p += kPanel) {
    const T* panel = packed + p * 16 * s.c_in;
    for (int64_t p0 = 0; p0 < positions; p0 += kDotRows)
      for (int phase = 0; phase < 4; ++phase) {  // the block's input rows stay in L1 for all four
        const int a = phase / 2, b = phase % 2;
        std::fill(block, block + kDotRows * kPanel, 0.0f);
        for (int tap = 0; tap < 4; ++tap)
          accumulate<kDotRows>(padded + (p0 + (a + tap / 2) * wp + b + tap % 2) * s.c_in, s.c_in,
                               panel + (phase * 4 + tap) * s.c_in * kPanel, s.c_in, block, kPanel);
        for (int64_t i = 0; i < kDotRows && p0 + i < positions; ++i) {
          const int64_t r = (p0 + i) / wp, col = (p0 + i) % wp;
          if (col < s.w)
            store_conv_outputs(block + i * kPanel, bias + p, std::min(kPanel, s.c_out - p),
                               out + ((2 * r + a) * out_w + 2 * col + b) * s.c_out + p);
        }
      }
  }
}

// A float32 3x3 'same' convolution in Winograd's form: each m x m block of outputs from the (m + 2) x (m + 2)
// block of padded input around it, as (m + 2)^2 products of the transformed input (B^T d B) and the transformed
// kernel (G g G^T, pack_winograd_kernel) per input channel, summed over the channels, then A^T M A. F(4x4, 3x3)
// where height and width are multiples of 4: 36 products per 16 outputs where the nine taps take 144 (4x fewer
// FMAs); F(2x2, 3x3) where they are only even: 16 per 4 (2.25x). F(2x2)'s transforms only add, subtract and
// halve, so its sums stay at XLA's float32 error; F(4x4)'s (Lavin and Gray's points 0, +-1, +-2) multiply by up
// to 8, and its error against float64 is a few times XLA's, still near float32's rounding
// (tests/test_float32_kernels.py bounds both). bf16 keeps the direct form, whose inputs VDPBF16PS takes as
// stored (the transformed inputs would need rounding to bf16 again).
// One form's size (outputs per block side) and its three transforms on (kIn x kIn) blocks of 16-lane vectors.
struct WinogradF2 {
  static constexpr int kOut = 2, kIn = 4, kTaps = kIn * kIn;
  static constexpr float kG[kIn][3] = {{1.0f, 0.0f, 0.0f}, {0.5f, 0.5f, 0.5f}, {0.5f, -0.5f, 0.5f}, {0.0f, 0.0f, 1.0f}};
  // B^T d for one column of four: B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1].
  static inline void input(Vec& d0, Vec& d1, Vec& d2, Vec& d3) {
    const Vec a = d0, b = d1, c = d2, e = d3;
    d0 = vsub(a, c), d1 = vadd(b, c), d2 = vsub(c, b), d3 = vsub(b, e);
  }
  static inline void input(Vec d[kIn][kIn]) {
    for (int c = 0; c < kIn; ++c) input(d[0][c], d[1][c], d[2][c], d[3][c]);
    for (int r = 0; r < kIn; ++r) input(d[r][0], d[r][1], d[r][2], d[r][3]);
  }
  // A^T m for one column of four: A^T = [1 1 1 0; 0 1 -1 -1].
  static inline void output(const Vec m[kIn], Vec o[kOut]) {
    o[0] = vadd(vadd(m[0], m[1]), m[2]);
    o[1] = vsub(vsub(m[1], m[2]), m[3]);
  }
};

struct WinogradF4 {
  static constexpr int kOut = 4, kIn = 6, kTaps = kIn * kIn;
  static constexpr float kG[kIn][3] = {{0.25f, 0.0f, 0.0f},
                                       {-1.0f / 6, -1.0f / 6, -1.0f / 6},
                                       {-1.0f / 6, 1.0f / 6, -1.0f / 6},
                                       {1.0f / 24, 1.0f / 12, 1.0f / 6},
                                       {1.0f / 24, -1.0f / 12, 1.0f / 6},
                                       {0.0f, 0.0f, 1.0f}};
  // B^T d for one column of six: B^T = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0;
  // 0 2 -1 -2 1 0; 0 4 0 -5 0 1].
  static inline void input(Vec& d0, Vec& d1, Vec& d2, Vec& d3, Vec& d4, Vec& d5) {
    const Vec four = vset1(4.0f), five = vset1(5.0f), two = vset1(2.0f);
    const Vec s12 = vadd(d1, d2), s34 = vadd(d3, d4), m12 = vsub(d1, d2), m43 = vsub(d4, d3);
    const Vec m31 = vsub(d3, d1), m42 = vsub(d4, d2);
    const Vec t0 = vfnmadd(five, d2, vfmadd(four, d0, d4)), t5 = vfnmadd(five, d3, vfmadd(four, d1, d5));
    d1 = vfnmadd(four, s12, s34), d2 = vfmadd(four, m12, m43);
    d3 = vfmadd(two, m31, m42), d4 = vfnmadd(two, m31, m42);
    d0 = t0, d5 = t5;
  }
  static inline void input(Vec d[kIn][kIn]) {
    for (int c = 0; c < kIn; ++c) input(d[0][c], d[1][c], d[2][c], d[3][c], d[4][c], d[5][c]);
    for (int r = 0; r < kIn; ++r) input(d[r][0], d[r][1], d[r][2], d[r][3], d[r][4], d[r][5]);
  }
  // A^T m for one column of six: A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1].
  static inline void output(const Vec m[kIn], Vec o[kOut]) {
    const Vec s12 = vadd(m[1], m[2]), s34 = vadd(m[3], m[4]), d12 = vsub(m[1], m[2]), d34 = vsub(m[3], m[4]);
    o[0] = vadd(vadd(m[0], s12), s34);
    o[1] = vfmadd(vset1(2.0f), d34, d12);
    o[2] = vfmadd(vset1(4.0f), s34, s12);
    o[3] = vadd(vfmadd(vset1(8.0f), d34, d12), m[5]);
  }
};

enum class Winograd { kNone, kF2, kF4 };

// A Winograd chunk of blocks (winograd_chunk_blocks): the packed kernel it reads, its scratch at most.
constexpr int64_t kWinogradChunkKernelBytes = 4 << 20, kWinogradChunkScratchBytes = 8 << 20;

static int64_t winograd_chunk_blocks(Winograd form, const ConvShape& s);

// F(4x4) where the sides allow it, else F(2x2) where they allow that; except that a kernel too large for
// one chunk's worth (its chunks then hold many blocks: 96-108 at 512 channels) takes F(2x2) unless every
// core gets a whole chunk of F(4x4)'s blocks. Otherwise a small image has fewer chunks than a many-core
// host has cores, each re-reading the 38 MB kernel: on 13 cores a 64x64 512-channel convolution took 32-39
// ms in F(4x4) against 13-18 ms in F(2x2) (docs/benchmarks.md); on 2 cores F(4x4) is as fast or faster.
static Winograd winograd_form(const ConvShape& s) {
  if (!s.f32 || s.products() != ConvProducts::kPanels) return Winograd::kNone;
  // An upsample in F(2x2) would take 16 products per four input pixels for each of its four phases: as
  // many as its merged taps do.
  const bool f2 = s.h % 2 == 0 && s.w % 2 == 0 && !s.upsample;
  if (s.h % 4 == 0 && s.w % 4 == 0) {
    const int64_t chunk = winograd_chunk_blocks(Winograd::kF4, s), blocks = s.batch * (s.h / 4) * (s.w / 4);
    if (!f2 || chunk == kDotRows || blocks >= worker_count() * chunk) return Winograd::kF4;
  }
  return f2 ? Winograd::kF2 : Winograd::kNone;
}

// The packed kernel's phases: a nearest 2x upsample's output pixel (2r + a, 2c + b) is phase 2a + b of input
// pixel (r, c) (upsample_conv_tile_panels); a plain convolution has one.
static int64_t winograd_phases(const ConvShape& s) { return s.upsample ? 4 : 1; }

// The row of the 3x3 window around input row r (r - 1, r, r + 1) that kernel row ky of a nearest 2x upsample
// then a 3x3 convolution reads for output row 2r + a: [a][ky]. Output row 2r reads upsampled rows 2r - 1, 2r
// and 2r + 1, which are input rows r - 1, r and r.
constexpr int kUpsampledWindowRow[2][3] = {{0, 1, 1}, {1, 1, 2}};

// G g G^T for each (input, output) channel of a (3, 3, Cin, Cout) kernel, packed as pack_conv_kernel packs
// its taps (tap u * kIn + v is row u of G against column v of G^T): each panel's taps straight from the
// kernel, sixteen output channels at a time, the tasks (a panel's tap each) shared between the cores. This
// runs on every call, and at 512 channels F(4x4)'s kernel is 38 MB: made in one thread, element by element,
// it took longer than the convolution's products. A nearest 2x upsample's (Upsample) holds each of its four
// phases' panels in turn (the phase's Cout rounded up to whole panels), the phase a 3x3 convolution of the
// input whose window rows the kernel's rows fall on as kUpsampledWindowRow says (and so its columns).
template <typename Form, bool Upsample>
static std::unique_ptr<float[]> pack_winograd_kernel(const float* kernel, int64_t c_in, int64_t c_out) {
  constexpr int taps = Form::kTaps, phases = Upsample ? 4 : 1;
  const int64_t panels = (c_out + kPanel - 1) / kPanel;  // per phase
  std::unique_ptr<float[]> packed(new float[phases * panels * kPanel * taps * c_in]);
  parallel_tasks(phases * panels * taps, workers_for(phases * panels * taps), [&](int64_t task, int) {
    const int64_t panel = task / taps, p = panel % panels * kPanel;
    const int tap = static_cast<int>(task % taps), u = tap / Form::kIn, v = tap % Form::kIn;
    const int a = static_cast<int>(panel / panels) / 2, b = static_cast<int>(panel / panels) % 2;
    float weights[9];
    for (int k = 0; k < 9; ++k)
      weights[k] = Upsample ? Form::kG[u][kUpsampledWindowRow[a][k / 3]] * Form::kG[v][kUpsampledWindowRow[b][k % 3]]
                            : Form::kG[u][k / 3] * Form::kG[v][k % 3];
    float* out = packed.get() + panel * kPanel * taps * c_in + tap * c_in * kPanel;
    for (int64_t c = 0; c < c_in; ++c, out += kPanel)
      for (int64_t half = 0; half < kPanel; half += 16) {  // columns past Cout: zeros
        const Lanes lanes = lanes_left(std::max<int64_t>(0, c_out - p - half));
        Vec sum = vzero();
        for (int k = 0; k < 9; ++k)
          if (weights[k] != 0.0f)
            sum = vfmadd(vset1(weights[k]), vload(kernel + (k * c_in + c) * c_out + p + half, lanes), sum);
        vstore(out + half, sum);
      }
  });
  return packed;
}

static std::unique_ptr<float[]> pack_winograd_kernel(Winograd form, const ConvShape& s, const float* kernel) {
  if (s.upsample) return pack_winograd_kernel<WinogradF4, true>(kernel, s.c_in, s.c_out);  // F(4x4) only
  return form == Winograd::kF4 ? pack_winograd_kernel<WinogradF4, false>(kernel, s.c_in, s.c_out)
                               : pack_winograd_kernel<WinogradF2, false>(kernel, s.c_in, s.c_out);
}

static int64_t winograd_size(Winograd form) { return form == Winograd::kF4 ? WinogradF4::kOut : WinogradF2::kOut; }
static int64_t winograd_taps(Winograd form) { return form == Winograd::kF4 ? WinogradF4::kTaps : WinogradF2::kTaps; }

// Blocks per chunk of a Winograd tile: the loop reads the whole packed kernel once per chunk. Up to
// kWinogradChunkKernelBytes of kernel a chunk is one group of kDotRows blocks (its transformed inputs and
// products in L1 and L2: the fastest while the kernel stays in the last-level cache); a larger kernel takes
// 12 blocks per kWinogradChunkKernelBytes (at 512 channels F(4x4)'s kernel is 38 MB, the upsample's four
// phases' 151 MB, and one group per read ran out of memory bandwidth), in whole groups, as many as
// kWinogradChunkScratchBytes of scratch holds.
static int64_t winograd_chunk_blocks(Winograd form, const ConvShape& s) {
  const int64_t kernel_bytes =
      winograd_taps(form) * s.c_in * winograd_phases(s) * round_up(s.c_out, kPanel) * int64_t{sizeof(float)};
  if (kernel_bytes <= kWinogradChunkKernelBytes) return kDotRows;
  const int64_t block_bytes = winograd_taps(form) * (s.c_in + kPanel) * int64_t{sizeof(float)};
  const int64_t blocks =
      std::min(12 * (kernel_bytes / kWinogradChunkKernelBytes), kWinogradChunkScratchBytes / block_bytes);
  return std::max<int64_t>(kDotRows, blocks / kDotRows * kDotRows);
}

// The scratch of one worker's Winograd tile of `rows` output rows: a chunk's transformed inputs
// [taps][blocks][Cin] and their products with one panel [taps][blocks][32], in float32.
static int64_t winograd_scratch_count(Winograd form, const ConvShape& s, int64_t rows) {
  const int64_t m = winograd_size(form), tile_blocks = round_up((rows / m) * (s.w / m), kDotRows);
  return winograd_taps(form) * std::min(winograd_chunk_blocks(form, s), tile_blocks) * (s.c_in + kPanel);
}

// One tile of output rows (a whole number of block rows) in Winograd's form, chunk by chunk of blocks: the
// chunk's inputs transformed once, then per panel of 32 output channels and per tap the products of the
// chunk's blocks (`accumulate`, in groups of kDotRows as the direct form's taps) against that tap's slice of
// the panel, and A^T M A with the bias. Block (i, j) of the tile reads padded rows m i .. m i + m + 1 and
// columns m j .. m j + m + 1, and writes output rows m i .. m i + m - 1 and those columns; with Upsample, each
// phase (a, b)'s panels write output pixel (2y + a, 2x + b) for the block's pixel (y, x).
template <typename Form, bool Upsample>
static void winograd_tile_panels(const ConvShape& s, const float* padded, const float* packed, const float* bias,
                                 int64_t rows, float* out, float* scratch, int64_t chunk) {
  constexpr int m = Form::kOut, n = Form::kIn, taps = Form::kTaps;
  const int64_t wp = s.wp(), across = s.w / m, blocks = (rows / m) * across, cin = s.c_in;
  for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
    const int64_t count = std::min(chunk, blocks - b0), stride = round_up(count, kDotRows);  // whole groups
    float* inputs = scratch;                             // [taps][stride][Cin]
    float* products = scratch + taps * stride * cin;     // [taps][stride][32]
    for (int64_t t = 0; t < stride; ++t) {
      if (t >= count) {  // the last group's rows past the last block: zeros, their products dropped
        for (int xi = 0; xi < taps; ++xi) std::fill_n(inputs + (xi * stride + t) * cin, cin, 0.0f);
        continue;
      }
      const int64_t i = (b0 + t) / across, j = (b0 + t) % across;
      const float* corner = padded + (m * i * wp + m * j) * cin;
      for (int64_t c = 0; c < cin; c += 16) {
        const Lanes lanes = lanes_left(cin - c);
        Vec d[n][n];
        for (int r = 0; r < n; ++r)
          for (int q = 0; q < n; ++q) d[r][q] = vload(corner + (r * wp + q) * cin + c, lanes);
        Form::input(d);
        for (int xi = 0; xi < taps; ++xi) vstore(inputs + (xi * stride + t) * cin + c, lanes, d[xi / n][xi % n]);
      }
    }
    const int64_t panels = (s.c_out + kPanel - 1) / kPanel;  // per phase
    for (int64_t k = 0; k < (Upsample ? 4 : 1) * panels; ++k) {
      const float* panel = packed + k * kPanel * taps * cin;
      const int64_t p = k % panels * kPanel, phase_row = k / panels / 2, phase_col = k / panels % 2;
      for (int xi = 0; xi < taps; ++xi)
        for (int64_t g = 0; g < stride; g += kDotRows)
          accumulate<kDotRows, false>(inputs + (xi * stride + g) * cin, cin, panel + xi * cin * kPanel, cin,
                                      products + (xi * stride + g) * kPanel, kPanel);
      const int64_t channels = std::min(kPanel, s.c_out - p);
      for (int64_t t = 0; t < count; ++t) {
        const int64_t i = (b0 + t) / across, j = (b0 + t) % across;
        alignas(64) float outputs[m * m][kPanel];  // the block's pixels, row by row
        for (int64_t half = 0; half < kPanel; half += 16) {
          // A^T M A: the columns of M first (r = A^T M), then the rows of r.
          Vec r[m][n];
          for (int q = 0; q < n; ++q) {
            Vec column[n], reduced[m];
            for (int u = 0; u < n; ++u) column[u] = vload(products + ((u * n + q) * stride + t) * kPanel + half);
            Form::output(column, reduced);
            for (int a = 0; a < m; ++a) r[a][q] = reduced[a];
          }
          for (int a = 0; a < m; ++a) {
            Vec pixels[m];
            Form::output(r[a], pixels);
            for (int b = 0; b < m; ++b) vstore(outputs[a * m + b] + half, pixels[b]);
          }
        }
        for (int pixel = 0; pixel < m * m; ++pixel) {
          const int64_t y = m * i + pixel / m, x = m * j + pixel % m;
          const int64_t at = Upsample ? (2 * y + phase_row) * 2 * s.w + 2 * x + phase_col : y * s.w + x;
          store_conv_outputs(outputs[pixel], bias + p, channels, out + at * s.c_out + p);
        }
      }
    }
  }
}

// Output rows per task. On the tiles and in panels: a tile's padded input within about 1 MB (the rows
// above and below are made again by the next tile), and in Winograd's form at least one chunk of blocks. On
// MKL: its float32 sums within about 512 KB. The image's rows are then split evenly into a whole number of
// tiles per core where they allow it, so that no core waits on another's last, longer tile.
static int64_t conv_tile_rows(const ConvShape& s) {
  const Winograd form = winograd_form(s);  // Winograd's tiles take whole rows of blocks
  const int64_t least = s.packed() ? 4 : 1;
  const int64_t padded_row_bytes = s.wp() * s.c_in * (s.f32 ? 4 : 2);
  int64_t most = std::max(least, s.packed() ? (1 << 20) / padded_row_bytes - 3 : (128 << 10) / (s.wp() * s.c_out));
  if (form != Winograd::kNone) {
    const int64_t m = winograd_size(form), across = s.w / m;
    most = std::max(most, (winograd_chunk_blocks(form, s) + across - 1) / across * m);
  }
  const int64_t cores = worker_count(), tiles = (s.h + most - 1) / most;
  const int64_t even = s.batch % cores == 0 ? tiles : round_up(tiles, cores);  // a batch of whole images evens out
  const int64_t tile = std::max(least, std::min(s.h, (s.h + even - 1) / even));
  return form == Winograd::kF4 ? round_up(tile, 4) : form == Winograd::kF2 ? round_up(tile, 2) : tile;
}

// A worker's padded input rows for a tile (and MKL's float32 sums), each element written before it is read.
template <typename T>
struct ConvScratch {
  std::vector<float> sums;
  std::vector<T> padded;
  void fit(int64_t padded_count, int64_t sums_count) {
    if (static_cast<int64_t>(padded.size()) < padded_count) padded.resize(padded_count);
    if (static_cast<int64_t>(sums.size()) < sums_count) sums.resize(sums_count);
  }
};

// This thread's convolution scratch, kept from call to call as the attention's is.
template <typename T>
static ConvScratch<T>& kept_conv_scratch(int64_t padded_count, int64_t sums_count) {
  thread_local ConvScratch<T> kept;
  kept.fit(padded_count, sums_count);
  return kept;
}

// For every tile of output rows, the tiles shared between the cores: fill(b, y, dst) writes padded row y
// of batch b (y from -1 to H + 1; zeros outside the image), then the tile's products and epilogue.
template <typename T, typename Fill>
static void conv_tiles(const ConvShape& s, const T* kernel, const T* bias, T* out, Fill fill) {
  const int64_t tile_rows = conv_tile_rows(s), tiles = (s.h + tile_rows - 1) / tile_rows, row = s.wp() * s.c_in;
  const std::vector<float> bias32 = widened_bias(bias, s.c_out);
  const Winograd form = winograd_form(s);
  const bool winograd = form != Winograd::kNone;
  const int64_t chunk = winograd ? winograd_chunk_blocks(form, s) : 0;
  std::vector<T> packed;
  std::unique_ptr<float[]> winograd_packed;
  if constexpr (std::is_same_v<T, float>)
    if (winograd) winograd_packed = pack_winograd_kernel(form, s, kernel);
  if (!winograd)
    packed = s.upsample ? pack_upsample_kernel(kernel, s.c_in, s.c_out)
             : s.packed() ? pack_conv_kernel(kernel, s.c_in, s.c_out) : std::vector<T>();
  const int workers = workers_for(s.batch * tiles);
  // `sums`: MKL's float32 sums, or Winograd's transformed inputs and products.
  const int64_t padded_count = padded_size(s, tile_rows),
                sums_count = winograd   ? winograd_scratch_count(form, s, tile_rows)
                             : s.packed() ? 0
                                          : tile_rows * s.wp() * s.c_out;
  const bool keep = padded_count * int64_t{sizeof(T)} + sums_count * int64_t{sizeof(float)} <= kKeptScratchBytes;
  std::vector<ConvScratch<T>> scratch(keep ? 0 : workers);
  for (auto& w : scratch) w.fit(padded_count, sums_count);
  parallel_tasks(s.batch * tiles, workers, [&](int64_t t, int worker) {
    const int64_t b = t / tiles, y0 = (t % tiles) * tile_rows, rows = std::min(tile_rows, s.h - y0);
    ConvScratch<T>& w = keep ? kept_conv_scratch<T>(padded_count, sums_count) : scratch[worker];
    T* padded = w.padded.data();
    for (int64_t j = 0; j < rows + 2; ++j) fill(b, y0 - 1 + j, padded + j * row);
    // The second row below and the slack are read for dropped positions only.
    std::fill(padded + (rows + 2) * row, padded + padded_size(s, rows), T{0});
    T* tile_out = out + (b * s.h + y0) * s.scale() * s.scale() * s.w * s.c_out;
    if constexpr (std::is_same_v<T, float>) {
      const float* wk = winograd_packed.get();
      float* sums = w.sums.data();
      if (form == Winograd::kF4 && s.upsample)
        return winograd_tile_panels<WinogradF4, true>(s, padded, wk, bias32.data(), rows, tile_out, sums, chunk);
      if (form == Winograd::kF4)
        return winograd_tile_panels<WinogradF4, false>(s, padded, wk, bias32.data(), rows, tile_out, sums, chunk);
      if (form == Winograd::kF2)
        return winograd_tile_panels<WinogradF2, false>(s, padded, wk, bias32.data(), rows, tile_out, sums, chunk);
    }
    if (s.products() == ConvProducts::kPanels) {
      if (s.upsample)
        upsample_conv_tile_panels(s, padded, packed.data(), bias32.data(), rows, tile_out);
      else
        conv_tile_panels(s, padded, packed.data(), bias32.data(), rows, tile_out);
    }
#if FLUX2KLEIN_BF16
    else if constexpr (std::is_same_v<T, uint16_t>) {  // the AMX plugin's, bf16 only
      if (s.products() == ConvProducts::kAmx)
        conv_tile_amx(s, padded, packed.data(), bias32.data(), rows, tile_out);
      else
        conv_tile_mkl(s, padded, kernel, bias32.data(), rows, w.sums.data(), tile_out);
    }
#endif
  });
}

// Padded row y of the (B, H, W, Cin) input x into dst: the row with a zero column each side, or zeros
// above and below the image.
template <typename T>
static void padded_row(const ConvShape& s, const T* x, int64_t b, int64_t y, T* dst) {
  if (y < 0 || y >= s.h) {
    std::fill(dst, dst + s.wp() * s.c_in, T{0});
    return;
  }
  std::fill(dst, dst + s.c_in, T{0});
  std::memcpy(dst + s.c_in, x + (b * s.h + y) * s.w * s.c_in, s.w * s.c_in * sizeof(T));
  std::fill(dst + (s.w + 1) * s.c_in, dst + s.wp() * s.c_in, T{0});
}

// A convolution handler's buffers: input, kernel, bias and output, all of one dtype.
#define FLUX2KLEIN_CONV_BINDING(D)                                                                          \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<D>>().Arg<ffi::Buffer<D>>().Arg<ffi::Buffer<D>>() \
      .Ret<ffi::Buffer<D>>()

static bool conv_shapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> kd, ffi::Span<const int64_t> od,
                        int64_t bias_count, ConvShape* s) {
  if (xd.size() != 4 || kd.size() != 4 || od.size() != 4 || kd[0] != 3 || kd[1] != 3 || kd[2] != xd[3] ||
      !std::equal(xd.begin(), xd.begin() + 3, od.begin()) || od[3] != kd[3] || bias_count != kd[3])
    return false;
  *s = ConvShape{xd[0], xd[1], xd[2], xd[3], kd[3]};
  return true;
}

// The shapes of a convolution call, for the AMX plugin (MKL loaded) or the AVX-512 one (bf16: input
// channels in pairs; or float32); an error when the call cannot run.
template <bool Avx512, ffi::DataType D>
static ffi::Error conv_call(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> kd, ffi::Span<const int64_t> od,
                            int64_t bias_count, ConvShape* s) {
  constexpr bool pairs = Avx512 && D == ffi::DataType::BF16;
  if (!Avx512 && gemm_bf16 == nullptr) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "oneMKL is not loaded");
  if (!conv_shapes(xd, kd, od, bias_count, s) || (pairs && s->c_in % 2 != 0))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      pairs ? "expected (B, H, W, Cin), (3, 3, Cin, Cout), (Cout,), Cin even"
                            : "expected (B, H, W, Cin), (3, 3, Cin, Cout), (Cout,)");
  s->avx512 = Avx512;
  s->f32 = D == ffi::DataType::F32;
  return ffi::Error::Success();
}

template <bool Avx512, ffi::DataType D = ffi::DataType::BF16>
static ffi::Error Conv3x3(ffi::ThreadPool pool, ffi::Buffer<D> x, ffi::Buffer<D> kernel, ffi::Buffer<D> bias,
                          ffi::ResultBuffer<D> out) {
  using T = Element<D>;
  PoolScope scope(pool);
  ConvShape s;
  ffi::Error shapes =
      conv_call<Avx512, D>(x.dimensions(), kernel.dimensions(), out->dimensions(), bias.element_count(), &s);
  if (shapes.failure()) return shapes;
  const auto* xp = reinterpret_cast<const T*>(x.untyped_data());
  conv_tiles(s, reinterpret_cast<const T*>(kernel.untyped_data()), reinterpret_cast<const T*>(bias.untyped_data()),
             reinterpret_cast<T*>(out->untyped_data()),
             [&](int64_t b, int64_t y, T* dst) { padded_row(s, xp, b, y, dst); });
  return ffi::Error::Success();
}

#if FLUX2KLEIN_BF16
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_amx_conv3x3, Conv3x3<false>, FLUX2KLEIN_CONV_BINDING(ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_conv3x3, Conv3x3<true>, FLUX2KLEIN_CONV_BINDING(ffi::BF16));
#endif
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_conv3x3_f32, (Conv3x3<true, ffi::DataType::F32>),
                              FLUX2KLEIN_CONV_BINDING(ffi::F32));

// A nearest 2x upsample then a 3x3 'same' convolution with bias, NHWC (B, H, W, Cin) x (3, 3, Cin, Cout)
// -> (B, 2H, 2W, Cout), bf16 or float32, in panels (upsample_conv_tile_panels).
template <ffi::DataType D>
static ffi::Error UpsampleConv3x3(ffi::ThreadPool pool, ffi::Buffer<D> x, ffi::Buffer<D> kernel, ffi::Buffer<D> bias,
                                  ffi::ResultBuffer<D> out) {
  using T = Element<D>;
  constexpr bool pairs = D == ffi::DataType::BF16;
  PoolScope scope(pool);
  auto xd = x.dimensions(), kd = kernel.dimensions(), od = out->dimensions();
  if (xd.size() != 4 || kd.size() != 4 || od.size() != 4 || kd[0] != 3 || kd[1] != 3 || kd[2] != xd[3] ||
      (pairs && xd[3] % 2 != 0) || od[0] != xd[0] || od[1] != 2 * xd[1] || od[2] != 2 * xd[2] || od[3] != kd[3] ||
      static_cast<int64_t>(bias.element_count()) != kd[3])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      pairs ? "expected (B, H, W, Cin), (3, 3, Cin, Cout), (Cout,), Cin even; out (B, 2H, 2W, Cout)"
                            : "expected (B, H, W, Cin), (3, 3, Cin, Cout), (Cout,); out (B, 2H, 2W, Cout)");
  ConvShape s{xd[0], xd[1], xd[2], xd[3], kd[3]};
  s.avx512 = s.upsample = true;
  s.f32 = !pairs;
  const auto* xp = reinterpret_cast<const T*>(x.untyped_data());
  conv_tiles(s, reinterpret_cast<const T*>(kernel.untyped_data()), reinterpret_cast<const T*>(bias.untyped_data()),
             reinterpret_cast<T*>(out->untyped_data()),
             [&](int64_t b, int64_t y, T* dst) { padded_row(s, xp, b, y, dst); });
  return ffi::Error::Success();
}

#if FLUX2KLEIN_BF16
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_upsample_conv3x3, UpsampleConv3x3<ffi::DataType::BF16>,
                              FLUX2KLEIN_CONV_BINDING(ffi::BF16));
#endif
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_upsample_conv3x3_f32, UpsampleConv3x3<ffi::DataType::F32>,
                              FLUX2KLEIN_CONV_BINDING(ffi::F32));

// silu(y) = y * sigmoid(y) on sixteen lanes, with e = exp(-|y|) only: sigmoid(y) = 1 / (1 + e) for
// y >= 0, e / (1 + e) below. A NaN stays NaN, and -inf gives NaN as XLA's form does (-inf * 0).
static inline Vec silu16(Vec y) {
  const Vec one = vset1(1.0f), zero = vzero();
  const Vec e = exp_nonpositive(vsub(zero, vabs(y)));
  const Vec silu = vmul(y, vdiv(vselect(vless(y, zero), e, one), vadd(one, e)));
  return vselect(vequal(y, vset1(-INFINITY)), vset1(NAN), silu);
}

// The VAE's GroupNorm then SiLU, applied to the input rows as a tile reads them instead of in a pass of
// its own: y = (x - mean) * scale + shift per (batch, channel), in float32, SiLU, rounded to bf16 in bf16
// (the numerics of GroupNorm(x, silu=True) in core/models/vae.py).
template <typename T>
struct Normalisation {
  const T* x;                         // (B, H, W, Cin)
  const float *mean, *scale, *shift;  // (B, Cin), (B, Cin), (Cin)
};

template <typename T>
static void normalised_row(const ConvShape& s, const Normalisation<T>& n, int64_t b, int64_t y, T* dst) {
  const int64_t cin = s.c_in;
  if (y < 0 || y >= s.h) {
    std::fill(dst, dst + s.wp() * cin, T{0});
    return;
  }
  std::fill(dst, dst + cin, T{0});
  std::fill(dst + (s.w + 1) * cin, dst + s.wp() * cin, T{0});
  const T* src = n.x + (b * s.h + y) * s.w * cin;
  for (int64_t col = 0; col < s.w; ++col)
    for (int64_t c = 0; c < cin; c += 16) {
      const Lanes lanes = lanes_left(cin - c);
      const Vec x = load16(src + col * cin + c, lanes);
      const Vec centred = vsub(x, vload(n.mean + b * cin + c, lanes));
      const Vec y = vadd(vmul(centred, vload(n.scale + b * cin + c, lanes)), vload(n.shift + c, lanes));
      store16(dst + (col + 1) * cin + c, lanes, silu16(y));
    }
}

template <bool Avx512, ffi::DataType D = ffi::DataType::BF16>
static ffi::Error NormSiluConv3x3(ffi::ThreadPool pool, ffi::Buffer<D> x, ffi::Buffer<ffi::F32> mean,
                                  ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> shift, ffi::Buffer<D> kernel,
                                  ffi::Buffer<D> bias, ffi::ResultBuffer<D> out) {
  using T = Element<D>;
  PoolScope scope(pool);
  ConvShape s;
  ffi::Error shapes =
      conv_call<Avx512, D>(x.dimensions(), kernel.dimensions(), out->dimensions(), bias.element_count(), &s);
  if (shapes.failure()) return shapes;
  if (static_cast<int64_t>(mean.element_count()) != s.batch * s.c_in ||
      static_cast<int64_t>(scale.element_count()) != s.batch * s.c_in ||
      static_cast<int64_t>(shift.element_count()) != s.c_in)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "expected (B, H, W, Cin), (B, Cin), (B, Cin), (Cin,), (3, 3, Cin, Cout), (Cout,)");
  const Normalisation<T> n{reinterpret_cast<const T*>(x.untyped_data()), mean.typed_data(), scale.typed_data(),
                           shift.typed_data()};
  conv_tiles(s, reinterpret_cast<const T*>(kernel.untyped_data()), reinterpret_cast<const T*>(bias.untyped_data()),
             reinterpret_cast<T*>(out->untyped_data()),
             [&](int64_t b, int64_t y, T* dst) { normalised_row(s, n, b, y, dst); });
  return ffi::Error::Success();
}

#define FLUX2KLEIN_NORM_CONV_BINDING(D)                                                                    \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()                                                                  \
      .Arg<ffi::Buffer<D>>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()                      \
      .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<D>>().Arg<ffi::Buffer<D>>().Ret<ffi::Buffer<D>>()
#if FLUX2KLEIN_BF16
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_amx_norm_silu_conv3x3, NormSiluConv3x3<false>,
                              FLUX2KLEIN_NORM_CONV_BINDING(ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_norm_silu_conv3x3, NormSiluConv3x3<true>,
                              FLUX2KLEIN_NORM_CONV_BINDING(ffi::BF16));
#endif
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_norm_silu_conv3x3_f32, (NormSiluConv3x3<true, ffi::DataType::F32>),
                              FLUX2KLEIN_NORM_CONV_BINDING(ffi::F32));

#if FLUX2KLEIN_BF16
// The transformer's SwiGLU in bf16, joined after another bf16 array when that has columns (the single
// block's attention output, which the output projection takes side by side with it): row t of the out
// is [after[t], bf16(bf16(silu(gate)) * value)], gate = x[t, start : start + H], value = x[t, start + H :
// start + 2H], SiLU in float32. The roundings are transformer.swiglu's (SiLU rounded to bf16, then the
// bf16 product). XLA widened this chain and the join to float32 and ran each in a pass of its own.
constexpr int64_t kRowsPerTask = 64;

static ffi::Error Swiglu(ffi::ThreadPool pool,
                         ffi::Buffer<ffi::BF16> after, ffi::Buffer<ffi::BF16> x, ffi::ResultBuffer<ffi::BF16> out,
                         int64_t start) {
  PoolScope scope(pool);
  auto ad = after.dimensions(), xd = x.dimensions(), od = out->dimensions();
  if (xd.size() == 0 || ad.size() != xd.size() || od.size() != xd.size() ||
      !std::equal(xd.begin(), xd.end() - 1, ad.begin()) || !std::equal(xd.begin(), xd.end() - 1, od.begin()))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "expected (..., A), (..., start + 2H), out (..., A + H)");
  const int64_t a = ad.back(), width = xd.back(), h = od.back() - a;
  if (start < 0 || h < 0 || start + 2 * h != width)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "expected (..., A), (..., start + 2H), out (..., A + H)");
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) rows *= xd[i];
  const auto* ap = reinterpret_cast<const uint16_t*>(after.untyped_data());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  auto* op = reinterpret_cast<uint16_t*>(out->untyped_data());
  const int64_t tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  parallel_tasks(tasks, workers_for(tasks), [&](int64_t task, int) {
    for (int64_t r = task * kRowsPerTask; r < std::min(rows, (task + 1) * kRowsPerTask); ++r) {
      uint16_t* row = op + r * (a + h);
      if (a > 0) std::memcpy(row, ap + r * a, a * 2);
      const uint16_t* gate = xp + r * width + start;
      for (int64_t c = 0; c < h; c += 16) {
        const __mmask16 lanes = lanes_left(h - c);
        const __m512 g = from_bf16x16(_mm256_maskz_loadu_epi16(lanes, gate + c));
        const __m512 v = from_bf16x16(_mm256_maskz_loadu_epi16(lanes, gate + h + c));
        const __m512 activated = from_bf16x16(to_bf16x16(silu16(g)));
        _mm256_mask_storeu_epi16(row + a + c, lanes, to_bf16x16(_mm512_mul_ps(activated, v)));
      }
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_swiglu, Swiglu,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>().Attr<int64_t>("start"));

// The single block's queries, keys and values from its fused projection: for each token and head,
// q = rope(rms_norm(proj[q part]) * q_weight), k the same with k_weight, v = proj[v part], each (B, S, H,
// D) bf16. The roundings are transformer.py's: the norm in float32 rounded to bf16, times the weight in
// bf16, then the rotation of interleaved pairs in float32 (x * cos + rotated * sin) rounded to bf16.
// XLA ran the slices, the two norms and the two rotations as six passes, most of them in float32.
static void norm_rope_head(const uint16_t* x, const uint16_t* weight, const float* cos, const float* sin, int64_t dim,
                           float eps, uint16_t* out) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) {
    const __m512 v = from_bf16x16(_mm256_maskz_loadu_epi16(lanes_left(dim - d), x + d));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(dim);
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  // The pair partner of each lane (2i <-> 2i + 1) and the sign of its term: -odd on even lanes.
  const __m512i swap = _mm512_set_epi32(14, 15, 12, 13, 10, 11, 8, 9, 6, 7, 4, 5, 2, 3, 0, 1);
  const __mmask16 even = 0x5555;
  for (int64_t d = 0; d < dim; d += 16) {
    const __mmask16 lanes = lanes_left(dim - d);
    const __m512 v = from_bf16x16(_mm256_maskz_loadu_epi16(lanes, x + d));
    const __m512 normed = from_bf16x16(to_bf16x16(_mm512_mul_ps(v, scale)));
    const __m512 w = from_bf16x16(_mm256_maskz_loadu_epi16(lanes, weight + d));
    const __m512 z = from_bf16x16(to_bf16x16(_mm512_mul_ps(normed, w)));
    const __m512 partner = _mm512_permutexvar_ps(swap, z);
    const __m512 rotated = _mm512_mask_sub_ps(partner, even, _mm512_setzero_ps(), partner);
    const __m512 turned = _mm512_add_ps(_mm512_mul_ps(z, _mm512_maskz_loadu_ps(lanes, cos + d)),
                                        _mm512_mul_ps(rotated, _mm512_maskz_loadu_ps(lanes, sin + d)));
    _mm256_mask_storeu_epi16(out + d, lanes, to_bf16x16(turned));
  }
}

static ffi::Error QkvHeads(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> proj, ffi::Buffer<ffi::BF16> q_weight,
                           ffi::Buffer<ffi::BF16> k_weight, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                           ffi::ResultBuffer<ffi::BF16> q, ffi::ResultBuffer<ffi::BF16> k, ffi::ResultBuffer<ffi::BF16> v,
                           float eps) {
  PoolScope scope(pool);
  auto pd = proj.dimensions(), qd = q->dimensions(), cd = cos.dimensions();
  if (pd.size() != 3 || qd.size() != 4 || cd.size() != 2 || qd[0] != pd[0] || qd[1] != pd[1] || cd[0] != pd[1] ||
      cd[1] != qd[3] || qd[3] % 2 != 0 || pd[2] < 3 * qd[2] * qd[3] ||
      static_cast<int64_t>(q_weight.element_count()) != qd[3] ||
      static_cast<int64_t>(k_weight.element_count()) != qd[3] || sin.element_count() != cos.element_count())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "expected (B, S, W >= 3HD), (D,), (D,), (S, D), (S, D) -> three (B, S, H, D), D even");
  const int64_t batch = pd[0], seq = pd[1], width = pd[2], heads = qd[2], dim = qd[3], tokens = batch * seq;
  const auto* pp = reinterpret_cast<const uint16_t*>(proj.untyped_data());
  const auto* qw = reinterpret_cast<const uint16_t*>(q_weight.untyped_data());
  const auto* kw = reinterpret_cast<const uint16_t*>(k_weight.untyped_data());
  uint16_t* outs[3] = {reinterpret_cast<uint16_t*>(q->untyped_data()), reinterpret_cast<uint16_t*>(k->untyped_data()),
                       reinterpret_cast<uint16_t*>(v->untyped_data())};
  const int64_t tasks = (tokens + kRowsPerTask - 1) / kRowsPerTask;
  parallel_tasks(tasks, workers_for(tasks), [&](int64_t task, int) {
    for (int64_t t = task * kRowsPerTask; t < std::min(tokens, (task + 1) * kRowsPerTask); ++t) {
      const uint16_t* row = pp + t * width;
      const float *c = cos.typed_data() + (t % seq) * dim, *s = sin.typed_data() + (t % seq) * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t at = (t * heads + h) * dim;
        norm_rope_head(row + h * dim, qw, c, s, dim, eps, outs[0] + at);
        norm_rope_head(row + (heads + h) * dim, kw, c, s, dim, eps, outs[1] + at);
      }
      std::memcpy(outs[2] + t * heads * dim, row + 2 * heads * dim, heads * dim * 2);
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_qkv_heads, QkvHeads,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>().Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>().Attr<float>("eps"));
#endif

// A Linear layer's product, bf16 (M, K) x bf16 (K, N) -> bf16 (M, N): float32 sums of VDPBF16PS pairs,
// rounded once (XLA's bf16 dot with a float32 result, then the convert). XLA's own ran these at 83-87% of
// the unit's rate, and its float32 result took a pass of its own to round. The same loop in float32 FMAs
// runs the VAE's float32 1x1 convolutions (XLA's float32 Linear products are as fast as it: not taken).
// A task is a block of kGemmRows rows against a block of columns; each worker packs a block of columns
// of the weight into panels once (the tasks come in column-block order, so a worker's share is mostly
// whole blocks), and each kDotRows rows' products against a panel run in registers, then are stored
// (bf16: rounded).
constexpr int64_t kGemmRows = 16 * kDotRows;

// Columns per packed block: the packed weight block fits in half a core's L2, a whole panel at least.
template <typename T>
static int64_t gemm_block_columns(int64_t k) {
  return std::clamp<int64_t>((256 * 1024 / (sizeof(T) * round_up(k, kPanel))) / kPanel * kPanel, kPanel, 8 * kPanel);
}

// A row of a product's float32 sums as the output holds them: rounded to bf16, or as they are.
#if FLUX2KLEIN_WIDE
static inline void store_sums(const float* sums, int64_t count, uint16_t* out) {
  for (int64_t c = 0; c < count; c += 16)
    _mm256_mask_storeu_epi16(out + c, lanes_left(count - c), to_bf16x16(_mm512_load_ps(sums + c)));
}
#endif

static inline void store_sums(const float* sums, int64_t count, float* out) {
  for (int64_t c = 0; c < count; c += 16) vstore(out + c, lanes_left(count - c), vload(sums + c));
}

// A worker's packed block of a weight's columns (half a core's L2: gemm_block_columns), kept by each
// thread from call to call as the attention's scratch is; a block packed in another call is packed again.
template <typename T>
struct GemmPanels {
  std::vector<T> panels;
  int64_t block = -1;
  uint64_t call = 0;
};

template <typename T>
static GemmPanels<T>& kept_gemm_panels(uint64_t call) {
  thread_local GemmPanels<T> kept;
  if (kept.call != call) kept.call = call, kept.block = -1;
  return kept;
}

// y (m, n) = x (m, k) x w (k, n), all row-major, bf16 (k even; the sums rounded) or float32; with a
// float32 `bias` (n, padded to a whole panel), that product plus the bias as store_conv_outputs adds it
// (nnx.Conv's numerics).
template <typename T>
static void panel_gemm(const T* xp, const T* wp, const float* bias, T* yp, int64_t m, int64_t k, int64_t n) {
  if (k == 0) {  // empty sums: +0
    std::fill(yp, yp + m * n, T{0});
    return;
  }
  const int64_t depth = round_up(k, kPanel), columns = gemm_block_columns<T>(k);
  const int64_t column_blocks = (n + columns - 1) / columns;
  const int64_t row_blocks = (m + kGemmRows - 1) / kGemmRows, tasks = column_blocks * row_blocks;
  const uint64_t call = next_call();
  parallel_tasks(tasks, workers_for(tasks), [&](int64_t t, int) {
    const int64_t block = t / row_blocks, col0 = block * columns, cols = std::min(columns, n - col0);
    GemmPanels<T>& mine = kept_gemm_panels<T>(call);
    if (mine.block != block) {  // the weight's columns [col0, col0 + cols) as panels
      mine.panels.resize(depth * round_up(cols, kPanel));
      pack_values(wp + col0, n, k, cols, mine.panels.data());
      mine.block = block;
    }
    alignas(64) float sums[kDotRows * kPanel];
    const int64_t row_end = std::min(m, (t % row_blocks + 1) * kGemmRows);
    for (int64_t r = t % row_blocks * kGemmRows; r < row_end; r += kDotRows) {
      const int64_t rows = std::min<int64_t>(kDotRows, row_end - r);
      for (int64_t p = 0; p < cols; p += kPanel) {
        if (rows == kDotRows)
          accumulate<kDotRows, false>(xp + r * k, k, mine.panels.data() + p * depth, k, sums, kPanel);
        else
          product(xp + r * k, k, mine.panels.data() + p * depth, k, sums, kPanel, rows);
        const int64_t count = std::min(kPanel, cols - p);
        for (int64_t i = 0; i < rows; ++i) {
          T* out = yp + (r + i) * n + col0 + p;
          if (bias != nullptr)
            store_conv_outputs(sums + i * kPanel, bias + col0 + p, count, out);
          else
            store_sums(sums + i * kPanel, count, out);
        }
      }
    }
  });
}

#if FLUX2KLEIN_BF16
static ffi::Error Gemm16(ffi::ThreadPool pool,
                         ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::BF16> y) {
  PoolScope scope(pool);
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[0] || xd[1] % 2 != 0 || yd[0] != xd[0] ||
      yd[1] != wd[1])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "expected (M, K) x (K, N) -> (M, N), K even");
  panel_gemm(reinterpret_cast<const uint16_t*>(x.untyped_data()), reinterpret_cast<const uint16_t*>(w.untyped_data()),
             nullptr, reinterpret_cast<uint16_t*>(y->untyped_data()), xd[0], xd[1], wd[1]);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_gemm, Gemm16,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
#endif

// A 1x1 convolution with bias, NHWC -> NHWC in bf16 or float32 (the VAE's shortcuts): the Linear layers'
// product over every position's channels, the bias added as nnx.Conv adds it. XLA's bf16 dot ran these
// narrow products (64 -> 32 channels at 512x512) far below the unit's rate.
template <ffi::DataType D>
static ffi::Error Conv1x1(ffi::ThreadPool pool, ffi::Buffer<D> x, ffi::Buffer<D> kernel, ffi::Buffer<D> bias,
                          ffi::ResultBuffer<D> out) {
  PoolScope scope(pool);
  constexpr bool pairs = D == ffi::DataType::BF16;
  auto xd = x.dimensions(), kd = kernel.dimensions(), od = out->dimensions();
  if (xd.size() != 4 || kd.size() != 4 || od.size() != 4 || kd[0] != 1 || kd[1] != 1 || kd[2] != xd[3] ||
      (pairs && xd[3] % 2 != 0) || !std::equal(xd.begin(), xd.begin() + 3, od.begin()) || od[3] != kd[3] ||
      static_cast<int64_t>(bias.element_count()) != kd[3])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      pairs ? "expected (B, H, W, Cin), (1, 1, Cin, Cout), (Cout,), Cin even"
                            : "expected (B, H, W, Cin), (1, 1, Cin, Cout), (Cout,)");
  using T = Element<D>;
  const int64_t c_out = kd[3];
  const std::vector<float> bias32 = widened_bias(reinterpret_cast<const T*>(bias.untyped_data()), c_out);
  // The (1, 1, Cin, Cout) kernel is a (Cin, Cout) weight, row-major.
  panel_gemm(reinterpret_cast<const T*>(x.untyped_data()), reinterpret_cast<const T*>(kernel.untyped_data()),
             bias32.data(), reinterpret_cast<T*>(out->untyped_data()), xd[0] * xd[1] * xd[2], xd[3], c_out);
  return ffi::Error::Success();
}

#if FLUX2KLEIN_BF16
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_conv1x1, Conv1x1<ffi::DataType::BF16>,
                              FLUX2KLEIN_CONV_BINDING(ffi::BF16));
#endif
XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_avx512_conv1x1_f32, Conv1x1<ffi::DataType::F32>,
                              FLUX2KLEIN_CONV_BINDING(ffi::F32));

// The loader's transposing copy (core/weights/loader.py, copy_into): a torch (out, in) weight into the
// (in, out) array JAX takes, converted on the way. numpy moves a transposed view one element at a time,
// strided, at about 1 GB/s here. This reads 16 rows of 16 values (converting them), transposes the block in
// registers and writes each of its columns as one run. The blocks go down the rows in strips of
// kTransposeStrip columns: the strip's destination rows are written along as the rows go by, where a sweep
// across whole rows touched a new page of the destination with every column. stored is (rows, cols) with
// row stride `stored_stride` elements, dest (cols, rows) with row stride `dest_stride`. Kinds: 0 float32 ->
// bfloat16 (rounded as to_bf16x16, so as ml_dtypes and XLA round), 1 16-bit values as they are, 2 32-bit
// values as they are. Returns 0, or 1 for an unknown kind. No tiles, no MKL: it runs wherever the shim
// loads (AVX2 and up), called from several reader threads at once.
constexpr int64_t kTransposeStrip = 256;

// Column j of a 16 x 16 block (its rows aligned to their size) to out + j * out_stride: 16-bit values in AVX2
// registers (interleaving pairs, then 32-bit, 64-bit and 128-bit halves leaves register j holding column j).
static inline void store_transposed(const uint16_t (*block)[16], uint16_t* out, int64_t out_stride) {
  __m256i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(block[i]));
  for (int i = 0; i < 16; i += 2)
    t[i] = _mm256_unpacklo_epi16(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_epi16(r[i], r[i + 1]);
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm256_unpacklo_epi32(t[i], t[i + 2]), r[i + 1] = _mm256_unpackhi_epi32(t[i], t[i + 2]);
    r[i + 2] = _mm256_unpacklo_epi32(t[i + 1], t[i + 3]), r[i + 3] = _mm256_unpackhi_epi32(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int k = 0; k < 4; ++k)
      t[i + 2 * k] = _mm256_unpacklo_epi64(r[i + k], r[i + k + 4]),
      t[i + 2 * k + 1] = _mm256_unpackhi_epi64(r[i + k], r[i + k + 4]);
  for (int k = 0; k < 8; ++k) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k * out_stride), _mm256_permute2x128_si256(t[k], t[k + 8], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (k + 8) * out_stride),
                        _mm256_permute2x128_si256(t[k], t[k + 8], 0x31));
  }
}

// The same for 32-bit values: one 16 x 16 transpose in AVX-512 registers, else four 8 x 8 ones in AVX2's.
static inline void store_transposed(const uint32_t (*block)[16], uint32_t* out, int64_t out_stride) {
#if FLUX2KLEIN_WIDE
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(block[i]);
  for (int i = 0; i < 16; i += 2)
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88), t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88), t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    _mm512_storeu_si512(out + i * out_stride, _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88));
    _mm512_storeu_si512(out + (i + 8) * out_stride, _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd));
    _mm512_storeu_si512(out + (i + 4) * out_stride, _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88));
    _mm512_storeu_si512(out + (i + 12) * out_stride, _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd));
  }
#else
  for (int h = 0; h < 2; ++h)  // rows 8h .. 8h + 7 of the block: columns' halves h
    for (int q = 0; q < 2; ++q) {  // columns 8q .. 8q + 7
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_load_ps(reinterpret_cast<const float*>(block[8 * h + i] + 8 * q));
      for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int k = 0; k < 4; ++k) {
        _mm256_storeu_ps(reinterpret_cast<float*>(out + (8 * q + k) * out_stride + 8 * h),
                         _mm256_permute2f128_ps(r[k], r[k + 4], 0x20));
        _mm256_storeu_ps(reinterpret_cast<float*>(out + (8 * q + k + 4) * out_stride + 8 * h),
                         _mm256_permute2f128_ps(r[k], r[k + 4], 0x31));
      }
    }
#endif
}

template <typename Out, typename Load>
static void transpose_blocks(int64_t rows, int64_t cols, Out* dest, int64_t dest_stride, Load load) {
  alignas(64) Out block[16][16];
  for (int64_t strip = 0; strip < cols; strip += kTransposeStrip)
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
      for (int64_t c0 = strip; c0 < std::min(cols, strip + kTransposeStrip); c0 += 16) {
        const int64_t nr = std::min<int64_t>(16, rows - r0), nc = std::min<int64_t>(16, cols - c0);
        for (int64_t i = 0; i < nr; ++i) load(r0 + i, c0, nc, block[i]);
        if (nr == 16 && nc == 16) {
          store_transposed(block, dest + c0 * dest_stride + r0, dest_stride);
          continue;
        }
        for (int64_t j = 0; j < nc; ++j) {  // the edges: value by value
          Out* column = dest + (c0 + j) * dest_stride + r0;
          for (int64_t i = 0; i < nr; ++i) column[i] = block[i][j];
        }
      }
}

extern "C" int flux2klein_transpose_copy(const void* stored, int64_t rows, int64_t cols, int64_t stored_stride,
                                         void* dest, int64_t dest_stride, int kind) {
  if (kind == 0) {
    const auto* in = static_cast<const float*>(stored);
    transpose_blocks(rows, cols, static_cast<uint16_t*>(dest), dest_stride,
                     [&](int64_t r, int64_t c, int64_t n, uint16_t* to) {
#if FLUX2KLEIN_WIDE
                       const __m512 values = _mm512_maskz_loadu_ps(lanes_left(n), in + r * stored_stride + c);
                       _mm256_store_si256(reinterpret_cast<__m256i*>(to), to_bf16x16(values));
#else
                       for (int64_t i = 0; i < n; ++i) to[i] = to_bf16(in[r * stored_stride + c + i]);
#endif
                     });
  } else if (kind == 1) {
    const auto* in = static_cast<const uint16_t*>(stored);
    transpose_blocks(rows, cols, static_cast<uint16_t*>(dest), dest_stride,
                     [&](int64_t r, int64_t c, int64_t n, uint16_t* to) {
                       if (n == 16) std::memcpy(to, in + r * stored_stride + c, 32);  // a constant size: inlined
                       else std::memcpy(to, in + r * stored_stride + c, n * 2);
                     });
  } else if (kind == 2) {
    const auto* in = static_cast<const uint32_t*>(stored);
    transpose_blocks(rows, cols, static_cast<uint32_t*>(dest), dest_stride,
                     [&](int64_t r, int64_t c, int64_t n, uint32_t* to) {
                       if (n == 16) std::memcpy(to, in + r * stored_stride + c, 64);
                       else std::memcpy(to, in + r * stored_stride + c, n * 4);
                     });
  } else {
    return 1;
  }
  return 0;
}
