/* AVX2 + AVX-VNNI (vpdpbusd on ymm: Alder Lake, Zen 5): the AVX2 unit compiled again with its
 * int8 dots (dot4 and the panel kernel's pair sums) as vpdpbusd. The same int32 sums, so the
 * same output bits as isa/avx2.cpp (tests/test_kernels.py checks it per format). */
#define FK_AVX2_VNNI 1
#include "avx2.cpp"
