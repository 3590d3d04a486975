# Side-by-side GRPO step timings on one machine, one run per setting, in the order given:
#   bash scripts/grpo_settings.sh OUT_DIR BUDGET_S NAME="overrides" [NAME="overrides" ...]
# e.g. (after `source scripts/device_prelude.sh` on the GPU machine)
#   bash scripts/grpo_settings.sh $OUT 540 bf16="policy.frozen_dtype=bfloat16" base=""
# Every run is the README's libero10_pi05 command (or $GRPO_EXPERIMENT's) cut to 2 steps of 1 rollout epoch
# (tasks 2 and 8, 160 env steps; grpo.micro_batch=$GRPO_MICRO_BATCH, default 32, which fits an 80 GB H100 in every
# mode) plus the setting's overrides. Each
# keeps OUT_DIR/grpo_NAME_report.json (the profiler's step report) and its log and metrics in
# OUT_DIR/grpo_NAME.tgz, so few files come back from the machine. Runs share BUDGET_S seconds: each
# is stopped (timeout: SIGTERM, on which a run closes its processes, and SIGKILL 60 s later) at the budget's end,
# later settings are then skipped (named in the output).
# GRPO_EXPERIMENT=NAME starts every run from another preset (default libero10_pi05; e.g. libero10_pi05_fast).
# GRPO_REPEATS=k runs the settings in turn k times (NAME.r1 .. NAME.rk: a setting's runs spread over the call);
# `python -m experiments.compare_grpo_runs OUT_DIR` tabulates the runs and each setting's mean, min and max.
# Each run leaves two files: past four runs a device call (8 files back) needs them packed into one tar.
# NAME@TREE="overrides" runs that setting in another source tree, e.g. an older commit for a same-card baseline:
#   git archive 3b25dc9 --prefix=base/ -- . ':(exclude)benchmarks/results' | tar -x -C .carry   (here, 4.5 MiB)
#   git rev-parse 3b25dc9 > .carry/base/GIT_SHA
#   bash scripts/grpo_settings.sh $OUT 540 old@.carry/base="..." new="..."                          (there)
# TREE/GIT_SHA names its commit in the run's results (required: the results would otherwise claim HEAD's).
set -u
out=$1; budget=$2; shift 2
mkdir -p "$out" || exit 2  # a missing OUT_DIR had every run fail at once on its log's redirect
out=$(cd "$out" && pwd)  # absolute: a run in another tree starts from there
tree_of() { case $1 in *@*) echo "${1#*@}";; esac; }  # TREE of a NAME@TREE label, nothing for a plain NAME
for setting in "$@"; do  # every tree checked before the first run: a typo must not cost a device call's runs
    label=${setting%%=*}; tree=$(tree_of "$label")
    if [ -n "$tree" ] && [ ! -f "$tree/GIT_SHA" ]; then
        echo "setting ${label%%@*}: $tree/GIT_SHA not found (a tree needs one)" >&2; exit 2
    fi
done
repeats=${GRPO_REPEATS:-1}
case $repeats in ''|*[!0-9]*|0) echo "GRPO_REPEATS must be a positive integer, got '$repeats'" >&2; exit 2;; esac
deadline=$(( $(date +%s) + budget ))
base="+experiment=${GRPO_EXPERIMENT:-libero10_pi05} env.task_ids=[2,8,2,8,2,8,2,8] env.max_episode_steps=160 grpo.steps=2"
base="$base grpo.rollout_epochs=1 grpo.filter_groups=false grpo.micro_batch=${GRPO_MICRO_BATCH:-32} logger=none"
base="$base profiler.exports=[json] run.checkpoint_every=0 eval.every=0"
for repeat in $(seq 1 "$repeats"); do for setting in "$@"; do
    label=${setting%%=*}; overrides=${setting#*=}; name=${label%%@*}; other=$(tree_of "$label")
    tree=$PWD; sha=; where=
    if [ -n "$other" ]; then tree=$(cd "$other" && pwd); sha=$(head -1 "$tree/GIT_SHA"); where=" in $other"; fi
    if [ "$repeats" -gt 1 ]; then name="$name.r$repeat"; fi
    left=$(( deadline - $(date +%s) ))
    if [ "$left" -lt 60 ]; then echo "SKIPPED $name: ${left} s of the budget left"; continue; fi
    dir=$out/grpo_$name
    # shellcheck disable=SC2086  # the overrides are words on purpose
    (cd "$tree" && export PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" && if [ -n "$sha" ]; then export VLA_GIT_SHA=$sha; fi &&
        timeout -k 60 "$left" python -m experiments.grpo $base $overrides run.dir="$dir") > "$out/grpo_$name.log" 2>&1
    echo "RUN $name (rc $?)$where: $overrides"
    tr '\r' '\n' < "$out/grpo_$name.log" | grep -aE '^step [0-9]+/[0-9]+ ' | tail -2
    grep -aE 'Error|out of memory' "$out/grpo_$name.log" | tail -2
    [ -f "$dir/report.json" ] && cp "$dir/report.json" "$out/grpo_${name}_report.json"
    find "$dir" -name '*.pt' -delete
    tar -czf "$out/grpo_$name.tgz" -C "$out" "grpo_$name.log" "grpo_$name" && rm -rf "$dir" "$out/grpo_$name.log"
done; done
