// stagewise._C.crc32c: the frame checksum (include/stagewise/crc32c.h) for Python, with the
// path forced for tests and the benchmark.
#include "bindings/crc32c_py.h"

#include <cstring>

#include "stagewise/crc32c.h"

namespace stagewise::glue {
namespace {

constexpr Py_ssize_t kReleaseGilBytes = 1 << 20;  // below this the GIL round trip costs more than it frees

// crc32c(data, value=0, path="auto") -> int: CRC32C of `data` continued from `value` (the
// CRC32C of the bytes before it), as crc32c.crc32c(data, value) of the crc32c package.
PyObject* py_crc32c(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"data", "value", "path", nullptr};
  Py_buffer data{};
  unsigned long long value = 0;
  const char* path_name = "auto";
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|Ks:crc32c", const_cast<char**>(keywords), &data, &value,
                                   &path_name))
    return nullptr;
  Crc32cPath path;
  if (std::strcmp(path_name, "auto") == 0) {
    path = Crc32cPath::kAuto;
  } else if (std::strcmp(path_name, "software") == 0) {
    path = Crc32cPath::kSoftware;
  } else if (std::strcmp(path_name, "hardware") == 0) {
    path = Crc32cPath::kHardware;
  } else {
    PyBuffer_Release(&data);
    PyErr_Format(PyExc_ValueError, "stagewise.crc32c: argument 'path' must be 'auto', 'hardware' or 'software', got '%s'",
                 path_name);
    return nullptr;
  }
  if (path == Crc32cPath::kHardware && crc32c_hardware() == nullptr) {
    PyBuffer_Release(&data);
    PyErr_SetString(PyExc_RuntimeError, "stagewise.crc32c: path 'hardware': this CPU has no CRC32C instruction");
    return nullptr;
  }
  if (value > 0xffffffffull) {
    PyBuffer_Release(&data);
    PyErr_Format(PyExc_ValueError, "stagewise.crc32c: argument 'value' must be a 32-bit CRC, got %llu", value);
    return nullptr;
  }
  uint32_t crc = static_cast<uint32_t>(value);
  if (data.len >= kReleaseGilBytes) {
    Py_BEGIN_ALLOW_THREADS crc = crc32c_extend_with(path, crc, data.buf, static_cast<size_t>(data.len));
    Py_END_ALLOW_THREADS
  } else {
    crc = crc32c_extend_with(path, crc, data.buf, static_cast<size_t>(data.len));
  }
  PyBuffer_Release(&data);
  return PyLong_FromUnsignedLong(crc);
}

// crc32c_hardware() -> str | None: the CPU instruction the automatic path uses ("sse4.2",
// "armv8-crc"), or None where it runs the software loop.
PyObject* py_crc32c_hardware(PyObject*, PyObject*) {
  const char* name = crc32c_hardware();
  if (name == nullptr) Py_RETURN_NONE;
  return PyUnicode_FromString(name);
}

PyMethodDef methods[] = {
    {"crc32c", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_crc32c)), METH_VARARGS | METH_KEYWORDS,
     "crc32c(data, value=0, path='auto') -> int: CRC32C of data continued from value"},
    {"crc32c_hardware", py_crc32c_hardware, METH_NOARGS,
     "crc32c_hardware() -> str or None: the CRC32C instruction in use"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* crc32c_py_methods() { return methods; }

}  // namespace stagewise::glue
