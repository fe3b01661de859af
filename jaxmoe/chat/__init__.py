"""Chat: the tokenizer, the native chat format, prompt rendering, output parsing, constrained decoding."""
