"""fucina.kernels: native kernels and their thin Python wrappers.

`attach(weight)` gives a LinearWeight a fast `kernel` callable when a native route
exists for its format; otherwise the weight keeps the reference path.
"""


def attach(weight) -> None:
    weight.kernel = None
