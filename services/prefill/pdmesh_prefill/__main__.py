"""`python -m pdmesh_prefill [options]`: what the prefill container runs (same options as `pdmesh
serve prefill`)."""

import sys

from pdmesh_prefill import server
from pdmesh_service.entry import serve_main

sys.exit(serve_main("prefill", server))
