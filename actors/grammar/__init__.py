"""Structured output: compile a request's constraint once (``compiler``), keep one matcher per
sequence and turn its state into token masks for the sampler each step (``states``, ``masks``)."""
