"""Build of fucina's native kernels (csrc/) as fucina.kernels._native.

Portable x86-64: no -march=native. Each ISA unit (scalar, AVX2, AVX2 + AVX-VNNI, AVX-512 VNNI) carries
its own `#pragma GCC target`, and the module picks one at import time from CPUID.
OpenMP: the extension links libgomp by its soname, which resolves to the copy torch
already loaded (fucina.kernels imports torch first), so torch and the kernels share
one thread pool.
"""
import glob
import platform

from setuptools import Extension, setup

# csrc/: units compiled once at the top (module.cpp: the Python module; fk_delta.cpp), one
# unit per ISA in isa/ (its matmul, attention and step, exported as one fk_isa table), the
# ISA-generic templates those units include in generic/
sources = ["csrc/module.cpp", "csrc/fk_delta.cpp", "csrc/fk_kda.cpp", "csrc/fk_dsv4.cpp", "csrc/isa/scalar.cpp"]
x86 = platform.machine().lower() in ("x86_64", "amd64")
if x86:
    sources += ["csrc/isa/avx2.cpp", "csrc/isa/avx2vnni.cpp", "csrc/isa/avx512.cpp"]

ext = Extension(
    "fucina.kernels._native",
    sources=sources,
    depends=["csrc/fk_common.h", "csrc/isa/avx2.cpp", "csrc/fk_plan.h", "csrc/fk_delta.h", "csrc/fk_kda.h", "csrc/fk_dsv4.h", *sorted(glob.glob("csrc/generic/*.inc")),
             *sorted(glob.glob("csrc/isa/*.inc"))],
    include_dirs=["csrc"],
    define_macros=[("FK_X86", "1")] if x86 else [],
    extra_compile_args=["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                        "-Wall", "-Wno-unused-function"],
    extra_link_args=["-fopenmp"],
    language="c++",
)

# the tokenizer's BPE / SentencePiece merge loops (fucina.text.tokenizer falls back to
# pure Python when this module is absent)
tokenizer_merge = Extension(
    "fucina.text.tokenizer._merge",
    sources=["csrc/tokenizer/merge_module.cpp"],
    extra_compile_args=["-O2", "-std=c++17", "-Wall"],
    language="c++",
)

# the Engram layer's inference forward (fucina.kernels.engram; its own ISA sections)
engram = Extension(
    "fucina.kernels._engram",
    sources=["csrc/engram_module.cpp"],
    depends=["csrc/generic/engram_impl.inc", "csrc/isa/avx2_engram.inc", "csrc/isa/avx512_engram.inc"],
    include_dirs=["csrc"],
    define_macros=[("FK_X86", "1")] if x86 else [],
    extra_compile_args=["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-Wall"],
    extra_link_args=["-fopenmp"],   # the projections inside the decoder step: the step's pool
    language="c++",
)

# the PTQTP solver (fucina.quant.ptqtp; falls back to its torch formulation when absent): no
# ISA pragmas and no FMA, so every x86-64 host writes the same planes
ptqtp = Extension(
    "fucina.quant._ptqtp",
    sources=["csrc/ptqtp_solve.cpp"],
    extra_compile_args=["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-Wall"],
    extra_link_args=["-fopenmp"],
    language="c++",
)

setup(ext_modules=[ext, tokenizer_merge, engram, ptqtp])
