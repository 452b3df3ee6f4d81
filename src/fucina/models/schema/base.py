"""The config reader and the tensor checks every family schema uses (torch-free).

A family's `Config` declares its GGUF keys once (`meta_field`), read by one generic
reader (`BaseConfig.from_gguf`); `finish` derives and checks the rest. Its `Schema` lists
every tensor the decoder reads, in build order, into a `Tensors` table: each entry is
checked against the file's header (present when required, the expected shape) and the
build reads only entries the table holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

import numpy as np

from fucina.errors import FucinaError, GGUFError
from fucina.gguf import GGUFFile, TensorInfo, Zero, meta_float_opt, meta_int_opt
from fucina.gguf.ptqtp import planes_of

REQUIRED = object()   # a meta_field default: the key must be present


def meta_field(key: str, default=REQUIRED, *, kind: type = int, zero_ok: bool = False, derive=None):
    """A config field read from GGUF `<arch>.<key>`: absent (or zero, unless zero_ok) takes
    `derive(values so far)` when given, else `default`; REQUIRED raises."""
    return field(default=None if default is REQUIRED else default,
                 metadata=dict(gguf=key, kind=kind, zero_ok=zero_ok, derive=derive, required=default is REQUIRED))


def _read(meta: dict, arch: str, fl) -> object:
    md = fl.metadata
    key = f"{arch}.{md['gguf']}"
    if md["kind"] is float:
        v = meta_float_opt(meta, arch, md["gguf"])
    else:
        v = meta_int_opt(meta, arch, md["gguf"], Zero.ACCEPT if md["zero_ok"] else Zero.REJECT)
        if v is None and key in meta and not isinstance(meta[key], (int, np.integer)):
            raise GGUFError(f"metadata {key} = {meta[key]!r} is not an integer")
    return v


@dataclass
class LayerSpec:
    """What one layer is: its mixer and ffn kinds, its KV geometry, window, RoPE table."""
    mixer: str = "attention"
    ffn: str = "dense"
    n_head: int = 0
    n_head_kv: int = 0
    head_dim: int = 0
    v_dim: int = 0
    window: int = 0        # 0: every position; > 0: sliding window (a WindowKV memory)
    rope: int = 0          # which of the model's RoPE tables


@dataclass
class BaseConfig:
    """Every family's config: fields declared once with their GGUF key and default, read
    by one generic reader (`from_gguf`); a family adds fields the same way and derives
    the rest in `finish`."""
    arch: str = ""
    n_embd: int = meta_field("embedding_length")
    n_layer: int = meta_field("block_count")
    n_head: int = meta_field("attention.head_count")
    n_head_kv: int = meta_field("attention.head_count_kv", derive=lambda v: v["n_head"])
    head_dim: int = meta_field("attention.key_length", derive=lambda v: v["n_embd"] // v["n_head"])
    v_dim: int = meta_field("attention.value_length", derive=lambda v: v["head_dim"])
    n_ff: int = meta_field("feed_forward_length")
    n_ctx_train: int = meta_field("context_length", 4096)
    rms_eps: float = meta_field("attention.layer_norm_rms_epsilon", kind=float)
    rope_base: float = meta_field("rope.freq_base", 10000.0, kind=float)
    n_rot: int = meta_field("rope.dimension_count", derive=lambda v: v["head_dim"])
    n_vocab: int = meta_field("vocab_size", 0)
    rope_scale: float = 1.0
    layers: list[LayerSpec] = field(default_factory=list)

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "BaseConfig":
        m, a = f.metadata, f.architecture
        vals: dict = {"arch": a}
        for fl in fields(cls):
            if "gguf" not in fl.metadata:
                continue
            v = _read(m, a, fl)
            if v is None and fl.metadata["derive"] is not None:
                v = fl.metadata["derive"](vals)
            if v is None and fl.metadata["required"]:
                raise GGUFError(f"{f.path}: missing metadata key {a}.{fl.metadata['gguf']}")
            vals[fl.name] = fl.default if v is None else v
        c = cls(**vals)
        c.finish(f)
        if not c.layers:
            c.layers = [c.layer_spec(i) for i in range(c.n_layer)]
        return c

    def finish(self, f: GGUFFile) -> None:
        """Values that need more than one key (a family extends it)."""
        if not self.n_vocab:
            self.n_vocab = f.tensor("token_embd.weight").ne[1]
        if f.metadata.get(f"{self.arch}.rope.scaling.type") == "linear":
            self.rope_scale = 1.0 / (meta_float_opt(f.metadata, self.arch, "rope.scaling.factor") or 1.0)

    def layer_spec(self, i: int) -> LayerSpec:
        return LayerSpec(n_head=self.n_head, n_head_kv=self.n_head_kv, head_dim=self.head_dim,
                         v_dim=self.v_dim)

    def extra_dims(self) -> dict[str, int]:
        """Named dims a family's schema adds (MoE: n_expert, n_ff_exp)."""
        return {}


@dataclass(frozen=True)
class TensorSpec:
    """One per-layer tensor of a family's schema: `blk.{i}.<name>.weight` (or .bias) with
    its shape as named dims (out, in) or (size,); loading and tests/synth.py both read it."""
    name: str
    shape: tuple[str, ...]
    required: bool = True
    role: str = "mat"          # "mat", "norm" (1 + noise in synth) or "bias"
    suffix: str = "weight"

    @property
    def key(self) -> str:
        return self.name if self.suffix == "weight" else f"{self.name}_{self.suffix}"

    def gguf_name(self, i: int) -> str:
        return f"blk.{i}.{self.name}.{self.suffix}"


def tensor_dims(c: BaseConfig) -> dict[str, int]:
    """The named dims a schema's shapes use."""
    q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    return dict(n_embd=c.n_embd, q_out=q, kv_out=kv, v_out=c.n_head_kv * c.v_dim, qkv_out=q + kv + c.n_head_kv * c.v_dim,
                n_ff=c.n_ff, gu_out=2 * c.n_ff, head_dim=c.head_dim, **c.extra_dims())


def check_tensor(f: GGUFFile, name: str, shape: tuple[int, ...], required: bool = True) -> TensorInfo | None:
    """The file's tensor `name` checked against `shape` (torch order): a vector (size,) by
    its element count, a matrix (out, in) as [in, out] rows (outer dims flattened), an
    expert stack (n_expert, out, in) exactly. None when absent and optional."""
    t = f.tensors.get(name)
    if t is None:
        t = planes_of(f, name)   # a PTQTP-decorated matrix: its planes (gguf/ptqtp.py)
    if t is None:
        if required:
            raise GGUFError(f"{f.path}: missing tensor {name!r}")
        return None
    if len(shape) == 1:
        if t.n_elements != shape[0]:
            raise GGUFError(f"{f.path}: tensor {name!r} has {t.n_elements} elements, expected {shape[0]}")
    elif len(shape) == 3:
        if tuple(t.shape) != tuple(shape):
            raise GGUFError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    else:
        rows = (t.n_elements // t.ne[0], t.ne[0]) if len(t.ne) > 1 else (1, t.ne[0])
        if rows != tuple(shape):
            raise GGUFError(f"tensor {name!r} has shape {rows}, expected {tuple(shape)}")
    return t


class Tensors:
    """The checked tensors of one file: what the schema listed, by GGUF name (None: an
    optional tensor the file lacks). The build reads only from here: a name the schema did
    not list is a bug in the family (a FucinaError), never an unchecked read."""

    def __init__(self, f: GGUFFile, config: BaseConfig):
        self.f, self.config = f, config
        self._checked: dict[str, TensorInfo | None] = {}

    def want(self, name: str, shape: tuple[int, ...], required: bool = True) -> TensorInfo | None:
        t = self._checked[name] = check_tensor(self.f, name, shape, required)
        return t

    def layer(self, i: int, schema: Sequence[TensorSpec], dims: dict[str, int]) -> dict[str, TensorInfo | None]:
        """Layer i's tensors of `schema` with its named dims, by spec key."""
        return {s.key: self.want(s.gguf_name(i), tuple(dims[d] for d in s.shape), s.required) for s in schema}

    def __getitem__(self, name: str) -> TensorInfo | None:
        try:
            return self._checked[name]
        except KeyError:
            raise FucinaError(f"{self.f.path}: the {self.config.arch} schema does not list tensor {name!r}") from None

    def __contains__(self, name: str) -> bool:
        """Listed and present in the file."""
        return self._checked.get(name) is not None


class Schema:
    """A dense family's schema (llama's; a family overrides what differs): the config, then
    the globals, every layer's `layer_tensors`, and the extras, in build order."""
    config_class: type[BaseConfig] = BaseConfig
    tensors: tuple[TensorSpec, ...] = ()      # the per-layer schema (tests/synth.py writes it)

    @classmethod
    def check(cls, f: GGUFFile, config: BaseConfig | None = None) -> Tensors:
        """Parse and check `f` against the family: the config, then every tensor the build
        reads. Raises the GGUFError naming the key or tensor; reads no weight bytes."""
        t = Tensors(f, config or cls.config_class.from_gguf(f))
        cls.check_globals(t)
        for i in range(t.config.n_layer):
            cls.check_layer(t, i)
        cls.check_extras(t)
        return t

    @classmethod
    def check_globals(cls, t: Tensors) -> None:
        c = t.config
        t.want("token_embd.weight", (c.n_vocab, c.n_embd))
        t.want("output_norm.weight", (c.n_embd,))
        t.want("output.weight", (c.n_vocab, c.n_embd), required=False)   # absent: tied to the embeddings

    @classmethod
    def check_layer(cls, t: Tensors, i: int) -> None:
        t.layer(i, cls.tensors, tensor_dims(t.config))

    @classmethod
    def check_extras(cls, t: Tensors) -> None:
        t.want("rope_freqs.weight", (t.config.n_rot // 2,), required=False)
