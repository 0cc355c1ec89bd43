"""Attention over the paged KV cache: the per-step batch layout every backend reads
(``metadata``), the backends themselves (``backends/``: torch SDPA, the compiled CPU
kernels, Triton for CUDA, FlashAttention when installed) and the choice between them
(``selector``)."""
