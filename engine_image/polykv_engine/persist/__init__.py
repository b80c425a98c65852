"""KV snapshots on disk: what makes saved cells valid, the file format, and the store."""
