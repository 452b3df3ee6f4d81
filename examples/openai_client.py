"""The OpenAI Python client against `fucina serve`: a reply, a stream, and parsed JSON.

    fucina serve --port 8080 &
    python examples/openai_client.py [URL]        # default http://127.0.0.1:8080
"""
import sys

from openai import OpenAI
from pydantic import BaseModel, Field

url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080"
client = OpenAI(base_url=url + "/v1", api_key="none")
messages = [{"role": "user", "content": "Name a city in France."}]

r = client.chat.completions.create(model="any", messages=messages, max_tokens=16, seed=1)
print(r.choices[0].message.content)

for chunk in client.chat.completions.create(model="any", messages=messages, max_tokens=16, seed=1,
                                            stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


parsed = client.chat.completions.parse(model="any", messages=messages, response_format=City, max_tokens=64,
                                       seed=1)
print(parsed.choices[0].message.parsed)
