import sys
from kvfuse.ops import native
print(native.__file__)
i = native.build_info(build=True)
print(sys.argv[1], i["built"], i["build_seconds"], str(i["error"])[:1500])
