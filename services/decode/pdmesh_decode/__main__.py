"""`python -m pdmesh_decode [options]`: what the decode container runs (same options as `pdmesh
serve decode`)."""

import sys

from pdmesh_decode import server
from pdmesh_service.entry import serve_main

sys.exit(serve_main("decode", server))
