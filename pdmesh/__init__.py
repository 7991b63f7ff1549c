"""pdmesh: serve Mixture-of-Experts language models with prefill/decode disaggregation and wide
expert parallelism.

This umbrella package is the `pdmesh` command over the per-service distributions:

    cli/       `pdmesh up | serve ROLE | generate | model | client | bench | eplb`
    launcher   `pdmesh up`: plan (mesh_plan) → start (private Redis, kvstore, eplb, prefill,
               decode, gateway) → supervise → stop
    supervisor the launcher's restart loop (policy: pdmesh_service.supervision)
    autoscaler `pdmesh up --autoscale`: the gateway's desired replicas → workers started or
               drained
    tools/     development tools kept off the serving path: seeded checkpoints, tokenizer training,
               corpus
"""

__version__ = "0.1.0"
