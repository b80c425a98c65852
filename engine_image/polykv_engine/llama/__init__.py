"""The only code that imports ``llama_cpp``: model, context, batch, sampler, KV primitives."""
