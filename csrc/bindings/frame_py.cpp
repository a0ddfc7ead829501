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
// (torch.frombuffer) and the Frame object. This file: decoding, the constants, the setup and the
// method table; encoding in frame_py_encode.cpp; the shared state in frame_py_state.h.
#include "bindings/frame_py.h"

#include <vector>

#include "bindings/frame_py_state.h"

namespace stagewise::glue {
namespace {

using namespace frame;  // NOLINT: the glue's shared state and helpers

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