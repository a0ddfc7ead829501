// `import stagewise._C` loads this library; its static initialisers register
// the ops with the dispatcher (torch.ops.stagewise.*). The module's own
// functions are fast paths called from Python without the dispatcher: the
// activation ring (ring_py.cpp), the frame codec (frame_py.cpp) and its checksum
// (crc32c_py.cpp); they need only Python.h, not libtorch_python.
#include <Python.h>

#include <vector>

#include "bindings/crc32c_py.h"
#include "bindings/frame_py.h"
#include "bindings/ring_py.h"

extern "C" PyObject* PyInit__C(void) {
  static std::vector<PyMethodDef> methods;
  if (methods.empty()) {
    for (PyMethodDef* table : {stagewise::glue::ring_py_methods(), stagewise::glue::frame_py_methods(),
                               stagewise::glue::crc32c_py_methods()})
      for (PyMethodDef* m = table; m->ml_name != nullptr; ++m) methods.push_back(*m);
    methods.push_back({nullptr, nullptr, 0, nullptr});
  }
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "stagewise ops", -1, methods.data()};
  return PyModule_Create(&module_def);
}
