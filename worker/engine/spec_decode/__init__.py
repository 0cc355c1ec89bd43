"""Speculative decoding: draft proposers (ngram.py) and the verification that keeps
outputs exactly those of ordinary decoding (verify.py); config.py parses vLLM's
--speculative-config."""
