"""errors.py's cases on the CPU: the GPU test module's model, batch and kvfuse helpers rebuilt
for the CPU, then errors.py as it is.   PYTHONPATH=$PWD python <this file> OUT.json"""
import os
import runpy
import sys

sys.path.insert(0, "tests/integrations")
import torch  # noqa: E402
import test_transformers_gpu as t  # noqa: E402

t.gpu_model = lambda name, dtype=torch.bfloat16: t.build(name, dtype, head_dim=t.HEAD_DIM[name])
t.gpu_batch = lambda lengths=(9, 4, 6), seed=1: t.left_padded_batch(lengths, seed)
t.with_kvfuse = lambda ref, config: t.kvt.enable(t.copy.deepcopy(ref), config)
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "errors.py"), run_name="__main__")
