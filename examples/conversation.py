"""A multi-turn conversation in Python: one KV cache across turns, streamed replies.

    python examples/conversation.py [MODEL]      # default: the packaged SmolLM2-135M-Instruct
"""
import sys

import fucina

llm = fucina.load(sys.argv[1] if len(sys.argv) > 1 else None)
chat = llm.chat(system="You are a concise assistant.", max_tokens=64, seed=1)
for message in ("What is the capital of France?", "And of Italy?"):
    print(f"> {message}")
    for piece in chat.stream(message):           # the reply as it is generated
        print(piece, end="", flush=True)
    print()
print(f"({len(chat.messages)} messages in the conversation)")
