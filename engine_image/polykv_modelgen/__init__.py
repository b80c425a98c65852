"""Deterministic GGUF models for tests and benchmarks (random weights, a trained BPE vocab)."""
