"""Sampling: the per-step sampling inputs (``sampling_metadata``), the sampler and logprobs."""
