// The Python module object of fastinfer._C / fastinfer._sim / fastinfer._simprof. The ops register
// their schemas and kernels with torch's dispatcher from static initialisers (common.h,
// FASTINFER_LIBRARY) when the library loads; the module's init then registers their fake impls
// (fastinfer/ops/_fake.py: the stable ABI has no symbolic shapes, so those are Python).
#include <Python.h>

#include "common.h"

// The op namespace of this module (the sim bindings, compiled once for fastinfer._sim and
// fastinfer._simprof, register under it: common.h).
namespace fastinfer::binding {
const char* library_namespace() { return FASTINFER_STR(FASTINFER_NS); }
}  // namespace fastinfer::binding

extern "C" PyMODINIT_FUNC FASTINFER_CAT(PyInit_, FASTINFER_MODULE_NAME)(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT,
      FASTINFER_STR(FASTINFER_MODULE_NAME),
      "fastinfer ops (namespace " FASTINFER_STR(FASTINFER_NS) "); use torch.ops." FASTINFER_STR(FASTINFER_NS),
      -1,
      nullptr,
  };
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  PyObject* fakes = PyImport_ImportModule("fastinfer.ops._fake");
  PyObject* done = fakes != nullptr ? PyObject_CallMethod(fakes, "register", "s", FASTINFER_STR(FASTINFER_NS)) : nullptr;
  Py_XDECREF(fakes);
  if (done == nullptr) {
    Py_DECREF(m);
    return nullptr;
  }
  Py_DECREF(done);
  return m;
}
