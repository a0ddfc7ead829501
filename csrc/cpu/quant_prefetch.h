// Software prefetch of the weight panels ahead (the int8 kernel of quant_linear_int8).
//
// A decode step streams every weight from memory once (the model is larger than the caches),
// and the kernels read a panel of rows at a time, 16 interleaved streams that the hardware
// prefetchers follow poorly. PanelPrefetch asks for the bytes of the panel kPrefetchPanels
// ahead into L2, a few cache lines per block step, so the requests spread over the panel's
// compute. Measured on Zen 4 with 1 thread (SmolLM2's linears at batch 16, weights streamed
// from DRAM): 35 ms -> 25 ms per step; distances 2 to 16 panels do alike, an L1 hint or all
// lines at once less well.
#pragma once
#include <algorithm>
#include <cstdint>

namespace stagewise::cpu {

inline constexpr int64_t kPrefetchPanels = 4;

class PanelPrefetch {
 public:
  // panel: the current panel's first byte; panels are panel_bytes long and contiguous;
  // steps: how many next() calls the panel's bytes are spread over; on: whether a panel
  // kPrefetchPanels ahead exists.
  PanelPrefetch(const uint8_t* panel, int64_t panel_bytes, int64_t steps, bool on)
      : ahead_(panel + kPrefetchPanels * panel_bytes),
        end_(on ? panel_bytes : 0),
        per_step_((panel_bytes / kLine + steps) / steps * kLine) {}

  inline void next() {
    const int64_t stop = std::min(off_ + per_step_, end_);
    for (; off_ < stop; off_ += kLine) __builtin_prefetch(ahead_ + off_, 0, 2);  // read, L2
  }

 private:
  static constexpr int64_t kLine = 64;
  const uint8_t* ahead_;
  int64_t end_, per_step_, off_ = 0;
};

}  // namespace stagewise::cpu
