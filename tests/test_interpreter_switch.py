"""No module of the test suite or the benchmarks turns on Triton's interpreter on a GPU host.

Triton decides between interpreted and compiled kernels when a kernel is defined, for the whole
process: a module that sets ``TRITON_INTERPRET=1`` unconditionally while pytest collects it makes
every later kernel interpreted on the GPU machine too (slow, and with the interpreter's numerics).
The conftest refuses such a session on a CUDA host; this test finds the module on any host.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _sets_interpreter(node: ast.AST) -> bool:
    """``os.environ.setdefault("TRITON_INTERPRET", ...)`` or ``os.environ["TRITON_INTERPRET"] = ...``."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        call = node.value
        return (isinstance(call.func, ast.Attribute) and call.func.attr in ("setdefault", "__setitem__")
                and ast.unparse(call.func.value) == "os.environ" and call.args
                and isinstance(call.args[0], ast.Constant) and call.args[0].value == "TRITON_INTERPRET")
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ"
                   and isinstance(t.slice, ast.Constant) and t.slice.value == "TRITON_INTERPRET"
                   for t in node.targets)
    return False


def unguarded_interpreter_switches(source: str) -> list[int]:
    """Line numbers of module-level statements that set TRITON_INTERPRET outside an
    ``if not torch.cuda.is_available():`` block."""
    lines = []
    for node in ast.parse(source).body:
        if _sets_interpreter(node):
            lines.append(node.lineno)
        elif isinstance(node, ast.If) and "cuda.is_available" not in ast.unparse(node.test):
            lines += [n.lineno for n in ast.walk(node) if _sets_interpreter(n)]
    return lines


def test_detector_finds_the_unguarded_form_and_accepts_the_guarded_one():
    assert unguarded_interpreter_switches('import os\nos.environ.setdefault("TRITON_INTERPRET", "1")\n') == [2]
    assert unguarded_interpreter_switches('import os\nos.environ["TRITON_INTERPRET"] = "1"\n') == [2]
    assert unguarded_interpreter_switches('if True:\n    os.environ.setdefault("TRITON_INTERPRET", "1")\n') == [2]
    guarded = 'if not torch.cuda.is_available():\n    os.environ.setdefault("TRITON_INTERPRET", "1")\n'
    assert unguarded_interpreter_switches(guarded) == []
    # A subprocess's own environment is not this process's.
    assert unguarded_interpreter_switches('env = {}\nenv["TRITON_INTERPRET"] = "0"\n') == []


@pytest.mark.parametrize("folder", ["tests", "benchmarks", "kvfuse"])
def test_no_module_switches_the_interpreter_on_unconditionally(folder):
    offenders = {str(path.relative_to(ROOT)): lines for path in sorted((ROOT / folder).rglob("*.py"))
                 if (lines := unguarded_interpreter_switches(path.read_text(encoding="utf-8")))}
    assert not offenders, f"TRITON_INTERPRET set without a CUDA guard (file: lines): {offenders}"
