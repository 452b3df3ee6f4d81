"""ExpertStack: a mixture-of-experts weight stack [n_expert, out, in] kept in its GGUF type.

The stack is one GGUF tensor (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`); each
expert's rows are contiguous in it, so expert e is a zero-copy LinearWeight over rows
[e * out, (e + 1) * out) of the mapped bytes, with the same native kernel as any other
weight. `whole` is the stack as one [n_expert * out, in] matrix: what the native layer
step is handed (it offsets into it per expert).
"""
from __future__ import annotations

from fucina.errors import FucinaError
from fucina.gguf import TensorInfo
from fucina.weights.linear import LinearWeight


class ExpertStack:
    def __init__(self, whole: LinearWeight, n_expert: int):
        if n_expert < 1 or whole.out_features % n_expert:
            raise FucinaError(f"{whole.name}: {whole.out_features} rows do not split into {n_expert} experts")
        self.whole, self.n_expert = whole, n_expert
        self.out_features, self.in_features = whole.out_features // n_expert, whole.in_features
        self.qtype, self.name = whole.qtype, whole.name
        self._experts: list[LinearWeight | None] = [None] * n_expert

    @classmethod
    def from_tensor(cls, t: TensorInfo) -> "ExpertStack":
        if len(t.ne) != 3:
            raise FucinaError(f"{t.name}: an expert stack is 3-d [in, out, n_expert], got ne={list(t.ne)}")
        return cls(LinearWeight.from_tensor(t), int(t.ne[2]))

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.n_expert, self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.whole.nbytes

    def expert(self, e: int) -> LinearWeight:
        """Expert e's [out, in] matrix: a view of the stack's bytes (made once, then kept)."""
        w = self._experts[e]
        if w is None:
            n = self.out_features
            w = LinearWeight(self.whole.raw[e * n:(e + 1) * n], self.qtype, n, self.in_features,
                             f"{self.name}[{e}]")
            from fucina.kernels import attach  # lazy, as LinearWeight does
            attach(w)
            self._experts[e] = w
        return w

    def __repr__(self) -> str:
        return f"ExpertStack({self.name!r}, {self.qtype.name}, {self.shape})"
