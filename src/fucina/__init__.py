"""fucina: a Python runtime for GGUF language models.

    import fucina
    llm = fucina.load()                 # default model: SmolLM2-135M-Instruct Q4_1
    print(llm.generate("The capital of France is", max_tokens=16, temperature=0))  # greedy
    chat = llm.chat(system="Be brief.")  # sampled: the model's recommendation or llama.cpp's defaults
    print(chat.send("Hello!"))

`load` computes nothing and imports no torch: the decoder is built on the first compute.
"""
__version__ = "0.1.0"
__all__ = ["load", "LLM", "__version__"]


def load(path=None, **kw):
    """Open a GGUF as an LLM (None: the default model); the keywords are
    fucina.text.api.load's (n_ctx, cache_type, lora, lora_scale, moe_ram, moe_policy, engram)."""
    from fucina.text import api

    with api.gc_paused():          # the vocabulary is ~10^5 long-lived strings; nothing to collect yet
        return api.load(path, **kw)


def __getattr__(name):
    # lazy: `import fucina.gguf` must not pull in the layers above it
    if name == "LLM":
        from fucina.text import api
        return api.LLM
    raise AttributeError(f"module 'fucina' has no attribute {name!r}")
