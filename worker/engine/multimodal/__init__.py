"""Image input of vision-language models in the engine (``images``: admission checks, the
encoder cache, the step's image inputs, memory profiling)."""
