"""pi0.5-class flow-matching VLA policies, flow sampling math, loaders and the fast GPU path."""
