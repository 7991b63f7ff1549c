"""`pdmesh sim` and `pdmesh plan`: a discrete-event simulation of a mesh, on a virtual clock, that
runs pdmesh's own cores (the gateway's admission and routing, the engine's scheduler and KV cache
manager) against a cost file instead of engines.

    COSTS.json → costs.Costs ─┐
    workload (serve.build_workload) → Job → mesh.SimMesh.issue ─→ ranks.Instance (Scheduler,
        lockstep DEP, shared CPU cores) → token times → serve.summarize → bench serve's JSON keys
    plan: topologies → simulate each → slo.goodput → the cheapest that meets the SLOs

`clock` is the virtual-time event loop; `simulate` one run; `cli` the `pdmesh sim` command;
`plots` its PNGs.
"""
