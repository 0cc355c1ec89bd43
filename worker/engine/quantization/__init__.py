"""Quantized checkpoints (issue 43): which formats load, and how their weights become
the tensors the model's layers hold.

``config.py`` reads a checkpoint's ``quantization_config`` (or ``compression_config``)
into a ``CheckpointQuantization``: what each linear layer stores and how; ``dequant.py``
holds the per-format unpacking math (pure torch); ``reader.py`` sits between the
checkpoint's tensor stream and the loader, turning each quantized layer's tensors
(packed weights, scales, zero points, group indices) into its dense weight.
"""
