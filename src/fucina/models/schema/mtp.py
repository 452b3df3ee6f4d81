"""The NextN (multi-token-prediction) block's own tensors, torch-free: `blk.{i}.nextn.*`
beside that block's layer tensors (GLM-4.5, DeepSeek-V3 and the heads `fucina mtp train`
writes share the names). A head file of its own carries the `mtp.*` keys below."""
from __future__ import annotations

from fucina.models.schema.base import BaseConfig, TensorSpec, tensor_dims
from fucina.models.schema.llama import T, norm

NEXTN: tuple[TensorSpec, ...] = (
    T("nextn.eh_proj", "n_embd", "eh_in"), norm("nextn.enorm"), norm("nextn.hnorm"),
    T("nextn.embed_tokens", "n_vocab", "n_embd", required=False),
    T("nextn.shared_head_head", "n_vocab", "n_embd", required=False), norm("nextn.shared_head_norm", required=False),
)

# a head file's architecture and keys (models/mtp.py reads them, train/mtp.py writes them)
HEAD_ARCH = "fucina-mtp"
KEY_BASE_ARCH = "mtp.base_architecture"
KEY_N_EMBD = "mtp.embedding_length"
KEY_N_VOCAB = "mtp.vocab_size"
KEY_BLOCK = "mtp.block"              # the layer index its tensors are named with
KEY_DRAFT_VOCAB = "mtp.draft_vocab"  # token ids the draft head scores (the most frequent), optional


def dims(c: BaseConfig) -> dict[str, int]:
    return dict(tensor_dims(c), n_vocab=c.n_vocab, eh_in=2 * c.n_embd)
