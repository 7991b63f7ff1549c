"""`python -m pdmesh_gateway [options]`: what the gateway container runs (same options as `pdmesh
serve gateway`)."""

import sys

from pdmesh_gateway import server
from pdmesh_service.entry import serve_main

sys.exit(serve_main("gateway", server))
