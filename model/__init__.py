"""What actor and learner share about the model: decoder, KV cache, sampler rule, HF load/save,
tokenizer, tiny base-model builder. Imports flow one way: core <- model <- {actor, learner}."""
