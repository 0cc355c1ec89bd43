"""Getting a model into the engine (its HF config lives with the models: ``models/config.py``):
the checkpoint loader and the checkpoint-name weight map (``loader``, ``weights``), the model a rank runs (``model_setup``)
and the seeded demo model (``demo_model``)."""
