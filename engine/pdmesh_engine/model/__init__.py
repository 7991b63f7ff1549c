"""Model definitions: `attention` (per-step attention metadata, CPU MLA decode) → `layers` (norms,
rope, MLA attention) → `experts` (routed-expert compute) → `moe` (routing, placement, dispatch) →
`deepseek_v3`."""
