"""The model on a device: the runner that turns a ``Batch`` into a forward, the sampler, draft verification, drafting, and the model families (``models/``)."""
