"""The replay buffer: exactly-once, bounded, persistent, hardened against hostile input.

store     resident groups, dedup memory, capacity, accounting invariant (pure)
policies  staleness/consumption policies as plain functions of the policy version
persist   append-only segment log, replay after a crash, compaction
server    the buffer process: ROUTER sockets for actors and learner (``python -m buffer.server``)
client    ActorClient (window, resend, spool) and LearnerClient (held requests, Consumed)
synth     well-formed synthetic groups; testing: harness for tests and the benchmark

Importable without torch.
"""
