"""Running the official vLLM wheel's tree on a machine without vLLM installed (the lent GPU
machine)."""
