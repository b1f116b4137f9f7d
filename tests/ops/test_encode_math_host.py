"""csrc/encode_math.h's E2M1 forms against its threshold form (e2m1_code), compiled for the host.

The CUDA NVFP4 write packs e2m1_code_biased (the code unmasked, its sign from a select of the
rounding constant); the CPU kernel uses e2m1_code. Every non-NaN float32 in the binades where the
codes change ([2^-4, 16) of either sign) is checked, and every 61st bit pattern elsewhere.
"""
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHECK = r"""
#include "encode_math.h"
#include <cstdio>
using namespace kvfuse;
static unsigned long long checked = 0, bad = 0;
static void check(uint32_t b) {
  const float q = bits_to_float(b);
  if (q != q) return;
  ++checked;
  const uint32_t ref = e2m1_code(q);
  const uint32_t biased = e2m1_code_biased(q) - kE2m1CodeBias;
  if (biased != ref || e2m1_code_not_nan(q) != ref) {
    if (bad++ < 8) std::printf("q bits %08x: e2m1_code %u, biased %u, not_nan %u\n", b, ref, biased, e2m1_code_not_nan(q));
  }
}
int main() {
  for (uint32_t sign = 0; sign < 2; ++sign) {
    const uint32_t lo = (sign << 31) | (123u << 23), hi = (sign << 31) | (131u << 23);  // [2^-4, 16)
    for (uint32_t b = lo; b < hi; ++b) check(b);
  }
  for (uint64_t b = 0; b <= 0xFFFFFFFFull; b += 61) check(static_cast<uint32_t>(b));
  const uint32_t specials[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x80000001u, 0x7F800000u, 0xFF800000u,
                               0x3E800000u, 0x3E800001u, 0x40A00000u, 0x40A00001u, 0x40C00000u, 0x7F7FFFFFu};
  for (uint32_t b : specials) check(b);
  std::printf("checked %llu, mismatches %llu\n", checked, bad);
  return bad != 0;
}
"""


@pytest.fixture(scope="module")
def e2m1_check(tmp_path_factory):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no host C++ compiler")
    build = tmp_path_factory.mktemp("e2m1")
    (build / "check.cpp").write_text(CHECK)
    exe = build / "check"
    subprocess.run([compiler, "-O2", "-std=c++17", f"-I{REPO / 'csrc'}", str(build / "check.cpp"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


def test_e2m1_codes_agree_with_the_threshold_form(e2m1_check):
    run = subprocess.run([str(e2m1_check)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    checked = int(run.stdout.split("checked ")[1].split(",")[0])
    assert checked > 2 * 8 * (1 << 23), run.stdout  # the dense band alone is 2 x 8 binades
