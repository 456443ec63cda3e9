// torch's wheel ships fbgemm's headers but not those of asmjit, fbgemm's code generator, which
// fbgemm/SimdUtils.h includes for the names of its vector registers. The CPU decode kernels
// call fbgemm's compiled float16 GEMM and never generate code: these empty register types are
// all that the included headers name.
#pragma once

#define ASMJIT_LIBRARY_MAKE_VERSION(major, minor, patch) \
  (((major) << 16) | ((minor) << 8) | (patch))
#define ASMJIT_LIBRARY_VERSION ASMJIT_LIBRARY_MAKE_VERSION(1, 0, 0)

namespace asmjit::x86 {
struct Xmm {};
struct Ymm {};
struct Zmm {};
}  // namespace asmjit::x86
