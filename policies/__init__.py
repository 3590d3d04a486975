"""pi0.5-class flow-matching VLA policies, flow sampling math, loaders and the fast GPU path.

Entry points: `PolicyConfig.preset(...)`, `build_policy(cfg)`, `Policy.sample` / `Policy.log_prob`
(policies/policy.py); flow math in policies/flow.py; checkpoints in policies/loaders.py; FLOP and
byte counts in policies/flops.py.
"""

from policies.config import PolicyConfig
from policies.observation import Observation
from policies.policy import Policy, build_policy

__all__ = ["Observation", "Policy", "PolicyConfig", "build_policy"]
