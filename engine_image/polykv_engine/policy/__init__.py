"""Pure decisions (admission, tps): no llama_cpp, no clock of their own, no I/O."""
