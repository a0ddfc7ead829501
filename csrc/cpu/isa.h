// The one instruction-set dispatch of the CPU library.
//
// Kernels are compiled several times over, each copy for one ISA level through a function
// attribute (STAGEWISE_TARGET_*: the extension itself is built for the baseline x86-64, so
// one wheel runs on every CPU), and picked at run time by cpu_isa(): the best level this
// CPU has, capped by the environment variable STAGEWISE_CPU_ISA (read once per process) so
// that every copy can be run, and tested, on a machine that has it.
//
//   level        instructions a copy may use            STAGEWISE_CPU_ISA
//   baseline     x86-64 (SSE2), or any other CPU        baseline
//   avx2         AVX2, FMA, F16C                        avx2
//   avx512       + AVX-512 F, BW, VL, DQ                avx512
//   avx512vnni   + AVX-512 VNNI (vpdpbusd)              avx512vnni
//
// A cap above what the CPU has changes nothing (the CPU's level is used); an unknown name is
// a ValueError at the first kernel call. Torch-free but for that error.
#pragma once
#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define STAGEWISE_X86 1
#define STAGEWISE_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define STAGEWISE_TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
#define STAGEWISE_TARGET_AVX512VNNI \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#endif

namespace stagewise::cpu {

enum class Isa : int32_t { kBaseline = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3 };

// The level the kernels run: the CPU's, capped by STAGEWISE_CPU_ISA. Looked up once.
Isa cpu_isa();

// The best level this CPU has, whatever the cap.
Isa cpu_isa_supported();

// "baseline", "avx2", "avx512" or "avx512vnni".
const char* isa_name(Isa isa);

// Whether the CPU has the SSE4.2 CRC32C instruction (x86-64; false elsewhere). Not capped:
// the checksum has its own software path, chosen by its callers (include/stagewise/crc32c.h).
bool cpu_has_sse42();

}  // namespace stagewise::cpu
