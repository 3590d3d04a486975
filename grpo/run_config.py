"""The whole experiment's configuration, validated at start before anything is written.

`ExperimentConfig.from_hydra(cfg)` builds every group's typed config (env, policy, rollout,
grpo, profiler, logger, run, eval) and the checks that cross groups; every error names the full
key and the value ("grpo.micro_batch must be a positive integer, got 0", "rollout.collector.stages
(3) must divide env.num_envs (8)"). Nothing touches the disk until it returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.config import (
    check_bool,
    check_choice,
    check_int_list,
    check_nonnegative_int,
    check_positive_int,
    reject_unknown_keys,
    to_container,
)
from envs.config import EnvConfig
from grpo.actor_group import check_actor_config
from grpo.config import GRPOConfig
from grpo.video import FORMATS as VIDEO_FORMATS
from grpo.video import check_format
from policies.config import PolicyConfig
from profiler.config import ProfilerConfig, WandbConfig
from rollout.collector_config import CollectorConfig
from rollout.collector_record import BatchShapes
from rollout.config import RolloutConfig
from rollout.placement import check_static

MODES = ("train", "eval")
EVAL_SAMPLING = ("ode", "sde")
TOP_LEVEL_KEYS = ("mode", "run", "eval", "env", "policy", "rollout", "grpo", "profiler", "logger")


@dataclass
class RunConfig:
    """Where and how the run goes (Hydra key `run`)."""

    dir: str = "runs/grpo"  # the run directory; a suffix -1, -2, ... is added if it exists (fresh runs)
    device: str = "auto"  # the trainer's device: auto (cuda if available), cpu, cuda, cuda:N
    seed: int = 0  # python / numpy / torch global seeds and the rollout seeds
    checkpoint_every: int = 1  # RL steps between checkpoints, and after the last step (0: none at all)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    resume: str | None = None  # a checkpoint file or a run directory (its newest checkpoint)
    show_progress: bool = True  # tqdm bars for training steps and rollout epochs
    torch_threads: int | None = None  # torch.set_num_threads in the driver (None: torch's default)

    def __post_init__(self) -> None:
        if not isinstance(self.dir, str) or not self.dir:
            raise ValueError(f"run.dir must be a non-empty path, got {self.dir!r}")
        kind, colon, index = str(self.device).partition(":")
        # "cuda:" (no index) passed here but torch.device refuses it, after the run directory exists
        if kind not in ("auto", "cpu", "cuda") or (colon and (kind != "cuda" or not index.isdigit())):
            raise ValueError(f"run.device must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', got {self.device!r}")
        _check_path_or_none("run.resume", self.resume)
        check_nonnegative_int("run.seed", self.seed)
        check_nonnegative_int("run.checkpoint_every", self.checkpoint_every)
        check_positive_int("run.keep_checkpoints", self.keep_checkpoints)
        if self.torch_threads is not None:
            check_positive_int("run.torch_threads", self.torch_threads)
        check_bool("run.show_progress", self.show_progress)


@dataclass
class EvalConfig:
    """Evaluation with ODE sampling (Hydra key `eval`): `mode=eval`, or every N training steps."""

    tasks: list[int] | None = None  # task ids of the suite (None: the tasks env.task_ids uses)
    init_states: int = 2  # init states per task, ids 0..init_states-1
    num_envs: int | None = None  # envs of the eval vector env (None: env.num_envs)
    every: int = 0  # during training: evaluate every N RL steps and after the last (0: never)
    at_start: bool = False  # also evaluate the initial weights before the first step (curve point 0)
    sampling: str = "ode"  # ode: deterministic flow (RLinf's eval) | sde: the flow-SDE rollout policy
    repeats: int = 1  # episodes per (task, init state): >1 averages over the sampling noise
    checkpoint: str | None = None  # mode=eval: weights to evaluate (file or run dir); None: the init
    videos: int = 2  # episodes written as videos (and logged)
    video_format: str = "auto"  # auto: mp4 when imageio can write it, else gif (PIL)
    video_fps: int = 4  # frames are chunk-end observations: a few per second reads well

    def __post_init__(self) -> None:
        check_positive_int("eval.init_states", self.init_states)
        check_nonnegative_int("eval.every", self.every)
        check_positive_int("eval.repeats", self.repeats)
        check_choice("eval.sampling", self.sampling, EVAL_SAMPLING)
        check_bool("eval.at_start", self.at_start)
        check_nonnegative_int("eval.videos", self.videos)
        check_positive_int("eval.video_fps", self.video_fps)
        if self.videos:  # an mp4 this machine cannot write failed at the first evaluation, after a step's training
            check_format("eval.video_format", self.video_format)
        else:
            check_choice("eval.video_format", self.video_format, VIDEO_FORMATS)
        if self.num_envs is not None:
            check_positive_int("eval.num_envs", self.num_envs)
        _check_path_or_none("eval.checkpoint", self.checkpoint)
        if self.tasks is not None:
            self.tasks = check_int_list("eval.tasks", self.tasks, 0, distinct=True)


def _check_path_or_none(key: str, value: Any) -> None:
    """A path is a string: Hydra reads `run.resume=5` as an int, which failed later in Path() naming no key."""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key} must be a path (a string) or null, got {type(value).__name__} {value!r}")


def _check_group_tasks(env: EnvConfig, col: CollectorConfig) -> None:
    """Per-env env.task_ids may mix tasks inside a GRPO group: the collector refuses that when it is
    built, after the run directory, the policy and the engine; the same check, here."""
    if env.task_ids is not None:
        col.check_group_tasks(env, env.env_task_ids(max(env.task_ids) + 1))


def _policy_for_env(raw_policy: Mapping[str, Any], env: EnvConfig) -> PolicyConfig:
    """The policy config. conf/grpo_main.yaml sets policy.sampling.logprob_chunk to env.chunk_size, so an
    env chunk longer than one policy call (e.g. env=libero_spatial's 10 with the tiny policy's 8) was
    refused naming only the log-prob chunk: name the env's chunk and the policy's instead."""
    try:
        return PolicyConfig.from_mapping(raw_policy)
    except ValueError:
        logprob_chunk = (raw_policy.get("sampling") or {}).get("logprob_chunk")
        if logprob_chunk == env.chunk_size:
            alone = PolicyConfig.from_mapping(raw_policy, sampling={"logprob_chunk": None})
            BatchShapes.from_configs(env, alone)  # "policy.chunk_size (8) is shorter than env.chunk_size (10)"
        raise


def _build(cls: type, data: Any, key: str) -> Any:
    data = reject_unknown_keys(cls, data if data is not None else {}, key)
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"{key}: {exc}") from exc


@dataclass
class ExperimentConfig:
    mode: str
    env: EnvConfig
    policy: PolicyConfig
    rollout: RolloutConfig
    collector: CollectorConfig
    grpo: GRPOConfig
    profiler: ProfilerConfig
    logger: WandbConfig
    run: RunConfig
    eval: EvalConfig
    raw: dict = field(default_factory=dict)  # the resolved Hydra config (written to the run dir)

    @staticmethod
    def from_hydra(cfg: Any) -> ExperimentConfig:
        raw = to_container(cfg)
        unknown = sorted(set(raw) - set(TOP_LEVEL_KEYS))
        if unknown:
            raise ValueError(f"unknown top-level key(s) {unknown}; known: {list(TOP_LEVEL_KEYS)}")
        mode = raw.get("mode", "train")
        check_choice("mode", mode, MODES)
        rollout = RolloutConfig.from_mapping(raw.get("rollout") or {})
        env = EnvConfig.from_mapping(raw.get("env") or {})
        out = ExperimentConfig(
            mode=mode,
            env=env,
            policy=_policy_for_env(raw.get("policy") or {}, env),
            rollout=rollout,
            collector=rollout.collector if rollout.collector is not None else CollectorConfig(),
            grpo=GRPOConfig.from_mapping(raw.get("grpo") or {}),
            profiler=ProfilerConfig.from_dict(raw.get("profiler") or {}, logger=raw.get("logger") or {}),
            logger=_build(WandbConfig, raw.get("logger"), "logger"),
            run=_build(RunConfig, raw.get("run"), "run"),
            eval=_build(EvalConfig, raw.get("eval"), "eval"),
            raw=raw,
        )
        out.check_cross_group()
        return out

    def _check_prefix_cache(self) -> None:
        """grpo.prefix_cache reuses the old-log-prob pass's prefix K/V in the update epochs: only right while the
        prefix does not train, and only the one-process actor takes it (the data-parallel one's wrapper forward
        recomputes it). With the consistent recompute the kept K/V are the fast path's, copied back into its buckets."""
        where = self.grpo.prefix_cache
        if where == "off":
            return
        if not self.policy.train_expert_only:
            raise ValueError(f"grpo.prefix_cache={where} needs policy.train_expert_only=true (a trained prefix "
                             "changes with every optimiser step), got policy.train_expert_only=false")
        if self.grpo.actor_parallel.mode != "none":
            raise ValueError(f"grpo.prefix_cache={where} is built for the one-process actor only, got "
                             f"grpo.actor_parallel.mode={self.grpo.actor_parallel.mode}")
        if where != "engine":
            return
        # the rollout's K/V stand in for the trainer's: the same bits only through the consistent recompute, and
        # only an in-process engine's tensors can be read here (the actor copies kept rows to its device)
        if not (self.policy.fast.enabled and self.policy.fast.consistent_recompute):
            raise ValueError("grpo.prefix_cache=engine needs policy.fast.enabled=true and "
                             "policy.fast.consistent_recompute=true (the trainer restores the rollout's K/V into the "
                             f"fast path's buckets), got policy.fast.enabled={self.policy.fast.enabled}, "
                             f"policy.fast.consistent_recompute={self.policy.fast.consistent_recompute}")
        self.rollout.engine.check_keeps_prefixes("grpo.prefix_cache=engine")

    def check_cross_group(self) -> None:
        env, pol, col = self.env, self.policy, self.collector
        col.check_against_env(env)
        if self.mode == "train":  # the evaluation lays out its own envs (grpo/evaluate.py eval_env_config)
            _check_group_tasks(env, col)
            if col.effective_group_size(env) < 2:
                key = "rollout.collector.group_size" if col.group_size is not None else "env.group_size"
                raise ValueError(f"{key} is 1: GRPO's advantage compares the rollouts of a group, so every row's "
                                 "is 0 and nothing would be learnt; training needs groups of 2 or more")
        check_static(self.rollout)  # the weight transport (the GPU count is checked at the trainer's start)
        BatchShapes.from_configs(env, pol)  # chunk sizes, log-prob chunk == env chunk, action dims
        obs_keys = {f"{c}_image" for c in env.cameras}
        missing = sorted(set(pol.inputs.camera_map) - obs_keys)
        if missing:
            raise ValueError(f"policy.inputs.camera_map reads {missing}, but env.cameras {env.cameras} "
                             f"gives {sorted(obs_keys)}")
        if not col.record_images and self.mode == "train":
            raise ValueError("rollout.collector.record_images must be true for training (the recompute needs them)")
        if self.mode == "train":
            self._check_prefix_cache()
            pol.check_consistent_training()  # else the first recompute fails, after a rollout into the run dir
        if self.eval.tasks is not None and self.eval.num_envs is not None and self.eval.num_envs % len(self.eval.tasks):
            raise ValueError(f"eval.num_envs ({self.eval.num_envs}) must be a multiple of the number of "
                             f"eval.tasks ({len(self.eval.tasks)})")
        if self.mode == "eval" and self.run.resume is not None:
            raise ValueError("run.resume is for training; evaluate a checkpoint with eval.checkpoint=PATH")
        check_actor_config(self)  # e.g. fsdp2 with checkpoints: refused here, not after the run dir exists
        eval_env = None
        if self.mode == "eval" or self.eval.every or self.eval.at_start:
            # the Evaluator is built only at the first evaluation, eval.every steps into training: check now
            # that eval.tasks exist and eval.init_states fits each of them
            from grpo.evaluate import eval_env_config  # lazy: grpo.evaluate imports this module

            eval_env = eval_env_config(self.env, self.eval)[0]
        self.check_prompt_lengths(eval_env)

    def check_prompt_lengths(self, eval_env: EnvConfig | None) -> None:
        """Every prompt the run can give the policy fits policy.max_token_len at its longest state encoding:
        the training env's tasks (mode train) and the evaluation's (`eval_env`, eval_env_config's; None where
        no evaluation runs), with their texts as the env catalog gives them. A LIBERO task text too long for
        the tiny preset's 128 tokens was refused only by the engine's first predict, after the run directory
        was written."""
        from envs.vector.catalog import env_slots
        from policies.prompt_builder import longest_prompt_tokens
        from policies.tokenizer import load_tokenizer

        sources = []
        if self.mode == "train":
            sources.append(("env", env_slots(self.env)))
        if eval_env is not None:
            sources.append(("eval", env_slots(eval_env)))
        pol = self.policy
        try:
            tokenizer = load_tokenizer(pol.tokenizer_path)
        except (OSError, RuntimeError, ImportError) as exc:  # a missing file: sentencepiece raises OSError
            raise ValueError(f"policy.tokenizer_path={pol.tokenizer_path}: cannot load the tokenizer: {exc}") from None
        seen: set[tuple[int, str]] = set()
        for key, slots in sources:
            for slot in sorted(slots, key=lambda s: s.task_id):
                if (slot.task_id, slot.prompt) in seen:
                    continue
                seen.add((slot.task_id, slot.prompt))
                length = longest_prompt_tokens(tokenizer, slot.prompt, pol.state_dim)
                if length > pol.max_token_len:
                    # no conf/policy yaml sets the key (Hydra refuses `policy.max_token_len=N` there: "+" adds
                    # it); "++" sets it either way, also where a "+" override put it in
                    override = "++" if "max_token_len" in (self.raw.get("policy") or {}) else "+"
                    raise ValueError(
                        f"{key} task {slot.task_id} {slot.prompt!r}: its prompt is up to {length} tokens (with the "
                        f"policy.state_dim {pol.state_dim} state bins at their longest), more than "
                        f"policy.max_token_len ({pol.max_token_len}); raise it, e.g. "
                        f"{override}policy.max_token_len={length}")

    def to_dict(self) -> dict[str, Any]:
        return {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
                for k, v in vars(self).items() if k != "raw"}


def from_mapping(data: Mapping[str, Any]) -> ExperimentConfig:
    """The same from a plain dict (tests, scripts)."""
    return ExperimentConfig.from_hydra(dict(data))
