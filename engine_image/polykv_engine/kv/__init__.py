"""Which sequence holds which KV cell: every change applied to llama.cpp and a shadow model."""
