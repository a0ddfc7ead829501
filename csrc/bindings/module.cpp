// `import stagewise._C` loads this library; its static initialisers register
// the ops with the dispatcher (torch.ops.stagewise.*). The module itself is
// empty, so it needs only Python.h, not libtorch_python.
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "stagewise ops", -1, nullptr};
  return PyModule_Create(&module_def);
}
