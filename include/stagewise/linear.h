// Linear layers over dense weights: out = x @ W.T + bias.
//
// Maths (the kernel): float32 x [rows, in] and W [out, in], products summed in float32 (the
// order is the kernel's own; fused multiply-adds where the CPU has them), the bias added once at
// the end. Against a float64 reference the error is that of float32 summation: a few ulps of
// sum |x * w| per output.
//
// The kernel is for the few rows of a decode step, where the weights are read once from memory
// and the maths is free: it reads them at the memory's pace (csrc/cpu/dense_linear.cpp says how).
// The op also takes float16 and bfloat16, and more rows than dense_linear_max_rows(), where a
// BLAS GEMM does better: the CPU glue calls at::addmm for those (csrc/bindings/ops_cpu.cpp).
#pragma once
#include "stagewise/common.h"

namespace stagewise {

struct DenseLinearParams {
  void* out;              // [rows, out_features], row stride out_row_stride (elements), dtype
  int64_t out_row_stride;
  const void* x;          // [rows, in_features], row stride x_row_stride (elements), dtype
  int64_t x_row_stride;
  const void* weight;     // [out_features, in_features] contiguous, dtype
  const void* bias;       // [out_features] contiguous, dtype; nullptr: no bias
  DType dtype;            // of all four; the kernel takes float32 only
  int64_t rows;           // the kernel takes up to dense_linear_max_rows()
  int64_t in_features;    // >= 1
  int64_t out_features;
};

namespace cpu {
// p.dtype float32, p.rows <= dense_linear_max_rows().
void dense_linear(const DenseLinearParams& p);
// The most rows of x the kernel takes; more go to a BLAS GEMM (measured per ISA level).
int64_t dense_linear_max_rows();
}  // namespace cpu

}  // namespace stagewise
