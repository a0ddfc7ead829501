// cpu_isa(): CPUID once, capped by STAGEWISE_CPU_ISA (csrc/cpu/isa.h).
#include "cpu/isa.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <string>

namespace stagewise::cpu {
namespace {

constexpr const char* kNames[] = {"baseline", "avx2", "avx512", "avx512vnni"};

Isa detect() {
#ifdef STAGEWISE_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512 && __builtin_cpu_supports("avx512vnni")) return Isa::kAvx512Vnni;
  if (avx512) return Isa::kAvx512;
  if (avx2) return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}

Isa capped() {
  const Isa best = cpu_isa_supported();
  const char* env = std::getenv("STAGEWISE_CPU_ISA");
  if (env == nullptr || *env == '\0') return best;
  const std::string cap = env;
  for (int i = 0; i < 4; ++i) {
    if (cap == kNames[i]) return static_cast<Isa>(std::min(i, static_cast<int>(best)));
  }
  TORCH_CHECK_VALUE(false, "stagewise: STAGEWISE_CPU_ISA must be one of baseline, avx2, avx512, avx512vnni "
                    "(or unset: the CPU's best, here ", kNames[static_cast<int>(best)], "), got '", cap, "'");
  return best;
}

}  // namespace

Isa cpu_isa_supported() {
  static const Isa isa = detect();
  return isa;
}

Isa cpu_isa() {
  static const Isa isa = capped();  // a bad name throws, and the next call tries again
  return isa;
}

const char* isa_name(Isa isa) { return kNames[static_cast<int>(isa)]; }

bool cpu_has_sse42() {
#ifdef STAGEWISE_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") != 0;
  }();
  return has;
#else
  return false;
#endif
}

}  // namespace stagewise::cpu
