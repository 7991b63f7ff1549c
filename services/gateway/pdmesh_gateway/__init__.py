"""The gateway: OpenAI REST and gRPC front door of a pdmesh deployment.

core (requests, validation, events, stop strings) and openai_api (the REST dialect) are pure;
router picks worker ranks; orchestrator runs a request over the workers' gRPC APIs; rest and
servicer are the two transports; server wires them into one process.
"""
