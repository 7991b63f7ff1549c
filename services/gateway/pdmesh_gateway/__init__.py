"""The gateway: OpenAI REST and gRPC front door of a pdmesh deployment.

Pure: core (requests, validation, events, stop strings), openai_api (the REST dialect), progress
(one request's chunks → events), retry (what is tried again, how long to wait), router and admission
(which rank), autoscale and load_window (how many ranks: the load's window → desired replicas).
Adapters: upstream (the workers' gRPC calls), orchestrator (composes them for one request),
metrics, rest and servicer (the two transports), autoscale_loop (samples, decides, publishes);
server wires them into one process.
Chain: request body / GenerateRequest → GenerationRequest → WorkerChunk → GenerationEvent →
response.
"""
