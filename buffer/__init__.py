"""The replay buffer: exactly-once, bounded, durable, hardened against hostile input.

store     resident groups, dedup memory, capacity, accounting invariant (pure)
policies  staleness/consumption policies as plain functions of the policy version
durable   the one durable copy of each accepted group (SQLite, WAL), kept until a checkpoint covers it
server    the buffer process (``python -m buffer.server``): group bytes arrive, are stored and leave
          in ZeroMQ frames, never re-encoded; only valid groups from peers holding the run's secret
client    ActorClient (window, resend, busy backoff, a spool of unacked groups) and
          LearnerClient (held requests, Consumed, never a key twice)

Importable without torch.
"""
