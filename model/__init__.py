"""What actor and learner share about the model: the decoder and its KV cache (``decoder``), the
sampler's truncation rule (``sampling``), HF-format load/save (``hf``), the checkpoint's
tokenizer and special ids (``tokenizer``), and the tiny base-model builder (``basemodel``).

Imports flow one way: core <- model <- {actor, learner}.
"""
