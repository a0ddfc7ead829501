// CRC32C: the frame checksum (docs/wire-format.md).
//
// The Castagnoli CRC of iSCSI, ext4 and the `crc32c` Python package: reflected polynomial
// 0x82F63B78, initial value and final XOR 0xFFFFFFFF, so crc32c("123456789") = 0xE3069283.
// crc32c_extend(crc32c(A), B) = crc32c(A || B); the CRC of no bytes is 0.
//
// Paths, chosen at run time: the CPU's CRC32C instruction (SSE4.2 on x86-64, found by
// CPUID; the ARMv8 CRC extension on aarch64, found by the kernel's hwcaps), three
// independent streams at once and combined; otherwise a table-driven software loop.
// Torch-free.
#pragma once
#include <cstddef>
#include <cstdint>

namespace stagewise {

enum class Crc32cPath : int {
  kAuto = 0,      // the hardware path where the CPU has it, else software
  kHardware = 1,  // the CPU's CRC32C instruction (only where crc32c_hardware() is non-null)
  kSoftware = 2,  // the portable table-driven loop
};

// The CRC32C of data[0, n) continued from `crc`, the CRC32C of the bytes before them (0: none).
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);

// The same through a chosen path. kHardware on a CPU without the instruction is a caller's
// error (check crc32c_hardware() first): it falls back to software rather than crash.
uint32_t crc32c_extend_with(Crc32cPath path, uint32_t crc, const void* data, size_t n);

// crc32c_extend over src[0, n) that also copies it to dst (the regions must not overlap): one
// pass over the bytes, for a sender that checksums a tensor while writing it into a ring slot.
uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t n);
uint32_t crc32c_copy_with(Crc32cPath path, uint32_t crc, void* dst, const void* src, size_t n);

// The hardware path this CPU runs ("sse4.2", "armv8-crc"), or nullptr where it has none.
const char* crc32c_hardware();

}  // namespace stagewise
