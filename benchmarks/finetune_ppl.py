"""What a LoRA adapter does to SmolLM2's perplexity, per kernel route and merge type (the
table in BENCHMARK.md's "LoRA perplexity shift"): the adapter of
tests/test_train_export.py's llama.cpp check, merged by apply_adapters.

    FUCINA_INVARIANT=1|0 [FUCINA_LORA_MERGE=Q8_0|F16] [NATIVE=0] python benchmarks/finetune_ppl.py
"""
import os
import sys
from pathlib import Path

import fucina.kernels as K
from fucina.models import load_model
from fucina.text.evaluate import perplexity
from fucina.text.tokenizer import Tokenizer
from fucina.train.adapters import apply_adapters, read_adapter, write_adapter

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from test_train_export import smollm2_adapter_pairs  # noqa: E402 (the test's adapter)

K.set_threads(1)
if os.environ.get("NATIVE") == "0":
    K.set_enabled(False)   # the exact figure: torch f32 on the dequantized weights
path = os.environ.get("MODEL", os.path.expanduser("~/.cache/fucina/SmolLM2-135M-Instruct.Q4_1.gguf"))
model = load_model(path)
adapter = write_adapter("/tmp/fucina-ppl-adapter.gguf", model.config.arch, 16.0, smollm2_adapter_pairs(model))
text = (Path(__file__).parent.parent / "tests" / "data" / "ppl.txt").read_text()[:2500]
tok = Tokenizer.from_metadata(model.gguf.metadata)
ids = tok.encode(text, add_special=True, parse_special=False)
bos = tok.bos_id if tok.add_bos else None
plain, _ = perplexity(model, ids, 128, bos)
apply_adapters(model, [(read_adapter(adapter), 1.0)])
lora, _ = perplexity(model, ids, 128, bos)
print(f"invariant={os.environ.get('FUCINA_INVARIANT', '1')} merge={os.environ.get('FUCINA_LORA_MERGE') or 'unmerged'} "
      f"native={os.environ.get('NATIVE', '1')}: plain {plain:.4f} lora {lora:.4f} ratio {lora / plain:.4f}")
