// The encoding half of the frame codec's glue: frame_head gathers a Python Frame into the
// plain structs of include/stagewise/frame.h and packs its head; frame_fill checksums and writes
// the frame. Declines (returns None) rather than raise about a frame; see frame_py.cpp.
#include <cstring>
#include <vector>

#include "bindings/frame_py_state.h"

namespace stagewise::glue::frame {
namespace {

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


// frame_head(frame, control, flags) -> None | (head bytearray, sources)

}  // namespace

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
      !w::plan_frame(&g.header, g.rows.size(), g.tensors, g.num_tensors, control_bytes, &head_bytes))
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
// tensors' own memory as they are read for the copy (never read back from `out`, whose cache
// lines may still be on the reader's core) and stored in the head when it is writable. With
// `out` (a writable buffer, or None), the frame is written there. Returns the checksum, 0
// without one.
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
  if (o != nullptr && want_checksum) {  // one pass: the tensors are checksummed as they are copied
    crc = w::write_frame_checksummed(h, head_bytes, spans, static_cast<size_t>(count), o);
  } else if (o != nullptr) {
    std::memcpy(o, h, head_bytes);
    w::write_payload(spans, static_cast<size_t>(count), o + head_bytes);
  } else if (want_checksum) {
    crc = w::frame_checksum(h, head_bytes, spans, static_cast<size_t>(count));
  }
  if (o != nullptr) std::memcpy(o + checksum_at, &crc, 8);
  if (want_checksum && !head.view.readonly) std::memcpy(h + checksum_at, &crc, 8);
  return PyLong_FromUnsignedLongLong(crc);
}

}  // namespace stagewise::glue::frame
