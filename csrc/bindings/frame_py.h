// The Python functions of stagewise._C for the frame codec's fast path (frame_py.cpp).
#pragma once
#include <Python.h>

namespace stagewise::glue {
PyMethodDef* frame_py_methods();
}
