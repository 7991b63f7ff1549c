"""The EPLB controller: expert loads in, expert placements out, per (instance, model).

    per-slot loads of each DEP rank → `planner.plan` (move-minimising, vectorised over layers)
      → versioned placements → the instance's ranks stage and switch at one step boundary

`planner` and `simulate` are pure numpy; `servicer` (gRPC) and `server` (wiring) are the adapters.
No torch: this service runs in its own small image.
"""
