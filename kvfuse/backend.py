"""Placeholder until the compile-path work lands: compiles with Inductor, no kvfuse passes."""

from __future__ import annotations


def make_backend(fuse: bool = True, **inductor_options):
    from torch._inductor.compile_fx import compile_fx

    def _backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, config_patches=dict(inductor_options))

    _backend.report = []
    return _backend


backend = make_backend()
