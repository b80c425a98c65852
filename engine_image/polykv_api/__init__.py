"""The PolyKV wire contract (pydantic models) and its HTTP client."""
