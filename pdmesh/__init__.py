"""pdmesh: serve Mixture-of-Experts language models with prefill/decode disaggregation and wide expert parallelism.

Packages follow the data: `engine` (model runtime) uses `kernels` (hot ops); `cli` wires commands;
`bench` measures.
"""
__version__ = "0.1.0"
