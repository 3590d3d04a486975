"""RLinf backend: our pi0.5 policy as an RLinf `BasePolicy`, built by RLinf's `get_model`.

    export RLINF_EXT_MODULE=rollout.rlinf.ext     # RLinf imports it on every worker, calls register()
    actor.model.model_type: vla_rollout_pi05      # rollout.rlinf.ext.MODEL_TYPE

- `rollout.rlinf.config`: what the adapter reads from RLinf's model config (typed, validated).
- `rollout.rlinf.weights`: RLinf's openpi (PI0Pytorch) weight names as row-slice views of our
  fused parameters, and the in-place load behind `load_state_dict`.
- `rollout.rlinf.policy`: `VLARolloutPolicy`, the `BasePolicy` subclass (predict_action_batch,
  default_forward, state_dict / load_state_dict, set_global_step).
- `rollout.rlinf.ext`: `register()` and the model builder RLinf calls.

Nothing here is imported by `rollout/__init__.py`: importing rlinf takes seconds.
"""
