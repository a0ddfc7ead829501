// quant_pack_int8: GGUF rows -> the int8 mode's panels (cpu/quant_pack.h). Once per weight, at
// load time; plain byte loops, panels in parallel.
#include <ATen/Parallel.h>

#include <cstring>

#include "cpu/cpu_utils.h"
#include "cpu/quant_blocks.h"
#include "cpu/quant_pack.h"

namespace stagewise::cpu {
namespace {

// The quants q[32] of one row's sub-block into lane l of a q4 / q8 / q2 region.
void put_q4(const uint8_t* q, int l, uint8_t* q4) {
  for (int m = 0; m < 4; ++m) {
    for (int c = 0; c < 4; ++c) q4[64 * m + 4 * l + c] = static_cast<uint8_t>((q[4 * m + c] & 15) | (q[16 + 4 * m + c] << 4));
  }
}

void put_q8(const uint8_t* q, int l, uint8_t* q8) {
  for (int j = 0; j < 8; ++j) std::memcpy(q8 + 64 * j + 4 * l, q + 4 * j, 4);
}

void put_q2(const uint8_t* q, int l, uint8_t* q2) {  // the bits 4 and 5 of Q6_K's 6-bit quants
  for (int k = 0; k < 2; ++k) {
    for (int c = 0; c < 4; ++c) {
      uint8_t byte = 0;
      for (int s = 0; s < 4; ++s) byte |= static_cast<uint8_t>(((q[4 * (4 * k + s) + c] >> 4) & 3) << (2 * s));
      q2[64 * k + 4 * l + c] = byte;
    }
  }
}

// Record `b` (GGUF block b of each row) of the panel whose rows are rows[0, n), n <= 16; the
// record was zeroed (the padding rows stay zero).
template <QType Q>
void pack_record(const uint8_t* const* rows, int n, int64_t b, uint8_t* rec) {
  using P = Pack<Q>;
  for (int l = 0; l < n; ++l) {
    const uint8_t* blk = rows[l] + b * Block<Q>::kBytes;
    std::memcpy(rec + 2 * l, blk + Block<Q>::kD, 2);                                    // d
    if constexpr (Block<Q>::kM >= 0) std::memcpy(rec + 32 + 2 * l, blk + Block<Q>::kM, 2);  // m or dmin
    for (int sub = 0; sub < P::kSubs; ++sub) {
      uint8_t* s = rec + P::kHeader + sub * P::kSub;
      uint8_t q[32];
      sub_quants<Q>(blk, sub, q);
      if constexpr (Q == QType::kQ4_K) {
        int sc, mn;
        q4_k_scale_min(blk + 4, sub, &sc, &mn);
        s[l] = static_cast<uint8_t>(sc);
        s[16 + l] = static_cast<uint8_t>(mn);
      } else if constexpr (Q == QType::kQ6_K) {
        s[l] = blk[192 + 2 * sub];
        s[16 + l] = blk[192 + 2 * sub + 1];
        put_q2(q, l, s + P::kQuants + 256);
      }
      if constexpr (Q == QType::kQ8_0) {
        put_q8(q, l, s + P::kQuants);
      } else {
        put_q4(q, l, s + P::kQuants);
      }
    }
  }
}

template <QType Q>
void pack(const uint8_t* qweight, int64_t rows, int64_t in_features, uint8_t* packed) {
  const int64_t nblocks = in_features / Block<Q>::kWeights, row_bytes = nblocks * Block<Q>::kBytes;
  const int64_t panels = (rows + kPanelRows - 1) / kPanelRows, panel_bytes = nblocks * Pack<Q>::kRecord;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* out = packed + p * panel_bytes;
      std::memset(out, 0, panel_bytes);
      const int n = static_cast<int>(std::min(kPanelRows, rows - p * kPanelRows));
      const uint8_t* src[kPanelRows];
      for (int l = 0; l < n; ++l) src[l] = qweight + (p * kPanelRows + l) * row_bytes;
      for (int64_t b = 0; b < nblocks; ++b) pack_record<Q>(src, n, b, out + b * Pack<Q>::kRecord);
    }
  });
}

}  // namespace

void quant_pack_int8(const uint8_t* qweight, QType qtype, int64_t rows, int64_t in_features, uint8_t* packed) {
  dispatch_qtype(qtype, [&](auto q) { pack<decltype(q)::value>(qweight, rows, in_features, packed); });
}

}  // namespace stagewise::cpu
