"""benchmarks.sass_count: the SASS parser behind the instructions-per-element figures."""

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
    import json
    import os
    import subprocess
    import sys

    import pytest

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
