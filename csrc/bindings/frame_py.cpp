// Python fast path of the frame codec (python/stagewise/transport/codec.py):
// the header, row table and tensor table of docs/wire-format.md packed and
// parsed in C++, without the interpreter's per-field cost (a Python codec
// spends 15-20 us a frame on what is here about 1 us).
//
// Both directions *accept or decline*, they never raise FrameError or
// ValueError about a frame: whatever they decline (any check that fails, any
// value of an unexpected type) goes to the Python codec, which is the
// reference and raises the precise error. So a frame the fast path accepts is
// exactly one the Python codec accepts, with the same result; the codec's
// tests compare the two on fuzzed frames.
//
// The checksum is XXH3-64 from the xxHash library that the `xxhash` Python
// package wraps (csrc/third_party/xxhash, the same version), so both codecs
// hash alike. What stays in Python: the control JSON, making tensors
// (torch.frombuffer) and the Frame object. Tensor bytes are copied and hashed
// from the addresses Python passes (data_ptr() of contiguous CPU tensors that
// the frame keeps alive during the call).
#include "bindings/frame_py.h"

#include <cstdint>
#include <cstring>
#include <unordered_set>
#include <utility>
#include <vector>

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the frame fast path assumes a little-endian host (the wire format is little-endian)"
#endif

namespace stagewise::glue {
namespace {

// docs/wire-format.md; codec.py checks these against its own at import.
constexpr uint64_t kHeaderBytes = 80, kRowBytes = 24, kTensorBytes = 80, kAlign = 64;
constexpr uint64_t kVersion = 1, kMaxRows = 1u << 20, kMaxTensors = 64, kMaxControl = 16u << 20;
constexpr uint64_t kMaxNdim = 8, kMaxName = 24, kNumStepKinds = 8, kNumDTypes = 10, kLayoutContiguous = 1;
constexpr uint32_t kRowFlagBits = 31, kFlagChecksum = 1;
constexpr uint64_t kChecksumAt = 72;
constexpr uint8_t kZeros[kAlign] = {};
constexpr uint64_t kU16 = 0xffff, kU32 = 0xffffffffu, kU64 = ~uint64_t{0};
constexpr uint64_t kItemsize[kNumDTypes + 1] = {0, 4, 2, 2, 8, 8, 4, 2, 1, 1, 1};
constexpr char kMagic[4] = {'S', 'W', 'F', 'R'};

// Set once by frame_setup: the Row class and RowFlags(v) for v in 0..31.
PyObject* g_row_type = nullptr;
PyObject* g_row_flags = nullptr;
// Set by frame_setup too: torch.Tensor, {torch dtype: wire code}, WireDType by code (0: None), b"SWFR".
PyObject* g_tensor_type = nullptr;
PyObject* g_dtype_codes = nullptr;
PyObject* g_wire_dtypes = nullptr;
PyObject* g_magic = nullptr;
// Interned attribute names: of Frame (read), of Frame (derived, set), of Row, of torch.Tensor.
PyObject* g_attr[10] = {};
const char* const kAttrNames[10] = {"step_kind",  "layout",   "request_id",  "step_id", "microbatch",
                                    "stage_from", "stage_to", "token_index", "rows",    "tensors"};
PyObject* g_dattr[7] = {};
const char* const kDerivedNames[7] = {"batch", "seq", "hidden_size", "dtype", "payload_bytes", "magic", "version"};
PyObject* g_tattr[5] = {};
const char* const kTensorAttrNames[5] = {"is_cpu", "is_contiguous", "dtype", "shape", "data_ptr"};
PyObject* g_row_attr[4] = {};
const char* const kRowAttrNames[4] = {"request_id", "first_position", "num_tokens", "flags"};

uint64_t align64(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

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

// a * b, false on overflow.
bool mul(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

struct Buffer {
  Py_buffer view{};
  bool held = false;
  ~Buffer() {
    if (held) PyBuffer_Release(&view);
  }
};

// ---- decode ------------------------------------------------------------------

struct Spec {
  const uint8_t* name;
  size_t name_len;
  uint64_t dtype, ndim, offset, nbytes, numel;
  uint32_t dims[kMaxNdim];
};

struct RowEntry {
  uint64_t request_id;
  uint32_t first, num_tokens, flags;
};

// (batch, seq, hidden_size) of a primary tensor of this shape (frame.py shape_fields); false when
// batch overflows u64 (then it cannot equal a u32 header field anyway).
bool shape_fields(const uint32_t* dims, uint64_t ndim, uint64_t out[3]) {
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
  for (uint64_t i = 0; i + 2 < ndim; ++i)
    if (!mul(b, dims[i], &b)) return false;
  out[0] = b;
  out[1] = dims[ndim - 2];
  out[2] = dims[ndim - 1];
  return true;
}

bool has_duplicate_ids(const std::vector<RowEntry>& rows) {
  if (rows.size() <= 32) {
    for (size_t i = 1; i < rows.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        if (rows[i].request_id == rows[j].request_id) return true;
    return false;
  }
  std::unordered_set<uint64_t> seen;
  seen.reserve(rows.size() * 2);
  for (const RowEntry& r : rows)
    if (!seen.insert(r.request_id).second) return true;
  return false;
}

PyObject* decline() { Py_RETURN_NONE; }

// frame_parse(buffer, max_payload_bytes, verify_checksum) -> None | (step_kind, dtype, layout, frame_flags, stage_from,
//   stage_to, microbatch, request_id, step_id, batch, seq, hidden_size, token_index, payload_at,
//   payload_bytes, checksum, rows, specs, control_at, control_bytes)
// rows: list of Row; specs: list of (name, dtype code, shape, absolute offset, numel).
// Every check of codec.decode_frame but the control JSON, which the caller does; None when any
// check fails.
PyObject* py_frame_parse(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "stagewise.frame_parse: expected 3 arguments, got %zd", nargs);
    return nullptr;
  }
  if (g_row_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "stagewise.frame_parse: frame_setup was not called");
    return nullptr;
  }
  const unsigned long long max_payload = PyLong_AsUnsignedLongLong(args[1]);
  if (max_payload == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    return decline();
  }
  Buffer buf;
  if (PyObject_GetBuffer(args[0], &buf.view, PyBUF_SIMPLE) < 0) return nullptr;
  buf.held = true;
  const auto* p = static_cast<const uint8_t*>(buf.view.buf);
  const auto n = static_cast<uint64_t>(buf.view.len);

  if (n < kHeaderBytes || std::memcmp(p, kMagic, 4) != 0 || load<uint16_t>(p + 4) != kVersion) return decline();
  const uint64_t kind = p[6], dtype = p[7], layout = p[8], flags = p[9];
  if (kind < 1 || kind > kNumStepKinds || dtype > kNumDTypes || layout != kLayoutContiguous) return decline();
  const uint64_t num_rows = load<uint32_t>(p + 48), num_tensors = load<uint16_t>(p + 52);
  const uint64_t control_len = load<uint32_t>(p + 56), payload_bytes = load<uint64_t>(p + 64);
  const uint64_t checksum = load<uint64_t>(p + 72);
  if ((flags & ~uint64_t{kFlagChecksum}) != 0 || load<uint16_t>(p + 54) != 0 || load<uint32_t>(p + 60) != 0)
    return decline();
  if (num_rows > kMaxRows || num_tensors > kMaxTensors || control_len > kMaxControl || payload_bytes > max_payload)
    return decline();
  const uint64_t rows_at = kHeaderBytes, tensors_at = rows_at + kRowBytes * num_rows;
  const uint64_t control_at = tensors_at + kTensorBytes * num_tensors;
  const uint64_t payload_at = align64(control_at + control_len);
  if (payload_bytes > n || n - payload_bytes != payload_at) return decline();  // n == payload_at + payload_bytes
  if (!(flags & kFlagChecksum) && checksum != 0) return decline();
  if ((flags & kFlagChecksum) && PyObject_IsTrue(args[2])) {  // XXH3-64 with the checksum field read as 0
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    XXH3_64bits_update(&state, p, kChecksumAt);
    XXH3_64bits_update(&state, kZeros, 8);
    XXH3_64bits_update(&state, p + kHeaderBytes, n - kHeaderBytes);
    if (XXH3_64bits_digest(&state) != checksum) return decline();
  }

  std::vector<RowEntry> rows(num_rows);
  for (uint64_t i = 0; i < num_rows; ++i) {
    const uint8_t* r = p + rows_at + i * kRowBytes;
    rows[i] = {load<uint64_t>(r), load<uint32_t>(r + 8), load<uint32_t>(r + 12), load<uint32_t>(r + 16)};
    if ((rows[i].flags & ~kRowFlagBits) != 0 || load<uint32_t>(r + 20) != 0) return decline();
  }
  if (has_duplicate_ids(rows)) return decline();

  std::vector<Spec> specs(num_tensors);
  uint64_t expect = 0;
  for (uint64_t i = 0; i < num_tensors; ++i) {
    const uint8_t* e = p + tensors_at + i * kTensorBytes;
    Spec& s = specs[i];
    size_t len = kMaxName;
    while (len > 0 && e[len - 1] == 0) --len;  // rstrip(b"\0")
    if (len == 0 || std::memchr(e, 0, len) != nullptr) return decline();
    for (uint64_t j = 0; j < i; ++j)
      if (specs[j].name_len == len && std::memcmp(specs[j].name, e, len) == 0) return decline();
    s.name = e;
    s.name_len = len;
    s.dtype = e[24];
    s.ndim = e[25];
    if (s.dtype < 1 || s.dtype > kNumDTypes || s.ndim > kMaxNdim || load<uint16_t>(e + 26) != 0 ||
        load<uint32_t>(e + 28) != 0)
      return decline();
    s.offset = load<uint64_t>(e + 32);
    s.nbytes = load<uint64_t>(e + 40);
    s.numel = 1;
    for (uint64_t d = 0; d < kMaxNdim; ++d) {
      s.dims[d] = load<uint32_t>(e + 48 + 4 * d);
      if (d >= s.ndim && s.dims[d] != 0) return decline();
      if (d < s.ndim && !mul(s.numel, s.dims[d], &s.numel)) return decline();
    }
    uint64_t want;
    if (!mul(s.numel, kItemsize[s.dtype], &want) || want != s.nbytes) return decline();
    expect = align64(expect);
    if (s.offset != expect || s.nbytes > payload_bytes || s.offset > payload_bytes - s.nbytes) return decline();
    expect = s.offset + s.nbytes;
  }
  if (expect != payload_bytes) return decline();
  if (control_len == 0 && (kind == 6 || kind == 8)) return decline();  // CONTROL / HELLO need JSON

  const uint64_t batch = load<uint32_t>(p + 32), seq = load<uint32_t>(p + 36), hidden = load<uint32_t>(p + 40);
  if (num_tensors == 0) {
    if (dtype != 0 || batch != 0 || seq != 0 || hidden != 0) return decline();
  } else {
    uint64_t f[3];
    if (dtype != specs[0].dtype || !shape_fields(specs[0].dims, specs[0].ndim, f) || f[0] != batch || f[1] != seq ||
        f[2] != hidden)
      return decline();
    if (num_rows > 0) {  // packed (tokens == batch * seq) or padded (one row per batch entry, <= seq tokens)
      uint64_t tokens = 0, most = 0;
      for (const RowEntry& r : rows) {
        tokens += r.num_tokens;
        if (r.num_tokens > most) most = r.num_tokens;
      }
      if (tokens != batch * seq && !(batch == num_rows && most <= seq)) return decline();
    }
  }

  // The names must be UTF-8 too; decode them before building anything else.
  PyObject* specs_list = PyList_New(static_cast<Py_ssize_t>(num_tensors));
  if (specs_list == nullptr) return nullptr;
  for (uint64_t i = 0; i < num_tensors; ++i) {
    const Spec& s = specs[i];
    PyObject* name = PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(s.name), s.name_len, "strict");
    if (name == nullptr) {
      Py_DECREF(specs_list);
      if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) return nullptr;
      PyErr_Clear();
      return decline();
    }
    PyObject* shape = PyTuple_New(static_cast<Py_ssize_t>(s.ndim));
    if (shape == nullptr) {
      Py_DECREF(name);
      Py_DECREF(specs_list);
      return nullptr;
    }
    for (uint64_t d = 0; d < s.ndim; ++d) PyTuple_SET_ITEM(shape, d, PyLong_FromUnsignedLong(s.dims[d]));
    PyObject* spec = Py_BuildValue("(NKNKK)", name, static_cast<unsigned long long>(s.dtype), shape,
                                   static_cast<unsigned long long>(payload_at + s.offset),
                                   static_cast<unsigned long long>(s.numel));
    if (spec == nullptr) {
      Py_DECREF(specs_list);
      return nullptr;
    }
    PyList_SET_ITEM(specs_list, i, spec);
  }

  PyObject* rows_list = PyList_New(static_cast<Py_ssize_t>(num_rows));
  if (rows_list == nullptr) {
    Py_DECREF(specs_list);
    return nullptr;
  }
  for (uint64_t i = 0; i < num_rows; ++i) {
    const RowEntry& r = rows[i];
    PyObject* a[4] = {PyLong_FromUnsignedLongLong(r.request_id), PyLong_FromUnsignedLong(r.first),
                      PyLong_FromUnsignedLong(r.num_tokens), PyTuple_GET_ITEM(g_row_flags, r.flags)};
    PyObject* row = (a[0] && a[1] && a[2]) ? PyObject_Vectorcall(g_row_type, a, 4, nullptr) : nullptr;
    Py_XDECREF(a[0]);
    Py_XDECREF(a[1]);
    Py_XDECREF(a[2]);
    if (row == nullptr) {
      Py_DECREF(rows_list);
      Py_DECREF(specs_list);
      return nullptr;
    }
    PyList_SET_ITEM(rows_list, i, row);
  }

  return Py_BuildValue(
      "(KKKKKKKKKKKKKKKKNNKK)", static_cast<unsigned long long>(kind), static_cast<unsigned long long>(dtype),
      static_cast<unsigned long long>(layout), static_cast<unsigned long long>(flags),
      static_cast<unsigned long long>(load<uint16_t>(p + 10)), static_cast<unsigned long long>(load<uint16_t>(p + 12)),
      static_cast<unsigned long long>(load<uint16_t>(p + 14)), static_cast<unsigned long long>(load<uint64_t>(p + 16)),
      static_cast<unsigned long long>(load<uint64_t>(p + 24)), static_cast<unsigned long long>(batch),
      static_cast<unsigned long long>(seq), static_cast<unsigned long long>(hidden),
      static_cast<unsigned long long>(load<uint32_t>(p + 44)), static_cast<unsigned long long>(payload_at),
      static_cast<unsigned long long>(payload_bytes), static_cast<unsigned long long>(checksum), rows_list, specs_list,
      static_cast<unsigned long long>(control_at), static_cast<unsigned long long>(control_len));
}

// ---- encode ------------------------------------------------------------------

// An int attribute in [0, top] (bool and int subclasses such as IntEnum members count, as in
// codec._check_range); false, with no error set, otherwise.
bool get_uint(PyObject* obj, PyObject* attr, uint64_t top, uint64_t* out) {
  PyObject* v = PyObject_GetAttr(obj, attr);
  if (v == nullptr) {
    PyErr_Clear();
    return false;
  }
  bool ok = PyLong_Check(v);
  if (ok) {
    const unsigned long long x = PyLong_AsUnsignedLongLong(v);
    ok = !(x == static_cast<unsigned long long>(-1) && PyErr_Occurred()) && x <= top;
    if (!ok) PyErr_Clear();
    *out = x;
  }
  Py_DECREF(v);
  return ok;
}

bool get_u64_item(PyObject* tuple, Py_ssize_t i, uint64_t top, uint64_t* out) {
  PyObject* v = PyTuple_GET_ITEM(tuple, i);
  if (!PyLong_Check(v)) return false;
  const unsigned long long x = PyLong_AsUnsignedLongLong(v);
  if (x == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  *out = x;
  return x <= top;
}

struct TensorIn {
  const char* name;
  Py_ssize_t name_len;
  uint64_t dtype, ndim, nbytes, addr, offset;
  uint64_t dims[kMaxNdim];
};

struct Packed {
  uint64_t fields[8];  // step_kind, layout, request_id, step_id, microbatch, stage_from, stage_to, token_index
  std::vector<RowEntry> rows;
  std::vector<TensorIn> tensors;
  const char* control = nullptr;
  Py_ssize_t control_len = 0;
  uint64_t flags = 0, batch = 0, seq = 0, hidden = 0, head_len = 0, payload_bytes = 0;
  std::vector<PyObject*> keep;  // tensor names (their UTF-8) held while packing
  ~Packed() {
    for (PyObject* o : keep) Py_DECREF(o);
  }
};

// A new reference to obj.name (or obj.name() with `call`); nullptr with no error set on failure.
PyObject* attr(PyObject* obj, PyObject* name, bool call = false) {
  PyObject* v = call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
  if (v == nullptr) PyErr_Clear();
  return v;
}

// One tensor of frame.tensors: a contiguous CPU torch.Tensor (exactly) of a wire dtype, with a
// name of 1-24 UTF-8 bytes without NUL; false (no error set) for anything else.
bool gather_tensor(PyObject* key, PyObject* t, TensorIn* ti) {
  if (!PyUnicode_CheckExact(key) || Py_TYPE(t) != reinterpret_cast<PyTypeObject*>(g_tensor_type)) return false;
  ti->name = PyUnicode_AsUTF8AndSize(key, &ti->name_len);  // cached in the str
  if (ti->name == nullptr) {
    PyErr_Clear();
    return false;
  }
  if (ti->name_len < 1 || static_cast<uint64_t>(ti->name_len) > kMaxName || std::memchr(ti->name, 0, ti->name_len))
    return false;
  PyObject* v = attr(t, g_tattr[0]);  // is_cpu
  bool ok = v == Py_True;
  Py_XDECREF(v);
  if (!ok) return false;
  v = attr(t, g_tattr[1], true);  // is_contiguous()
  ok = v == Py_True;
  Py_XDECREF(v);
  if (!ok) return false;
  v = attr(t, g_tattr[2]);  // dtype
  if (v == nullptr) return false;
  PyObject* code = PyDict_GetItemWithError(g_dtype_codes, v);  // borrowed
  Py_DECREF(v);
  if (code == nullptr) {
    PyErr_Clear();
    return false;
  }
  ti->dtype = PyLong_AsUnsignedLong(code);
  if (ti->dtype < 1 || ti->dtype > kNumDTypes) {
    PyErr_Clear();
    return false;
  }
  v = attr(t, g_tattr[3]);  // shape: a torch.Size, a tuple
  if (v == nullptr) return false;
  ok = PyTuple_Check(v) && static_cast<uint64_t>(PyTuple_GET_SIZE(v)) <= kMaxNdim;
  uint64_t want = 1;  // nbytes must be numel * itemsize
  if (ok) {
    ti->ndim = static_cast<uint64_t>(PyTuple_GET_SIZE(v));
    for (uint64_t d = 0; ok && d < ti->ndim; ++d)
      ok = get_u64_item(v, d, kU32, &ti->dims[d]) && mul(want, ti->dims[d], &want);
    for (uint64_t d = ti->ndim; d < kMaxNdim; ++d) ti->dims[d] = 0;
  }
  Py_DECREF(v);
  if (!ok || !mul(want, kItemsize[ti->dtype], &want)) return false;
  ti->nbytes = want;
  v = attr(t, g_tattr[4], true);  // data_ptr()
  if (v == nullptr) return false;
  ti->addr = PyLong_AsUnsignedLongLong(v);
  Py_DECREF(v);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return ti->nbytes == 0 || ti->addr != 0;
}

// Gather and check what frame_head packs: the frame's fields, rows and tensors; false (with no
// error set) to decline.
bool gather(PyObject* frame, PyObject* control, uint64_t flags, Packed* pk) {
  static const uint64_t tops[8] = {kNumStepKinds, kLayoutContiguous, kU64, kU64, kU16, kU16, kU16, kU32};
  for (int i = 0; i < 8; ++i)
    if (!get_uint(frame, g_attr[i], tops[i], &pk->fields[i])) return false;
  if (pk->fields[0] < 1 || pk->fields[1] != kLayoutContiguous) return false;
  pk->flags = flags & kFlagChecksum;
  pk->control = PyBytes_AS_STRING(control);
  pk->control_len = PyBytes_GET_SIZE(control);
  if (static_cast<uint64_t>(pk->control_len) > kMaxControl) return false;

  PyObject* rows = attr(frame, g_attr[8]);
  if (rows == nullptr) return false;
  bool ok = PyList_Check(rows) && static_cast<uint64_t>(PyList_GET_SIZE(rows)) <= kMaxRows;
  if (ok) {
    const Py_ssize_t count = PyList_GET_SIZE(rows);
    pk->rows.resize(count);
    for (Py_ssize_t i = 0; ok && i < count; ++i) {
      PyObject* r = PyList_GET_ITEM(rows, i);
      Py_INCREF(r);
      uint64_t v[4];
      for (int k = 0; ok && k < 4; ++k) ok = get_uint(r, g_row_attr[k], k == 0 ? kU64 : kU32, &v[k]);
      Py_DECREF(r);
      if (ok) pk->rows[i] = {v[0], static_cast<uint32_t>(v[1]), static_cast<uint32_t>(v[2]), static_cast<uint32_t>(v[3])};
      ok = ok && PyList_Check(rows) && PyList_GET_SIZE(rows) == count;  // unchanged meanwhile
    }
  }
  Py_DECREF(rows);
  if (!ok) return false;

  PyObject* tensors = attr(frame, g_attr[9]);
  if (tensors == nullptr) return false;
  ok = PyDict_CheckExact(tensors) && static_cast<uint64_t>(PyDict_GET_SIZE(tensors)) <= kMaxTensors;
  if (ok) {
    const Py_ssize_t count = PyDict_GET_SIZE(tensors);
    pk->tensors.resize(count);
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *t;
    while (ok && PyDict_Next(tensors, &pos, &key, &t)) {
      Py_INCREF(key);
      Py_INCREF(t);
      ok = i < count && gather_tensor(key, t, &pk->tensors[i]);
      if (ok) pk->keep.push_back(key);  // the name's UTF-8 lives in the str
      else Py_DECREF(key);
      Py_DECREF(t);
      ++i;
    }
    ok = ok && i == count;
  }
  Py_DECREF(tensors);
  if (!ok) return false;

  uint64_t offset = 0;
  for (TensorIn& t : pk->tensors) {
    offset = align64(offset);
    t.offset = offset;
    if (t.nbytes > kU64 - offset - kAlign) return false;
    offset += t.nbytes;
  }
  pk->payload_bytes = offset;
  if (!pk->tensors.empty()) {
    uint32_t dims32[kMaxNdim];
    for (uint64_t d = 0; d < pk->tensors[0].ndim; ++d) dims32[d] = static_cast<uint32_t>(pk->tensors[0].dims[d]);
    uint64_t f[3];
    if (!shape_fields(dims32, pk->tensors[0].ndim, f) || f[0] > kU32) return false;
    pk->batch = f[0];
    pk->seq = f[1];
    pk->hidden = f[2];
  }
  pk->head_len = align64(kHeaderBytes + kRowBytes * pk->rows.size() + kTensorBytes * pk->tensors.size() +
                         pk->control_len);
  return true;
}

// Header, tables, control and zero padding (checksum field 0) into out[0, head_len).
void write_head(const Packed& pk, uint8_t* out) {
  std::memset(out, 0, pk.head_len);
  std::memcpy(out, kMagic, 4);
  store<uint16_t>(out + 4, kVersion);
  out[6] = static_cast<uint8_t>(pk.fields[0]);
  out[7] = pk.tensors.empty() ? 0 : static_cast<uint8_t>(pk.tensors[0].dtype);
  out[8] = static_cast<uint8_t>(pk.fields[1]);
  out[9] = static_cast<uint8_t>(pk.flags);
  store<uint16_t>(out + 10, pk.fields[5]);
  store<uint16_t>(out + 12, pk.fields[6]);
  store<uint16_t>(out + 14, pk.fields[4]);
  store<uint64_t>(out + 16, pk.fields[2]);
  store<uint64_t>(out + 24, pk.fields[3]);
  store<uint32_t>(out + 32, pk.batch);
  store<uint32_t>(out + 36, pk.seq);
  store<uint32_t>(out + 40, pk.hidden);
  store<uint32_t>(out + 44, pk.fields[7]);
  store<uint32_t>(out + 48, pk.rows.size());
  store<uint16_t>(out + 52, pk.tensors.size());
  store<uint32_t>(out + 56, pk.control_len);
  store<uint64_t>(out + 64, pk.payload_bytes);
  uint8_t* q = out + kHeaderBytes;
  for (const RowEntry& r : pk.rows) {
    store<uint64_t>(q, r.request_id);
    store<uint32_t>(q + 8, r.first);
    store<uint32_t>(q + 12, r.num_tokens);
    store<uint32_t>(q + 16, r.flags);
    q += kRowBytes;
  }
  for (const TensorIn& t : pk.tensors) {
    std::memcpy(q, t.name, t.name_len);
    q[24] = static_cast<uint8_t>(t.dtype);
    q[25] = static_cast<uint8_t>(t.ndim);
    store<uint64_t>(q + 32, t.offset);
    store<uint64_t>(q + 40, t.nbytes);
    for (uint64_t d = 0; d < t.ndim; ++d) store<uint32_t>(q + 48 + 4 * d, t.dims[d]);
    q += kTensorBytes;
  }
  if (pk.control_len > 0) std::memcpy(q, pk.control, pk.control_len);
}

bool set(PyObject* frame, PyObject* name, PyObject* value) {  // steals value
  if (value == nullptr) return false;
  const int rc = PyObject_SetAttr(frame, name, value);
  Py_DECREF(value);
  return rc == 0;
}

// frame_head(frame, control, flags) -> None | (head bytearray, sources)
// The header, tables, control (UTF-8 JSON bytes, b"" for none) and padding of the frame, its
// checksum field 0 and frame_flags = flags; sources: per tensor (address, nbytes) for frame_fill.
// Sets the frame's derived fields (batch, seq, hidden_size, dtype, payload_bytes, magic, version).
// None: declined (the reference codec decides), the frame untouched.
PyObject* py_frame_head(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyBytes_Check(args[1]) || !PyLong_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "stagewise.frame_head: expected (frame, control bytes, flags int)");
    return nullptr;
  }
  if (g_row_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "stagewise.frame_head: frame_setup was not called");
    return nullptr;
  }
  const unsigned long flags = PyLong_AsUnsignedLong(args[2]);
  if (PyErr_Occurred()) return nullptr;
  PyObject* frame = args[0];
  Packed pk;
  if (!gather(frame, args[1], flags, &pk)) return decline();
  PyObject* head = PyByteArray_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(pk.head_len));
  if (head == nullptr) return nullptr;
  write_head(pk, reinterpret_cast<uint8_t*>(PyByteArray_AS_STRING(head)));
  PyObject* sources = PyList_New(static_cast<Py_ssize_t>(pk.tensors.size()));
  if (sources == nullptr) {
    Py_DECREF(head);
    return nullptr;
  }
  for (size_t i = 0; i < pk.tensors.size(); ++i) {
    PyObject* src = Py_BuildValue("(KK)", static_cast<unsigned long long>(pk.tensors[i].addr),
                                  static_cast<unsigned long long>(pk.tensors[i].nbytes));
    if (src == nullptr) {
      Py_DECREF(head);
      Py_DECREF(sources);
      return nullptr;
    }
    PyList_SET_ITEM(sources, i, src);
  }
  PyObject* dtype = pk.tensors.empty() ? Py_None : PyTuple_GET_ITEM(g_wire_dtypes, pk.tensors[0].dtype);
  Py_INCREF(dtype);
  Py_INCREF(g_magic);
  if (!set(frame, g_dattr[0], PyLong_FromUnsignedLongLong(pk.batch)) ||
      !set(frame, g_dattr[1], PyLong_FromUnsignedLongLong(pk.seq)) ||
      !set(frame, g_dattr[2], PyLong_FromUnsignedLongLong(pk.hidden)) || !set(frame, g_dattr[3], dtype) ||
      !set(frame, g_dattr[4], PyLong_FromUnsignedLongLong(pk.payload_bytes)) || !set(frame, g_dattr[5], g_magic) ||
      !set(frame, g_dattr[6], PyLong_FromUnsignedLongLong(kVersion))) {
    Py_DECREF(head);
    Py_DECREF(sources);
    return nullptr;
  }
  return Py_BuildValue("(NN)", head, sources);
}

// frame_fill(out, head, sources, checksum) -> checksum: the frame whose head and sources frame_head
// returned (checksum field 0), with the tensor bytes at the sources' addresses (contiguous memory that
// the caller keeps alive). With `checksum`, its XXH3-64 is computed from the head and the tensors'
// own memory (not from `out`, whose cache lines may still be on the reader's core) and stored in
// the head when it is writable. With `out` (a writable buffer, or None), the frame is written there:
// the head, then each tensor at its 64-aligned payload offset, zeros in between. Returns the
// checksum, 0 without one.
PyObject* py_frame_fill(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyList_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "stagewise.frame_fill: expected (out or None, head, sources list, checksum)");
    return nullptr;
  }
  PyObject* specs = args[2];
  const Py_ssize_t nt = PyList_GET_SIZE(specs);
  std::vector<std::pair<uint64_t, uint64_t>> src(nt);  // (address, nbytes)
  uint64_t payload = 0;
  for (Py_ssize_t i = 0; i < nt; ++i) {
    PyObject* s = PyList_GET_ITEM(specs, i);
    if (!PyTuple_Check(s) || PyTuple_GET_SIZE(s) != 2 || !get_u64_item(s, 0, kU64, &src[i].first) ||
        !get_u64_item(s, 1, kU64, &src[i].second) || src[i].second > kU64 - align64(payload) ||
        (src[i].second > 0 && src[i].first == 0)) {
      PyErr_Format(PyExc_ValueError, "stagewise.frame_fill: sources[%zd] is not (address, nbytes)", i);
      return nullptr;
    }
    payload = align64(payload) + src[i].second;
  }
  const int want_checksum = PyObject_IsTrue(args[3]);
  if (want_checksum < 0) return nullptr;
  Buffer head, out;
  if (PyObject_GetBuffer(args[1], &head.view, PyBUF_SIMPLE) < 0) return nullptr;
  head.held = true;
  const auto head_len = static_cast<uint64_t>(head.view.len);
  auto* h = static_cast<uint8_t*>(head.view.buf);
  if (head_len < kHeaderBytes || head_len % kAlign != 0) {
    PyErr_SetString(PyExc_ValueError, "stagewise.frame_fill: argument 'head' is not a frame head");
    return nullptr;
  }
  uint8_t* o = nullptr;
  if (args[0] != Py_None) {
    if (PyObject_GetBuffer(args[0], &out.view, PyBUF_WRITABLE) < 0) return nullptr;
    out.held = true;
    if (head_len + payload > static_cast<uint64_t>(out.view.len)) {
      PyErr_Format(PyExc_ValueError, "stagewise.frame_fill: the frame has %llu bytes, the buffer %zd",
                   static_cast<unsigned long long>(head_len + payload), out.view.len);
      return nullptr;
    }
    o = static_cast<uint8_t*>(out.view.buf);
  }
  uint64_t digest = 0;
  if (want_checksum) {
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    XXH3_64bits_update(&state, h, kChecksumAt);
    XXH3_64bits_update(&state, kZeros, 8);
    XXH3_64bits_update(&state, h + kHeaderBytes, head_len - kHeaderBytes);
    uint64_t pos = 0;
    for (const auto& [addr, nbytes] : src) {
      const uint64_t at = align64(pos);
      if (at > pos) XXH3_64bits_update(&state, kZeros, at - pos);
      if (nbytes > 0) XXH3_64bits_update(&state, reinterpret_cast<const void*>(addr), nbytes);
      pos = at + nbytes;
    }
    digest = XXH3_64bits_digest(&state);
    if (!head.view.readonly) store<uint64_t>(h + kChecksumAt, digest);
  }
  if (o != nullptr) {
    std::memcpy(o, h, head_len);
    store<uint64_t>(o + kChecksumAt, digest);
    uint64_t pos = head_len;
    for (const auto& [addr, nbytes] : src) {
      const uint64_t at = head_len + align64(pos - head_len);
      if (at > pos) std::memset(o + pos, 0, at - pos);
      if (nbytes > 0) std::memcpy(o + at, reinterpret_cast<const void*>(addr), nbytes);
      pos = at + nbytes;
    }
  }
  return PyLong_FromUnsignedLongLong(digest);
}

bool intern_all(PyObject** out, const char* const* names, int n) {
  for (int i = 0; i < n; ++i)
    if (out[i] == nullptr && (out[i] = PyUnicode_InternFromString(names[i])) == nullptr) return false;
  return true;
}

// frame_setup(Row, row_flags, Tensor, dtype_codes, wire_dtypes, magic): the Row class, a tuple of
// RowFlags(v) for v in 0..31, torch.Tensor, {torch dtype: wire code}, (None, WireDType(1), ...,
// WireDType(10)) and b"SWFR". Returns the wire constants this file assumes, for codec.py to check
// against its own.
PyObject* py_frame_setup(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6 || !PyType_Check(args[0]) || !PyTuple_Check(args[1]) ||
      PyTuple_GET_SIZE(args[1]) != kRowFlagBits + 1 || !PyType_Check(args[2]) || !PyDict_Check(args[3]) ||
      !PyTuple_Check(args[4]) || PyTuple_GET_SIZE(args[4]) != kNumDTypes + 1 || !PyBytes_Check(args[5])) {
    PyErr_SetString(PyExc_TypeError,
                    "stagewise.frame_setup: expected (Row, 32 RowFlags, Tensor, dtype codes, 11 dtypes, magic)");
    return nullptr;
  }
  if (!intern_all(g_attr, kAttrNames, 10) || !intern_all(g_row_attr, kRowAttrNames, 4) ||
      !intern_all(g_dattr, kDerivedNames, 7) || !intern_all(g_tattr, kTensorAttrNames, 5))
    return nullptr;
  PyObject** slots[6] = {&g_row_type, &g_row_flags, &g_tensor_type, &g_dtype_codes, &g_wire_dtypes, &g_magic};
  for (int i = 0; i < 6; ++i) {
    Py_INCREF(args[i]);
    Py_XSETREF(*slots[i], args[i]);
  }
  return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsKsKsN}", "header", kHeaderBytes, "row", kRowBytes, "tensor",
                       kTensorBytes, "align", kAlign, "version", kVersion, "max_rows", kMaxRows, "max_tensors",
                       kMaxTensors, "max_control", kMaxControl, "max_ndim", kMaxNdim, "max_name", kMaxName,
                       "step_kinds", kNumStepKinds, "row_flag_bits", static_cast<unsigned long long>(kRowFlagBits),
                       "magic", PyBytes_FromStringAndSize(kMagic, 4));
}

#define SW_FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f))

PyMethodDef methods[] = {
    {"frame_setup", SW_FASTCALL(py_frame_setup), METH_FASTCALL,
     "frame_setup(Row, row_flags, Tensor, dtype_codes, wire_dtypes, magic) -> wire constants"},
    {"frame_parse", SW_FASTCALL(py_frame_parse), METH_FASTCALL,
     "frame_parse(buffer, max_payload_bytes, verify_checksum) -> None (declined: ask the Python codec) or the "
     "parsed fields"},
    {"frame_head", SW_FASTCALL(py_frame_head), METH_FASTCALL,
     "frame_head(frame, control, flags) -> None or (head, sources)"},
    {"frame_fill", SW_FASTCALL(py_frame_fill), METH_FASTCALL,
     "frame_fill(out or None, head, specs, checksum) -> checksum (0 without)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* frame_py_methods() { return methods; }

}  // namespace stagewise::glue
