"""The engine thread: slots, scheduling, one llama_decode per step, pool operations."""
