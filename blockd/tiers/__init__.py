"""The tiers below a pool's device blocks, behind one protocol (`blockd.tiers.base`),
chosen from a registry (`blockd.tiers.registry`); see docs/tiers.md."""
