"""Model definitions: `layers` (norms, rope, MLA attention) → `moe` (routing, placement, dispatch) →
`deepseek_v3`."""
