"""The engine core: the step loop (``EngineCore``), the scheduler and the paged KV block
manager, the step in flight (async scheduling) and the components' context.  The records
they share with the features (requests, sequences, outputs) are the leaf
``worker/engine/records.py``; ``engine_core`` wires the features; the rest knows none."""
