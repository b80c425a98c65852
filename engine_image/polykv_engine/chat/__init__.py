"""Chat formats: the model's template, tool definitions and tool calls in and out."""
