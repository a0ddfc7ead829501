// The int8 mode's weight layout ("panels"): GGUF blocks regrouped once, when a model is loaded
// (quant_pack_int8), so that the kernels run one weight row per 32-bit lane.
//
// Rows are taken 16 at a time (a panel; the last one padded with zero rows, zero weights whose
// outputs are never stored). A panel is a run of records, one per GGUF block of its 16 rows, in
// the order of the blocks; a record holds the 16 rows' scales (fp16 as in the file, or the 6-bit
// and 8-bit sub-block scales unpacked to bytes) and their quants regrouped so that 32 bits of a
// vector lane are 4 consecutive weights of one row:
//   q4 (256 bytes, one 32-weight sub-block): 4 chunks of 64 bytes; chunk m, lane l (row l), byte
//      c holds weight 4m + c of row l in its low nibble and weight 16 + 4m + c in its high one.
//      Chunk & 15 meets x's dword m, chunk >> 4 x's dword 4 + m.
//   q8 (512 bytes): 8 chunks; chunk j, lane l, byte c: the int8 weight 4j + c of row l.
//   q2 (128 bytes, Q6_K's high bits): 2 chunks; chunk k, lane l, byte c, bits 2s, 2s + 1: the high
//      2 bits of weight 4 (4k + s) + c of row l.
// Records (h16: 16 fp16, one per row; u8 / i8: 16 bytes, one per row):
//   Q4_0  d h16 | q4                                              288 bytes = 16 x 18
//   Q4_1  d h16 | m h16 | q4                                      320 bytes = 16 x 20
//   Q8_0  d h16 | q8                                              544 bytes = 16 x 34
//   Q4_K  d h16 | dmin h16 | 8 x (sc u8 | mn u8 | q4)             2368 bytes (GGUF: 16 x 144)
//   Q6_K  d h16 | 8 x (sc_lo i8 | sc_hi i8 | q4 | q2)             3360 bytes = 16 x 210
// (Q4_K's 6-bit scales take a byte each.) The values are those of the file: the kernels compute
// the maths of include/stagewise/quant.h from them.
#pragma once
#include <cstdint>

#include "stagewise/quant.h"

namespace stagewise::cpu {

inline constexpr int64_t kPanelRows = 16;

template <QType Q>
struct Pack {
  static constexpr bool kK = Q == QType::kQ4_K || Q == QType::kQ6_K;
  // Bytes before the first sub-block: the fp16 scales of the 16 rows.
  static constexpr int64_t kHeader = Q == QType::kQ4_1 || Q == QType::kQ4_K ? 64 : 32;
  // Bytes of one sub-block of 32 weights: its own scales (K-quants) then the quants.
  static constexpr int64_t kSub = Q == QType::kQ8_0 ? 512 : Q == QType::kQ4_K ? 288 : Q == QType::kQ6_K ? 416 : 256;
  // Where the quants start inside a sub-block.
  static constexpr int64_t kQuants = Q == QType::kQ4_K || Q == QType::kQ6_K ? 32 : 0;
  static constexpr int kSubs = kK ? 8 : 1;
  static constexpr int64_t kRecord = kHeader + kSubs * kSub;
};

// Bytes of one record (16 rows x one GGUF block) of `q`.
inline int64_t quant_pack_record_bytes(QType q) {
  switch (q) {
    case QType::kQ4_0: return Pack<QType::kQ4_0>::kRecord;
    case QType::kQ4_1: return Pack<QType::kQ4_1>::kRecord;
    case QType::kQ8_0: return Pack<QType::kQ8_0>::kRecord;
    case QType::kQ4_K: return Pack<QType::kQ4_K>::kRecord;
    case QType::kQ6_K: return Pack<QType::kQ6_K>::kRecord;
  }
  return 0;
}

}  // namespace stagewise::cpu
