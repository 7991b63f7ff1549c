"""`python -m pdmesh_eplb [options]`: what the eplb container runs (same options as `pdmesh serve
eplb`)."""

import sys

from pdmesh_eplb import server
from pdmesh_service.entry import serve_main

sys.exit(serve_main("eplb", server))
