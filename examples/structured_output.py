"""Structured output: a pydantic model, a regex and a choice list constrain the reply.

    python examples/structured_output.py [MODEL]
"""
import sys

from pydantic import BaseModel, ConfigDict, Field

import fucina


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")            # no extra keys: the JSON ends after these
    name: str = Field(max_length=40)
    population: int = Field(ge=0, le=100_000_000)        # bounded, so a small sampled model finishes


llm = fucina.load(sys.argv[1] if len(sys.argv) > 1 else None)
chat = llm.chat(json_schema=City, max_tokens=96, temperature=0.8, seed=1)
city = City.model_validate_json(chat.send("Describe Paris as JSON."))
print(city)
print(llm.generate("Is water wet? Answer:", max_tokens=8, regex=" (yes|no)\\.", seed=1))
print(llm.generate("My favourite colour is", max_tokens=4, choices=[" red", " blue"], seed=1))
