"""The steady-state loop finder of stable_attn/kernels/triton_aot.py, on listings and on a real compiled kernel.

benchmarks/kernel_resources.py reports ``loop_sass`` and ``R`` from :func:`triton_aot.steady_loop`;
these tests check that it finds the loop a kernel spends its time in: on hand-written SASS with
the shapes ptxas produces (an outer loop, barrier-wait spins, a slow path after the last EXIT that
branches back into the loop, the trap after the end), and on a small Triton kernel compiled for
sm_80 and sm_90 whose masked stretch comes first in the code and is longer than the unmasked one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton
import triton.language as tl

from stable_attn.kernels import triton_aot as aot

BLOCK = 64
WARPS = 4


def listing(body: list[str]) -> str:
    """A ``cuobjdump -sass`` listing of one function, 16 bytes per instruction."""
    lines = ["\tcode for sm_90a", "\t\tFunction : k"]
    for i, ins in enumerate(body):
        lines.append(f"        /*{16 * i:04x}*/                   {ins} ;       /* 0x0000000000000000 */")
        lines.append("                                                             /* 0x000fe20000000000 */")
    return "\n".join(lines)


def test_steady_loop_on_a_listing():
    body = [
        "MOV R1, c[0x0][0x28]",  # 0x00
        "ISETP.GE.AND P0, PT, R2, R3, PT",  # 0x10
        "IADD3 R4, R4, 0x1, RZ",  # 0x20  the outer loop starts here
        "HMMA.16816.F32.BF16 R8, R12, R16, R8",  # 0x30  masked stretch 0x30..0x90, 7 instructions
        "FSEL R8, R8, -INF, P1",  # 0x40
        "FSEL R9, R9, -INF, P1",  # 0x50
        "FSEL R10, R10, -INF, P1",  # 0x60
        "FSEL R11, R11, -INF, P1",  # 0x70
        "FSEL R12, R12, -INF, P1",  # 0x80
        "@P1 BRA 0x30",  # 0x90
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [R5], R6",  # 0xa0  unmasked stretch 0xa0..0xf0, 6 instructions
        "@!P2 BRA 0x150",  # 0xb0  to the slow path after EXIT
        "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24",  # 0xc0
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",  # 0xd0
        "@P3 BRA 0xd0",  # 0xe0  a spin without tensor-core work: not a candidate
        "@P0 BRA 0xa0",  # 0xf0
        "@P4 BRA 0x20",  # 0x100  the outer loop (contains both stretches)
        "@P5 EXIT",  # 0x110
        "STG.E [R2], R8",  # 0x120
        "EXIT",  # 0x130
        "BRA 0x140",  # 0x140 the trap
        "SYNCS.PHASECHK.TRANS64 P2, [R5], R6",  # 0x150 slow path
        "@!P2 BRA 0x150",  # 0x160
        "BRA 0xc0",  # 0x170 back into the loop: after the last EXIT, so no loop
    ]
    instrs = aot.parse_sass(listing(body))
    assert [a for a, _ in instrs] == [16 * i for i in range(len(body))]
    loops = aot.find_loops(instrs)
    assert {(lp.start, lp.end) for lp in loops} == {(0x30, 0x90), (0xd0, 0xe0), (0xa0, 0xf0), (0x20, 0x100)}
    best = aot.steady_loop(instrs)
    assert (best.start, best.end, best.sass, best.mma) == (0xa0, 0xf0, 6, 1)
    # the same loop by operation (predicates and modifiers dropped), most frequent first
    ops = aot.loop_opcodes(instrs)
    assert ops == {"BRA": 3, "HGMMA": 1, "SYNCS": 1, "WARPGROUP": 1} and list(ops)[0] == "BRA"
    assert sum(ops.values()) == best.sass


def test_steady_loop_refuses_a_listing_without_matrix_loops():
    with pytest.raises(ValueError, match="no loop with tensor-core"):
        aot.steady_loop(aot.parse_sass(listing(["IADD3 R1, R1, 0x1, RZ", "@P0 BRA 0x0", "EXIT"])))
    with pytest.raises(ValueError, match="one kernel"):
        aot.parse_sass(listing(["EXIT"]) + "\n\t\tFunction : other\n")


@triton.jit
def two_stretch_kernel(A, B, C, n_part, n_all, BLOCK: tl.constexpr):
    """``C = A @ B[0:n_all]`` summed over key blocks: a masked stretch first, then an unmasked one."""
    offs = tl.arange(0, BLOCK)
    a = tl.load(A + offs[:, None] * BLOCK + offs[None, :])
    acc = tl.zeros([BLOCK, BLOCK], tl.float32)
    for start in range(0, n_part, BLOCK):
        rows = start + offs
        b = tl.load(B + rows[:, None] * BLOCK + offs[None, :], mask=rows[:, None] < n_all, other=0.0)
        s = tl.dot(a, b)
        acc += tl.where(offs[None, :] <= rows[:, None] - n_part, s, float("-inf"))
    for start in range(n_part, n_all, BLOCK):
        b = tl.load(B + (start + offs)[:, None] * BLOCK + offs[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(C + offs[:, None] * BLOCK + offs[None, :], acc)


def compile_two_stretch(cc: int) -> dict:
    """Compile the kernel above for ``sm_{cc}``; what the finder sees in its SASS."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    align = [["tt.divisibility", 16]]
    src = ASTSource(fn=two_stretch_kernel, constexprs={"BLOCK": BLOCK},
                    signature={"A": "*bf16", "B": "*bf16", "C": "*fp32", "n_part": "i32", "n_all": "i32",
                               "BLOCK": "constexpr"},
                    attrs={(0,): align, (1,): align, (2,): align})
    kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(num_warps=WARPS, num_stages=2))
    instrs = aot.parse_sass(aot.sass_of(kernel.asm["cubin"]))
    best = aot.steady_loop(instrs)
    mma_loops = [lp for lp in aot.find_loops(instrs) if lp.mma > 0]

    def text(lp):
        return " ".join(i for a, i in instrs if lp.start <= a <= lp.end)

    return dict(best=best._asdict(), loops=[lp._asdict() for lp in mma_loops],
                texts=[text(lp) for lp in mma_loops], wgmma="wgmma" in kernel.asm["ptx"])


@pytest.fixture(scope="module")
def compiled():
    # a fresh interpreter without TRITON_INTERPRET (this process runs the interpreter)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return {int(cc): r for cc, r in json.loads(done.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("cc", [80, 90])
def test_steady_loop_of_a_compiled_kernel(compiled, cc):
    r = compiled[cc]
    best, loops = r["best"], r["loops"]
    # two stretches, two loops with matrix instructions; the masked one is first and longer
    assert len(loops) == 2 and loops[0]["start"] < loops[1]["start"]
    assert "INF" in r["texts"][0] and "INF" not in r["texts"][1]
    assert best == loops[1] and best["sass"] < loops[0]["sass"]
    # exactly one iteration's matrix work: 64x64x64 per program, split over the warps
    if cc == 80:  # mma.sync m16n8k16, one per warp and 4096 FLOPs
        assert not r["wgmma"] and best["mma"] == 2 * BLOCK**3 // (2 * 16 * 8 * 16) // WARPS
    else:  # one warpgroup: wgmma 64x64x16, issued by every warp of the group
        assert r["wgmma"] and best["mma"] == BLOCK // 16
    assert best["sass"] == (best["end"] - best["start"]) // 16 + 1


def test_iteration_flops():
    assert aot.iteration_flops("fwd", 128, 64, 128) == 2 * 2 * 128 * 64 * 128
    assert aot.iteration_flops("bwd_dkdv", 64, 128, 128) == 4 * 2 * 64 * 128 * 128
    assert aot.iteration_flops("bwd_dq", 128, 64, 64) == 3 * 2 * 128 * 64 * 64
    assert aot.iteration_flops("bwd_fused", 64, 128, 64) == 5 * 2 * 64 * 128 * 64
    # a value head dim of its own: P V (fwd), dP and dV (dK/dV), dP (dQ) run over it
    assert aot.iteration_flops("fwd", 32, 128, 256, 128) == 2 * 32 * 128 * (256 + 128)
    assert aot.iteration_flops("bwd_dkdv", 16, 32, 256, 128) == 2 * 16 * 32 * (2 * 256 + 2 * 128)
    assert aot.iteration_flops("bwd_dq", 32, 16, 256, 128) == 2 * 32 * 16 * (2 * 256 + 128)


if __name__ == "__main__":
    print(json.dumps({cc: compile_two_stretch(cc) for cc in (80, 90)}))
