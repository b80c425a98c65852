"""PolyKV engine: a llama.cpp server with first-class shared-prefix KV pools."""

__version__ = "0.1.0"
