"""benchmarks.sass_count: the SASS parser behind the instructions-per-element figures;
benchmarks.ptxas_native: the ptxas log parser behind its register / spill / serialisation report."""

import json
import shutil

import pytest

from benchmarks.sass_count import classify, sass_opcodes

SNIPPET = """\
.text._encode_and_cache_write_kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   MUFU.RCP R0, R25 ;
        /*0020*/                   BSSY B2, `(.L_x_0) ;
        /*0030*/                   FCHK P1, R2, R25 ;
        /*0040*/                   FFMA R26, R2, R3, RZ ;
        /*0050*/              @!P1 BRA `(.L_x_1) ;
        /*0060*/                   IMAD.MOV.U32 R0, RZ, RZ, R2 ;
        /*0070*/                   MOV R18, 0x90 ;
        /*0080*/                   CALL.REL.NOINC `($__internal_0_$__cuda_sm3x_div_rn_noftz_f32_slowpath) ;
        /*0090*/                   IMAD.MOV.U32 R26, RZ, RZ, R0 ;
.L_x_1:
        /*00a0*/                   BSYNC B2 ;
.L_x_0:
        /*00b0*/               @P0 BRA `(.L_x_2) ;
        /*00c0*/                   STG.E.U8 desc[UR4][R2.64], R26 ;
.L_x_2:
        /*00d0*/                   EXIT ;
        /*00e0*/                   NOP ;
$__internal_0_$__cuda_sm3x_div_rn_noftz_f32_slowpath:
        /*00f0*/                   FCHK P0, R0, R3 ;
        /*0100*/                   RET.REL.NODEC R18 `(_encode_and_cache_write_kernel) ;
"""


def test_all_instructions_in_program_order():
    ops = sass_opcodes(SNIPPET)
    assert ops[:3] == ["LDC", "MUFU.RCP", "BSSY"]
    assert len(ops) == 17 and ops[-2:] == ["FCHK", "RET.REL.NODEC"]


def test_fast_path_skips_division_slow_paths_and_subroutines_only():
    ops = sass_opcodes(SNIPPET, fast_path=True)
    # The slow-path block (3 moves and the call) and the subroutine are gone; the branch that
    # skips them stays, and so does a predicated branch over an ordinary store.
    assert ops == ["LDC", "MUFU.RCP", "BSSY", "FCHK", "FFMA", "BRA", "BSYNC", "BRA", "STG.E.U8", "EXIT", "NOP"]


def test_classes():
    assert [classify(op) for op in ("FFMA", "IMAD.MOV.U32", "STG.E.U8", "BRA", "S2R")] == [
        "float", "integer", "memory", "control", "other"]


LOOP_SNIPPET = """\
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_5:
        /*0010*/                   LDG.E.U8 R4, desc[UR4][R2.64] ;
        /*0020*/                   LDGSTS.E.64 [R7], desc[UR4][R8.64] ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/                   STL [R1+0x4], R4 ;
        /*0050*/                   HMMA.16816.F32 R12, R16, R20, R12 ;
        /*0060*/                   NOP ;
        /*0070*/               @P0 BRA `(.L_x_5) ;
        /*0080*/               @P1 BRA `(.L_x_6) ;
        /*0090*/                   EXIT ;
.L_x_6:
        /*00a0*/                   EXIT ;
"""


def test_loop_bodies_are_backward_branches_only():
    from benchmarks.sass_attention import loops

    found = loops(LOOP_SNIPPET)
    assert len(found) == 1  # the forward branch to .L_x_6 is no loop
    body = found[0]
    assert body["instructions"] == 6  # label to branch, NOP excluded
    assert body["global_loads"] == {"LDG.E.U8": 1, "LDGSTS.E.64": 1}
    assert (body["barriers"], body["spills"], body["tensor_core"]) == (1, 1, 1)


def test_word_scales_take_the_nvfp4_scale_loads_off_the_synchronous_path(tmp_path):
    """The mechanism WORD_SCALES exists for, in the sm_90 SASS of the decode kernel at the issue's
    reference point: the default key loop issues byte loads of block scales (synchronous: a byte
    cannot be an asynchronous copy); with words, the loop's global traffic is asynchronous copies
    (plus the block-table read every tile has). Compiled in a subprocess: this session's kernels
    are interpreted."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-m", "benchmarks.sass_attention", "--formats", "nvfp4", "--tile", "WORD_SCALES=1",
                    "--out", str(tmp_path)], cwd=root, check=True, capture_output=True, timeout=600,
                   env=dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root))
    rows = json.loads((tmp_path / "sass_attention.json").read_text())["rows"]
    default, words = (r["main_loop"]["global_loads"] for r in rows)
    assert default.get("LDG.E.U8", 0) > 0
    assert not any(op.startswith("LDG.E.U8") for op in words)
    assert words.get("LDGSTS.E", 0) > 0


# ptxas -v as nvcc prints it for two kernels (names shortened): the warning line names its kernel
# and comes before that kernel's own lines, as in the log of the serialised build at 05ba852.
PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to \
insufficient register resources for the wgmma pipeline in the function '_Z8fp8_tilev'
ptxas info    : Compiling entry function '_Z9bf16_tilev' for 'sm_90a'
ptxas info    : Function properties for _Z9bf16_tilev
    8 bytes stack frame, 8 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 8 bytes cumulative stack size
ptxas info    : Compiling entry function '_Z8fp8_tilev' for 'sm_90a'
ptxas info    : Function properties for _Z8fp8_tilev
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 236 registers, used 16 barriers
"""


def test_ptxas_log_parser_finds_spills_and_serialised_wgmma():
    from benchmarks.ptxas_native import parse_ptxas_log

    kernels = {k.name: k for k in parse_ptxas_log(PTXAS_LOG)}
    assert set(kernels) == {"_Z9bf16_tilev", "_Z8fp8_tilev"}
    bf16, fp8 = kernels["_Z9bf16_tilev"], kernels["_Z8fp8_tilev"]
    assert (bf16.arch, bf16.registers, bf16.stack_bytes) == ("sm_90a", 168, 8)
    assert (bf16.spill_stores, bf16.spill_loads) == (8, 24)
    assert bf16.warnings == [] and not bf16.serialised
    assert (fp8.arch, fp8.registers, fp8.stack_bytes, fp8.spill_stores, fp8.spill_loads) == ("sm_90a", 236, 0, 0, 0)
    assert fp8.serialised and len(fp8.warnings) == 1
    assert fp8.warnings[0].startswith("C7511: Potential Performance Loss: wgmma.mma_async instructions are serialized")


def test_ptxas_report_strict_fails_on_serialised_kernels(monkeypatch, tmp_path, capsys):
    from benchmarks import ptxas_native

    monkeypatch.setattr(ptxas_native, "compile_report", lambda *a: ptxas_native.parse_ptxas_log(PTXAS_LOG))
    assert ptxas_native.main(["--out", str(tmp_path)]) == 0  # reported, not enforced
    assert ptxas_native.main(["--strict"]) == 1
    rows = json.loads((tmp_path / "ptxas_native.json").read_text())["rows"]
    assert [(r["source"], r["registers"], r["serialised"]) for r in rows] == [
        ("prefill_attention.cu", 168, False), ("prefill_attention.cu", 236, True)]
    if shutil.which("c++filt"):
        assert [r["kernel"] for r in rows] == ["bf16_tile", "fp8_tile"]
    assert "YES" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ptxas_native.main(["--sources", "no_such_file.cu"])

    tail = PTXAS_LOG.replace("(C7511)", "(C7000)")  # another ptxas remark is not a serialisation
    monkeypatch.setattr(ptxas_native, "compile_report", lambda *a: ptxas_native.parse_ptxas_log(tail))
    assert ptxas_native.main(["--strict"]) == 0


# Two builds of one kernel as nvdisasm lists them: the anonymous namespace's hash, the labels and
# the internal subroutines' numbers differ, the code does not (until `changed` edits it).
_KERNEL = "_ZN6kvfuse47_GLOBAL__N__{hash}_14_cache_write_cu_6916d0bb11rows_kernelINS0_10NoRotationEEEvNS0_9RowParamsE"
_LISTING = """\
.text.{name}:
        .type           {name},@function
{name}:
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
        /*0010*/              @!P1 BRA `(.L_x_{label}) ;
        /*0020*/                   CALL.REL.NOINC `($__internal_{sub}_$__cuda_sm20_rcp_rn_f32_slowpath) ;
.L_x_{label}:
        /*0030*/                   {op} R2, R2, R3 ;
        /*0040*/                   EXIT ;
.text._Z5otherv:
_Z5otherv:
        /*0000*/                   EXIT ;
"""


def _listing(hash_="81b74cba", label=7, sub=442, op="FMUL", other=True):
    text = _LISTING.format(name=_KERNEL.format(hash=hash_), label=label, sub=sub, op=op)
    return text if other else text.split(".text._Z5otherv")[0]


def test_sass_native_sets_aside_what_a_rebuild_renames():
    from benchmarks.sass_native import compare, kernels

    base = kernels(_listing())
    assert len(base) == 2
    rows = next(v for k, v in base.items() if "rows_kernel" in k)
    assert rows[0] == "LDC R1, c[0x0][0x28]"  # address and encoding dropped
    assert rows[1] == "@!P1 BRA `(.L_x)"
    assert [r.status for r in compare(base, kernels(_listing("b3e61e07", 9, 490)))] == ["same", "same"]

    changed = compare(base, kernels(_listing(op="FADD")))
    status = {r.kernel: (r.status, r.changed) for r in changed}
    assert sorted(status.values()) == [("differs", 2), ("same", 0)]  # one FMUL out, one FADD in


def test_sass_native_sets_aside_the_namespace_hash_in_a_return_target():
    """nvcc 13.0 names the anonymous namespace `_GLOBAL__N__<file>_<hash>_<number>` in mangled
    targets; two builds of an unchanged kernel differ only there (prefill_attention.cu's kernels
    end in such a return)."""
    from benchmarks.sass_native import compare, kernels

    target = "_ZN6kvfuse59_GLOBAL__N__20_prefill_attention_cu_{hash}_{number}24prefill_attention_kernelILNS0_7OperandE0EEEv"
    listing = """\
.text.{name}:
{name}:
        /*0000*/                   RET.REL.NODEC R2 `({name}) ;
"""

    def build(hash_, number, register="R2"):
        return kernels(listing.format(name=target.format(hash=hash_, number=number)).replace("R2", register))

    rows = compare(build("024f6148", 12725), build("8331993d", 12737))
    assert [r.status for r in rows] == ["same"]
    assert [r.status for r in compare(build("024f6148", 12725), build("8331993d", 9, "R4"))] == ["differs"]


def test_sass_native_reports_order_kernels_of_one_build_and_filters():
    from benchmarks.sass_native import compare, kernels

    reordered = _listing().replace("LDC R1, c[0x0][0x28] ;", "EXIT ;", 1).replace(
        "/*0040*/                   EXIT ;", "/*0040*/                   LDC R1, c[0x0][0x28] ;")
    rows = {r.kernel: r for r in compare(kernels(_listing()), kernels(reordered))}
    kernel = next(k for k in rows if "rows_kernel" in k)
    assert (rows[kernel].status, rows[kernel].changed) == ("differs", 0)  # same instructions, other order

    one_sided = compare(kernels(_listing()), kernels(_listing(other=False)))
    assert sorted((r.status, r.base_instructions, r.tree_instructions) for r in one_sided) == [
        ("only in base", 1, 0), ("same", 5, 5)]
    assert [r.kernel for r in compare(kernels(_listing()), kernels(_listing()), "other")] == [
        k for k in kernels(_listing()) if "other" in k]


def test_sass_native_cli_strict_and_json(monkeypatch, tmp_path, capsys):
    from benchmarks import sass_native
    from benchmarks.sass_native import kernels

    builds = {}

    def disassemble(source, arch, defines):
        builds.setdefault("calls", []).append((source.name, tuple(defines)))
        return kernels(_listing(op="FADD" if "CHANGE=1" in defines else "FMUL"))

    monkeypatch.setattr(sass_native, "disassemble", disassemble)
    assert sass_native.main(["--base-define", "CHANGE=0", "--define", "CHANGE=0", "--strict"]) == 0
    assert sass_native.main(["--base-define", "CHANGE=0", "--define", "CHANGE=1", "--out", str(tmp_path)]) == 0
    assert sass_native.main(["--base-define", "CHANGE=0", "--define", "CHANGE=1", "--strict"]) == 1
    assert builds["calls"][-2:] == [("cache_write.cu", ("CHANGE=0",)), ("cache_write.cu", ("CHANGE=1",))]
    saved = json.loads((tmp_path / "sass_native.json").read_text())
    assert saved["base_defines"] == ["CHANGE=0"] and saved["defines"] == ["CHANGE=1"]
    assert sorted(r["status"] for r in saved["rows"]) == ["differs", "same"]
    assert "1 same, 1 differs" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # two identical builds: nothing to compare
        sass_native.main([])
    with pytest.raises(SystemExit):
        sass_native.main(["--base-define", "X=1", "--sources", "no_such_file.cu"])


def test_sass_native_base_revision_brings_its_whole_csrc(tmp_path):
    import subprocess

    from benchmarks.sass_native import REPO_ROOT, base_tree

    if subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    root = base_tree("HEAD", tmp_path)
    committed = subprocess.run(["git", "-C", str(REPO_ROOT), "show", "HEAD:csrc/cuda/cache_write.cu"],
                               capture_output=True, text=True, check=True).stdout
    assert (root / "csrc" / "cuda" / "cache_write.cu").read_text() == committed
    assert (root / "csrc" / "cache_write.h").is_file()  # what its includes need
    with pytest.raises(SystemExit):
        base_tree("no-such-revision", tmp_path / "x")


def test_sass_native_compiles_the_base_revision_from_its_own_tree(monkeypatch, tmp_path):
    from benchmarks import sass_native

    compiled = []
    monkeypatch.setattr(sass_native, "base_tree", lambda revision, into: tmp_path / revision)
    monkeypatch.setattr(sass_native, "disassemble", lambda source, arch, defines: compiled.append(source) or {})
    assert sass_native.main(["--base", "abc123", "--sources", "cache_write.cu,decode_attention.cu"]) == 0
    assert compiled == [tmp_path / "abc123" / "csrc" / "cuda" / "cache_write.cu",
                        sass_native.REPO_ROOT / "csrc" / "cuda" / "cache_write.cu",
                        tmp_path / "abc123" / "csrc" / "cuda" / "decode_attention.cu",
                        sass_native.REPO_ROOT / "csrc" / "cuda" / "decode_attention.cu"]
