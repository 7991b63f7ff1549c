"""KV hand-off transport: pure block-pool layout arithmetic (`layout`), its wire form (`pb`), and a
thin synchronous NIXL agent that pushes a request's blocks in one WRITE (`agent`). Import the
submodules directly; this package imports nothing so `layout` stays usable without nixl."""
