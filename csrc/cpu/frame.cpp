// Frame pack and parse over plain structs (include/stagewise/frame.h).
#include "stagewise/frame.h"

#include <cstring>
#include <unordered_set>

#include "stagewise/crc32c.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the frame codec assumes a little-endian host (the wire format is little-endian)"
#endif

namespace stagewise::wire {
namespace {

constexpr uint8_t kZeros[kAlign] = {};
constexpr uint64_t kU32 = 0xffffffffu;
constexpr uint32_t kChecksumAt = at(kHChecksum);

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void store(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

bool mul(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

bool duplicate_ids(const std::vector<Row>& rows) {
  if (rows.size() <= 32) {
    for (size_t i = 1; i < rows.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        if (rows[i].request_id == rows[j].request_id) return true;
    return false;
  }
  std::unordered_set<uint64_t> seen;
  seen.reserve(rows.size() * 2);
  for (const Row& r : rows)
    if (!seen.insert(r.request_id).second) return true;
  return false;
}

// Rows either pack the primary tensor's batch * seq token slots exactly, or take one batch
// entry each with at most seq tokens (a padded batch).
bool rows_fit(const std::vector<Row>& rows, uint64_t batch, uint64_t seq) {
  uint64_t tokens = 0, most = 0;
  for (const Row& r : rows) {
    tokens += r.num_tokens;
    if (r.num_tokens > most) most = r.num_tokens;
  }
  return tokens == batch * seq || (batch == rows.size() && most <= seq);
}

}  // namespace

bool shape_fields(const uint32_t* dims, uint32_t ndim, uint64_t out[3]) {
  if (ndim == 0) {
    out[0] = out[1] = out[2] = 1;
    return true;
  }
  if (ndim == 1) {
    out[0] = dims[0];
    out[1] = out[2] = 1;
    return true;
  }
  uint64_t b = 1;
  for (uint32_t i = 0; i + 2 < ndim; ++i)
    if (!mul(b, dims[i], &b)) return false;
  out[0] = b;
  out[1] = dims[ndim - 2];
  out[2] = dims[ndim - 1];
  return true;
}

// ---- encoding -----------------------------------------------------------------------------

bool plan_frame(Header* h, size_t num_rows, Tensor* tensors, size_t num_tensors, uint64_t control_bytes,
                uint64_t* head_bytes) {
  if (num_rows > kMaxRows || num_tensors > kMaxTensors || control_bytes > kMaxControlBytes) return false;
  uint64_t offset = 0;
  for (size_t i = 0; i < num_tensors; ++i) {
    Tensor& t = tensors[i];
    if (t.dtype < 1 || t.dtype > kNumDTypes || t.ndim > kMaxNdim) return false;
    uint64_t nbytes = kDTypes[t.dtype].itemsize;
    for (uint32_t d = 0; d < t.ndim; ++d)
      if (!mul(nbytes, t.dims[d], &nbytes)) return false;
    offset = align_up(offset);
    if (nbytes > ~uint64_t{0} - offset - kAlign) return false;
    t.offset = offset;
    t.nbytes = nbytes;
    offset += nbytes;
  }
  h->payload_bytes = offset;
  h->num_rows = static_cast<uint32_t>(num_rows);
  h->num_tensors = static_cast<uint32_t>(num_tensors);
  h->control_bytes = static_cast<uint32_t>(control_bytes);
  if (num_tensors == 0) {
    h->dtype = h->batch = h->seq = h->hidden_size = 0;
  } else {
    uint64_t f[3];
    if (!shape_fields(tensors[0].dims, tensors[0].ndim, f) || f[0] > kU32) return false;
    h->dtype = tensors[0].dtype;
    h->batch = static_cast<uint32_t>(f[0]);
    h->seq = static_cast<uint32_t>(f[1]);
    h->hidden_size = static_cast<uint32_t>(f[2]);
  }
  *head_bytes = align_up(kHeaderBytes + kRowBytes * num_rows + kTensorBytes * num_tensors + control_bytes);
  return true;
}

void write_head(const Header& h, const Row* rows, const Tensor* tensors, const uint8_t* control, uint8_t* out,
                uint64_t head_bytes) {
  std::memset(out, 0, head_bytes);
  std::memcpy(out + at(kHMagic), kMagic, sizeof(kMagic));
  store<uint16_t>(out + at(kHVersion), kVersion);
  out[at(kHStepKind)] = static_cast<uint8_t>(h.step_kind);
  out[at(kHDType)] = static_cast<uint8_t>(h.dtype);
  out[at(kHLayout)] = static_cast<uint8_t>(h.layout);
  out[at(kHFlags)] = static_cast<uint8_t>(h.flags);
  store<uint16_t>(out + at(kHStageFrom), h.stage_from);
  store<uint16_t>(out + at(kHStageTo), h.stage_to);
  store<uint16_t>(out + at(kHMicrobatch), h.microbatch);
  store<uint64_t>(out + at(kHRequestId), h.request_id);
  store<uint64_t>(out + at(kHStepId), h.step_id);
  store<uint32_t>(out + at(kHBatch), h.batch);
  store<uint32_t>(out + at(kHSeq), h.seq);
  store<uint32_t>(out + at(kHHiddenSize), h.hidden_size);
  store<uint32_t>(out + at(kHTokenIndex), h.token_index);
  store<uint32_t>(out + at(kHNumRows), h.num_rows);
  store<uint16_t>(out + at(kHNumTensors), h.num_tensors);
  store<uint32_t>(out + at(kHControlBytes), h.control_bytes);
  store<uint64_t>(out + at(kHPayloadBytes), h.payload_bytes);
  store<uint64_t>(out + at(kHChecksum), h.checksum);
  uint8_t* q = out + kHeaderBytes;
  for (uint32_t i = 0; i < h.num_rows; ++i, q += kRowBytes) {
    store<uint64_t>(q + kRowFields[kRRequestId].offset, rows[i].request_id);
    store<uint32_t>(q + kRowFields[kRFirstPosition].offset, rows[i].first_position);
    store<uint32_t>(q + kRowFields[kRNumTokens].offset, rows[i].num_tokens);
    store<uint32_t>(q + kRowFields[kRFlags].offset, rows[i].flags);
  }
  for (uint32_t i = 0; i < h.num_tensors; ++i, q += kTensorBytes) {
    const Tensor& t = tensors[i];
    std::memcpy(q + kTensorFields[kTName].offset, t.name, t.name_bytes);
    q[kTensorFields[kTDType].offset] = static_cast<uint8_t>(t.dtype);
    q[kTensorFields[kTNdim].offset] = static_cast<uint8_t>(t.ndim);
    store<uint64_t>(q + kTensorFields[kTOffset].offset, t.offset);
    store<uint64_t>(q + kTensorFields[kTNbytes].offset, t.nbytes);
    for (uint32_t d = 0; d < t.ndim; ++d) store<uint32_t>(q + kTensorFields[kTDims].offset + 4 * d, t.dims[d]);
  }
  if (h.control_bytes > 0) std::memcpy(q, control, h.control_bytes);
}

namespace {

// CRC32C of the head with its checksum field read as zero.
uint32_t head_checksum(const uint8_t* head, uint64_t head_bytes) {
  const uint32_t crc = crc32c_extend(crc32c_extend(0, head, kChecksumAt), kZeros, 8);
  return crc32c_extend(crc, head + kHeaderBytes, head_bytes - kHeaderBytes);
}

}  // namespace

uint32_t frame_checksum(const uint8_t* head, uint64_t head_bytes, const Span* spans, size_t num_spans) {
  uint32_t crc = head_checksum(head, head_bytes);
  uint64_t pos = 0;
  for (size_t i = 0; i < num_spans; ++i) {
    const uint64_t start = align_up(pos);
    if (start > pos) crc = crc32c_extend(crc, kZeros, start - pos);
    if (spans[i].nbytes > 0) crc = crc32c_extend(crc, spans[i].data, spans[i].nbytes);
    pos = start + spans[i].nbytes;
  }
  return crc;
}

uint64_t write_payload(const Span* spans, size_t num_spans, uint8_t* out) {
  uint64_t pos = 0;
  for (size_t i = 0; i < num_spans; ++i) {
    const uint64_t start = align_up(pos);
    if (start > pos) std::memset(out + pos, 0, start - pos);
    if (spans[i].nbytes > 0) std::memcpy(out + start, spans[i].data, spans[i].nbytes);
    pos = start + spans[i].nbytes;
  }
  return pos;
}

uint32_t write_frame_checksummed(const uint8_t* head, uint64_t head_bytes, const Span* spans, size_t num_spans,
                                 uint8_t* out) {
  std::memcpy(out, head, head_bytes);
  uint32_t crc = head_checksum(head, head_bytes);
  uint8_t* payload = out + head_bytes;
  uint64_t pos = 0;
  for (size_t i = 0; i < num_spans; ++i) {
    const uint64_t start = align_up(pos);
    if (start > pos) {
      std::memset(payload + pos, 0, start - pos);
      crc = crc32c_extend(crc, kZeros, start - pos);
    }
    if (spans[i].nbytes > 0) crc = crc32c_copy(crc, payload + start, spans[i].data, spans[i].nbytes);
    pos = start + spans[i].nbytes;
  }
  return crc;
}

// ---- decoding -----------------------------------------------------------------------------

bool parse_frame(const uint8_t* p, uint64_t n, uint64_t max_payload_bytes, bool verify_checksum, Parsed* out,
                 std::vector<Row>* rows) {
  if (n < kHeaderBytes || std::memcmp(p, kMagic, sizeof(kMagic)) != 0) return false;
  Header& h = out->header;
  if (load<uint16_t>(p + at(kHVersion)) != kVersion) return false;
  h.step_kind = p[at(kHStepKind)];
  h.dtype = p[at(kHDType)];
  h.layout = p[at(kHLayout)];
  h.flags = p[at(kHFlags)];
  if (h.step_kind < 1 || h.step_kind > kNumStepKinds || h.dtype > kNumDTypes || h.layout != kLayoutContiguous)
    return false;
  if ((h.flags & ~kFrameFlagBits) != 0 || load<uint16_t>(p + at(kHReserved0)) != 0 ||
      load<uint32_t>(p + at(kHReserved1)) != 0)
    return false;
  h.num_rows = load<uint32_t>(p + at(kHNumRows));
  h.num_tensors = load<uint16_t>(p + at(kHNumTensors));
  h.control_bytes = load<uint32_t>(p + at(kHControlBytes));
  h.payload_bytes = load<uint64_t>(p + at(kHPayloadBytes));
  h.checksum = load<uint64_t>(p + at(kHChecksum));
  if (h.num_rows > kMaxRows || h.num_tensors > kMaxTensors || h.control_bytes > kMaxControlBytes ||
      h.payload_bytes > max_payload_bytes)
    return false;
  out->rows_at = kHeaderBytes;
  out->tensors_at = out->rows_at + uint64_t{kRowBytes} * h.num_rows;
  out->control_at = out->tensors_at + uint64_t{kTensorBytes} * h.num_tensors;
  out->payload_at = align_up(out->control_at + h.control_bytes);
  const uint64_t inline_payload = (h.flags & kFlagDetachedPayload) ? 0 : h.payload_bytes;
  if (inline_payload > n || n - inline_payload != out->payload_at) return false;  // n == payload_at + payload
  if (h.flags & kFlagChecksum) {
    if ((h.checksum >> 32) != 0) return false;
    if (verify_checksum && frame_checksum(p, n, nullptr, 0) != h.checksum) return false;
  } else if (h.checksum != 0) {
    return false;
  }

  rows->resize(h.num_rows);
  for (uint32_t i = 0; i < h.num_rows; ++i) {
    const uint8_t* r = p + out->rows_at + uint64_t{i} * kRowBytes;
    Row& row = (*rows)[i];
    row.request_id = load<uint64_t>(r + kRowFields[kRRequestId].offset);
    row.first_position = load<uint32_t>(r + kRowFields[kRFirstPosition].offset);
    row.num_tokens = load<uint32_t>(r + kRowFields[kRNumTokens].offset);
    row.flags = load<uint32_t>(r + kRowFields[kRFlags].offset);
    if ((row.flags & ~kRowFlagBits) != 0 || load<uint32_t>(r + kRowFields[kRReserved].offset) != 0) return false;
  }
  if (duplicate_ids(*rows)) return false;

  uint64_t expect = 0;
  for (uint32_t i = 0; i < h.num_tensors; ++i) {
    const uint8_t* e = p + out->tensors_at + uint64_t{i} * kTensorBytes;
    Tensor& t = out->tensors[i];
    uint32_t len = kMaxNameBytes;
    while (len > 0 && e[len - 1] == 0) --len;  // NUL padding
    if (len == 0 || std::memchr(e, 0, len) != nullptr) return false;
    for (uint32_t j = 0; j < i; ++j)
      if (out->tensors[j].name_bytes == len && std::memcmp(out->tensors[j].name, e, len) == 0) return false;
    t.name = e;
    t.name_bytes = len;
    t.dtype = e[kTensorFields[kTDType].offset];
    t.ndim = e[kTensorFields[kTNdim].offset];
    if (t.dtype < 1 || t.dtype > kNumDTypes || t.ndim > kMaxNdim ||
        load<uint16_t>(e + kTensorFields[kTReserved0].offset) != 0 ||
        load<uint32_t>(e + kTensorFields[kTReserved1].offset) != 0)
      return false;
    t.offset = load<uint64_t>(e + kTensorFields[kTOffset].offset);
    t.nbytes = load<uint64_t>(e + kTensorFields[kTNbytes].offset);
    uint64_t want = kDTypes[t.dtype].itemsize;
    for (uint32_t d = 0; d < kMaxNdim; ++d) {
      t.dims[d] = load<uint32_t>(e + kTensorFields[kTDims].offset + 4 * d);
      if (d >= t.ndim && t.dims[d] != 0) return false;
      if (d < t.ndim && !mul(want, t.dims[d], &want)) return false;
    }
    if (want != t.nbytes) return false;
    expect = align_up(expect);
    if (t.offset != expect || t.nbytes > h.payload_bytes || t.offset > h.payload_bytes - t.nbytes) return false;
    expect = t.offset + t.nbytes;
  }
  if (expect != h.payload_bytes) return false;
  if (h.control_bytes == 0 && (h.step_kind == kStepControl || h.step_kind == kStepHello)) return false;

  h.stage_from = load<uint16_t>(p + at(kHStageFrom));
  h.stage_to = load<uint16_t>(p + at(kHStageTo));
  h.microbatch = load<uint16_t>(p + at(kHMicrobatch));
  h.request_id = load<uint64_t>(p + at(kHRequestId));
  h.step_id = load<uint64_t>(p + at(kHStepId));
  h.batch = load<uint32_t>(p + at(kHBatch));
  h.seq = load<uint32_t>(p + at(kHSeq));
  h.hidden_size = load<uint32_t>(p + at(kHHiddenSize));
  h.token_index = load<uint32_t>(p + at(kHTokenIndex));
  if (h.num_tensors == 0) return h.dtype == 0 && h.batch == 0 && h.seq == 0 && h.hidden_size == 0;
  const Tensor& primary = out->tensors[0];
  uint64_t f[3];
  if (h.dtype != primary.dtype || !shape_fields(primary.dims, primary.ndim, f) || f[0] != h.batch ||
      f[1] != h.seq || f[2] != h.hidden_size)
    return false;
  return h.num_rows == 0 || rows_fit(*rows, h.batch, h.seq);
}

}  // namespace stagewise::wire
