// `import stagewise._C` loads this library; its static initialisers register
// the ops with the dispatcher (torch.ops.stagewise.*). The module's own
// functions are fast paths called from Python without the dispatcher: the
// activation ring (ring_py.cpp), the frame codec (frame_py.cpp) and its checksum
// (crc32c_py.cpp); they need only Python.h, not libtorch_python. Also here: the
// instruction-set level the CPU kernels run (cpu/isa.h).
#include <Python.h>

#include <c10/util/Exception.h>

#include <vector>

#include "bindings/crc32c_py.h"
#include "bindings/frame_py.h"
#include "bindings/ring_py.h"
#include "cpu/isa.h"
#include "stagewise/linear.h"

namespace {

// cpu_isa() -> str: the level the kernels run (a bad STAGEWISE_CPU_ISA raises ValueError).
PyObject* cpu_isa_py(PyObject*, PyObject*) {
  try {
    return PyUnicode_FromString(stagewise::cpu::isa_name(stagewise::cpu::cpu_isa()));
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  }
}

// cpu_isa_supported() -> str: the best level this CPU has.
PyObject* cpu_isa_supported_py(PyObject*, PyObject*) {
  return PyUnicode_FromString(stagewise::cpu::isa_name(stagewise::cpu::cpu_isa_supported()));
}

// dense_linear_max_rows() -> int (a bad STAGEWISE_CPU_ISA raises ValueError).
PyObject* dense_linear_max_rows_py(PyObject*, PyObject*) {
  try {
    return PyLong_FromLongLong(stagewise::cpu::dense_linear_max_rows());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  }
}

PyMethodDef isa_methods[] = {
    {"cpu_isa", cpu_isa_py, METH_NOARGS, "The instruction-set level the CPU kernels run."},
    {"cpu_isa_supported", cpu_isa_supported_py, METH_NOARGS, "The best instruction-set level this CPU has."},
    {"dense_linear_max_rows", dense_linear_max_rows_py, METH_NOARGS,
     "The most rows of x dense_linear's float32 kernel takes at this ISA level."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" PyObject* PyInit__C(void) {
  static std::vector<PyMethodDef> methods;
  if (methods.empty()) {
    for (PyMethodDef* table : {stagewise::glue::ring_py_methods(), stagewise::glue::frame_py_methods(),
                               stagewise::glue::crc32c_py_methods(), isa_methods})
      for (PyMethodDef* m = table; m->ml_name != nullptr; ++m) methods.push_back(*m);
    methods.push_back({nullptr, nullptr, 0, nullptr});
  }
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "stagewise ops", -1, methods.data()};
  return PyModule_Create(&module_def);
}
