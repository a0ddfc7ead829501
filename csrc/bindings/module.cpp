// `import stagewise._C` loads this library; its static initialisers register
// the ops with the dispatcher (torch.ops.stagewise.*). The module's own
// functions are the activation ring's fast path (ring_py.cpp); it needs only
// Python.h, not libtorch_python.
#include <Python.h>

#include "bindings/ring_py.h"

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "stagewise ops", -1,
                                   stagewise::glue::ring_py_methods()};
  return PyModule_Create(&module_def);
}
