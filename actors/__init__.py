"""The engine and what runs it, one sub-package per job.

- ``engine``: one replica's step loop (``LLMEngine``), outputs, stats, the executor seam, P/D's engine side.
- ``runner``: the model on one device: forward, sampling, draft verification, drafting.
- ``models``: the model families (layers, linears, architecture registry).
- ``load``: weights into a model: Hugging Face folders, GGUF, quantized formats, cache, presets.
- ``grammar``: structured output's constraints and token masks.
- ``remote``: the Ray glue: scheduler and shard actors, Ray executor, step channel, process groups.

The modules here are what every job shares and import none of them:
``config`` (``EngineConfig``), ``quant_methods``, ``errors``, ``log``.
"""
