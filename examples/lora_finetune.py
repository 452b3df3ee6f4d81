"""LoRA fine-tuning on the quantized GGUF, then chatting with the adapter applied.

    python examples/lora_finetune.py [MODEL] [--steps N]

Writes a few training examples, trains an adapter with `fucina finetune` (a few steps:
a demonstration, not a useful model), and loads it with `fucina.load(..., lora=...)`.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import fucina

ap = argparse.ArgumentParser()
ap.add_argument("model", nargs="?", default="smollm2")
ap.add_argument("--steps", type=int, default=4)
a = ap.parse_args()

examples = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(16)]
with tempfile.TemporaryDirectory() as tmp:
    data = os.path.join(tmp, "train.jsonl")
    with open(data, "w") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in examples)
    out = os.path.join(tmp, "run")
    subprocess.run([sys.executable, "-m", "fucina", "finetune", a.model, "--data", data, "--out", out,
                    "--steps", str(a.steps), "--batch", "2", "--ctx", "128", "--rank", "8"], check=True)
    with open(os.path.join(out, "summary.json")) as fh:
        print("training summary:", {k: v for k, v in json.load(fh).items() if not isinstance(v, (list, dict))})
    llm = fucina.load(a.model, lora=os.path.join(out, "adapter.gguf"))
    print(llm.chat(max_tokens=24, temperature=0).send("What is 7 plus 7?"))
