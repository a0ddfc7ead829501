// stagewise._C.crc32c: the frame checksum (include/stagewise/crc32c.h) for Python, with the
// path forced for tests and the benchmark.
#include "bindings/crc32c_py.h"

#include <cstring>

#include "stagewise/crc32c.h"

namespace stagewise::glue {
namespace {

constexpr Py_ssize_t kReleaseGilBytes = 1 << 20;  // below this the GIL round trip costs more than it frees

// The path named by `name`, or false with a Python error set.
bool parse_path(const char* op, const char* name, Crc32cPath* out) {
  if (std::strcmp(name, "auto") == 0) {
    *out = Crc32cPath::kAuto;
  } else if (std::strcmp(name, "software") == 0) {
    *out = Crc32cPath::kSoftware;
  } else if (std::strcmp(name, "hardware") == 0) {
    *out = Crc32cPath::kHardware;
  } else {
    PyErr_Format(PyExc_ValueError, "stagewise.%s: argument 'path' must be 'auto', 'hardware' or 'software', got '%s'",
                 op, name);
    return false;
  }
  if (*out == Crc32cPath::kHardware && crc32c_hardware() == nullptr) {
    PyErr_Format(PyExc_RuntimeError, "stagewise.%s: path 'hardware': this CPU has no CRC32C instruction", op);
    return false;
  }
  return true;
}

bool parse_value(const char* op, unsigned long long value, uint32_t* out) {
  if (value > 0xffffffffull) {
    PyErr_Format(PyExc_ValueError, "stagewise.%s: argument 'value' must be a 32-bit CRC, got %llu", op, value);
    return false;
  }
  *out = static_cast<uint32_t>(value);
  return true;
}

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
  uint32_t crc = 0;
  if (!parse_path("crc32c", path_name, &path) || !parse_value("crc32c", value, &crc)) {
    PyBuffer_Release(&data);
    return nullptr;
  }
  if (data.len >= kReleaseGilBytes) {
    Py_BEGIN_ALLOW_THREADS crc = crc32c_extend_with(path, crc, data.buf, static_cast<size_t>(data.len));
    Py_END_ALLOW_THREADS
  } else {
    crc = crc32c_extend_with(path, crc, data.buf, static_cast<size_t>(data.len));
  }
  PyBuffer_Release(&data);
  return PyLong_FromUnsignedLong(crc);
}

// crc32c_copy(dst, src, value=0, path="auto") -> int: crc32c(src, value, path), copying src
// into dst (a writable buffer at least as long) in the same pass.
PyObject* py_crc32c_copy(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"dst", "src", "value", "path", nullptr};
  Py_buffer dst{}, src{};
  unsigned long long value = 0;
  const char* path_name = "auto";
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "w*y*|Ks:crc32c_copy", const_cast<char**>(keywords), &dst, &src,
                                   &value, &path_name))
    return nullptr;
  Crc32cPath path;
  uint32_t crc = 0;
  bool ok = parse_path("crc32c_copy", path_name, &path) && parse_value("crc32c_copy", value, &crc);
  if (ok && dst.len < src.len) {
    PyErr_Format(PyExc_ValueError, "stagewise.crc32c_copy: argument 'dst' has %zd bytes, 'src' %zd", dst.len, src.len);
    ok = false;
  }
  if (ok) crc = crc32c_copy_with(path, crc, dst.buf, src.buf, static_cast<size_t>(src.len));
  PyBuffer_Release(&dst);
  PyBuffer_Release(&src);
  return ok ? PyLong_FromUnsignedLong(crc) : nullptr;
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
    {"crc32c_copy", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_crc32c_copy)),
     METH_VARARGS | METH_KEYWORDS, "crc32c_copy(dst, src, value=0, path='auto') -> int: crc32c(src) while copying it"},
    {"crc32c_hardware", py_crc32c_hardware, METH_NOARGS,
     "crc32c_hardware() -> str or None: the CRC32C instruction in use"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* crc32c_py_methods() { return methods; }

}  // namespace stagewise::glue
