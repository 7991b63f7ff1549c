"""`python -m pdmesh_kvstore [options]`: what the kvstore container runs (same options as `pdmesh
serve kvstore`)."""

import sys

from pdmesh_kvstore import server
from pdmesh_service.entry import serve_main

sys.exit(serve_main("kvstore", server))
