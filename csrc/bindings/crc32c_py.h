// The Python functions of stagewise._C for the frame checksum (crc32c_py.cpp).
#pragma once
#include <Python.h>

namespace stagewise::glue {
PyMethodDef* crc32c_py_methods();
}
