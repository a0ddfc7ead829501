// What the frame codec's glue (frame_py.cpp, frame_py_encode.cpp) shares: the Python objects it
// needs, in one place, and small helpers that read Python values without raising.
#pragma once
#include <Python.h>

#include <cstdint>

#include "stagewise/frame.h"

namespace stagewise::glue::frame {

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

inline State& state() {
  static State s;
  return s;
}

inline bool intern(PyObject** slot, const char* name) {
  return *slot != nullptr || (*slot = PyUnicode_InternFromString(name)) != nullptr;
}

inline bool intern_names(State& s) {
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

inline State* ready_state(const char* op) {
  State& s = state();
  if (!s.ready) {
    PyErr_Format(PyExc_RuntimeError, "stagewise.%s: frame_setup was not called", op);
    return nullptr;
  }
  return &s;
}

inline PyObject* new_ref(PyObject* o) {
  Py_INCREF(o);
  return o;
}

inline PyObject* decline() { Py_RETURN_NONE; }

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
inline PyObject* attr(PyObject* obj, PyObject* name, bool call = false) {
  PyObject* v = call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
  if (v == nullptr) PyErr_Clear();
  return v;
}

// An int in [0, top] (bool and int subclasses such as IntEnum members count, as in the
// reference's range check); false, with no error set, otherwise.
inline bool as_uint(PyObject* v, uint64_t top, uint64_t* out) {
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
inline bool get_uint(PyObject* obj, PyObject* name, uint64_t top, T* out) {
  PyObject* v = attr(obj, name);
  uint64_t x = 0;
  const bool ok = as_uint(v, top, &x);
  Py_XDECREF(v);
  *out = static_cast<T>(x);
  return ok;
}

PyObject* py_frame_head(PyObject*, PyObject* const* args, Py_ssize_t nargs);
PyObject* py_frame_fill(PyObject*, PyObject* const* args, Py_ssize_t nargs);

}  // namespace stagewise::glue::frame
