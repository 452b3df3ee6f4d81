"""The Anthropic Python client against `fucina serve` (its /v1/messages route).

    fucina serve --port 8080 &
    python examples/anthropic_client.py [URL]     # default http://127.0.0.1:8080
"""
import sys

from anthropic import Anthropic

url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080"
client = Anthropic(base_url=url, api_key="none")
msg = client.messages.create(model="any", max_tokens=16,
                             messages=[{"role": "user", "content": "Say hello in French."}])
print(msg.content[0].text)

with client.messages.stream(model="any", max_tokens=16,
                            messages=[{"role": "user", "content": "Count to five."}]) as stream:
    for text in stream.text_stream:
        print(text, end="", flush=True)
print()
