"""The Ray glue: the scheduler actor, the model-shard actors, the Ray executor, the step channel between them, process groups and thread rules."""
