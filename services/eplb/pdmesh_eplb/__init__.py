"""The EPLB controller: expert loads in, expert placements out, per (instance, model).

    LoadReport of every DEP rank (Redis, `pdmesh_service.eplb_protocol`)
      → controller.window_of: logical loads [L, E] under the current version
      → controller.decide: window / interval / min-gain / Off policy → planner.plan
        (move-minimising)
      → balancer: compare-and-set placement V + its RebalanceRecord (Redis) → the ranks stage and
        switch

`planner`, `simulate` and `controller` are pure (numpy); `balancer` (the Redis loop), `servicer`
(gRPC), `convert` and `server` (wiring) are the adapters; `metrics` the `pdmesh_eplb_*` series.
No torch: this service runs in its own small image.
"""
