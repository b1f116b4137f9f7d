"""Builds the native kernels into KVFUSE_NATIVE_BUILD_DIR; prints NAME cuda seconds error."""
import sys
import kvfuse.ops.native as native
s = native._ensure_built()
print(native.__file__)
print(sys.argv[1], s["cuda"], s["seconds"], s["error"] or s["cuda_error"] or "", "" if s["cuda"] else "unavailable")
