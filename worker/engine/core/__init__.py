"""The engine core: the step loop (``EngineCore``) and its records: requests and their
sequences, the scheduler and the paged KV block manager, per-step outputs and their packing
into the wire's CompletionDeltas.  ``engine_core`` wires the features; the rest knows none."""
