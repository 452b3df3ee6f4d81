"""fucina: a Python runtime for GGUF language models.

    import fucina
    llm = fucina.load()                 # default model: SmolLM2-135M-Instruct Q4_1
    print(llm.generate("The capital of France is", max_tokens=16, temperature=0))  # greedy
    chat = llm.chat(system="Be brief.")  # sampled: the model's recommendation or llama.cpp's defaults
    print(chat.send("Hello!"))
"""
import contextlib
import gc

__version__ = "0.1.0"
__all__ = ["load", "LLM", "__version__"]


@contextlib.contextmanager
def _gc_paused():
    """No cyclic GC while torch imports and a model loads: both allocate hundreds of
    thousands of long-lived objects, and collections re-scanning them were ~0.25 s CPU
    of a cold start. The previous state comes back after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load(path=None, **kw):
    """Open a GGUF as an LLM (None: the default model); the keywords are
    fucina.text.api.load's (n_ctx, cache_type, lora, lora_scale)."""
    with _gc_paused():
        from fucina.text import api
        return api.load(path, **kw)


def __getattr__(name):
    # lazy: `import fucina.gguf` must not pull in torch-heavy layers above it
    if name == "LLM":
        with _gc_paused():
            from fucina.text import api
        return api.LLM
    raise AttributeError(f"module 'fucina' has no attribute {name!r}")
