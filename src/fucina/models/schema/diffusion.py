"""What a text-diffusion family adds to its config (torch-free): the mask token the canvas
starts from (`tokenizer.ggml.mask_token_id`) and whether position p reads the logits of
row p - 1 (`diffusion.shift_logits`; absent: true, as llama-diffusion-cli reads it)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fucina.errors import GGUFError
from fucina.gguf import GGUFFile

MASK_KEY = "tokenizer.ggml.mask_token_id"
SHIFT_KEY = "diffusion.shift_logits"


@dataclass
class DiffusionFields:
    """Mixed into a family's Config before its base: the canvas attends both ways, and the
    diffusion keys are read after the base's own."""
    mask_token_id: int = -1
    shift_logits: bool = True
    causal: bool = False

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        self.read_diffusion(f)

    def read_diffusion(self, f: GGUFFile) -> None:
        m = f.metadata
        mask = m.get(MASK_KEY)
        if mask is None:
            raise GGUFError(f"{f.path}: a {self.arch} model needs {MASK_KEY} (the token a canvas starts from)")
        if isinstance(mask, bool) or not isinstance(mask, (int, np.integer)) or not 0 <= int(mask) < self.n_vocab:
            raise GGUFError(f"{f.path}: {MASK_KEY} = {mask!r} is not a token id below {self.n_vocab}")
        self.mask_token_id = int(mask)
        shift = m.get(SHIFT_KEY, True)
        if not isinstance(shift, (bool, np.bool_)):
            raise GGUFError(f"{f.path}: {SHIFT_KEY} = {shift!r} is not a boolean")
        self.shift_logits = bool(shift)
