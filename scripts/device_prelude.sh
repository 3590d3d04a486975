# Sourced at the start of every GPU-machine call (the machine starts bare, with no network):
#   source scripts/device_prelude.sh        # the call carries [".carry", ".gl"]
# Carried, git-ignored inputs, all written by one command here (scripts/pack_offline.py):
# .gl (EGL/GL loader debs), .carry/whl (wheels the image lacks), .carry/env/libero.tar.gz (the
# LIBERO tasks' code and assets), .carry/GIT_SHA. Sets PYTHONPATH and the LIBERO config.
for f in .gl/*.deb; do dpkg -x "$f" / ; done; ldconfig
if [ -d .carry/whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .carry/whl/*.whl || return 1
fi
# wheels too big to carry as they are travel repacked (scripts/pack_offline.py: xz, some paths left out)
for f in .carry/pkg/*.tar.xz; do
    [ -f "$f" ] || continue
    mkdir -p /tmp/site && tar -xJf "$f" -C /tmp/site || return 1
done
if [ -f .carry/env/libero.tar.gz ]; then
    mkdir -p /tmp/site && tar -xzf .carry/env/libero.tar.gz -C /tmp/site
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export LIBERO_CONFIG_PATH=/tmp/libero_config PYTHONUNBUFFERED=1
# The copy of the tree has no git history: result files take the sha from .carry/GIT_SHA
# (scripts/pack_offline.py writes it: the commit, and "dirty" when the tree differs from it).
export VLA_GIT_SHA="$(tr '\n' '-' < .carry/GIT_SHA 2>/dev/null | sed 's/-$//')"
# flashinfer JIT-compiles its kernels on first use (~100 s for the bf16/hd256 prefill module on
# the H200); the compiled cache from an earlier call is carried back in and unpacked here.
if [ -f .carry/jit/flashinfer_cache.tgz ]; then
    mkdir -p ~/.cache && tar -xzf .carry/jit/flashinfer_cache.tgz -C ~/.cache
fi
nvidia-smi -L
