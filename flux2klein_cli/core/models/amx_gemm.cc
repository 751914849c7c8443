// XLA FFI handler: bf16 (M, K) x bf16 (K, N) -> f32 (M, N) through oneMKL's cblas_gemm_bf16bf16f32,
// which runs on AMX tiles where the CPU has them. MKL is opened at run time (dlopen), so this file
// builds with no MKL headers and the shim loads only where the Python side found libmkl_rt.
#include <dlfcn.h>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using GemmBf16 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const void*, int64_t, const void*,
                          int64_t, float, float*, int64_t);
static GemmBf16 gemm_bf16 = nullptr;

constexpr int kRowMajor = 101, kNoTrans = 111;

extern "C" int flux2klein_amx_open(const char* path) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) return 1;
  gemm_bf16 = reinterpret_cast<GemmBf16>(dlsym(lib, "cblas_gemm_bf16bf16f32"));
  return gemm_bf16 == nullptr ? 2 : 0;
}

static ffi::Error Gemm(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  if (gemm_bf16 == nullptr) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "oneMKL is not loaded");
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "expected (M, K) x (K, N)");
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  gemm_bf16(kRowMajor, kNoTrans, kNoTrans, m, n, k, 1.0f, x.untyped_data(), k, w.untyped_data(), n, 0.0f,
            y->typed_data(), n);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(flux2klein_amx_gemm, Gemm,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
