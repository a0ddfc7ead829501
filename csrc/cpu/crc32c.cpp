// CRC32C (include/stagewise/crc32c.h): a hardware path with three streams, a software path.
//
// All arithmetic is on the CRC "register" s: crc32c(bytes) = ~R(~0, bytes), where R(s, X)
// feeds the bytes X into the register s, least significant bit first (the reflected form).
//
// Why three streams: the CRC32C instruction has a latency of about three cycles and a
// throughput of one per cycle, so one stream (each step needs the previous result) runs
// at a third of what the core can do. A block of 3L bytes is cut into lanes A, B, C of L
// bytes, each fed from its own register (A from s, B and C from 0), and the three
// results are joined by linearity over GF(2):
//
//   R(s, A || B) = Z_L(R(s, A)) ^ R(0, B),
//
// where Z_L(v) = R(v, L zero bytes) is linear in v (a 32x32 bit matrix). So
// R(s, A || B || C) = Z_L(Z_L(a) ^ b) ^ c for the lanes' results a, b, c. Z_L is built
// once per lane length by squaring the one-zero-byte matrix, and applied through four
// 256-entry tables (one per byte of v).
#include "stagewise/crc32c.h"

#include "cpu/isa.h"

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_acle.h>
#include <sys/auxv.h>
#endif

namespace stagewise {
namespace {

constexpr uint32_t kPolyReflected = 0x82F63B78u;

// Slicing tables: t[0][b] feeds byte b through the register; t[k][b] then k more zero bytes.
struct ByteTables {
  uint32_t t[8][256];
};

constexpr ByteTables make_byte_tables() {
  ByteTables s{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) c = (c >> 1) ^ (kPolyReflected & (0u - (c & 1u)));
    s.t[0][b] = c;
  }
  for (int k = 1; k < 8; ++k)
    for (uint32_t b = 0; b < 256; ++b) s.t[k][b] = (s.t[k - 1][b] >> 8) ^ s.t[0][s.t[k - 1][b] & 0xffu];
  return s;
}

constexpr ByteTables kBytes = make_byte_tables();

uint64_t load64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);  // the wire and every supported host are little-endian
  return w;
}

void store64(uint8_t* p, uint64_t w) { std::memcpy(p, &w, 8); }

// ---- software: slicing by 8 --------------------------------------------------------------

uint32_t software_update(uint32_t s, const uint8_t* p, size_t n) {
  const auto& t = kBytes.t;
  for (; n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0; --n) s = (s >> 8) ^ t[0][(s ^ *p++) & 0xffu];
  for (; n >= 8; n -= 8, p += 8) {
    // Byte i of the word has 7 - i bytes after it in the word: table t[7 - i].
    const uint64_t w = load64(p) ^ s;
    s = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
        t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
  }
  for (; n > 0; --n) s = (s >> 8) ^ t[0][(s ^ *p++) & 0xffu];
  return s;
}

// ---- Z_L: shifting a register over L zero bytes ---------------------------------------------

// A linear map on 32-bit registers: m(v) = XOR of col[i] over the set bits i of v.
struct Matrix {
  uint32_t col[32];
};

uint32_t apply(const Matrix& m, uint32_t v) {
  uint32_t r = 0;
  for (int i = 0; v != 0; ++i, v >>= 1)
    if (v & 1u) r ^= m.col[i];
  return r;
}

Matrix compose(const Matrix& a, const Matrix& b) {  // a after b
  Matrix r;
  for (int i = 0; i < 32; ++i) r.col[i] = apply(a, b.col[i]);
  return r;
}

// Z_n as a matrix: the one-zero-byte step raised to the n-th power by squaring.
Matrix zeros_matrix(size_t n) {
  Matrix step, out;
  for (int i = 0; i < 32; ++i) {
    const uint32_t v = 1u << i;
    step.col[i] = (v >> 8) ^ kBytes.t[0][v & 0xffu];
    out.col[i] = v;
  }
  for (; n != 0; n >>= 1, step = compose(step, step))
    if (n & 1u) out = compose(step, out);
  return out;
}

struct Shift {
  uint32_t z[4][256];  // z[k][b] = Z_L(b << 8k)

  explicit Shift(size_t lane_bytes) {
    const Matrix m = zeros_matrix(lane_bytes);
    for (int k = 0; k < 4; ++k)
      for (uint32_t b = 0; b < 256; ++b) z[k][b] = apply(m, b << (8 * k));
  }

  uint32_t operator()(uint32_t v) const {
    return z[0][v & 0xffu] ^ z[1][(v >> 8) & 0xffu] ^ z[2][(v >> 16) & 0xffu] ^ z[3][v >> 24];
  }
};

// Lane lengths, longest first (multiples of 16 bytes). Huge lanes for buffers from memory:
// lanes 128 KB apart stream from DRAM at about 23 GB/s on the development machine (AMD EPYC),
// lanes 8 KB apart at 14. The shorter ones keep what is left on three streams: an 8 KB frame
// runs at 25 GB/s with the 2 KB and 64-byte tiers, 21 without; the last < 192 bytes run on one.
constexpr size_t kHugeLane = 128 << 10, kLongLane = 8 << 10, kMidLane = 2 << 10, kShortLane = 256, kTinyLane = 64;

template <size_t kLane>
const Shift& shift_over() {
  static const Shift s(kLane);
  return s;
}

// ---- hardware -----------------------------------------------------------------------------

#if defined(__x86_64__)
#define SW_CRC_TARGET __attribute__((target("sse4.2")))
SW_CRC_TARGET inline uint32_t hw_step64(uint32_t s, uint64_t w) {
  return static_cast<uint32_t>(_mm_crc32_u64(s, w));
}
SW_CRC_TARGET inline uint32_t hw_step8(uint32_t s, uint8_t b) { return _mm_crc32_u8(s, b); }

const char* detect_hardware() { return cpu::cpu_has_sse42() ? "sse4.2" : nullptr; }
#elif defined(__aarch64__)
#define SW_CRC_TARGET __attribute__((target("+crc")))
SW_CRC_TARGET inline uint32_t hw_step64(uint32_t s, uint64_t w) { return __crc32cd(s, w); }
SW_CRC_TARGET inline uint32_t hw_step8(uint32_t s, uint8_t b) { return __crc32cb(s, b); }

const char* detect_hardware() {
  constexpr unsigned long kHwcapCrc32 = 1ul << 7;  // HWCAP_CRC32 of the Linux arm64 ABI
  return (getauxval(AT_HWCAP) & kHwcapCrc32) != 0 ? "armv8-crc" : nullptr;
}
#endif

#if defined(SW_CRC_TARGET)
// Blocks of three lanes of `lane` bytes, while they last; returns the register after them. With
// kCopy, each word is also stored at the same offset from d (checksum while copying: one read).
template <bool kCopy>
SW_CRC_TARGET inline uint32_t hw_three_lanes(uint32_t s, const uint8_t*& p, uint8_t*& d, size_t& n, size_t lane,
                                             const Shift& shift) {
  for (; n >= 3 * lane; n -= 3 * lane, p += 3 * lane, d += kCopy ? 3 * lane : 0) {
    uint32_t a = s, b = 0, c = 0;
    const uint8_t* pb = p + lane;
    const uint8_t* pc = p + 2 * lane;
    for (size_t i = 0; i < lane; i += 16) {  // lanes are multiples of 16 bytes
      const uint64_t wa0 = load64(p + i), wb0 = load64(pb + i), wc0 = load64(pc + i);
      const uint64_t wa1 = load64(p + i + 8), wb1 = load64(pb + i + 8), wc1 = load64(pc + i + 8);
      if constexpr (kCopy) {
        store64(d + i, wa0);
        store64(d + lane + i, wb0);
        store64(d + 2 * lane + i, wc0);
        store64(d + i + 8, wa1);
        store64(d + lane + i + 8, wb1);
        store64(d + 2 * lane + i + 8, wc1);
      }
      a = hw_step64(a, wa0);
      b = hw_step64(b, wb0);
      c = hw_step64(c, wc0);
      a = hw_step64(a, wa1);
      b = hw_step64(b, wb1);
      c = hw_step64(c, wc1);
    }
    s = shift(shift(a) ^ b) ^ c;
  }
  return s;
}

template <bool kCopy>
SW_CRC_TARGET uint32_t hardware_pass(uint32_t s, const uint8_t* p, uint8_t* d, size_t n) {
  if (n >= 3 * kHugeLane) s = hw_three_lanes<kCopy>(s, p, d, n, kHugeLane, shift_over<kHugeLane>());
  if (n >= 3 * kLongLane) s = hw_three_lanes<kCopy>(s, p, d, n, kLongLane, shift_over<kLongLane>());
  if (n >= 3 * kMidLane) s = hw_three_lanes<kCopy>(s, p, d, n, kMidLane, shift_over<kMidLane>());
  if (n >= 3 * kShortLane) s = hw_three_lanes<kCopy>(s, p, d, n, kShortLane, shift_over<kShortLane>());
  if (n >= 3 * kTinyLane) s = hw_three_lanes<kCopy>(s, p, d, n, kTinyLane, shift_over<kTinyLane>());
  if constexpr (kCopy) std::memcpy(d, p, n);
  for (; n >= 8; n -= 8, p += 8) s = hw_step64(s, load64(p));
  for (; n > 0; --n) s = hw_step8(s, *p++);
  return s;
}

uint32_t hardware_update(uint32_t s, const uint8_t* p, size_t n) { return hardware_pass<false>(s, p, nullptr, n); }

uint32_t hardware_copy(uint32_t s, const uint8_t* p, uint8_t* d, size_t n) { return hardware_pass<true>(s, p, d, n); }
#endif

uint32_t software_copy(uint32_t s, const uint8_t* p, uint8_t* d, size_t n) {
  std::memcpy(d, p, n);
  return software_update(s, p, n);
}

using Update = uint32_t (*)(uint32_t, const uint8_t*, size_t);
using Copy = uint32_t (*)(uint32_t, const uint8_t*, uint8_t*, size_t);

struct Paths {
  const char* hardware_name = nullptr;
  Update best = software_update;
  Copy best_copy = software_copy;

  Paths() {
#if defined(SW_CRC_TARGET)
    hardware_name = detect_hardware();
    if (hardware_name != nullptr) {
      best = hardware_update;
      best_copy = hardware_copy;
    }
#endif
  }
};

const Paths& paths() {
  static const Paths p;
  return p;
}

}  // namespace

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
  return ~paths().best(~crc, static_cast<const uint8_t*>(data), n);
}

uint32_t crc32c_extend_with(Crc32cPath path, uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  if (path == Crc32cPath::kSoftware) return ~software_update(~crc, p, n);
  return ~paths().best(~crc, p, n);  // kAuto, and kHardware (software where there is none)
}

uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t n) {
  return ~paths().best_copy(~crc, static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), n);
}

uint32_t crc32c_copy_with(Crc32cPath path, uint32_t crc, void* dst, const void* src, size_t n) {
  const auto* p = static_cast<const uint8_t*>(src);
  auto* d = static_cast<uint8_t*>(dst);
  if (path == Crc32cPath::kSoftware) return ~software_copy(~crc, p, d, n);
  return ~paths().best_copy(~crc, p, d, n);
}

const char* crc32c_hardware() { return paths().hardware_name; }

}  // namespace stagewise
