"""The model runner (one step's batch layout and forward pass) and the hooks through which
features plug into it (``hooks``)."""
