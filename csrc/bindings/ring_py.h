// The Python functions of stagewise._C (the activation ring's fast path).
#pragma once
#include <Python.h>

namespace stagewise::glue {
PyMethodDef* ring_py_methods();
}
