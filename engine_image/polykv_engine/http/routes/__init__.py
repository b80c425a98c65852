"""Route handlers: inference (llama-server / OpenAI), info, pools."""
