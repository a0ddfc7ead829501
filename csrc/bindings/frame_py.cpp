// Python glue of the frame codec's fast path (python/stagewise/transport/codec.py): Python
// objects <-> the plain structs of include/stagewise/frame.h, whose functions
// (csrc/cpu/frame.cpp) pack, parse, check and checksum. A Python codec spends 15-20 us a
// frame on what is here about 1 us.
//
// Both directions *accept or decline*; they never raise about a frame: whatever they decline
// (any check that fails, any value of an unexpected type) goes to the Python reference
// (codec_reference.py), which raises the precise error. So a frame the fast path accepts is
// exactly one the reference accepts, with the same result; tests/transport/test_codec_fast.py
// compares the two on fuzzed frames. What stays in Python: the control JSON, making tensors
// (torch.frombuffer) and the Frame object.
#include "bindings/frame_py.h"

#include <cstring>
#include <vector>

#include "stagewise/crc32c.h"
#include "stagewise/frame.h"

namespace stagewise::glue {
namespace {

namespace w = stagewise::wire;

// The Python objects the glue needs, in one place: the classes and enum members handed over
// once by frame_setup, and interned attribute names.
struct State {
  PyObject* row_type = nullptr;     // transport.frame.Row
  PyObject* row_flags = nullptr;    // tuple: RowFlags(v) for v in 0..kRowFlagBits
  PyObject* tensor_type = nullptr;  // torch.Tensor (exactly; subclasses are declined)
  PyObject* dtype_codes = nullptr;  // dict: torch dtype -> wire code
  PyObject* wire_dtypes = nullptr;  // tuple: None, WireDType(1), ..., WireDType(kNumDTypes)
  PyObject* magic = nullptr;        // b"SWFR"
  PyObject* version = nullptr;      // kVersion as an int
  struct {  // Frame
    PyObject *step_kind, *layout, *request_id, *step_id, *microbatch, *stage_from, *stage_to, *token_index, *rows,
        *tensors, *batch, *seq, *hidden_size, *dtype, *payload_bytes, *magic, *version;
  } frame{};
  struct {  // Row
    PyObject *request_id, *first_position, *num_tokens, *flags;
  } row{};
  struct {  // torch.Tensor
    PyObject *is_cpu, *is_contiguous, *dtype, *shape, *data_ptr;
  } tensor{};
  bool ready = false;
};

State& state() {
  static State s;
  return s;
}

bool intern(PyObject** slot, const char* name) {
  return *slot != nullptr || (*slot = PyUnicode_InternFromString(name)) != nullptr;
}

bool intern_names(State& s) {
  auto& f = s.frame;
  auto& r = s.row;
  auto& t = s.tensor;
  return intern(&f.step_kind, "step_kind") && intern(&f.layout, "layout") && intern(&f.request_id, "request_id") &&
         intern(&f.step_id, "step_id") && intern(&f.microbatch, "microbatch") && intern(&f.stage_from, "stage_from") &&
         intern(&f.stage_to, "stage_to") && intern(&f.token_index, "token_index") && intern(&f.rows, "rows") &&
         intern(&f.tensors, "tensors") && intern(&f.batch, "batch") && intern(&f.seq, "seq") &&
         intern(&f.hidden_size, "hidden_size") && intern(&f.dtype, "dtype") &&
         intern(&f.payload_bytes, "payload_bytes") && intern(&f.magic, "magic") && intern(&f.version, "version") &&
         intern(&r.request_id, "request_id") && intern(&r.first_position, "first_position") &&
         intern(&r.num_tokens, "num_tokens") && intern(&r.flags, "flags") && intern(&t.is_cpu, "is_cpu") &&
         intern(&t.is_contiguous, "is_contiguous") && intern(&t.dtype, "dtype") && intern(&t.shape, "shape") &&
         intern(&t.data_ptr, "data_ptr");
}

State* ready_state(const char* op) {
  State& s = state();
  if (!s.ready) {
    PyErr_Format(PyExc_RuntimeError, "stagewise.%s: frame_setup was not called", op);
    return nullptr;
  }
  return &s;
}

PyObject* decline() { Py_RETURN_NONE; }

struct Buffer {
  Py_buffer view{};
  bool held = false;
  bool get(PyObject* obj, int flags) {
    held = PyObject_GetBuffer(obj, &view, flags) == 0;
    return held;
  }
  ~Buffer() {
    if (held) PyBuffer_Release(&view);
  }
};

// A new reference to obj.name (or obj.name() with `call`); nullptr with no error set on failure.
PyObject* attr(PyObject* obj, PyObject* name, bool call = false) {
  PyObject* v = call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
  if (v == nullptr) PyErr_Clear();
  return v;
}

// An int in [0, top] (bool and int subclasses such as IntEnum members count, as in the
// reference's range check); false, with no error set, otherwise.
bool as_uint(PyObject* v, uint64_t top, uint64_t* out) {
  if (v == nullptr || !PyLong_Check(v)) return false;
  const unsigned long long x = PyLong_AsUnsignedLongLong(v);
  if (x == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  *out = x;
  return x <= top;
}

template <typename T>
bool get_uint(PyObject* obj, PyObject* name, uint64_t top, T* out) {
  PyObject* v = attr(obj, name);
  uint64_t x = 0;
  const bool ok = as_uint(v, top, &x);
  Py_XDECREF(v);
  *out = static_cast<T>(x);
  return ok;
}

// ---- encode --------------------------------------------------------------------------------

// What frame_head gathers from a Frame: the structs, and the Python objects they point into.
// Tensors in fixed arrays (at most kMaxTensors): no allocation for a frame without rows.
struct Gathered {
  w::Header header;
  std::vector<w::Row> rows;
  size_t num_tensors = 0;
  w::Tensor tensors[w::kMaxTensors];
  w::Span spans[w::kMaxTensors];
  PyObject* names[w::kMaxTensors];  // held: their UTF-8 is what tensors[i].name points to
  size_t num_names = 0;
  ~Gathered() {
    for (size_t i = 0; i < num_names; ++i) Py_DECREF(names[i]);
  }
};

// One entry of frame.tensors: a torch.Tensor (exactly) of a wire dtype, named by 1-24 UTF-8
// bytes without NUL; contiguous and on the CPU unless the payload is detached (then only its
// dtype and shape are read). False (no error set) for anything else.
bool gather_tensor(const State& s, PyObject* key, PyObject* t, bool detached, w::Tensor* out, w::Span* span) {
  if (!PyUnicode_CheckExact(key) || Py_TYPE(t) != reinterpret_cast<PyTypeObject*>(s.tensor_type)) return false;
  Py_ssize_t len = 0;
  const char* name = PyUnicode_AsUTF8AndSize(key, &len);  // cached in the str
  if (name == nullptr) {
    PyErr_Clear();
    return false;
  }
  if (len < 1 || static_cast<uint64_t>(len) > w::kMaxNameBytes || std::memchr(name, 0, len) != nullptr) return false;
  out->name = reinterpret_cast<const uint8_t*>(name);
  out->name_bytes = static_cast<uint32_t>(len);
  if (!detached) {
    PyObject* v = attr(t, s.tensor.is_cpu);
    bool ok = v == Py_True;
    Py_XDECREF(v);
    v = ok ? attr(t, s.tensor.is_contiguous, true) : nullptr;
    ok = v == Py_True;
    Py_XDECREF(v);
    if (!ok) return false;
  }
  PyObject* v = attr(t, s.tensor.dtype);
  if (v == nullptr) return false;
  PyObject* code = PyDict_GetItemWithError(s.dtype_codes, v);  // borrowed
  Py_DECREF(v);
  uint64_t dtype = 0;
  if (!as_uint(code, w::kNumDTypes, &dtype) || dtype < 1) {
    PyErr_Clear();
    return false;
  }
  out->dtype = static_cast<uint32_t>(dtype);
  v = attr(t, s.tensor.shape);  // a torch.Size, a tuple
  bool ok = v != nullptr && PyTuple_Check(v) && static_cast<uint64_t>(PyTuple_GET_SIZE(v)) <= w::kMaxNdim;
  if (ok) {
    out->ndim = static_cast<uint32_t>(PyTuple_GET_SIZE(v));
    for (uint32_t d = 0; ok && d < out->ndim; ++d) {
      uint64_t dim = 0;
      ok = as_uint(PyTuple_GET_ITEM(v, d), 0xffffffffu, &dim);
      out->dims[d] = static_cast<uint32_t>(dim);
    }
  }
  Py_XDECREF(v);
  if (!ok) return false;
  span->data = nullptr;
  if (!detached) {
    v = attr(t, s.tensor.data_ptr, true);
    uint64_t addr = 0;
    ok = as_uint(v, ~uint64_t{0}, &addr);
    Py_XDECREF(v);
    if (!ok) return false;
    span->data = reinterpret_cast<const void*>(addr);
  }
  return true;
}

bool gather(const State& s, PyObject* frame, uint64_t flags, Gathered* g) {
  w::Header& h = g->header;
  if (!get_uint(frame, s.frame.step_kind, w::kNumStepKinds, &h.step_kind) || h.step_kind < 1 ||
      !get_uint(frame, s.frame.layout, w::kLayoutContiguous, &h.layout) || h.layout != w::kLayoutContiguous ||
      !get_uint(frame, s.frame.request_id, ~uint64_t{0}, &h.request_id) ||
      !get_uint(frame, s.frame.step_id, ~uint64_t{0}, &h.step_id) ||
      !get_uint(frame, s.frame.microbatch, 0xffff, &h.microbatch) ||
      !get_uint(frame, s.frame.stage_from, 0xffff, &h.stage_from) ||
      !get_uint(frame, s.frame.stage_to, 0xffff, &h.stage_to) ||
      !get_uint(frame, s.frame.token_index, 0xffffffffu, &h.token_index))
    return false;
  h.flags = static_cast<uint32_t>(flags);
  const bool detached = (flags & w::kFlagDetachedPayload) != 0;

  PyObject* rows = attr(frame, s.frame.rows);
  bool ok = rows != nullptr && PyList_Check(rows) && static_cast<uint64_t>(PyList_GET_SIZE(rows)) <= w::kMaxRows;
  if (ok) {
    const Py_ssize_t count = PyList_GET_SIZE(rows);
    g->rows.resize(count);
    for (Py_ssize_t i = 0; ok && i < count; ++i) {
      PyObject* r = PyList_GET_ITEM(rows, i);
      Py_INCREF(r);  // the attribute reads below may run Python code
      w::Row& row = g->rows[i];
      ok = get_uint(r, s.row.request_id, ~uint64_t{0}, &row.request_id) &&
           get_uint(r, s.row.first_position, 0xffffffffu, &row.first_position) &&
           get_uint(r, s.row.num_tokens, 0xffffffffu, &row.num_tokens) &&
           get_uint(r, s.row.flags, 0xffffffffu, &row.flags);
      Py_DECREF(r);
      ok = ok && PyList_Check(rows) && PyList_GET_SIZE(rows) == count;  // unchanged meanwhile
    }
  }
  Py_XDECREF(rows);
  if (!ok) return false;

  PyObject* tensors = attr(frame, s.frame.tensors);
  ok = tensors != nullptr && PyDict_CheckExact(tensors) &&
       static_cast<uint64_t>(PyDict_GET_SIZE(tensors)) <= w::kMaxTensors;
  if (ok) {
    const Py_ssize_t count = PyDict_GET_SIZE(tensors);
    g->num_tensors = static_cast<size_t>(count);
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *t;
    while (ok && PyDict_Next(tensors, &pos, &key, &t)) {
      Py_INCREF(key);
      Py_INCREF(t);
      ok = i < count && gather_tensor(s, key, t, detached, &g->tensors[i], &g->spans[i]);
      if (ok) g->names[g->num_names++] = key;
      else Py_DECREF(key);
      Py_DECREF(t);
      ++i;
    }
    ok = ok && i == count;
  }
  Py_XDECREF(tensors);
  return ok;
}

bool set(PyObject* obj, PyObject* name, PyObject* value) {  // steals value
  if (value == nullptr) return false;
  const int rc = PyObject_SetAttr(obj, name, value);
  Py_DECREF(value);
  return rc == 0;
}

PyObject* new_ref(PyObject* o) {
  Py_INCREF(o);
  return o;
}

// frame_head(frame, control, flags) -> None | (head bytearray, sources)
// The header, tables, control (UTF-8 JSON bytes, b"" for none) and padding of the frame, its
// checksum field 0 and frame_flags = flags; sources: per tensor (address, nbytes) for
// frame_fill (address 0 with a detached payload). Sets the frame's derived fields (batch,
// seq, hidden_size, dtype, payload_bytes, magic, version). None: declined, the frame untouched.
PyObject* py_frame_head(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyBytes_Check(args[1]) || !PyLong_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "stagewise.frame_head: expected (frame, control bytes, flags int)");
    return nullptr;
  }
  const State* s = ready_state("frame_head");
  if (s == nullptr) return nullptr;
  const unsigned long flags = PyLong_AsUnsignedLong(args[2]);
  if (PyErr_Occurred()) return nullptr;
  if ((flags & ~static_cast<unsigned long>(w::kFrameFlagBits)) != 0) {
    PyErr_Format(PyExc_ValueError, "stagewise.frame_head: unknown frame_flags bits in %#lx", flags);
    return nullptr;
  }
  Gathered g;
  uint64_t head_bytes = 0;
  const auto control_bytes = static_cast<uint64_t>(PyBytes_GET_SIZE(args[1]));
  if (!gather(*s, args[0], flags, &g) ||
      !w::plan_frame(&g.header, g.rows.data(), g.rows.size(), g.tensors, g.num_tensors, control_bytes, &head_bytes))
    return decline();
  for (size_t i = 0; i < g.num_tensors; ++i)
    if (g.tensors[i].nbytes > 0 && g.spans[i].data == nullptr && !(flags & w::kFlagDetachedPayload)) return decline();
  PyObject* head = PyByteArray_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(head_bytes));
  if (head == nullptr) return nullptr;
  w::write_head(g.header, g.rows.data(), g.tensors,
                reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(args[1])),
                reinterpret_cast<uint8_t*>(PyByteArray_AS_STRING(head)), head_bytes);
  PyObject* sources = PyList_New(static_cast<Py_ssize_t>(g.num_tensors));
  for (size_t i = 0; sources != nullptr && i < g.num_tensors; ++i) {
    PyObject* src = Py_BuildValue("(KK)", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(g.spans[i].data)),
                                  static_cast<unsigned long long>(g.tensors[i].nbytes));
    if (src == nullptr) Py_CLEAR(sources);
    else PyList_SET_ITEM(sources, i, src);
  }
  PyObject* frame = args[0];
  const w::Header& h = g.header;
  if (sources == nullptr || !set(frame, s->frame.batch, PyLong_FromUnsignedLong(h.batch)) ||
      !set(frame, s->frame.seq, PyLong_FromUnsignedLong(h.seq)) ||
      !set(frame, s->frame.hidden_size, PyLong_FromUnsignedLong(h.hidden_size)) ||
      !set(frame, s->frame.dtype, new_ref(PyTuple_GET_ITEM(s->wire_dtypes, h.dtype))) ||
      !set(frame, s->frame.payload_bytes, PyLong_FromUnsignedLongLong(h.payload_bytes)) ||
      !set(frame, s->frame.magic, new_ref(s->magic)) || !set(frame, s->frame.version, new_ref(s->version))) {
    Py_DECREF(head);
    Py_XDECREF(sources);
    return nullptr;
  }
  return Py_BuildValue("(NN)", head, sources);
}

// frame_fill(out, head, sources, checksum) -> checksum: the frame whose head and sources
// frame_head returned (checksum field 0), the tensor bytes at the sources' addresses (memory
// the caller keeps alive). With `checksum`, the CRC32C is computed from the head and the
// tensors' own memory (not from `out`, whose cache lines may still be on the reader's core)
// and stored in the head when it is writable. With `out` (a writable buffer, or None), the
// frame is written there. Returns the checksum, 0 without one.
PyObject* py_frame_fill(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyList_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "stagewise.frame_fill: expected (out or None, head, sources list, checksum)");
    return nullptr;
  }
  PyObject* list = args[2];
  const Py_ssize_t count = PyList_GET_SIZE(list);
  if (static_cast<uint64_t>(count) > w::kMaxTensors) {
    PyErr_Format(PyExc_ValueError, "stagewise.frame_fill: %zd sources, a frame has at most %u tensors", count,
                 w::kMaxTensors);
    return nullptr;
  }
  w::Span spans[w::kMaxTensors];
  uint64_t payload = 0;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* src = PyList_GET_ITEM(list, i);
    uint64_t addr = 0, nbytes = 0;
    if (!PyTuple_Check(src) || PyTuple_GET_SIZE(src) != 2 || !as_uint(PyTuple_GET_ITEM(src, 0), ~uint64_t{0}, &addr) ||
        !as_uint(PyTuple_GET_ITEM(src, 1), ~uint64_t{0}, &nbytes) || nbytes > ~uint64_t{0} - w::align_up(payload) ||
        (nbytes > 0 && addr == 0)) {
      PyErr_Format(PyExc_ValueError, "stagewise.frame_fill: sources[%zd] is not (address, nbytes)", i);
      return nullptr;
    }
    spans[i] = {reinterpret_cast<const void*>(addr), nbytes};
    payload = w::align_up(payload) + nbytes;
  }
  const int want_checksum = PyObject_IsTrue(args[3]);
  if (want_checksum < 0) return nullptr;
  Buffer head, out;
  if (!head.get(args[1], PyBUF_SIMPLE)) return nullptr;
  const auto head_bytes = static_cast<uint64_t>(head.view.len);
  auto* h = static_cast<uint8_t*>(head.view.buf);
  if (head_bytes < w::kHeaderBytes || head_bytes % w::kAlign != 0) {
    PyErr_SetString(PyExc_ValueError, "stagewise.frame_fill: argument 'head' is not a frame head");
    return nullptr;
  }
  uint8_t* o = nullptr;
  if (args[0] != Py_None) {
    if (!out.get(args[0], PyBUF_WRITABLE)) return nullptr;
    if (head_bytes + payload > static_cast<uint64_t>(out.view.len)) {
      PyErr_Format(PyExc_ValueError, "stagewise.frame_fill: the frame has %llu bytes, the buffer %zd",
                   static_cast<unsigned long long>(head_bytes + payload), out.view.len);
      return nullptr;
    }
    o = static_cast<uint8_t*>(out.view.buf);
  }
  const uint64_t checksum_at = w::at(w::kHChecksum);
  uint64_t crc = 0;
  if (want_checksum) {
    crc = w::frame_checksum(h, head_bytes, spans, static_cast<size_t>(count));
    if (!head.view.readonly) std::memcpy(h + checksum_at, &crc, 8);
  }
  if (o != nullptr) {
    std::memcpy(o, h, head_bytes);
    std::memcpy(o + checksum_at, &crc, 8);
    w::write_payload(spans, static_cast<size_t>(count), o + head_bytes);
  }
  return PyLong_FromUnsignedLongLong(crc);
}

// ---- decode --------------------------------------------------------------------------------

// frame_parse(buffer, max_payload_bytes, verify_checksum) -> None | (step_kind, dtype, layout,
//   frame_flags, stage_from, stage_to, microbatch, request_id, step_id, batch, seq, hidden_size,
//   token_index, payload_at, payload_bytes, checksum, rows, specs, control_at, control_bytes)
// rows: list of Row; specs: list of (name, dtype code, shape, offset in the payload, numel).
// Every check of the reference decoder but the control JSON, which the caller does; None when
// any check fails.
PyObject* py_frame_parse(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "stagewise.frame_parse: expected 3 arguments, got %zd", nargs);
    return nullptr;
  }
  const State* s = ready_state("frame_parse");
  if (s == nullptr) return nullptr;
  uint64_t max_payload = 0;
  if (!as_uint(args[1], ~uint64_t{0}, &max_payload)) return decline();
  const int verify = PyObject_IsTrue(args[2]);
  if (verify < 0) return nullptr;
  Buffer buf;
  if (!buf.get(args[0], PyBUF_SIMPLE)) return nullptr;
  w::Parsed parsed;
  std::vector<w::Row> rows;
  if (!w::parse_frame(static_cast<const uint8_t*>(buf.view.buf), static_cast<uint64_t>(buf.view.len), max_payload,
                      verify != 0, &parsed, &rows))
    return decline();
  const w::Header& h = parsed.header;

  PyObject* specs = PyList_New(h.num_tensors);
  if (specs == nullptr) return nullptr;
  for (uint32_t i = 0; i < h.num_tensors; ++i) {
    const w::Tensor& t = parsed.tensors[i];
    PyObject* name = PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(t.name), t.name_bytes, "strict");
    if (name == nullptr) {  // names must be UTF-8: the reference names the entry
      Py_DECREF(specs);
      if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) return nullptr;
      PyErr_Clear();
      return decline();
    }
    PyObject* shape = PyTuple_New(t.ndim);
    for (uint32_t d = 0; shape != nullptr && d < t.ndim; ++d) {
      PyObject* dim = PyLong_FromUnsignedLong(t.dims[d]);
      if (dim == nullptr) Py_CLEAR(shape);
      else PyTuple_SET_ITEM(shape, d, dim);
    }
    const uint64_t numel = t.nbytes / w::kDTypes[t.dtype].itemsize;
    PyObject* spec = shape == nullptr ? nullptr
                                      : Py_BuildValue("(NINKK)", name, static_cast<unsigned>(t.dtype), shape,
                                                      static_cast<unsigned long long>(t.offset),
                                                      static_cast<unsigned long long>(numel));
    if (spec == nullptr) {
      if (shape == nullptr) Py_DECREF(name);
      Py_DECREF(specs);
      return nullptr;
    }
    PyList_SET_ITEM(specs, i, spec);
  }

  PyObject* row_list = PyList_New(h.num_rows);
  for (uint32_t i = 0; row_list != nullptr && i < h.num_rows; ++i) {
    const w::Row& r = rows[i];
    PyObject* a[4] = {PyLong_FromUnsignedLongLong(r.request_id), PyLong_FromUnsignedLong(r.first_position),
                      PyLong_FromUnsignedLong(r.num_tokens), PyTuple_GET_ITEM(s->row_flags, r.flags)};
    PyObject* row = (a[0] && a[1] && a[2]) ? PyObject_Vectorcall(s->row_type, a, 4, nullptr) : nullptr;
    Py_XDECREF(a[0]);
    Py_XDECREF(a[1]);
    Py_XDECREF(a[2]);
    if (row == nullptr) Py_CLEAR(row_list);
    else PyList_SET_ITEM(row_list, i, row);
  }
  if (row_list == nullptr) {
    Py_DECREF(specs);
    return nullptr;
  }
  using ull = unsigned long long;
  return Py_BuildValue("(IIIIIIIKKIIIIKKKNNKI)", h.step_kind, h.dtype, h.layout, h.flags, h.stage_from, h.stage_to,
                       h.microbatch, static_cast<ull>(h.request_id), static_cast<ull>(h.step_id), h.batch, h.seq,
                       h.hidden_size, h.token_index, static_cast<ull>(parsed.payload_at),
                       static_cast<ull>(h.payload_bytes), static_cast<ull>(h.checksum), row_list, specs,
                       static_cast<ull>(parsed.control_at), h.control_bytes);
}

// ---- constants and setup -------------------------------------------------------------------

template <size_t N>
PyObject* fields_tuple(const w::Field (&fields)[N]) {
  PyObject* out = PyTuple_New(N);
  for (size_t i = 0; out != nullptr && i < N; ++i) {
    const w::Field& f = fields[i];
    PyObject* item = Py_BuildValue("(sIIC I)", f.name, f.offset, f.size, f.format, f.count);
    if (item == nullptr) Py_CLEAR(out);
    else PyTuple_SET_ITEM(out, i, item);
  }
  return out;
}

// frame_constants() -> dict: the wire format's one table (include/stagewise/frame.h).
PyObject* py_frame_constants(PyObject*, PyObject*) {
  PyObject* out = PyDict_New();
  bool ok = out != nullptr;
  auto put = [&](const char* key, PyObject* value) {  // steals value
    ok = ok && value != nullptr && PyDict_SetItemString(out, key, value) == 0;
    Py_XDECREF(value);
  };
  auto put_uint = [&](const char* key, uint64_t value) { put(key, PyLong_FromUnsignedLongLong(value)); };
  put("magic", PyBytes_FromStringAndSize(w::kMagic, sizeof(w::kMagic)));
  put_uint("version", w::kVersion);
  put_uint("align", w::kAlign);
  put_uint("max_rows", w::kMaxRows);
  put_uint("max_tensors", w::kMaxTensors);
  put_uint("max_control_bytes", w::kMaxControlBytes);
  put_uint("max_ndim", w::kMaxNdim);
  put_uint("max_name_bytes", w::kMaxNameBytes);
  put_uint("default_max_payload_bytes", w::kDefaultMaxPayloadBytes);
  put_uint("num_step_kinds", w::kNumStepKinds);
  put_uint("step_control", w::kStepControl);
  put_uint("step_hello", w::kStepHello);
  put_uint("layout_contiguous", w::kLayoutContiguous);
  put_uint("flag_checksum", w::kFlagChecksum);
  put_uint("flag_detached_payload", w::kFlagDetachedPayload);
  put_uint("row_flag_bits", w::kRowFlagBits);
  PyObject* dtypes = PyTuple_New(w::kNumDTypes);
  for (uint32_t c = 1; dtypes != nullptr && c <= w::kNumDTypes; ++c) {
    PyObject* item = Py_BuildValue("(IsI)", c, w::kDTypes[c].name, w::kDTypes[c].itemsize);
    if (item == nullptr) Py_CLEAR(dtypes);
    else PyTuple_SET_ITEM(dtypes, c - 1, item);
  }
  put("dtypes", dtypes);
  put("header", fields_tuple(w::kHeaderFields));
  put("row", fields_tuple(w::kRowFields));
  put("tensor", fields_tuple(w::kTensorFields));
  if (!ok) Py_CLEAR(out);
  return out;
}

// frame_setup(Row, row_flags, Tensor, dtype_codes, wire_dtypes): the Python objects the glue
// makes or recognises (see State).
PyObject* py_frame_setup(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !PyType_Check(args[0]) || !PyTuple_Check(args[1]) ||
      PyTuple_GET_SIZE(args[1]) != w::kRowFlagBits + 1 || !PyType_Check(args[2]) || !PyDict_Check(args[3]) ||
      !PyTuple_Check(args[4]) || PyTuple_GET_SIZE(args[4]) != w::kNumDTypes + 1) {
    PyErr_Format(PyExc_TypeError,
                 "stagewise.frame_setup: expected (Row, %u RowFlags, Tensor, dtype codes, %u dtypes)",
                 w::kRowFlagBits + 1, w::kNumDTypes + 1);
    return nullptr;
  }
  State& s = state();
  if (!intern_names(s)) return nullptr;
  PyObject* magic = PyBytes_FromStringAndSize(w::kMagic, sizeof(w::kMagic));
  PyObject* version = PyLong_FromUnsignedLong(w::kVersion);
  if (magic == nullptr || version == nullptr) {
    Py_XDECREF(magic);
    Py_XDECREF(version);
    return nullptr;
  }
  Py_XSETREF(s.magic, magic);
  Py_XSETREF(s.version, version);
  PyObject** slots[5] = {&s.row_type, &s.row_flags, &s.tensor_type, &s.dtype_codes, &s.wire_dtypes};
  for (int i = 0; i < 5; ++i) Py_XSETREF(*slots[i], new_ref(args[i]));
  s.ready = true;
  Py_RETURN_NONE;
}

#define SW_FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f))

PyMethodDef methods[] = {
    {"frame_constants", py_frame_constants, METH_NOARGS,
     "frame_constants() -> dict: the wire format's constants (include/stagewise/frame.h)"},
    {"frame_setup", SW_FASTCALL(py_frame_setup), METH_FASTCALL,
     "frame_setup(Row, row_flags, Tensor, dtype_codes, wire_dtypes) -> None"},
    {"frame_parse", SW_FASTCALL(py_frame_parse), METH_FASTCALL,
     "frame_parse(buffer, max_payload_bytes, verify_checksum) -> None (declined: ask the Python reference) or the "
     "parsed fields"},
    {"frame_head", SW_FASTCALL(py_frame_head), METH_FASTCALL,
     "frame_head(frame, control, flags) -> None or (head, sources)"},
    {"frame_fill", SW_FASTCALL(py_frame_fill), METH_FASTCALL,
     "frame_fill(out or None, head, sources, checksum) -> checksum (0 without)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* frame_py_methods() { return methods; }

}  // namespace stagewise::glue
