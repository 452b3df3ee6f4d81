"""Torch-free family schemas: each family's config (its GGUF keys, defaults and
consistency checks) and the tensors its decoder reads (names, shapes, which are optional,
which combinations a layer needs), one module per family, the family module's torch-free
half (`fucina.models.<family>` re-exports it and builds from it).

`fucina.load()` runs a family's `Schema.check(f)` on the opened file (metadata and tensor
headers only: no torch, no weight bytes read) so a broken file fails at load; the decoder
build runs the same check and reads its tensors from the table it returns
(`schema.base.Tensors`), so the two cannot disagree.
"""
