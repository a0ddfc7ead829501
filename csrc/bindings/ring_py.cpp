// Python fast path of the activation ring, for stagewise.transport.shm: the
// same C++ as the ring_* torch ops (csrc/cpu/ring.cpp), called once or twice
// per message without the dispatcher, whose own cost from Python (about 5 us a
// call on a small CPU) would by itself exceed the ring's latency budget.
// Arguments are the segment's address and size as ints; the header is checked
// on every call, as the ops do. Blocking waits release the GIL.
#include "bindings/ring_py.h"

#include <string>

#include "stagewise/ring.h"

namespace stagewise::glue {
namespace {

bool parse_i64(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want, const char* op, int64_t* out) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "stagewise.%s: expected %zd arguments, got %zd", op, want, nargs);
    return false;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    out[i] = PyLong_AsLongLong(args[i]);
    if (out[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

RingHeader* header(const char* op, int64_t addr, int64_t size) {
  const char* why = addr == 0 || size < 0 ? "null or negative" : ring_check(reinterpret_cast<void*>(addr), size);
  if (why != nullptr) {
    PyErr_Format(PyExc_ValueError, "stagewise.%s: argument 'ring' is not a valid ring: %s", op, why);
    return nullptr;
  }
  return reinterpret_cast<RingHeader*>(addr);
}

// ring_reserve(addr, size, timeout_us) -> slot | -1 timed out | -2 closed
PyObject* py_ring_reserve(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t a[3];
  if (!parse_i64(args, nargs, 3, "ring_reserve", a)) return nullptr;
  RingHeader* h = header("ring_reserve", a[0], a[1]);
  if (h == nullptr) return nullptr;
  int64_t slot;
  if (a[2] == 0) {
    slot = cpu::ring_reserve(h, 0);
  } else {
    Py_BEGIN_ALLOW_THREADS slot = cpu::ring_reserve(h, a[2]);
    Py_END_ALLOW_THREADS
  }
  return PyLong_FromLongLong(slot);
}

// ring_commit(addr, size, slot, nbytes) -> None
PyObject* py_ring_commit(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t a[4];
  if (!parse_i64(args, nargs, 4, "ring_commit", a)) return nullptr;
  RingHeader* h = header("ring_commit", a[0], a[1]);
  if (h == nullptr) return nullptr;
  if (a[3] < 0) {
    PyErr_Format(PyExc_ValueError, "stagewise.ring_commit: argument 'nbytes' must be >= 0, got %lld",
                 static_cast<long long>(a[3]));
    return nullptr;
  }
  const RingStatus s = cpu::ring_commit(h, a[2], static_cast<uint64_t>(a[3]));
  if (s != RingStatus::kOk) {
    PyErr_SetString(PyExc_ValueError, ring_status_message("ring_commit", s, h, a[2], a[3]).c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// ring_acquire(addr, size, timeout_us, due_mode) -> (slot | -1 | -2 | -3 due, nbytes)
PyObject* py_ring_acquire(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t a[4];
  if (!parse_i64(args, nargs, 4, "ring_acquire", a)) return nullptr;
  RingHeader* h = header("ring_acquire", a[0], a[1]);
  if (h == nullptr) return nullptr;
  uint64_t nbytes = 0;
  int64_t slot;
  if (a[2] == 0) {
    slot = cpu::ring_acquire(h, 0, &nbytes);
  } else {
    Py_BEGIN_ALLOW_THREADS slot = cpu::ring_acquire(h, a[2], &nbytes, static_cast<int>(a[3]));
    Py_END_ALLOW_THREADS
  }
  return Py_BuildValue("(LK)", static_cast<long long>(slot), static_cast<unsigned long long>(nbytes));
}

// ring_release(addr, size, slot) -> None
PyObject* py_ring_release(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t a[3];
  if (!parse_i64(args, nargs, 3, "ring_release", a)) return nullptr;
  RingHeader* h = header("ring_release", a[0], a[1]);
  if (h == nullptr) return nullptr;
  const RingStatus s = cpu::ring_release(h, a[2]);
  if (s != RingStatus::kOk) {
    PyErr_SetString(PyExc_ValueError, ring_status_message("ring_release", s, h, a[2], 0).c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"ring_reserve", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_ring_reserve)),
     METH_FASTCALL, "ring_reserve(addr, size, timeout_us) -> slot, -1 (timed out) or -2 (closed)"},
    {"ring_commit", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_ring_commit)),
     METH_FASTCALL, "ring_commit(addr, size, slot, nbytes)"},
    {"ring_acquire", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_ring_acquire)),
     METH_FASTCALL, "ring_acquire(addr, size, timeout_us, due_mode) -> (slot or -1/-2/-3, nbytes)"},
    {"ring_release", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_ring_release)),
     METH_FASTCALL, "ring_release(addr, size, slot)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* ring_py_methods() { return methods; }

}  // namespace stagewise::glue
