"""Batch invariance on the torch blocks. Families without a native layer step serve from
them (and every family does under FUCINA_NATIVE_STEP=0 or with a q8_0 cache), so a row's
logits must not depend on the chunk or the verify block it was computed in there either:
speculation is lossless only if a verify row equals the decode step it stands for. Steps
of up to base.ROWWISE_MAX rows are bitwise the token-by-token decode; longer prefill
chunks take one SDPA call per layer and are only close (models/base.py says why)."""
from __future__ import annotations

import gguf
import pytest
import torch

import fucina.kernels as K
from fucina.models import load_model
from synth import ARCHS, chunked_logits, write_model

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built")

IDS = [3 + (37 * i) % 97 for i in range(23)]
CHUNKINGS = ((1,) * 23, (9, 1, 1, 12), (4,) * 5 + (3,), (16, 7))


def _logits(model, chunks) -> torch.Tensor:
    return chunked_logits(model, IDS, chunks, native=False)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_torch_blocks_rows_do_not_depend_on_chunking(arch, qtype, tmp_path):
    model = load_model(write_model(tmp_path / "m.gguf", arch, layers=2,
                                   qtype=getattr(gguf.GGMLQuantizationType, qtype)))
    decoded = _logits(model, CHUNKINGS[0])
    for chunks in CHUNKINGS[1:]:
        got = _logits(model, chunks)
        assert torch.equal(got, decoded), f"{chunks}: max |d| {(got - decoded).abs().max().item():.3g}"
