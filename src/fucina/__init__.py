"""fucina: a Python runtime for GGUF language models.

    import fucina
    llm = fucina.load()                 # default model: SmolLM2-135M-Instruct Q4_1
    print(llm.generate("The capital of France is", max_tokens=16, temperature=0))  # greedy
    chat = llm.chat(system="Be brief.")  # sampled: the model's recommendation or llama.cpp's defaults
    print(chat.send("Hello!"))
"""
__version__ = "0.1.0"
__all__ = ["load", "LLM", "__version__"]


def __getattr__(name):
    # lazy: `import fucina.gguf` must not pull in torch-heavy layers above it
    if name in ("load", "LLM"):
        from fucina.text import api
        return getattr(api, name)
    raise AttributeError(f"module 'fucina' has no attribute {name!r}")
