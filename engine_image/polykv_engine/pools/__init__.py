"""The pool tree, its materialization into the KV cache, and its wire listing."""
