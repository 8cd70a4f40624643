"""The engine-process runtime: what runs behind the api process, and the messages the two speak.

The api (decode_server/api/) speaks HTTP and talks to the runtime only through its `EngineClient`, which spawns
`engine_process.run_engine_process` and exchanges `messages` with it over ZMQ. The runtime imports nothing of the
api. Modules, from the process entry down:

- `engine_process`: the spawned process's entry: one engine (and its PD role), or rank 0 of a rank group.
- `tp_ranks`: how tensor-parallel ranks share the work (lockstep: rank 0 broadcasts the api's messages) and the
  `python -m` entry of ranks 1..N-1.
- `rank_group`: any rank group: devices, rendezvous, launching and supervising ranks 1..N-1, the bodies of rank
  0 and of the others, parametrized by the loops that say how ranks share the work (`RankLoops`).
- `loop`: `EngineLoop`, api messages in, engine steps, deltas out; `heartbeat`: the heartbeat thread and step
  watchdog beside it; `describe`: what a ready engine reports; `lifetime`: children that die with their parent.
- `messages`: the typed api ↔ engine messages and their codec (imported by both processes; no torch).

See docs/server.md ("Processes") and docs/parallelism.md ("Runtime").
"""
