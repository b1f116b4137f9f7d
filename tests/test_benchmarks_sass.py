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
