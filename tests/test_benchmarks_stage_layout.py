"""benchmarks.stage_layout: the shared-memory model behind the FP8 and NVFP4 decode stage layouts."""

from pathlib import Path

import pytest

from benchmarks.stage_layout import (StageLayout, chunk_copies, chunk_reads, line_swizzle, main, model, swizzle,
                                     wavefronts)

KERNEL = Path(__file__).resolve().parents[1] / "csrc" / "cuda" / "decode_attention.cu"


def test_wavefronts_of_known_patterns():
    # 16-byte loads, 8 lanes per phase: 128 contiguous bytes per phase = one wavefront each.
    assert wavefronts([16 * lane for lane in range(32)], 16) == 4
    # Every lane of a phase on the same bank group at distinct rows: 8 wavefronts per phase.
    assert wavefronts([128 * lane for lane in range(32)], 16) == 32
    # One word read by all lanes is a broadcast; idle lanes cost nothing.
    assert wavefronts([0] * 32, 4) == 1
    assert wavefronts([None] * 31 + [4], 4) == 1


@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_swizzle_permutes_each_rows_units(head_size):
    units = head_size // 32
    for key in range(16):
        layout = StageLayout("swizzled", head_size)
        starts = sorted(layout.place(key, 32 * u) - key * head_size for u in range(units))
        assert starts == [32 * u for u in range(units)]
        assert 0 <= swizzle(key, units) < units


@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_padded_rows_split_every_odd_rows_sectors(head_size):
    # What ncu measured at D=128 (23.8 sector requests per 512-byte copy, 48.4 read wavefronts per chunk).
    requests, sectors, instructions = chunk_copies(StageLayout("padded", head_size))
    assert requests * 2 == sectors * 3 and requests == 24 * instructions
    reads, minimum = chunk_reads(StageLayout("padded", head_size))
    assert reads * 2 == minimum * 3


@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_swizzled_rows_keep_sectors_whole_and_reads_no_worse(head_size):
    requests, sectors, _ = chunk_copies(StageLayout("swizzled", head_size))
    assert requests == sectors
    reads, minimum = chunk_reads(StageLayout("swizzled", head_size))
    padded, _ = chunk_reads(StageLayout("padded", head_size))
    assert reads <= padded
    if head_size >= 128:
        assert reads == minimum  # D=64 rows hold two units: rows 0, 2, 4, 6 share two bank groups
    else:
        assert reads == padded


def test_kernel_swizzle_is_the_one_modelled():
    source = KERNEL.read_text()
    assert "return (((k >> 1) & 1) | (((k ^ (k >> 2)) & 1) << 1)) & (kUnits - 1);" in source
    assert "static constexpr int kPitch = L::kRowScales ? kPieces * 16 : L::kRowBytes + (kSwizzled ? 0 : 16);" in source


@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_nvfp4_stage_is_a_permutation_of_whole_units(head_size):
    layout = StageLayout("nvfp4", head_size)
    rows = head_size // 2
    places = sorted(layout.place(key, byte) for key in range(16) for byte in range(rows))
    assert places == list(range(16 * rows))
    for key in range(16):
        for unit in range(0, rows, 32):
            start = layout.place(key, unit)
            assert start % 32 == 0 and all(layout.place(key, unit + i) == start + i for i in range(32))
            # The unit stays in its 128-byte line.
            assert start // 128 == (key * rows + unit) // 128


@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_nvfp4_stage_copies_whole_sectors_and_reads_at_the_minimum(head_size):
    requests, sectors, _ = chunk_copies(StageLayout("nvfp4", head_size))
    assert requests == sectors
    reads, minimum = chunk_reads(StageLayout("nvfp4", head_size))
    assert reads == minimum
    # The FP8 stage's swizzle on rows this long leaves the V reads of rows 0, 2, 4, 6 colliding
    # below 128-byte rows; at 128 bytes (D = 256) the two layouts are one.
    fp8_rows = StageLayout("swizzled", head_size // 2)
    if head_size < 256:
        assert chunk_reads(fp8_rows)[0] > minimum
    else:
        assert all(fp8_rows.place(k, b) == StageLayout("nvfp4", 256).place(k, b) for k in range(16) for b in range(128))


def test_kernel_line_swizzle_is_the_one_modelled():
    source = KERNEL.read_text()
    assert """    return kUnits == 4   ? (((k >> 1) & 1) | (((k ^ (k >> 2)) & 1) << 1))
           : kUnits == 2 ? ((k >> 1) & 3)
                         : ((k >> 2) & 1);""" in source
    assert "return (((unit & ~3) | ((unit & 3) ^ line_swizzle(k))) << 5) | (byte & 31);" in source
    assert [line_swizzle(k, 2) for k in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [line_swizzle(k, 1) for k in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_layout_validation_names_the_argument():
    with pytest.raises(ValueError, match="StageLayout.name='tiled'"):
        StageLayout("tiled", 128)
    with pytest.raises(ValueError, match="StageLayout.head_size=80"):
        StageLayout("swizzled", 80)
    with pytest.raises(ValueError, match="StageLayout.head_size=512: expected 64, 128 or 256 for 'nvfp4'"):
        StageLayout("nvfp4", 512)


def test_cli_writes_the_table_and_json(tmp_path, capsys):
    main(["--head-sizes", "128", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| 128 | swizzled | 128 | 32 (32) | 128 (128) | 16.0 |" in out
    assert (tmp_path / "stage_layout.json").exists()
    assert [r["layout"] for r in model([64])] == ["padded", "swizzled", "nvfp4"]
    with pytest.raises(SystemExit):
        main(["--head-sizes", "x"])
