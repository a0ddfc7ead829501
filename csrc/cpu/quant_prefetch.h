// Software prefetch of the weight stream of the quantised linears (quant_linear_isa.h,
// quant_int8_isa.h).
//
// A decode step streams every weight from memory once (the model is larger than the caches).
// The kernels walk a tile of a few weight rows at once: several short streams of a few hundred
// bytes each (a row of SmolLM2's 576 inputs is 360 bytes in Q4_1), which end before the
// hardware prefetchers have ramped up. A thread's tiles are one contiguous run of bytes,
// though, so StreamPrefetch asks for that run a fixed distance ahead of the kernel, a few cache
// lines per step, spread over the tile's compute. Measured on Zen 4 with 1 thread (SmolLM2's
// linears, weights from DRAM): the figures below.
#pragma once
#include <algorithm>
#include <cstdint>

namespace stagewise::cpu {

// Bytes requested ahead of the kernel's position: far enough to cover the memory latency at
// full bandwidth (~20 GB/s x ~300 ns), near enough to stay in L2. Measured (SmolLM2's linears,
// 1 thread, Zen 4): exact batch 1 16.7 ms without, 11.6 at 4 KB, 12.0 at 16 KB; int8 batch 16
// 21.5 ms without, 17.8 at 4 KB, 16.2 at 16 KB; 64 KB is worse than none.
inline constexpr int64_t kPrefetchAhead = 16 << 10;

class StreamPrefetch {
 public:
  // [begin, end): the bytes this thread reads, in order.
  StreamPrefetch(const uint8_t* begin, const uint8_t* end) : next_(begin + kPrefetchAhead), end_(end) {}

  // The kernel has reached `at` (in [begin, end]): request every line up to at + kPrefetchAhead.
  inline void reach(const uint8_t* at) {
    const uint8_t* stop = std::min(at + kPrefetchAhead, end_);
    for (; next_ < stop; next_ += kLine) __builtin_prefetch(next_, 0, 2);  // read, into L2
  }

 private:
  static constexpr int64_t kLine = 64;
  const uint8_t* next_;
  const uint8_t* end_;
};

}  // namespace stagewise::cpu
