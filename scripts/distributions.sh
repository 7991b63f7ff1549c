#!/usr/bin/env bash
# The folders that hold a pdmesh distribution, in dependency order (the root `pdmesh` umbrella last, not listed).
echo protos kernels engine services/common services/gateway services/kvstore services/eplb \
     services/prefill services/decode sdk bench
