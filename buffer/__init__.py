"""The replay buffer: exactly-once, bounded, persistent, hardened against hostile input.

store     resident groups, dedup memory, capacity, accounting invariant (pure)
policies  staleness/consumption policies as plain functions of the policy version
persist   append-only segment log (written and synced by an I/O thread), replay after a crash,
          recycled segment files, compaction
staging   per-actor slots in run_dir: a same-host actor's groups wait there for their ack and
          cross the socket as a GroupRef (the slots are also every actor's spool)
server    the buffer process: ROUTER sockets for actors and learner (``python -m buffer.server``)
client    ActorClient (window, resend, staging) and LearnerClient (held requests, Consumed,
          reading by-ref batches from the segment log)
synth     well-formed synthetic groups; testing: harness for tests and the benchmark

Importable without torch.
"""
