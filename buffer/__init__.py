"""The replay buffer: exactly-once, bounded, persistent, hardened against hostile input.

store     resident groups, dedup memory, capacity, accounting invariant (pure)
policies  staleness/consumption policies as plain functions of the policy version
persist   append-only segment log (written and synced by an I/O thread), replay after a crash
          (a torn tail is cut off, any other damage refused until ``python -m buffer.persist
          --salvage RUN_DIR/buffer``), recycled segment files, compaction
server    the buffer process: ROUTER sockets for actors and learner (``python -m buffer.server``);
          group bytes arrive in, are logged from and leave in ZeroMQ frames, never re-encoded;
          only groups within the run's limits, only from peers holding the run's secret
client    ActorClient (window, resend, busy backoff, a spool of unacked groups) and
          LearnerClient (held requests, Consumed, never a key twice)

Importable without torch.
"""
