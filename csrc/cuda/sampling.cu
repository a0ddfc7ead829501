// Token bitmask on the GPU (include/stagewise/sampling.h): one thread per (row, token), in a
// grid of (token blocks, rows); a thread reads its token's word (neighbouring threads read the
// same word: one transaction per 32 tokens) and writes -inf where the bit is clear.
#include "stagewise/sampling.h"

#include <algorithm>
#include <climits>

#include "common.cuh"

namespace stagewise::cuda {
namespace {

using detail::ceil_div;

constexpr int kThreads = 256;
constexpr int64_t kMaxRowsPerLaunch = 65535;  // gridDim.y

template <typename T>
__global__ void __launch_bounds__(kThreads) token_bitmask_kernel(TokenBitmaskParams p, int64_t row0) {
  const int64_t r = row0 + blockIdx.y;
  const int64_t j = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (j >= p.vocab) return;
  const int64_t row = load_index(p.rows, p.rows_type, r);
  if (row < 0 || row >= p.batch) return;
  const int64_t word = j >> 5;
  const bool allowed =
      word < p.num_words && ((static_cast<uint32_t>(p.bitmask[r * p.num_words + word]) >> (j & 31)) & 1u);
  if (!allowed) {
    static_cast<T*>(p.logits)[row * p.logits_row_stride + j] = detail::from_float<T>(-INFINITY);
  }
}

}  // namespace

cudaError_t apply_token_bitmask(const TokenBitmaskParams& p, cudaStream_t stream) {
  if (p.num_rows <= 0 || p.vocab <= 0) return cudaSuccess;
  if (ceil_div(p.vocab, kThreads) > INT32_MAX) return cudaErrorInvalidValue;
  return detail::dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t row0 = 0; row0 < p.num_rows; row0 += kMaxRowsPerLaunch) {
      const dim3 grid(static_cast<unsigned>(ceil_div(p.vocab, kThreads)),
                      static_cast<unsigned>(std::min(kMaxRowsPerLaunch, p.num_rows - row0)));
      token_bitmask_kernel<T><<<grid, kThreads, 0, stream>>>(p, row0);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
  });
}

}  // namespace stagewise::cuda
