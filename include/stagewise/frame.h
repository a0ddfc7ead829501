// The frame: one message between stages (docs/wire-format.md).
//
// This header is the one table of the wire format's constants: sizes, offsets, limits,
// magic, version, flag bits, dtype codes and element sizes, the number of step kinds.
// The C++ fast path uses it directly; the Python codec (stagewise.transport.wire) reads
// it from stagewise._C.frame_constants() and builds its struct formats from it, so the two
// cannot drift apart. Torch-free and Python-free: plain structs and functions over bytes.
//
// A frame = header (80 bytes) + row table (24 bytes a row) + tensor table (80 bytes a
// tensor) + control (UTF-8 JSON) + zero padding to a multiple of 64 + payload (each
// tensor's bytes at a 64-aligned offset, zeros between). All integers little-endian.
// The checksum is CRC32C (include/stagewise/crc32c.h) of the whole frame with the
// checksum field read as zero, stored in the low 32 bits of that 64-bit field.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace stagewise::wire {

inline constexpr char kMagic[4] = {'S', 'W', 'F', 'R'};
inline constexpr uint32_t kVersion = 2;
inline constexpr uint32_t kAlign = 64;  // the payload and each tensor in it start 64-aligned
inline constexpr uint32_t kMaxRows = 1u << 20;
inline constexpr uint32_t kMaxTensors = 64;
inline constexpr uint32_t kMaxControlBytes = 16u << 20;
inline constexpr uint32_t kMaxNdim = 8;
inline constexpr uint32_t kMaxNameBytes = 24;
inline constexpr uint64_t kDefaultMaxPayloadBytes = uint64_t{2} << 30;  // unless the receiver says otherwise

// Step kinds are 1..kNumStepKinds; two of them must carry a control JSON object.
inline constexpr uint32_t kNumStepKinds = 8;
inline constexpr uint32_t kStepControl = 6, kStepHello = 8;
inline constexpr uint32_t kLayoutContiguous = 1;  // the only layout

// Header frame_flags bits.
inline constexpr uint32_t kFlagChecksum = 1;  // the checksum field holds the frame's CRC32C
// The frame is a descriptor: header, tables and control only; its tensors' bytes lie
// outside it (in a ring slot), at the table's offsets. payload_bytes is their extent.
inline constexpr uint32_t kFlagDetachedPayload = 2;
inline constexpr uint32_t kFrameFlagBits = kFlagChecksum | kFlagDetachedPayload;

// Row flags: PREFILL 1, LAST_PREFILL_CHUNK 2, FINISHED 4, CANCELLED 8, ERROR 16.
inline constexpr uint32_t kRowFlagBits = 31;

// Element types by wire code (index 0: no tensor).
struct DType {
  const char* name;
  uint32_t itemsize;
};
inline constexpr DType kDTypes[] = {
    {"", 0},       {"float32", 4}, {"float16", 2}, {"bfloat16", 2}, {"float64", 8}, {"int64", 8},
    {"int32", 4},  {"int16", 2},   {"int8", 1},    {"uint8", 1},    {"bool", 1},
};
inline constexpr uint32_t kNumDTypes = sizeof(kDTypes) / sizeof(kDTypes[0]) - 1;

// One field of a fixed-size record: `count` values of `format` (a Python struct code:
// 's' bytes of `size`, 'B' u8, 'H' u16, 'I' u32, 'Q' u64) at `offset`.
struct Field {
  const char* name;
  uint32_t offset, size;
  char format;
  uint32_t count;
};

// Indices into kHeaderFields, in wire order.
enum HeaderField : int {
  kHMagic, kHVersion, kHStepKind, kHDType, kHLayout, kHFlags, kHStageFrom, kHStageTo, kHMicrobatch,
  kHRequestId, kHStepId, kHBatch, kHSeq, kHHiddenSize, kHTokenIndex, kHNumRows, kHNumTensors, kHReserved0,
  kHControlBytes, kHReserved1, kHPayloadBytes, kHChecksum, kNumHeaderFields,
};
inline constexpr Field kHeaderFields[] = {
    {"magic", 0, 4, 's', 1},         {"version", 4, 2, 'H', 1},      {"step_kind", 6, 1, 'B', 1},
    {"dtype", 7, 1, 'B', 1},         {"layout", 8, 1, 'B', 1},       {"frame_flags", 9, 1, 'B', 1},
    {"stage_from", 10, 2, 'H', 1},   {"stage_to", 12, 2, 'H', 1},    {"microbatch", 14, 2, 'H', 1},
    {"request_id", 16, 8, 'Q', 1},   {"step_id", 24, 8, 'Q', 1},     {"batch", 32, 4, 'I', 1},
    {"seq", 36, 4, 'I', 1},          {"hidden_size", 40, 4, 'I', 1}, {"token_index", 44, 4, 'I', 1},
    {"num_rows", 48, 4, 'I', 1},     {"num_tensors", 52, 2, 'H', 1}, {"reserved0", 54, 2, 'H', 1},
    {"control_bytes", 56, 4, 'I', 1}, {"reserved1", 60, 4, 'I', 1},  {"payload_bytes", 64, 8, 'Q', 1},
    {"checksum", 72, 8, 'Q', 1},
};
inline constexpr uint32_t kHeaderBytes = 80;

enum RowField : int { kRRequestId, kRFirstPosition, kRNumTokens, kRFlags, kRReserved, kNumRowFields };
inline constexpr Field kRowFields[] = {
    {"request_id", 0, 8, 'Q', 1}, {"first_position", 8, 4, 'I', 1}, {"num_tokens", 12, 4, 'I', 1},
    {"flags", 16, 4, 'I', 1},     {"reserved", 20, 4, 'I', 1},
};
inline constexpr uint32_t kRowBytes = 24;

enum TensorField : int { kTName, kTDType, kTNdim, kTReserved0, kTReserved1, kTOffset, kTNbytes, kTDims, kNumTensorFields };
inline constexpr Field kTensorFields[] = {
    {"name", 0, kMaxNameBytes, 's', 1}, {"dtype", 24, 1, 'B', 1},   {"ndim", 25, 1, 'B', 1},
    {"reserved0", 26, 2, 'H', 1},       {"reserved1", 28, 4, 'I', 1}, {"offset", 32, 8, 'Q', 1},
    {"nbytes", 40, 8, 'Q', 1},          {"dims", 48, 4 * kMaxNdim, 'I', kMaxNdim},
};
inline constexpr uint32_t kTensorBytes = 80;

// Each table is contiguous and adds up to its record size (checked at compile time).
template <size_t N>
constexpr bool packed(const Field (&fields)[N], uint32_t total) {
  uint32_t at = 0;
  for (const Field& f : fields) {
    if (f.offset != at) return false;
    at += f.size;
  }
  return at == total;
}
static_assert(packed(kHeaderFields, kHeaderBytes) && sizeof(kHeaderFields) / sizeof(Field) == kNumHeaderFields);
static_assert(packed(kRowFields, kRowBytes) && sizeof(kRowFields) / sizeof(Field) == kNumRowFields);
static_assert(packed(kTensorFields, kTensorBytes) && sizeof(kTensorFields) / sizeof(Field) == kNumTensorFields);

constexpr uint32_t at(HeaderField f) { return kHeaderFields[f].offset; }
constexpr uint64_t align_up(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// ---- the plain structs ------------------------------------------------------------------

struct Header {
  uint32_t step_kind = 0, dtype = 0, layout = kLayoutContiguous, flags = 0;
  uint32_t stage_from = 0, stage_to = 0, microbatch = 0;
  uint64_t request_id = 0, step_id = 0;
  uint32_t batch = 0, seq = 0, hidden_size = 0, token_index = 0;
  uint32_t num_rows = 0, num_tensors = 0, control_bytes = 0;
  uint64_t payload_bytes = 0, checksum = 0;
};

struct Row {
  uint64_t request_id = 0;
  uint32_t first_position = 0, num_tokens = 0, flags = 0;
};

// Left uninitialised by default (a parse fills what it reads; 64 of them sit on the stack).
struct Tensor {
  const uint8_t* name;  // UTF-8, not NUL-terminated; points into the frame or the caller's string
  uint32_t name_bytes;
  uint32_t dtype, ndim;
  uint32_t dims[kMaxNdim];  // the first ndim
  uint64_t offset, nbytes;  // in the payload
};

// One tensor's bytes for the payload (contiguous memory the caller keeps alive).
struct Span {
  const void* data;
  uint64_t nbytes;
};

// (batch, seq, hidden_size) of a primary tensor: the last dimension is hidden_size, the one
// before it seq, the earlier ones multiply into batch; a vector [n] gives (n, 1, 1), a scalar
// (1, 1, 1). False when batch overflows 64 bits.
bool shape_fields(const uint32_t* dims, uint32_t ndim, uint64_t out[3]);

// ---- encoding ---------------------------------------------------------------------------

// Lay a frame out: from the caller's step_kind, layout, flags, ids and positions in `h` and
// each tensor's name, dtype and dims, fill h's dtype, shape fields, counts, control_bytes and
// payload_bytes, and each tensor's offset and nbytes. *head_bytes = the bytes before the
// payload (header, tables, control, padding). False when a value is outside the wire's
// ranges (a count above its maximum, a dimension product that overflows, a batch above u32).
bool plan_frame(Header* h, size_t num_rows, Tensor* tensors, size_t num_tensors, uint64_t control_bytes,
                uint64_t* head_bytes);

// Write header, tables, control and padding into out[0, head_bytes) (the checksum field as
// h.checksum; plan_frame's caller leaves it 0 and stores the CRC later).
void write_head(const Header& h, const Row* rows, const Tensor* tensors, const uint8_t* control, uint8_t* out,
                uint64_t head_bytes);

// CRC32C of the frame made of `head` (its checksum field read as zero) and the payload of
// `spans` at their 64-aligned offsets with zeros between. The payload is read where it
// lies, not from a copy.
uint32_t frame_checksum(const uint8_t* head, uint64_t head_bytes, const Span* spans, size_t num_spans);

// Write the payload of `spans` into out (64-aligned offsets, zero gaps); returns its bytes.
uint64_t write_payload(const Span* spans, size_t num_spans, uint8_t* out);

// Write the whole frame, head then payload, into out and return frame_checksum's value; the
// payload is checksummed while it is copied (each byte read once). out's checksum field is
// written as it is in head.
uint32_t write_frame_checksummed(const uint8_t* head, uint64_t head_bytes, const Span* spans, size_t num_spans,
                                 uint8_t* out);

// ---- decoding ---------------------------------------------------------------------------

struct Parsed {
  Header header;
  uint64_t rows_at = 0, tensors_at = 0, control_at = 0, payload_at = 0;
  Tensor tensors[kMaxTensors];  // the first header.num_tensors; offsets relative to the payload
};

// Parse and check a whole frame of n bytes: every check of the Python reference decoder
// (stagewise.transport.codec_reference) except the control JSON and the UTF-8 of tensor names,
// which need Python. *rows receives the row table. False at the first check that fails (the
// reference then names it). A detached-payload frame is its head alone (n == payload_at).
bool parse_frame(const uint8_t* p, uint64_t n, uint64_t max_payload_bytes, bool verify_checksum, Parsed* out,
                 std::vector<Row>* rows);

}  // namespace stagewise::wire
