// Torch-free definitions shared by the CPU kernels, the CUDA kernels and the
// torch glue. Every kernel takes a params struct of raw pointers, element
// strides and sizes (FlashInfer style); the glue in csrc/bindings fills it.
#pragma once
#include <cstdint>

#if defined(__CUDACC__) || defined(STAGEWISE_WITH_CUDA) || defined(STAGEWISE_CUDA_DECLS)
#include <cuda_runtime_api.h>
#define STAGEWISE_HAS_CUDA_DECLS 1
#endif

namespace stagewise {

// Floating point element type of activations, weights and caches.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Element type of an index tensor (positions, slots, block tables, lengths).
enum class IndexType : int32_t { kInt32 = 0, kInt64 = 1 };

// A slot of -1 in a slot mapping marks a padding token: nothing is written or read.
inline constexpr int64_t kPaddingSlot = -1;

// Reads element i of an int32 or int64 index array as int64.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t load_index(const void* p, IndexType t, int64_t i) {
  return t == IndexType::kInt32 ? static_cast<int64_t>(static_cast<const int32_t*>(p)[i])
                                : static_cast<const int64_t*>(p)[i];
}

inline int dtype_size(DType d) { return d == DType::kFloat32 ? 4 : 2; }

}  // namespace stagewise
