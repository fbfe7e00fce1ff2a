// The Python module object of fastinfer._C / fastinfer._sim. The ops register themselves with
// torch's dispatcher from static initialisers (TORCH_LIBRARY); importing the module loads them.
#include <Python.h>

#define FASTINFER_STR2(x) #x
#define FASTINFER_STR(x) FASTINFER_STR2(x)
#define FASTINFER_CAT2(a, b) a##b
#define FASTINFER_CAT(a, b) FASTINFER_CAT2(a, b)

// The op namespace of this module (the sim bindings, compiled once for fastinfer._sim and
// fastinfer._simprof, register under it: common.h, FASTINFER_RUNTIME_NS).
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
  return PyModule_Create(&module);
}
